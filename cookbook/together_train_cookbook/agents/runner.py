"""Running an agent once: a Python function or an external command, given a fresh rollout URL.

An agent is written against the ``openai`` client only. It gets a ``base_url`` of the form
``http://HOST:PORT/v1/rollouts/{rollout_id}`` (the server records every call made under it, token
for token), an ``api_key``, the ``model`` to name (the training session id: its latest published
weights) and its ``task``, and returns its reward:

- a function: ``agent(base_url=..., api_key=..., model=..., task=...) -> float`` (or a dict with
  ``"reward"`` and more numbers, logged as ``env/<name>``); ``--agent package.module:function``
  or ``path/to/file.py:function``;
- a command line (``--agent "python my_agent.py"``): run once per rollout with
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (read by the ``openai`` client itself, so an
  unmodified agent works), ``OPENAI_MODEL``, ``AGENT_TASK`` (the task as JSON) and
  ``AGENT_ROLLOUT_ID`` set; its reward is the last line it prints (a number, or a JSON object
  with ``"reward"``), or comes from a reward callback when it prints none.

Imports only the standard library.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class AgentOutcome:
    """What one agent run returned: its reward (None: none given) and its numbers."""

    reward: float | None
    metrics: dict[str, float] = field(default_factory=dict)


class AgentError(RuntimeError):
    """An agent run failed (raised, exited non-zero, printed no reward): the rollout is not trained."""


Agent = Callable[[str, str, str, Any], AgentOutcome]  # (base_url, api_key, model, task) -> outcome


def _outcome(value: Any, where: str) -> AgentOutcome:
    if isinstance(value, dict):
        if "reward" not in value:
            raise AgentError(f"{where} returned a dict without 'reward': {value!r}")
        rest = {k: float(v) for k, v in value.items() if k != "reward" and isinstance(v, (int, float))}
        return AgentOutcome(None if value["reward"] is None else float(value["reward"]), rest)
    if value is None:
        return AgentOutcome(None)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise AgentError(f"{where} returned {value!r}; expected a number or a dict with 'reward'")
    return AgentOutcome(float(value))


def load_object(spec: str, what: str = "--agent") -> Any:
    """``package.module:name`` or ``path/to/file.py:name`` -> the object.

    Raises:
        ValueError: no ``:name``, or the module / file / name does not exist (naming `what`).
    """
    mod_name, sep, attr = spec.rpartition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(f"{what} {spec!r}: expected module:function or file.py:function")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise ValueError(f"{what} {spec!r}: no file {path}")
            loaded = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(loaded)
            sys.modules.setdefault(path.stem, module)
            loaded.loader.exec_module(module)
        else:
            module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(f"{what} {spec!r}: cannot import {mod_name}: {e}") from None
    if not hasattr(module, attr):
        raise ValueError(f"{what} {spec!r}: {mod_name} has no {attr!r}")
    return getattr(module, attr)


def function_agent(fn: Callable[..., Any]) -> Agent:
    """An `Agent` calling ``fn(base_url=, api_key=, model=, task=)``; an exception is an `AgentError`."""
    name = getattr(fn, "__qualname__", repr(fn))

    def run(base_url: str, api_key: str, model: str, task: Any) -> AgentOutcome:
        try:
            value = fn(base_url=base_url, api_key=api_key, model=model, task=task)
        except Exception as e:  # an agent's own failure: the rollout is dropped, the run goes on
            raise AgentError(f"agent {name} raised {type(e).__name__}: {e}") from e
        return _outcome(value, f"agent {name}")

    return run


def command_agent(command: str | list[str], timeout_s: float = 600.0) -> Agent:
    """An `Agent` running `command` once per rollout (see the module docstring for its environment)."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)

    def run(base_url: str, api_key: str, model: str, task: Any) -> AgentOutcome:
        env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key, "OPENAI_MODEL": model,
               "AGENT_TASK": json.dumps(task), "AGENT_ROLLOUT_ID": base_url.rstrip("/").rsplit("/", 1)[-1]}
        try:
            p = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                               timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise AgentError(f"agent command {argv[0]!r} failed: {e}") from None
        if p.returncode != 0:
            raise AgentError(f"agent command {argv[0]!r} exited {p.returncode}: {p.stderr.strip()[-500:]}")
        lines = [ln.strip() for ln in p.stdout.splitlines() if ln.strip()]
        if not lines:
            return AgentOutcome(None)
        try:
            value = json.loads(lines[-1])
        except ValueError:
            return AgentOutcome(None)  # its last line is not a reward: the callback gives it
        return _outcome(value, f"agent command {argv[0]!r}")

    return run


def load_agent(spec: str, timeout_s: float = 600.0) -> Agent:
    """``--agent``: ``module:function`` / ``file.py:function`` (a function agent) or a command line."""
    spec = spec.strip()
    if spec and not any(c.isspace() for c in spec) and ":" in spec:
        return function_agent(load_object(spec))
    if not spec:
        raise ValueError("--agent is empty: give module:function or a command line")
    return command_agent(spec, timeout_s)
