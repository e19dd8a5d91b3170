"""engines/memory.py: allocator trimming hook (TOGETHER_TRAIN_TRIM_AFTER) used by benchmarks/sessions.py."""

from __future__ import annotations

import platform

import pytest

from together_train_server.engines import memory


class _Engine:
    def __init__(self) -> None:
        self.calls = 0

    def optim_step(self, x: int) -> int:
        """Doubles x."""
        self.calls += 1
        return 2 * x

    def forward(self) -> None:
        raise RuntimeError("boom")


def test_trim_allocator_runs_on_glibc():
    ran = memory.trim_allocator()
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        assert ran is True


def test_install_from_env_wraps_named_methods_and_keeps_results(monkeypatch):
    trims = []
    monkeypatch.setattr(memory, "trim_allocator", lambda: trims.append(1) or True)
    eng = memory.install_trim_from_env(_Engine(), {memory.ENV_VAR: " optim_step , forward"})
    assert eng.optim_step(21) == 42 and eng.calls == 1 and len(trims) == 1
    assert eng.optim_step.__doc__ == "Doubles x."
    with pytest.raises(RuntimeError, match="boom"):
        eng.forward()
    assert len(trims) == 2  # trimmed after a failing call too


def test_unset_env_leaves_engine_untouched():
    eng = _Engine()
    assert memory.install_trim_from_env(eng, {}) is eng
    assert "optim_step" not in vars(eng)


def test_unknown_method_is_named():
    with pytest.raises(ValueError, match=r"TOGETHER_TRAIN_TRIM_AFTER.*no method 'optim_stp'"):
        memory.install_trim_from_env(_Engine(), {memory.ENV_VAR: "optim_stp"})
