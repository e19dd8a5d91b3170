"""engines/memory.py: allocator trimming hook (TOGETHER_TRAIN_TRIM_AFTER) used by benchmarks/sessions.py,
and its composition with other hooks in one engines/wrapped.py wrapper."""

from __future__ import annotations

import platform

import pytest

from together_train_server.engines import memory
from together_train_server.engines.wrapped import WrappedTrainerEngine


class _Engine:
    """The two TrainerEngine methods this test calls."""

    def __init__(self) -> None:
        self.calls = 0

    def optim_step(self, adapter_id: str, cfg: int) -> int:
        self.calls += 1
        return 2 * cfg

    def forward(self, adapter_id, samples, loss_fn, loss_params=None, **kw) -> None:
        raise RuntimeError("boom")


def test_trim_allocator_runs_on_glibc():
    ran = memory.trim_allocator()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert ran is True


def test_install_from_env_wraps_named_methods_and_keeps_results(monkeypatch):
    trims = []
    monkeypatch.setattr(memory, "trim_allocator", lambda: trims.append(1) or True)
    inner = _Engine()
    eng = memory.install_trim_from_env(inner, {memory.ENV_VAR: " optim_step , forward"})
    assert isinstance(eng, WrappedTrainerEngine) and eng.inner is inner and "optim_step" not in vars(inner)
    assert eng.optim_step("s", 21) == 42 and inner.calls == 1 and len(trims) == 1
    with pytest.raises(RuntimeError, match="boom"):
        eng.forward("s", [], "cross_entropy")
    assert len(trims) == 2  # trimmed after a failing call too


def test_hooks_compose_in_one_wrapper(monkeypatch):
    """Trimming over fault injection: one wrapper, the later hook outermost (as cli.cmd_serve installs them)."""
    from together_train_server.engines import fault_injection

    trims = []
    monkeypatch.setattr(memory, "trim_allocator", lambda: trims.append(1) or True)
    inner = _Engine()
    eng = fault_injection.install_from_env(inner, {fault_injection.ENV_VAR: "optim_step:2"})
    eng = memory.install_trim_from_env(eng, {memory.ENV_VAR: "optim_step"})
    assert eng.inner is inner and [type(h).__name__ for h in eng.hooks] == ["FaultInjection", "TrimAllocator"]
    assert eng.optim_step("s", 1) == 2
    with pytest.raises(fault_injection.InjectedFault, match="optim_step .call 2"):
        eng.optim_step("s", 1)
    assert eng.optim_step("s", 3) == 6 and inner.calls == 2 and len(trims) == 3


def test_unset_env_leaves_engine_untouched():
    eng = _Engine()
    assert memory.install_trim_from_env(eng, {}) is eng
    assert "optim_step" not in vars(eng)


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match=r"TOGETHER_TRAIN_TRIM_AFTER.*no method 'optim_stp'"):
        memory.install_trim_from_env(_Engine(), {memory.ENV_VAR: "optim_stp"})
