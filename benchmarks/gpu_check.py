"""GPU check: bf16 LoRA training throughput and MFU, the torch generator vs generate, bf16 parity, ZeRO-2.

    bash benchmarks/gpu_check.sh [--peak-tflops F] [--part train,generate,parity,zero2]
    bash benchmarks/gpu_check.sh --cpu-smoke      # tiny sizes on CPU: checks the script itself

Needs torch, transformers, peft (and grpcio for the package imports); no
internet, no hub: the model is a random Qwen2 built from a config (~0.79 B
parameters: vocab 32000, hidden 2048, intermediate 5632, 16 layers, 16 heads,
4 KV heads, tied embeddings) with a synthetic word-level tokenizer, written
to a temporary directory in bf16. Parts (in this order, one process; zero2 in
a child process):

- train: ``TorchTrainerEngine`` (bf16 base, LoRA rank 16 on every block linear
  layer, fp32 adapter + AdamW), batch 8 x 2048 tokens, 2 warm-up + 5 timed
  steps of forward_backward + optim_step. Prints ``train_tok_s=`` and
  ``mfu=`` = 6 * N * train_tok_s / peak, with N = the base's parameters
  (tied embeddings counted once, as the lm_head matmul) + the LoRA
  parameters, and peak = the GPU's dense bf16 peak (``--peak-tflops``;
  default by device name: H100/H200 989.4 TFLOP/s, A100 312, L40S 362.1,
  else 0 = MFU not printed). The 6N convention counts weight gradients the
  frozen base never computes; the FLOPs actually executed are ~4N per token
  (forward 2N + activation gradients 2N), printed as ``mfu_executed_4n=``.
  Attention's sequence-length term is left out of both.
- generate: ``TorchGeneratorEngine`` (bf16, all requests submitted at once)
  vs ``model.generate`` once per prompt (num_return_sequences) and once
  left-padded over all prompts (batched), same prompts, every completion
  exactly ``new_tokens`` long, temperature 1. Prints ``sample_tok_s=``,
  ``generate_tok_s=``, ``batched_generate_tok_s=``, ``sample_ratio_vs_generate=``,
  ``sample_ratio_vs_batched=`` (target >= 1.0).
- parity: after the train part's 7 optim_steps (lr 1e-3, so LoRA B is
  non-zero) the trainer's adapter is loaded into the generator; trainer ``forward(return_logprobs)``
  vs generator ``compute_logprobs`` on 4 sequences of 512 tokens, both bf16.
  Prints ``parity_max_abs=`` and ``parity_mean_abs=`` (nats).
- cycle: 8 sessions' 64-token forward_backward as one clock-cycle pass (``forward_many``) vs one by
  one on twin adapters: ``cycle_speedup_8x64=``, ``cycle_max_loss_rel=``, ``cycle_errors=``; the
  products the engine picks (``cycle_matmul_auto=grouped|bmm``); the same forward pass with the LoRA
  terms by ``torch._grouped_mm`` vs per-row ``bmm`` (``cycle_grouped_vs_bmm_8x64=`` time ratio,
  ``cycle_grouped_max_loss_diff=``, or ``cycle_grouped=failed (...)``); and the raw kernel over the
  same 8 segments vs ``bmm`` (``grouped_mm_max_abs_vs_bmm=``, or why not).
- zero2: where ``import deepspeed`` works, a 1-process ZeRO-2
  ``DeepSpeedTrainerEngine`` (bf16, LoRA rank 16): one forward_backward +
  optim_step; prints ``zero2_step_s=`` and ``zero2_loss=``; else
  ``zero2=skipped (deepspeed not installed)``.

--cpu-smoke: the same parts on CPU with a tiny model (vocab 512, hidden 64,
2 layers), 2 x 64 training tokens, 4 prompts x 2 samples x 8 tokens and a
nominal 1 TFLOP/s peak (the MFU line then only checks the arithmetic).
Every line is ``key=value``; the run ends with ``gpu_check_seconds=``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "server", ROOT):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402
import torch  # noqa: E402

# Dense bf16 tensor-core peaks (no sparsity), TFLOP/s, from the vendors' datasheets.
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 PCIe": 756.5,
                    "H100 NVL": 835.5, "H100": 989.4, "A100": 312.0, "L40S": 362.1, "A10G": 70.0, "L4": 121.0}

FULL = dict(vocab=32000, hidden=2048, inter=5632, layers=16, heads=16, kv=4, max_pos=4096,
            batch=8, seq=2048, prompts=32, samples=4, prompt_len=128, new_tokens=64, parity_len=512)
SMOKE = dict(vocab=512, hidden=64, inter=128, layers=2, heads=4, kv=2, max_pos=512,
             batch=2, seq=64, prompts=4, samples=2, prompt_len=16, new_tokens=8, parity_len=32)


RESULTS: dict = {}


def emit(key: str, value) -> None:
    """Print one ``key=value`` line (floats with 4 significant digits) and flush; kept for --json-out."""
    RESULTS[key] = value
    print(f"{key}={value:.4g}" if isinstance(value, float) else f"{key}={value}", flush=True)


def build_model(out: Path, s: dict, dtype: torch.dtype, device: str) -> Path:
    """A random Qwen2 of sizes ``s`` with a synthetic word-level tokenizer (ids ``t<k>``), saved to ``out``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast, Qwen2Config

    out.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"t{i}": i for i in range(len(specials), s["vocab"])})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  pad_token="<pad>")
    tok.save_pretrained(str(out))
    cfg = Qwen2Config(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"],
                      num_hidden_layers=s["layers"], num_attention_heads=s["heads"], num_key_value_heads=s["kv"],
                      max_position_embeddings=s["max_pos"], tie_word_embeddings=True, use_sliding_window=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    with torch.device(device):  # random init on the GPU: seconds instead of a minute on the CPU
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=3)
    model.save_pretrained(str(out), safe_serialization=True)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_samples(s: dict, seed: int):
    from together_train_server.engines.types import Sample

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(s["batch"]):
        t = rng.integers(4, s["vocab"], s["seq"] + 1).astype(np.int64)
        out.append(Sample(t[:-1].copy(), {"target_tokens": t[1:].copy(),
                                                "weights": np.ones(s["seq"], np.float32)}))
    return out


def peak_tflops(args, device: str) -> float:
    if args.peak_tflops is not None:
        return float(args.peak_tflops)
    if not device.startswith("cuda"):
        return 1.0  # nominal (--cpu-smoke): checks the arithmetic only
    name = torch.cuda.get_device_name()
    for key, v in PEAK_BF16_TFLOPS.items():
        if key in name:
            return v
    return 0.0


def part_train(args, s: dict, model_dir: Path, device: str) -> tuple:
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.engines.types import AdamParams, LoraConfig

    eng = TorchTrainerEngine(model_dir, dtype="bfloat16", device=device, micro_batch_tokens=s["batch"] * s["seq"])
    n_lora = eng.create_adapter("a", LoraConfig(rank=16, alpha=32.0, seed=0))
    # the frozen base (tied embeddings counted once) = every parameter that is not a LoRA matrix
    n_base = sum(p.numel() for n, p in eng.table.peft.named_parameters() if "lora_" not in n)
    n_total = n_base + n_lora
    adam = AdamParams(learning_rate=1e-3)
    tokens = s["batch"] * s["seq"]
    for k in range(2):  # warm-up (kernels, allocator, AdamW state)
        eng.forward("a", train_samples(s, k), "cross_entropy", backward=True)
        eng.optim_step("a", adam)
    times = []
    for k in range(5):
        batch = train_samples(s, 10 + k)
        sync(device)
        t0 = time.perf_counter()
        eng.forward("a", batch, "cross_entropy", backward=True)
        eng.optim_step("a", adam)
        sync(device)
        times.append(time.perf_counter() - t0)
    tok_s = tokens / statistics.median(times)
    peak = peak_tflops(args, device)
    emit("model_params", n_base)
    emit("lora_params", n_lora)
    emit("train_tokens_per_step", tokens)
    emit("train_step_s", statistics.median(times))
    emit("train_tok_s", tok_s)
    emit("peak_tflops_bf16", peak)
    if peak > 0:
        emit("mfu", 6.0 * n_total * tok_s / (peak * 1e12))
        emit("mfu_executed_4n", 4.0 * n_total * tok_s / (peak * 1e12))
    else:
        emit("mfu", f"unknown (no peak for {torch.cuda.get_device_name()}; pass --peak-tflops)")
    if device.startswith("cuda"):
        emit("train_peak_mem_gib", torch.cuda.max_memory_allocated() / 2**30)
    return eng


def part_cycle(s: dict, model_dir: Path, device: str) -> None:
    """The clock cycle: 8 sessions' forward_backward (64 tokens each; 16 with --cpu-smoke) as one
    ``forward_many`` pass vs one by one on twin adapters (same seeds); the pass's LoRA products by
    ``torch._grouped_mm`` (what the engine uses where `prefers_grouped`) against per-row ``bmm`` (its
    fallback): time and loss difference; then the raw kernel on the same segments against ``bmm``."""
    from together_train_server.engines.cross_session import ForwardItem
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.engines.types import LoraConfig, Sample

    n, t = 8, (16 if s["hidden"] < 256 else 64)
    eng = TorchTrainerEngine(model_dir, dtype="bfloat16", device=device)
    for k in range(n):
        for p in ("c", "t"):
            eng.create_adapter(f"{p}{k}", LoraConfig(rank=16, alpha=32.0, seed=k))
    rng = np.random.default_rng(5)
    data = []
    for _ in range(n):
        tok = rng.integers(4, s["vocab"], t + 1).astype(np.int64)
        data.append([Sample(tok[:-1].copy(), {"target_tokens": tok[1:].copy(), "weights": np.ones(t, np.float32)})])
    items = [ForwardItem(f"c{k}", data[k], "cross_entropy", backward=True) for k in range(n)]
    times = {"alone": [], "cycle": []}
    for rep in range(3):   # the first is a warm-up
        sync(device)
        t0 = time.perf_counter()
        alone = [eng.forward(f"t{k}", data[k], "cross_entropy", backward=True).loss for k in range(n)]
        sync(device)
        t1 = time.perf_counter()
        outs = eng.forward_many(items)
        sync(device)
        if rep:
            times["alone"].append(t1 - t0)
            times["cycle"].append(time.perf_counter() - t1)
    bad = [o for o in outs if isinstance(o, BaseException)]
    emit("cycle_errors", len(bad))
    if not bad:
        emit("cycle_max_loss_rel", max(abs(o.loss - a) / max(abs(a), 1e-12) for o, a in zip(outs, alone)))
    emit("cycle_speedup_8x%d" % t, statistics.median(times["alone"]) / statistics.median(times["cycle"]))
    from together_train_server.engines import cross_session
    from together_train_server.engines.row_lora import prefers_grouped

    p = next(iter(eng.trainable_parameters("c0").values()))
    emit("cycle_matmul_auto", "grouped" if prefers_grouped(p.device, p.dtype, s["hidden"], 16, s["hidden"]) else "bmm")
    by: dict[str, list] = {}
    for mode in ("bmm", "grouped", "bmm", "grouped"):   # alternating; the first of each is a warm-up
        cross_session.ROW_LORA_MATMUL = mode
        sync(device)
        t0 = time.perf_counter()
        try:
            res = eng.forward_many([ForwardItem(f"t{k}", data[k], "cross_entropy") for k in range(n)])
        except Exception as e:   # grouped products refused here (older GPU or build)
            emit("cycle_grouped", f"failed ({type(e).__name__}: {str(e)[:120]})")
            by = {}
            break
        sync(device)
        by.setdefault(mode, []).append((time.perf_counter() - t0, [o.loss for o in res]))
    cross_session.ROW_LORA_MATMUL = "auto"
    if by:
        emit("cycle_grouped_vs_bmm_8x%d" % t, by["bmm"][-1][0] / by["grouped"][-1][0])
        emit("cycle_grouped_max_loss_diff", max(abs(a - b) for a, b in zip(by["bmm"][-1][1], by["grouped"][-1][1])))
    grouped = getattr(torch, "_grouped_mm", None)
    if grouped is None or not device.startswith("cuda"):
        emit("grouped_mm", "unavailable (needs torch._grouped_mm on CUDA)")
        return
    try:
        x = torch.randn(n * t, s["hidden"], dtype=torch.bfloat16, device=device)
        a = torch.randn(n, s["hidden"], 16, dtype=torch.bfloat16, device=device)
        offs = torch.arange(t, n * t + 1, t, dtype=torch.int32, device=device)
        y = grouped(x, a, offs=offs)
        ref = torch.bmm(x.view(n, t, -1), a).reshape(n * t, -1)
        emit("grouped_mm_max_abs_vs_bmm", float((y.float() - ref.float()).abs().max()))
    except Exception as e:   # an older GPU or build: the kernel's own refusal
        emit("grouped_mm", f"failed ({type(e).__name__}: {str(e)[:120]})")


def part_generate(args, s: dict, model_dir: Path, device: str, gen_eng) -> None:
    from transformers import AutoModelForCausalLM

    from together_train_server.engines.types import SamplingParams

    rng = np.random.default_rng(1)
    # varied lengths: prompt_len/2 ... prompt_len
    prompts = [rng.integers(4, s["vocab"], int(rng.integers(s["prompt_len"] // 2, s["prompt_len"] + 1))).tolist()
               for _ in range(s["prompts"])]
    n, T = s["samples"], s["new_tokens"]
    total = len(prompts) * n * T
    gp = SamplingParams(max_tokens=T, temperature=1.0, seed=0, ignore_eos=True)
    gen_eng.generate(prompts[0], SamplingParams(max_tokens=2, seed=0))  # warm-up
    sync(device)
    t0 = time.perf_counter()
    futs = [gen_eng.submit(p, SamplingParams(max_tokens=T, temperature=1.0, seed=i, ignore_eos=True), n)
            for i, p in enumerate(prompts)]
    outs = [f.result() for f in futs]
    sync(device)
    eng_s = time.perf_counter() - t0
    assert all(len(q.tokens) == T for o in outs for q in o.sequences), "engine completions of the wrong length"
    del gp

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16, local_files_only=True)
    model = model.to(device).eval()
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=T, min_new_tokens=T,
              num_return_sequences=n, pad_token_id=3)
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=2, min_new_tokens=2,
                       do_sample=True, pad_token_id=3)
        sync(device)
        t0 = time.perf_counter()
        for p in prompts:
            model.generate(torch.tensor([p], device=device), attention_mask=torch.ones(1, len(p), dtype=torch.long,
                                                                                       device=device), **kw)
        sync(device)
        per_prompt = time.perf_counter() - t0
        L = max(map(len, prompts))
        ids = torch.full((len(prompts), L), 3, dtype=torch.long)
        mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids.to(device), attention_mask=mask.to(device), **kw)
        sync(device)
        batched = time.perf_counter() - t0
        assert out.shape == (len(prompts) * n, L + T)
    del model
    emit("sample_shape", f"{len(prompts)}x{n}x{T}")
    emit("sample_tok_s", total / eng_s)
    emit("generate_tok_s", total / per_prompt)
    emit("batched_generate_tok_s", total / batched)
    emit("sample_ratio_vs_generate", per_prompt / eng_s)
    emit("sample_ratio_vs_batched", batched / eng_s)


def part_parity(s: dict, trainer, gen_eng) -> None:
    from together_train_server.engines.types import Sample

    gen_eng.load_adapter("a", trainer.spec("a"), trainer.adapter_tensors("a"), version=1)
    rng = np.random.default_rng(2)
    seqs = [rng.integers(4, s["vocab"], s["parity_len"]).tolist() for _ in range(4)]
    samples = [Sample(np.asarray(q[:-1], np.int64), {"target_tokens": np.asarray(q[1:], np.int64),
                                                          "weights": np.ones(len(q) - 1, np.float32)})
               for q in seqs]
    tr = trainer.forward("a", samples, "cross_entropy", return_logprobs=True).logprobs
    ge = gen_eng.compute_logprobs(seqs, adapter="a")
    diffs = np.concatenate([np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)) for a, b in zip(tr, ge)])
    emit("parity_max_abs", float(diffs.max()))
    emit("parity_mean_abs", float(diffs.mean()))


def part_zero2_child(s: dict, model_dir: Path, device: str) -> None:
    """Runs in a child process (its own torch.distributed world of 1)."""
    from together_train_server.engines.deepspeed import DeepSpeedTrainerEngine, init_distributed
    from together_train_server.engines.types import AdamParams, LoraConfig

    init_distributed()
    eng = DeepSpeedTrainerEngine(model_dir, zero_stage=2, dtype="bfloat16", device=device,
                                 micro_batch_tokens=s["batch"] * s["seq"])
    try:
        eng.create_adapter("a", LoraConfig(rank=16, alpha=32.0, seed=0))
        eng.forward("a", train_samples(s, 0), "cross_entropy", backward=True)  # warm-up
        eng.optim_step("a", AdamParams(learning_rate=1e-4))
        sync(device)
        t0 = time.perf_counter()
        out = eng.forward("a", train_samples(s, 1), "cross_entropy", backward=True)
        eng.optim_step("a", AdamParams(learning_rate=1e-4))
        sync(device)
        emit("zero2_step_s", time.perf_counter() - t0)
        emit("zero2_loss", float(out.loss))
    finally:
        eng.close()


def part_zero2(args, s: dict, model_dir: Path, device: str) -> None:
    try:
        import deepspeed  # noqa: F401
    except Exception:
        emit("zero2", "skipped (deepspeed not installed)")
        return
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0"}
    cmd = [sys.executable, __file__, "--zero2-child", str(model_dir), "--device", device]
    if args.cpu_smoke:
        cmd.append("--cpu-smoke")
    try:
        p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.zero2_timeout)
    except subprocess.TimeoutExpired:
        emit("zero2", f"failed (timeout {args.zero2_timeout} s)")
        return
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("zero2_")]
    for ln in lines:
        k, _, v = ln.partition("=")
        RESULTS[k] = v
        print(ln, flush=True)
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        emit("zero2", f"failed (exit {p.returncode}: {tail[:300]})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on CPU (tests the script)")
    ap.add_argument("--device", default=None, help="default cuda (cpu with --cpu-smoke)")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="dense bf16 peak of the GPU in TFLOP/s (default: by device name, H200 989.4)")
    ap.add_argument("--part", default="train,generate,parity,cycle,zero2", help="comma list of parts to run")
    ap.add_argument("--zero2-timeout", type=int, default=240, help="seconds for the ZeRO-2 child")
    ap.add_argument("--json-out", default=None, help="also write the key=value lines as JSON")
    ap.add_argument("--zero2-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    s = SMOKE if args.cpu_smoke else FULL
    device = args.device or ("cpu" if args.cpu_smoke else "cuda")
    if args.zero2_child:
        part_zero2_child(s, Path(args.zero2_child), device)
        return 0
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_check=failed (no CUDA device; use --cpu-smoke to test the script on CPU)", flush=True)
        return 2
    t_start = time.perf_counter()
    parts = set(filter(None, args.part.split(",")))
    emit("device", torch.cuda.get_device_name() if device.startswith("cuda") else "cpu")
    emit("torch", torch.__version__)
    with tempfile.TemporaryDirectory(prefix="tt-gpu-check-") as tmp:
        t0 = time.perf_counter()
        model_dir = build_model(Path(tmp) / "random-qwen2", s, torch.bfloat16, device)
        emit("build_model_s", time.perf_counter() - t0)
        trainer = gen_eng = None
        if parts & {"train", "parity"}:
            trainer = part_train(args, s, model_dir, device)
        if parts & {"generate", "parity"}:
            from together_train_server.engines.torch_generator import TorchGeneratorEngine

            gen_eng = TorchGeneratorEngine(model_dir, dtype="bfloat16", device=device)
        try:
            if "generate" in parts:
                part_generate(args, s, model_dir, device, gen_eng)
            if "parity" in parts:
                part_parity(s, trainer, gen_eng)
        finally:
            if gen_eng is not None:
                gen_eng.close()
        del trainer, gen_eng
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        if "cycle" in parts:
            part_cycle(s, model_dir, device)
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        if "zero2" in parts:
            part_zero2(args, s, model_dir, device)
    emit("gpu_check_seconds", time.perf_counter() - t_start)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": RESULTS}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
