"""Sampling benchmark (b): the service's vLLM engine vs the same vLLM ``LLM`` used directly.

    .venv-vllm/bin/python benchmarks/sampling_vllm.py [--model DIR|embedded] [--quick] [--json out.json]

Prints ``ratio_vs_vllm=...`` (service tokens/s / direct vLLM tokens/s; target
>= 0.9) plus both throughputs. Same prompts, same sampling parameters, same
engine arguments (LoRA enabled, the same rank-``r`` adapter active: on the
service a fresh session's adapter pushed by ``weights_sync``, directly an
identically shaped PEFT adapter), one replica; the direct run happens after
the service has shut down so the two never share the cores. Full size: 64
prompts x 4 samples x 64 new tokens; ``--quick``: 8 x 2 x 16.

``benchmarks/sampling.py`` can call :func:`vllm_comparison` for its part (b)
when vllm is importable.

Measured on the 2-core dev machine while other benchmarks ran (load 10-14),
``--quick``, embedded SmolLM2-135M, bf16, rank 32: service 86.5 tok/s, direct
8.5 tok/s, ``ratio_vs_vllm=10.2``. Not a real 10x: vLLM run in *this*
process (``LLM`` or ``VllmGeneratorEngine`` alike) took 27-65 s for the
same 256 tokens while the replica subprocess took 2-5 s in three runs, so
the direct side is slowed by something in this process's CPU setup (OpenMP
wait policy fixed above; thread binding suspected). Re-measure on a quiet
machine or a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The direct run must use the engine configuration the replica uses.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
# As the replica process gets it from the CLI (docs/design.md §9): without it, idle
# OpenMP threads spin and, on a shared CPU, the direct run measured 6x slower.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def _prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, size=int(rng.integers(16, 33))).tolist() for _ in range(n)]


def _adapter_dir(model_dir: Path, rank: int, out: Path) -> Path:
    """A PEFT adapter shaped like a session's default adapter (all block linears, B = 0 as at creation).

    Built from a meta-device model: no weights are loaded and no torch
    kernels run in this process before vLLM binds its CPU threads.
    """
    import torch
    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from together_train_server.engines.lora import default_target_modules, make_lora_config
    from together_train_server.engines.types import LoraConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(model_dir)))
    cfg = make_lora_config(LoraConfig(rank=rank, alpha=2.0 * rank), default_target_modules(model), str(model_dir))
    shapes = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(get_peft_model(model, cfg)).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: (torch.zeros(s) if ".lora_B." in k else torch.full(s, 0.01)) for k, s in shapes.items()},
              str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(cfg.to_dict(), default=list))
    return out


def vllm_comparison(model: str | None = None, *, prompts: list[list[int]] | None = None, n_prompts: int = 64,
                    n_samples: int = 4, max_tokens: int = 64, rank: int = 32, dtype: str = "bfloat16",
                    threads: int = 0) -> dict:
    """Run the comparison; returns the numbers (keys as printed).

    ``prompts`` (token id lists) default to ``n_prompts`` random prompts of
    16-32 tokens. Every completion runs to ``max_tokens`` (``ignore_eos``).
    """
    import together_train as tt
    from together_train_server.engines.model_loading import resolve_model_dir

    model_dir = resolve_model_dir(None if model in (None, "embedded") else model)
    import json as _json

    vocab = int(_json.loads((model_dir / "config.json").read_text())["vocab_size"])
    prompts = [list(map(int, p)) for p in prompts] if prompts is not None else _prompts(n_prompts, vocab)
    threads = threads or (os.cpu_count() or 1)

    # 1. through the service: all requests in flight at once, as an RL loop submits them
    sp = tt.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    # Same LoRA rank capacity on both sides (it sizes vLLM's LoRA buffers and kernels).
    cap = 64 if rank <= 64 else 256
    with tt.launch_local(model=str(model_dir), generators=1, env={"TOGETHER_TRAIN_VLLM_MAX_LORA_RANK": str(cap)},
                         extra_args=[
            "--engine", "vllm", "--generator-dtype", dtype, "--trainer-threads", "1",
            "--generator-threads", str(threads)]) as client:
        session = client.create_session(lora=tt.LoraConfig(rank=rank, alpha=2.0 * rank, seed=0))
        session.weights_sync().result(timeout=600)
        session.sample(prompts[0], sp, num_samples=n_samples).result(timeout=600)   # warm-up
        t0 = time.perf_counter()
        futs = [session.sample(p, tt.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True),
                               num_samples=n_samples) for i, p in enumerate(prompts)]
        service_tokens = sum(len(s.tokens) for f in futs for s in f.result(timeout=3600).sequences)
        service_s = time.perf_counter() - t0
    print(f"service: {service_tokens} tokens in {service_s:.1f} s", flush=True)

    # 2. vLLM directly, same engine arguments as VllmGeneratorEngine's defaults
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    with tempfile.TemporaryDirectory() as tmp:
        adapter = _adapter_dir(model_dir, rank, Path(tmp) / "adapter")
        # The embedded model's converted config keeps a stale GGUF quantization_config
        # (see VllmGeneratorEngine._config_overrides); drop it the same way.
        qc = _json.loads((model_dir / "config.json").read_text()).get("quantization_config") or {}
        extra = {"hf_overrides": {"quantization_config": None}} if qc.get("quant_method") == "gguf" else {}
        llm = LLM(model=str(model_dir), dtype=dtype, seed=0, enforce_eager=True, enable_prefix_caching=True,
                  enable_lora=True, max_loras=4, max_lora_rank=cap, max_cpu_loras=16, max_num_seqs=256,
                  logprobs_mode="processed_logprobs", generation_config="vllm", **extra)
        lora = LoRARequest("bench", 1, str(adapter))
        params = [SamplingParams(n=n_samples, max_tokens=max_tokens, temperature=1.0, seed=i, ignore_eos=True,
                                 logprobs=0) for i in range(len(prompts))]
        llm.generate([{"prompt_token_ids": prompts[0]}], params[0], lora_request=lora, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=lora, use_tqdm=False)
        direct_s = time.perf_counter() - t0
        direct_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    print(f"direct vLLM: {direct_tokens} tokens in {direct_s:.1f} s", flush=True)

    service_tps = service_tokens / service_s
    direct_tps = direct_tokens / direct_s
    return {
        "ratio_vs_vllm": round(service_tps / direct_tps, 3),
        "service_vllm_tok_s": round(service_tps, 1),
        "direct_vllm_tok_s": round(direct_tps, 1),
        "tokens": service_tokens,
        "shape": f"{len(prompts)}x{n_samples}x{max_tokens}",
        "lora_rank": rank,
        "dtype": dtype,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="embedded")
    ap.add_argument("--quick", action="store_true", help="8 prompts x 2 samples x 16 tokens")
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    shape = dict(n_prompts=8, n_samples=2, max_tokens=16) if args.quick else {}
    res = vllm_comparison(args.model, rank=args.rank, dtype=args.dtype, **shape)
    for k, v in res.items():
        print(f"{k}={v}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
