"""DeepSpeed ZeRO backend: step time on 1 and 2 ranks, and peak memory per rank with ZeRO-3.

One run, every variant in fresh processes (so each has its own peak memory),
the same LoRA SFT steps (global batch ``batch_size x seq_len`` random tokens,
cross-entropy, AdamW) on the same batches:

- ``single``: the single-process backend (``TorchTrainerEngine``), the baseline;
- ``1rank`` / ``2ranks``: ``DeepSpeedTrainerEngine`` at ``--stage`` (default 2)
  on 1 and 2 ranks (processes started with torch.multiprocessing; rank 0
  drives, the other follows, as under ``serve``). The global batch is split
  across ranks; threads: ``--threads-per-rank`` (default cores / ranks, so
  both use the same cores);
- ``zero3_2ranks``: ZeRO-3 (the frozen base partitioned) on 2 ranks, for memory.

Step time: median seconds of forward_backward + optim_step after warmup.
Memory per rank: peak RSS (``VmHWM``, the same as ``ru_maxrss``) over the
process's life (``peak_mem_mb_*``: includes loading the model), and the peak
while training only (``*_train``: ``VmHWM`` reset through
``/proc/self/clear_refs`` once the engine is built), plus the bytes of
parameters each rank stores (a ZeRO-3 rank holds its partition of the base).
``mem_ratio_zero3_2ranks`` = ZeRO-3 rank 0's peak / the single-process peak.
Every worker runs with ``MALLOC_MMAP_THRESHOLD_=131072`` (``--glibc-malloc-defaults``
drops it): glibc's default threshold is dynamic (each freed mmapped block
raises it to that block's size, up to 32 MiB), so later freed blocks (gathered ZeRO-3 layers,
logits) stay in the heap and RSS keeps counting them; a fixed 128 KiB
threshold returns every large block to the OS when it is freed, so the peak
RSS is the live memory (measured, ``--quick``: without it ZeRO-3 rank 0
peaked at 1467 MB vs 1391 MB single, and after loading held 945 MB where
rank 1, with the same live tensors, held 697; with it 1073 vs 1254 MB and
668 / 667 MB). Steps get somewhat slower with it (every large block is a
fresh mmap).
On a GPU (``torch.cuda.is_available()``) the same runs use cuda + NCCL and
peak memory is ``torch.cuda.max_memory_allocated``; 2 ranks need 2 GPUs.

Prints ``key=value`` lines (step_s_single, step_s_1rank, step_s_2ranks,
speedup_2ranks, peak_mem_mb_single, peak_mem_mb_zero3_rank0,
mem_ratio_zero3_2ranks, zero_stage, gpu, ...) and writes them as JSON.

    python benchmarks/zero.py            # SmolLM2-135M-Instruct (embedded), 4 x 128, 2 warmup + 4 steps, ZeRO-2 times
    python benchmarks/zero.py --quick    # < 2 min: embedded model, 4 x 32, 1 warmup + 2 steps, ZeRO-3 throughout
    python benchmarks/zero.py --quick --model tiny   # tiny random Llama (too small to show the memory effect)

ZeRO-3 ranks load the model already partitioned (built under
``deepspeed.zero.Init``, checkpoint copied in one module at a time), so no
rank's peak while loading (``hwm_after_load_mb`` in the JSON runs) includes
a whole copy of the model. Measured (``--quick``, 2 shared cores):
``mem_ratio_zero3_2ranks=0.856`` (rank 0 1073 MB, single 1254 MB; the peak
is the training step, loading peaks at 903 MB), ``param_mb_zero3_rank0=275.2``
of ``param_mb_single=531.8``, wall 44 s.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@dataclass
class Config:
    model: str = "embedded"
    batch_size: int = 4            # small: activations (logits: tokens x 49152 x 4 B) must not hide the weights
    seq_len: int = 128
    steps: int = 4
    warmup_steps: int = 2
    lora_rank: int = 16
    learning_rate: float = 1e-4
    stage: int = 2                 # ZeRO stage of the 1/2-rank step-time runs
    memory_stage: int = 3          # ZeRO stage of the memory run
    stage3_lean: bool = True       # stage 3: release each gathered layer after use (LEAN_STAGE3)
    dtype: str = "float32"
    threads_per_rank: int = 0      # 0: cores // ranks
    seed: int = 0
    json_out: str = "runs/bench/zero.json"
    malloc_mmap_threshold: int = 131072   # MALLOC_MMAP_THRESHOLD_ of every worker (0: glibc's dynamic default)


# DeepSpeed's stage-3 defaults keep up to 1e9 gathered parameters live (and prefetch 5e7), i.e. a
# 135M model stays gathered for the whole step and ZeRO-3 saves no memory; these release each layer.
LEAN_STAGE3 = {"zero_optimization": {"stage3_max_live_parameters": 0, "stage3_max_reuse_distance": 0,
                                     "stage3_prefetch_bucket_size": 0, "stage3_param_persistence_threshold": 0}}


# ----------------------------------------------------------------------------- measuring
def _vm_kb(field: str) -> int:
    """A ``/proc/self/status`` field (VmRSS, VmHWM) in kB; 0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _reset_hwm() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False when not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def _param_bytes(engine) -> int:
    """Bytes of parameters this rank stores (ZeRO-3: its partition ``ds_tensor``, not the empty ``data``)."""
    # Benchmark introspection: the engines have no public accessor for their model.
    engine = getattr(engine, "worker", engine)  # DeepSpeedTrainerEngine: this rank's worker holds the model
    model = engine.table.head_model()
    total = 0
    for p in model.parameters():  # tied weights come once
        t = getattr(p, "ds_tensor", None)
        total += t.numel() * t.element_size() if t is not None else p.numel() * p.element_size()
    return total


def _batches(cfg: Config, vocab: int):
    """``warmup + steps`` global batches of random tokens (weights 1 on every target)."""
    import numpy as np

    from together_train_server.engines.types import Sample

    rng = np.random.default_rng(cfg.seed)
    out = []
    for _ in range(cfg.warmup_steps + cfg.steps):
        batch = []
        for _ in range(cfg.batch_size):
            tok = rng.integers(0, vocab, cfg.seq_len + 1).astype(np.int64)
            batch.append(Sample(tok[:-1].copy(), {"target_tokens": tok[1:].copy(),
                                                       "weights": np.ones(cfg.seq_len, np.float32)}))
        out.append(batch)
    return out


def _worker(kind: str, rank: int, world: int, port: int, cfg_d: dict, model_dir: str, device: str,
            threads: int, out_file: str) -> None:
    """One process of a variant: build the engine, train (rank 0 drives), write measurements as JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS=str(threads))
    import torch

    from together_train_server.engines.model_loading import configure_cpu_threads
    from together_train_server.engines.types import AdamParams, LoraConfig

    cfg = Config(**cfg_d)
    configure_cpu_threads(threads)
    cuda = device == "cuda"
    t_load = time.perf_counter()
    if kind == "single":
        from together_train_server.engines.torch_trainer import TorchTrainerEngine

        eng = TorchTrainerEngine(model_dir, dtype=cfg.dtype, device=device)
    else:
        from together_train_server.engines.deepspeed import DeepSpeedTrainerEngine

        stage = cfg.memory_stage if kind == "zero3" else cfg.stage
        lean = stage == 3 and cfg.stage3_lean
        eng = DeepSpeedTrainerEngine(model_dir, zero_stage=stage, dtype=cfg.dtype, device=device,
                                     deepspeed_config=LEAN_STAGE3 if lean else None)
    load_s = time.perf_counter() - t_load
    rec = {"kind": kind, "rank": rank, "world": world, "threads": threads, "load_s": load_s,
           "hwm_after_load_mb": _vm_kb("VmHWM") / 1024, "rss_after_load_mb": _vm_kb("VmRSS") / 1024}
    rec["hwm_reset"] = _reset_hwm()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    if rank == 0:
        batches = _batches(cfg, eng.vocab_size)
        eng.create_adapter("bench", LoraConfig(rank=cfg.lora_rank, alpha=2.0 * cfg.lora_rank, seed=cfg.seed))
        adam = AdamParams(learning_rate=cfg.learning_rate)
        times, losses, norms = [], [], []
        try:
            for batch in batches:
                t0 = time.perf_counter()
                out = eng.forward("bench", batch, "cross_entropy", backward=True)
                opt = eng.optim_step("bench", adam)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
                losses.append(float(out.loss))
                norms.append(float(opt.grad_norm))
            rec.update(step_times=times[cfg.warmup_steps:], losses=losses, grad_norms=norms)
            rec["param_bytes"] = _param_bytes(eng)
        finally:
            if kind != "single":
                eng.close()
    else:
        eng.follow()
        rec["param_bytes"] = _param_bytes(eng)
    rec["peak_rss_mb"] = _vm_kb("VmHWM") / 1024 if not rec["hwm_reset"] else max(
        rec["hwm_after_load_mb"], _vm_kb("VmHWM") / 1024)
    rec["peak_rss_train_mb"] = _vm_kb("VmHWM") / 1024 if rec["hwm_reset"] else float("nan")
    rec["ru_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if cuda:
        rec["cuda_peak_mb"] = torch.cuda.max_memory_allocated() / 2**20
    Path(out_file).write_text(json.dumps(rec))
    if kind != "single":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_variant(kind: str, world: int, cfg: Config, model_dir: str, device: str, tmp: Path,
                timeout_s: float = 1800.0) -> list[dict]:
    """Start ``world`` fresh processes for one variant; returns each rank's measurements."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    cores = os.cpu_count() or 1
    threads = cfg.threads_per_rank or max(1, cores // world)
    port = _free_port()
    files = [tmp / f"{kind}-{world}-{r}.json" for r in range(world)]
    procs = [ctx.Process(target=_worker, args=(kind, r, world, port, asdict(cfg), model_dir, device, threads,
                                                str(files[r])), daemon=False) for r in range(world)]
    # Children inherit the environment at start: thread budget before torch loads; CPU runs on a
    # GPU machine hide the GPUs, or the engine would pick NCCL for CPU tensors.
    env = {"OMP_NUM_THREADS": str(threads), **({"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {})}
    if cfg.malloc_mmap_threshold > 0:   # read by glibc at process start (see the module docstring)
        env["MALLOC_MMAP_THRESHOLD_"] = str(cfg.malloc_mmap_threshold)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    deadline = time.time() + timeout_s
    for p in procs:
        p.join(max(1.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    bad = [r for r, p in enumerate(procs) if p.exitcode != 0 or not files[r].exists()]
    if bad:
        raise RuntimeError(f"{kind} on {world} rank(s): rank(s) {bad} failed (exit codes "
                           f"{[p.exitcode for p in procs]})")
    return [json.loads(f.read_text()) for f in files]


# ----------------------------------------------------------------------------- report
def _median(xs) -> float:
    return statistics.median(xs) if xs else float("nan")


def _fmt(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def measure(cfg: Config, device: str, prefix: str = "") -> tuple[dict, list[str], dict]:
    """Run every variant on ``device``; returns (key -> value report with ``prefix``, notes, raw runs)."""
    from together_train_server.engines.model_loading import resolve_model_dir

    if cfg.model == "tiny":
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from _models import build_tiny_model  # test-only helper, kept under tests/

        model_dir = str(build_tiny_model(Path(tempfile.mkdtemp(prefix="zero-bench-")) / "tiny", seed=0))
    else:
        model_dir = str(resolve_model_dir(None if cfg.model == "embedded" else cfg.model))
    n_gpus = __import__("torch").cuda.device_count() if device == "cuda" else 0
    out: dict = {}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="zero-bench-") as tmp:
        tmp_p = Path(tmp)
        runs = {"single": run_variant("single", 1, cfg, model_dir, device, tmp_p),
                "1rank": run_variant("ds", 1, cfg, model_dir, device, tmp_p)}
        two = device != "cuda" or n_gpus >= 2
        if two:
            runs["2ranks"] = run_variant("ds", 2, cfg, model_dir, device, tmp_p)
            # Same stage for times and memory (--quick): the 2-rank run is the memory run.
            same = cfg.stage == cfg.memory_stage
            runs["zero3"] = runs["2ranks"] if same else run_variant("zero3", 2, cfg, model_dir, device, tmp_p)
        else:
            notes.append(f"2 ranks need 2 GPUs (found {n_gpus}): 2-rank keys are nan")
    mem_key = "cuda_peak_mb" if device == "cuda" else "peak_rss_mb"
    single = runs["single"][0]
    out["step_s_single"] = _median(single["step_times"])
    out["step_s_1rank"] = _median(runs["1rank"][0]["step_times"])
    out["step_s_2ranks"] = _median(runs["2ranks"][0]["step_times"]) if "2ranks" in runs else float("nan")
    out["speedup_2ranks"] = out["step_s_1rank"] / out["step_s_2ranks"]
    out["zero_stage"] = cfg.stage
    out["stage3_config"] = "lean" if cfg.stage3_lean else "deepspeed-defaults"
    out["peak_mem_mb_single"] = single[mem_key]
    if "zero3" in runs:
        z3 = runs["zero3"]
        out["peak_mem_mb_zero3_rank0"] = z3[0][mem_key]
        out["peak_mem_mb_zero3_rank1"] = z3[1][mem_key]
        out["mem_ratio_zero3_2ranks"] = z3[0][mem_key] / single[mem_key]
        if device != "cuda":
            out["peak_mem_mb_single_train"] = single["peak_rss_train_mb"]
            out["peak_mem_mb_zero3_rank0_train"] = z3[0]["peak_rss_train_mb"]
            out["mem_ratio_zero3_2ranks_train"] = z3[0]["peak_rss_train_mb"] / single["peak_rss_train_mb"]
        out["param_mb_single"] = single["param_bytes"] / 2**20
        out["param_mb_zero3_rank0"] = z3[0]["param_bytes"] / 2**20
        out["param_mb_zero3_rank1"] = z3[1]["param_bytes"] / 2**20
        out["step_s_zero3_2ranks"] = _median(z3[0]["step_times"])
    else:
        out["mem_ratio_zero3_2ranks"] = float("nan")
    if "2ranks" in runs:
        out["param_mb_2ranks_rank0"] = runs["2ranks"][0]["param_bytes"] / 2**20
        out["peak_mem_mb_2ranks_rank0"] = runs["2ranks"][0][mem_key]
    # Same work in every variant: the losses agree (the order of float sums differs).
    ref = single["losses"]
    diffs = [abs(a - b) / max(1e-12, abs(b)) for k, r in runs.items() if k != "single"
             for a, b in zip(r[0]["losses"], ref)]
    out["max_loss_rel_diff"] = max(diffs) if diffs else float("nan")
    out["threads_per_rank"] = {k: r[0]["threads"] for k, r in runs.items()}
    return {prefix + k: v for k, v in out.items()}, notes, runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="under two minutes: embedded model, 4 x 32 tokens, 1 warmup + 2 steps, "
                             "ZeRO-3 for the step times too (the 2-rank run is the memory run)")
    parser.add_argument("--model", default=None, help="'embedded' (SmolLM2-135M-Instruct), 'tiny', or a directory")
    parser.add_argument("--stage", type=int, default=None, choices=[1, 2, 3], help="ZeRO stage of the step-time runs")
    parser.add_argument("--memory-stage", type=int, default=None, choices=[1, 2, 3],
                        help="ZeRO stage of the memory run (default 3)")
    parser.add_argument("--glibc-malloc-defaults", action="store_true",
                        help="workers keep glibc's dynamic mmap threshold (freed blocks stay in RSS)")
    parser.add_argument("--stage3-defaults", action="store_true",
                        help="ZeRO-3 with DeepSpeed's default live/prefetch limits instead of LEAN_STAGE3")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--seq-len", type=int, default=None)
    parser.add_argument("--threads-per-rank", type=int, default=None)
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    cfg = Config()
    if args.quick:
        cfg.model, cfg.batch_size, cfg.seq_len, cfg.steps, cfg.warmup_steps = "embedded", 4, 32, 2, 1
        cfg.stage = 3  # one 2-rank launch serves both the step time and the memory keys
    for name in ("model", "stage", "memory_stage", "steps", "batch_size", "seq_len", "threads_per_rank", "json_out"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))

    cfg.stage3_lean = not args.stage3_defaults
    if args.glibc_malloc_defaults:
        cfg.malloc_mmap_threshold = 0
    import torch

    t0 = time.time()
    report, notes, runs = measure(cfg, "cpu")
    gpu = "none"
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
        gpu_report, gpu_notes, gpu_runs = measure(cfg, "cuda", prefix="gpu_")
        report.update(gpu_report)
        notes += [f"gpu: {n}" for n in gpu_notes]
        runs.update({f"gpu_{k}": v for k, v in gpu_runs.items()})
    report["gpu"] = gpu
    report["model"] = cfg.model
    report["memory_stage"] = cfg.memory_stage
    report["malloc_mmap_threshold"] = cfg.malloc_mmap_threshold
    report["wall_s"] = time.time() - t0
    if cfg.memory_stage != 3:
        notes.append(f"memory run used ZeRO-{cfg.memory_stage}, not ZeRO-3")
    out = Path(cfg.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": asdict(cfg), "results": report, "notes": notes, "runs": runs},
                              indent=2, default=str))
    for note in notes:
        print(f"# {note}")
    for k, v in report.items():
        if not isinstance(v, dict):
            print(f"{k}={_fmt(v)}")
    print(f"json={out}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
