"""Engine fault injection, FOR TESTS ONLY: make chosen engine methods raise.

Tests need a real server whose engine fails unexpectedly, to check that such
a failure reaches the client as INTERNAL with an error id and that the server
logs its traceback under that id (issue 11 item 6). Nothing is injected unless
the environment variable ``TOGETHER_TRAIN_TEST_FAULTS`` is set; never set it in
production. Its value is a comma-separated list of ``method`` (every call of
``engine.method`` raises) or ``method:K`` (only the K-th call, 1-based, raises),
e.g. ``TOGETHER_TRAIN_TEST_FAULTS=optim_step:1,create_adapter:3``.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Any, Mapping

ENV_VAR = "TOGETHER_TRAIN_TEST_FAULTS"

log = logging.getLogger("together_train_server")


class InjectedFault(RuntimeError):
    """The exception an injected fault raises (an ordinary uncoded engine error)."""


def parse_spec(spec: str) -> dict[str, int | None]:
    """``"a,b:2"`` -> ``{"a": None, "b": 2}`` (None = every call).

    Raises:
        ValueError: an empty method name or a call number that is not an integer >= 1.
    """
    out: dict[str, int | None] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, nth = part.partition(":")
        if not name:
            raise ValueError(f"{ENV_VAR}: empty method name in {spec!r}")
        if nth and (not nth.isdigit() or int(nth) < 1):
            raise ValueError(f"{ENV_VAR}: call number of {name!r} must be an integer >= 1, got {nth!r}")
        out[name] = int(nth) if nth else None
    return out


def _faulty(name: str, nth: int | None, original: Any) -> Any:
    calls = 0
    lock = threading.Lock()

    @functools.wraps(original)
    def faulty(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        with lock:
            calls += 1
            n = calls
        if nth is None or n == nth:
            raise InjectedFault(f"injected test fault in {name} (call {n}, {ENV_VAR})")
        return original(*args, **kwargs)

    return faulty


def install(engine: Any, faults: Mapping[str, int | None]) -> Any:
    """Wrap ``engine``'s methods named in ``faults`` (on the instance) so they raise InjectedFault.

    Returns:
        ``engine`` itself (its type, and so what capabilities report, is unchanged).

    Raises:
        ValueError: the engine has no such method.
    """
    for name, nth in faults.items():
        original = getattr(engine, name, None)
        if not callable(original):
            raise ValueError(f"{ENV_VAR}: engine {type(engine).__name__} has no method {name!r}")
        faulty = _faulty(name, nth, original)
        setattr(engine, name, faulty)
    log.warning("%s is set: engine methods %s will fail on purpose (tests only)", ENV_VAR, dict(faults))
    return engine


def install_from_env(engine: Any, env: Mapping[str, str] | None = None) -> Any:
    """``install(engine, parse_spec(env[ENV_VAR]))`` when the variable is set; else ``engine`` untouched."""
    spec = (os.environ if env is None else env).get(ENV_VAR, "")
    return install(engine, parse_spec(spec)) if spec.strip() else engine
