"""What a trainer engine can do is declared once (engines/interfaces.py `TrainerCapabilities`), matches what it
implements, is reported by GetCapabilities, and a serve flag asking for a missing one is refused naming the engine
(backends.capability_refusal, called by ``serve`` before anything else starts)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from together_train_server.backends import capability_refusal
from together_train_server.engines.interfaces import CycleTrainer, PageableTrainer, TrainerCapabilities
from together_train_server.engines.torch_trainer import TorchTrainerEngine


def _deepspeed_engine_class():
    from together_train_server.engines.deepspeed.engine import DeepSpeedTrainerEngine

    return DeepSpeedTrainerEngine


def _implements(cls: type, protocol: type) -> bool:
    """Whether ``cls`` has every method of ``protocol`` (checked on the class: no model is loaded)."""
    names = [n for n in vars(protocol) if not n.startswith("_") and callable(vars(protocol)[n])]
    return all(callable(getattr(cls, n, None)) for n in names)


@pytest.mark.parametrize("which", ["torch", "deepspeed"])
def test_declared_capabilities_match_the_methods(which):
    cls = TorchTrainerEngine if which == "torch" else _deepspeed_engine_class()
    caps = cls.capabilities
    assert isinstance(caps, TrainerCapabilities)
    assert caps.paging == _implements(cls, PageableTrainer), (which, caps)
    assert caps.clock_cycle == _implements(cls, CycleTrainer), (which, caps)


def test_the_engines_declare_what_they_do():
    assert TorchTrainerEngine.capabilities.names() == ["paging", "clock_cycle", "long_context"]
    assert _deepspeed_engine_class().capabilities.names() == ["full_weight", "long_context"]


def _cfg(**over):
    base = dict(trainer="deepspeed", session_memory_mb=None, batch_window_ms=0.0, mode="lora",
                activation_checkpointing="auto")
    return SimpleNamespace(**{**base, **over})


def test_a_flag_for_a_missing_capability_is_refused_naming_the_engine():
    ds = SimpleNamespace(capabilities=_deepspeed_engine_class().capabilities, backend_name="DeepSpeedTrainerEngine")
    assert capability_refusal(_cfg(), ds) is None
    assert capability_refusal(_cfg(mode="full", activation_checkpointing="on"), ds) is None
    assert capability_refusal(_cfg(session_memory_mb=0.0), ds) is None   # 0 = never page: asks for nothing
    assert capability_refusal(_cfg(session_memory_mb=512.0), ds) == (
        "--session-memory-mb 512 needs paging, which --trainer deepspeed (DeepSpeedTrainerEngine) does not have "
        "(it has: full_weight, long_context)")
    assert capability_refusal(_cfg(batch_window_ms=5.0), ds) == (
        "--batch-window-ms 5 needs clock cycle, which --trainer deepspeed (DeepSpeedTrainerEngine) does not have "
        "(it has: full_weight, long_context)")
    torch_engine = SimpleNamespace(capabilities=TorchTrainerEngine.capabilities, backend_name="TorchTrainerEngine")
    assert capability_refusal(_cfg(trainer="torch", session_memory_mb=512.0, batch_window_ms=5.0), torch_engine) is None
    assert capability_refusal(_cfg(trainer="torch", mode="full"), torch_engine) == (
        "--mode full needs full weight, which --trainer torch (TorchTrainerEngine) does not have "
        "(it has: paging, clock_cycle, long_context)")


def test_get_capabilities_lists_the_trainer_capabilities(resource):
    """The shared tiny resource (--trainer torch) reports its engine's declaration over gRPC."""
    assert resource.get_capabilities(refresh=True).trainer_capabilities == ("paging", "clock_cycle", "long_context")


def test_serve_refuses_a_missing_capability_before_loading_anything(tmp_path):
    """The refusal comes from the engine's class, on every rank, before the model is read: here the model
    directory does not even exist, and the refusal (not a model error) is what `serve` says."""
    import os
    import subprocess
    import sys

    missing = tmp_path / "no-such-model"
    proc = subprocess.run([sys.executable, "-m", "together_train_server.cli", "serve", "--trainer", "deepspeed",
                           "--session-memory-mb", "100", "--model", str(missing), "--allocator", "glibc"],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode != 0, proc
    assert ("--session-memory-mb 100 needs paging, which --trainer deepspeed (DeepSpeedTrainerEngine) does not "
            "have") in proc.stderr, proc.stderr[-2000:]
    assert str(missing) not in proc.stderr, proc.stderr[-2000:]
