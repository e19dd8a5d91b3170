"""Long sequences: peak memory and step time of one forward_backward, service vs plain (issue 21).

In one run, on the embedded SmolLM2-135M-Instruct (fp32, CPU), one LoRA
session (rank 16, every linear layer), one cross_entropy sample of 1K, 2K,
4K and 8K tokens:

- service: a local resource (``serve --model embedded``, no replicas,
  defaults: chunked logprobs, activation checkpointing auto, mmap threshold
  1 MiB) driven through the gRPC SDK. ``peak_mb_<n>k`` is the trainer
  process's peak RSS during the forward_backward minus its RSS right before
  it (the kernel's VmHWM, reset through ``/proc/<pid>/clear_refs``), MiB;
  ``step_s_<n>k`` the operation's wall time seen by the client; ``est_mb_<n>k``
  the server's admission estimate for it (information: it must not be below
  the peak).
- plain: today's path before this work, in a fresh process: transformers +
  peft (same LoRA), ``model(ids).logits`` -> ``log_softmax`` -> gather ->
  ``-sum(w * p)`` -> ``backward()``, glibc's default allocator. Skipped
  where it cannot fit (``plain_<n>k=skipped (...)``): its peak grows about
  3.2 GB per 1K tokens (12.8 GB at 4K), so a length runs only when that
  estimate is below 70 % of the memory available; 8K is never run.

Prints ``peak_mb_<n>k=``, ``plain_peak_mb_<n>k=``, ``step_s_<n>k=``,
``plain_step_s_<n>k=``, ``peak_ratio_4k=`` (service / plain peak at 4K),
``step_ratio_4k=`` (service / plain time at 4K), ``tokens_per_gb=`` (tokens
of the longest length / its peak in GB), and ``uptime`` (timings on a loaded
machine are not the machine's). Targets: ``peak_ratio_4k <= 0.2``,
``step_ratio_4k <= 1.35``, ``peak_mb_8k <= 2000``.

    python benchmarks/long_context.py            # 1K-8K, each length twice (the second timed)
    python benchmarks/long_context.py --quick    # 1K-8K once each (under 10 minutes on 2 idle cores)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np

LENGTHS = (1024, 2048, 4096, 8192)
PLAIN_GB_PER_1K = 3.2
PLAIN_FIXED_GB = 1.0


def _status(pid: int | str, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _reset_peak(pid: int | str) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def _available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def _sample(n: int, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    full = rng.integers(0, vocab, n + 1).astype(np.int64)
    return full[:-1].copy(), full[1:].copy(), np.ones(n, np.float32)


# ---------------------------------------------------------------------------------------------- plain
def plain_child(lengths: list[int], repeats: int) -> None:
    """Child process: the plain transformers + peft loop; prints one JSON line per length."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from together_train_server.engines.model_loading import configure_cpu_threads, resolve_model_dir

    configure_cpu_threads(os.cpu_count() or 1)
    path = resolve_model_dir(None)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"))
    model.eval()
    vocab = model.get_output_embeddings().weight.shape[0]

    def step(n: int, seed: int) -> float:
        ids, tgt, w = (torch.as_tensor(a) for a in _sample(n, vocab, seed))
        t = time.perf_counter()
        logits = model(input_ids=ids[None], use_cache=False).logits.float()[0]
        lp = torch.log_softmax(logits, -1).gather(-1, tgt[:, None]).squeeze(-1)
        (-(w * lp).sum()).backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t

    step(64, 0)
    for n in lengths:
        for r in range(repeats):
            before = _status("self", "VmRSS:")
            _reset_peak("self")
            dt = step(n, 1 + r)
            peak = _status("self", "VmHWM:") - before
        print(json.dumps({"n": n, "peak_mb": peak / 2**20, "step_s": dt}), flush=True)


def run_plain(lengths: list[int], repeats: int) -> dict[int, dict]:
    """The plain loop in a fresh process (its own memory), lengths that fit; others skipped."""
    out: dict[int, dict] = {}
    fit = []
    for n in lengths:
        need = (PLAIN_GB_PER_1K * n / 1024 + PLAIN_FIXED_GB) * 2**30
        avail = _available()
        if n > 4096 or need > 0.7 * avail:
            out[n] = {"skipped": f"needs ~{need / 2**30:.1f} GB, {avail / 2**30:.1f} GB available"}
        else:
            fit.append(n)
    if fit:
        proc = subprocess.run(
            [sys.executable, __file__, "--plain-child", ",".join(map(str, fit)), "--repeats", str(repeats)],
            capture_output=True, text=True, timeout=3600,
        )
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                r = json.loads(line)
                out[int(r["n"])] = r
        for n in fit:
            if n not in out:
                out[n] = {"skipped": f"the plain process ended (rc {proc.returncode}): {proc.stderr[-300:]!r}"}
    return out


# -------------------------------------------------------------------------------------------- service
def run_service(lengths: list[int], repeats: int) -> dict[int, dict]:
    import together_train as tt

    out: dict[int, dict] = {}
    with tempfile.TemporaryDirectory() as storage, tt.launch_local(
        model="embedded", generators=0, storage_dir=Path(storage), extra_args=["--max-sessions", "2"],
    ) as client:
        pid = client.local_resource.process.pid
        s = client.create_session(lora=tt.LoraConfig(rank=16, alpha=32.0, seed=0))
        vocab = 49152

        def fb(n: int, seed: int) -> float:
            ids, tgt, w = _sample(n, vocab, seed)
            t = time.perf_counter()
            s.forward_backward([tt.Sample(model_input=ids, loss_fn_inputs={"target_tokens": tgt, "weights": w})],
                               "cross_entropy").result(timeout=3600)
            return time.perf_counter() - t

        fb(64, 0)
        for n in lengths:
            for r in range(repeats):
                before = _status(pid, "VmRSS:")
                _reset_peak(pid)
                dt = fb(n, 1 + r)
                peak = _status(pid, "VmHWM:") - before
            out[n] = {"peak_mb": peak / 2**20, "step_s": dt}
            print(f"# service {n}: peak {peak / 2**20:.0f} MB, {dt:.1f} s", flush=True)
        s.stop()
    return out


def estimates(lengths: list[int]) -> dict[int, float]:
    """The server's admission estimate (MB) of each length, from the model config alone."""
    from transformers import AutoConfig

    from together_train_server.engines.activation_checkpointing import AUTO_MIN_TOKENS
    from together_train_server.engines.chunked_logprobs import chunk_rows
    from together_train_server.engines.memory_estimate import dims_of, micro_batch_bytes
    from together_train_server.engines.model_loading import resolve_model_dir

    cfg = AutoConfig.from_pretrained(str(resolve_model_dir(None)))
    d = dims_of(cfg)
    h, kv, i = d.hidden, d.kv, d.intermediate   # rank-16 A and B of q, k, v, o, gate, up, down (fp32 grads)
    lora = 4 * 16 * d.layers * (2 * (h + h) + 2 * (h + kv) + 3 * (h + i))
    return {n: micro_batch_bytes(d, n, backward=True, checkpointed=n >= AUTO_MIN_TOKENS,
                                 rows=chunk_rows(d.vocab), param_grad_bytes=lora) / 2**20 for n in lengths}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="each length once")
    ap.add_argument("--skip-plain", action="store_true", help="service only")
    ap.add_argument("--plain-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--repeats", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plain_child:
        plain_child([int(x) for x in args.plain_child.split(",")], args.repeats or 1)
        return 0
    repeats = 1 if args.quick else 2
    lengths = list(LENGTHS)
    print(f"uptime={subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    service = run_service(lengths, repeats)
    plain = {n: {"skipped": "--skip-plain"} for n in lengths} if args.skip_plain else run_plain(lengths, repeats)
    est = estimates(lengths)
    for n in lengths:
        k = f"{n // 1024}k"
        print(f"peak_mb_{k}={service[n]['peak_mb']:.0f}")
        print(f"step_s_{k}={service[n]['step_s']:.2f}")
        print(f"est_mb_{k}={est[n]:.0f}")
        if "skipped" in plain[n]:
            print(f"plain_{k}=skipped ({plain[n]['skipped']})")
        else:
            print(f"plain_peak_mb_{k}={plain[n]['peak_mb']:.0f}")
            print(f"plain_step_s_{k}={plain[n]['step_s']:.2f}")
    if "skipped" not in plain[4096]:
        print(f"peak_ratio_4k={service[4096]['peak_mb'] / plain[4096]['peak_mb']:.3f}")
        print(f"step_ratio_4k={service[4096]['step_s'] / plain[4096]['step_s']:.3f}")
    longest = lengths[-1]
    print(f"tokens_per_gb={longest / (service[longest]['peak_mb'] / 1024):.0f}")
    print(f"uptime={subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
