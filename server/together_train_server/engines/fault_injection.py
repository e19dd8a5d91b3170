"""Engine fault injection, FOR TESTS ONLY: make chosen engine methods raise.

Tests need a real server whose engine fails unexpectedly, to check that such
a failure reaches the client as INTERNAL with an error id and that the server
logs its traceback under that id. Nothing is injected unless
the environment variable ``TOGETHER_TRAIN_TEST_FAULTS`` is set; never set it in
production. Its value is a comma-separated list of ``method`` (every call of
``engine.method`` raises) or ``method:K`` (only the K-th call, 1-based, raises),
e.g. ``TOGETHER_TRAIN_TEST_FAULTS=optim_step:1,create_adapter:3``.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Mapping, TypeVar

from .interfaces import TrainerEngine
from .wrapped import WrappedTrainerEngine, check_method_names, wrap

T = TypeVar("T")

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


class FaultInjection:
    """`EngineHook`: the calls chosen by ``faults`` (``{method: K or None}``) raise `InjectedFault`.

    ``None``: every call of the method; ``K``: only its K-th call (1-based, counted
    across threads).
    """

    def __init__(self, faults: Mapping[str, int | None]) -> None:
        self.faults = dict(faults)
        self._calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def around(self, method: str, call: Callable[[], T]) -> T:
        if method not in self.faults:
            return call()
        with self._lock:
            n = self._calls[method] = self._calls.get(method, 0) + 1
        nth = self.faults[method]
        if nth is None or n == nth:
            raise InjectedFault(f"injected test fault in {method} (call {n}, {ENV_VAR})")
        return call()


def install(engine: TrainerEngine, faults: Mapping[str, int | None]) -> WrappedTrainerEngine:
    """``engine`` wrapped so the calls named in ``faults`` raise InjectedFault (`FaultInjection`).

    Returns:
        One `WrappedTrainerEngine` (its ``backend_name``, what capabilities report, is ``engine``'s).

    Raises:
        ValueError: the engine has no such method.
    """
    check_method_names(list(faults), engine, ENV_VAR)
    log.warning("%s is set: engine methods %s will fail on purpose (tests only)", ENV_VAR, dict(faults))
    return wrap(engine, FaultInjection(faults))


def install_from_env(engine: TrainerEngine, env: Mapping[str, str] | None = None) -> TrainerEngine:
    """``install(engine, parse_spec(env[ENV_VAR]))`` when the variable is set; else ``engine`` untouched."""
    spec = (os.environ if env is None else env).get(ENV_VAR, "")
    return install(engine, parse_spec(spec)) if spec.strip() else engine
