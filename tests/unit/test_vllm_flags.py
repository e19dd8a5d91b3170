"""The ``--vllm-*`` flags of ``serve`` / ``generator`` reach vLLM's EngineArgs keyword arguments.

vLLM is not needed: ``engine_args_kwargs`` is the pure function whose result
``VllmGeneratorEngine`` passes to ``vllm.EngineArgs``; ``vllm_flag_args`` is what
``serve`` appends to every spawned ``generator`` replica's command line.
"""

from __future__ import annotations

import pytest

from together_train_server.cli import build_parser, vllm_engine_options, vllm_flag_args
from together_train_server.engines.vllm_generator import engine_args_kwargs

GEN_REQUIRED = ["generator", "--replica-secret-file", "/nonexistent/secret"]


def _engine_kwargs(argv: list[str]) -> dict:
    """serve argv -> replica argv -> generator options -> EngineArgs kwargs."""
    serve = build_parser().parse_args(["serve", "--engine", "vllm", *argv])
    gen = build_parser().parse_args([*GEN_REQUIRED, "--engine", "vllm", "--device", serve.device,
                                     *vllm_flag_args(serve)])
    return engine_args_kwargs("/m", dtype="bfloat16", device=gen.device, seed=0, max_model_len=2048,
                              max_num_seqs=256, max_lora_rank=64, max_cpu_loras=None, **vllm_engine_options(gen))


def test_defaults_cuda_graphs_on_gpu():
    kw = _engine_kwargs(["--device", "cuda"])
    assert kw["enforce_eager"] is False, kw
    assert kw["max_loras"] == 4 and kw["max_cpu_loras"] == 16
    assert kw["gpu_memory_utilization"] == 0.85


def test_defaults_eager_on_cpu():
    kw = _engine_kwargs([])
    assert kw["enforce_eager"] is True, kw
    assert "gpu_memory_utilization" not in kw  # vLLM's CPU backend sizes its KV cache itself


def test_flags_reach_engine_args():
    kw = _engine_kwargs(["--device", "cuda:1", "--vllm-enforce-eager", "--vllm-max-loras", "24",
                         "--vllm-gpu-memory-utilization", "0.6"])
    assert kw["enforce_eager"] is True
    assert kw["max_loras"] == 24 and kw["max_cpu_loras"] == 24
    assert kw["gpu_memory_utilization"] == 0.6


@pytest.mark.parametrize("bad,match", [({"max_loras": 0}, "max_loras"),
                                       ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization")])
def test_bad_values_are_named(bad, match):
    opts = {"enforce_eager": None, "max_loras": 4, "gpu_memory_utilization": 0.85, **bad}
    with pytest.raises(ValueError, match=match):
        engine_args_kwargs("/m", dtype="float32", device="cuda", seed=0, max_model_len=16, max_num_seqs=1,
                           max_lora_rank=8, max_cpu_loras=None, **opts)
