"""How cost grows with work: log-log scaling curves of the service, each beside a plain in-process baseline.

    python benchmarks/scaling.py [--quick] [--json-out F] [--png-out F]

Curves (service = a real `together-train serve` on loopback, driven by the SDK):

- step: forward_backward latency (cross_entropy, LoRA rank 16 on every block
  linear layer) vs tokens per batch (rows of 128 tokens); baseline: the same
  forward + backward written with plain transformers + peft in this process.
  Expected exponent <= 1 (linear in tokens once overheads are amortised).
- train_sessions: aggregate training throughput (tokens/s of forward_backward
  + optim_step) vs concurrent sessions 1, 2, 4, 8 (one client thread each;
  measured in the order 1, 2, 4, 8, 8, 4, 2, 1 and averaged per count);
  baseline: the plain peft loop's throughput with one adapter (a flat line).
  Expected exponent ~0 (the trainer runs one operation at a time).
- sample_concurrency: sampling throughput (generated tokens/s, every
  completion exactly max_tokens long) vs concurrent requests 1 ... 64;
  baseline: one left-padded batched ``model.generate`` of the same size.
  Expected exponent in [0, 1] (batching amortises the weights' reads).
- sample_replicas: sampling throughput at the largest concurrency with 1 and
  2 generator replicas (threads split between them); no baseline.
- sync: weights_sync latency vs adapter bytes (ranks 4 ... 128); baseline:
  the same bytes through a plain gRPC client stream between two processes
  (benchmarks/raw_grpc_stream.py, when present). Expected exponent <= 1.
- rss: trainer RSS minus its idle RSS vs sessions 1 ... 8 (allocator trimmed
  after every optim_step, TOGETHER_TRAIN_TRIM_AFTER); reference line: the
  state, trainable parameters x 16 bytes per session. Expected exponent <= 1.

For each curve ``exp_<curve>=<slope of log y vs log x>`` (least squares) is
printed, and ``superlinear_<curve>=yes`` where a cost grows faster than linear
(exponent > 1.1) or a throughput falls with more work where it should not
(exponent < -0.1). Numbers go to JSON (--json-out), the panels to one PNG
(--png-out, default docs/scaling.png).

--quick: a random Llama (hidden 256, 4 layers, the SmolLM2 tokenizer, 49152
vocab) instead of SmolLM2-135M, tokens 128 ... 2048, sessions up to 8 with 2
steps each, concurrency 1 ... 64 with 8 new tokens, ranks 4 ... 64: a few
minutes on 2 cores. Full: SmolLM2-135M-Instruct fp32, tokens 128 ... 8192,
32 new tokens, ranks 4 ... 128.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
ROW = 128          # tokens per training row
RANK = 16


def build_small_model(out: Path) -> Path:
    """A random Llama (hidden 256, intermediate 768, 4 layers, 4 heads, 2 KV heads) with the embedded tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from together_train_server.engines.model_loading import embedded_tokenizer_dir

    tok = AutoTokenizer.from_pretrained(str(embedded_tokenizer_dir()), local_files_only=True)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=eos,
                      pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    return out


def fit_exponent(xs, ys) -> float:
    """Least-squares slope of log(y) vs log(x) (the power-law exponent)."""
    x, y = np.log(np.asarray(xs, float)), np.log(np.asarray(ys, float))
    return float(np.polyfit(x, y, 1)[0])


def rss_bytes(pid: int) -> int:
    """Resident set size of a process (from /proc/<pid>/status VmRSS), bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def samples(vocab: int, n_tokens: int, seed: int):
    """``n_tokens / ROW`` cross-entropy samples of ROW random tokens each."""
    import together_train as tt

    rng = np.random.default_rng(seed)
    rows = max(1, n_tokens // ROW)
    tok = rng.integers(0, vocab, size=(rows, ROW + 1), dtype=np.int64)
    return [tt.Sample(model_input=tok[b, :-1], loss_fn_inputs={"target_tokens": tok[b, 1:],
                                                               "weights": np.ones(ROW, np.float32)})
            for b in range(rows)]


# ------------------------------------------------------------------ baselines (plain in-process code)
class PlainPeft:
    """transformers + peft LoRA (rank 16, all block linear layers), summed cross-entropy, AdamW."""

    def __init__(self, model_dir: Path, threads: int) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(threads)
        base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, local_files_only=True)
        cfg = LoraConfig(r=RANK, lora_alpha=2.0 * RANK, target_modules="all-linear", lora_dropout=0.0)
        self.model = get_peft_model(base, cfg).eval()
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)
        self.torch = torch

    def forward_backward(self, ids) -> float:
        """One forward + backward of int64 ``ids [B, ROW+1]``; returns seconds."""
        torch = self.torch
        x, y = torch.as_tensor(ids[:, :-1]), torch.as_tensor(ids[:, 1:])
        t0 = time.perf_counter()
        logits = self.model(input_ids=x, use_cache=False).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                                                 reduction="sum")
        loss.backward()
        return time.perf_counter() - t0

    def step(self, ids) -> float:
        """forward_backward + AdamW step + zero_grad; returns seconds."""
        t0 = time.perf_counter()
        self.forward_backward(ids)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0


def baseline_generate(model_dir: Path, prompt: list[int], batch: int, new_tokens: int, threads: int, pad: int):
    """Seconds of one batched ``model.generate`` of ``batch`` copies of ``prompt`` (sampling, fixed length)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = _GEN_CACHE.get(str(model_dir))
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                     local_files_only=True).eval()
        _GEN_CACHE[str(model_dir)] = model
    ids = torch.tensor([prompt] * batch)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, pad_token_id=pad)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        el = time.perf_counter() - t0
    assert out.shape == (batch, len(prompt) + new_tokens)
    return el


_GEN_CACHE: dict = {}


# ------------------------------------------------------------------ service measurements
def launch(model_dir: Path, generators: int, threads: int, env: dict | None = None, max_sessions: int = 8):
    import together_train as tt

    return tt.launch_local(model=str(model_dir), generators=generators, dtype="float32", env=env,
                           extra_args=["--max-sessions", str(max_sessions), "--trainer-threads", str(threads),
                                       "--generator-threads", str(max(1, threads // max(1, generators)))])


def run_steps(session, batches, adam) -> None:
    futs = []
    for b in batches:
        futs.append(session.forward_backward(b, loss_fn="cross_entropy"))
        futs.append(session.optim_step(adam))
    for f in futs:
        f.result(timeout=3600)


def measure_step(client, vocab: int, tokens: list[int], repeats: int) -> list[float]:
    import together_train as tt

    s = client.create_session(lora=tt.LoraConfig(rank=RANK, alpha=2.0 * RANK, seed=0))
    out = []
    try:
        s.forward_backward(samples(vocab, ROW, 0), loss_fn="cross_entropy").result(timeout=600)  # warm-up
        for n in tokens:
            b = samples(vocab, n, n)
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                s.forward_backward(b, loss_fn="cross_entropy").result(timeout=3600)
                ts.append(time.perf_counter() - t0)
            out.append(statistics.median(ts))
    finally:
        s.stop()
    return out


def measure_sessions(client, vocab: int, counts: list[int], tokens: int, steps: int) -> list[float]:
    import together_train as tt

    adam = tt.AdamParams(learning_rate=1e-4)
    sess = [client.create_session(lora=tt.LoraConfig(rank=RANK, alpha=2.0 * RANK, seed=i))
            for i in range(max(counts))]
    try:
        for s in sess:
            run_steps(s, [samples(vocab, tokens, 99)], adam)  # warm-up, moments allocated
        batches = [samples(vocab, tokens, k) for k in range(steps)]
        # counts forward then backward (1,2,4,8,8,4,2,1): a linear drift in machine load cancels
        per: dict[int, list[float]] = {n: [] for n in counts}
        for n in list(counts) + list(reversed(counts)):
            errors: list[BaseException] = []

            def work(s, errors: list[BaseException] = errors) -> None:
                try:
                    run_steps(s, batches, adam)
                except BaseException as e:
                    errors.append(e)

            threads = [threading.Thread(target=work, args=(s,)) for s in sess[:n]]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            el = time.perf_counter() - t0
            if errors:
                raise errors[0]
            per[n].append(n * steps * tokens / el)
    finally:
        for s in sess:
            s.stop()
    return [float(np.mean(per[n])) for n in counts]


def measure_sampling(client, prompt: list[int], counts: list[int], new_tokens: int) -> list[float]:
    import together_train as tt

    client.sample(prompt, tt.SamplingParams(max_tokens=2, seed=0)).result(timeout=600)  # warm-up
    out = []
    for n in counts:
        t0 = time.perf_counter()
        futs = [client.sample(prompt, tt.SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i,
                                                        ignore_eos=True)) for i in range(n)]
        res = [f.result(timeout=3600) for f in futs]
        el = time.perf_counter() - t0
        assert all(len(s.tokens) == new_tokens for r in res for s in r.sequences)
        out.append(n * new_tokens / el)
    return out


def measure_sync(client, ranks: list[int], repeats: int) -> tuple[list[int], list[float]]:
    import together_train as tt

    nbytes, ms = [], []
    for r in ranks:
        s = client.create_session(lora=tt.LoraConfig(rank=r, alpha=2.0 * r, seed=0))
        try:
            first = s.weights_sync().result(timeout=600)
            lat = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                s.weights_sync().result(timeout=600)
                lat.append((time.perf_counter() - t0) * 1e3)
            nbytes.append(int(first.num_bytes))
            ms.append(statistics.median(lat))
        finally:
            s.stop()
    return nbytes, ms


def measure_rss(client, pid: int, vocab: int, n: int) -> tuple[float, list[float], int]:
    import together_train as tt

    adam = tt.AdamParams(learning_rate=1e-4)
    idle = rss_bytes(pid)
    sess, out = [], []
    for i in range(n):
        s = client.create_session(lora=tt.LoraConfig(rank=RANK, alpha=2.0 * RANK, seed=i))
        run_steps(s, [samples(vocab, 2 * ROW, i)], adam)
        sess.append(s)
        reads = []
        for _ in range(3):
            reads.append(rss_bytes(pid))
            time.sleep(0.1)
        out.append(float(np.median(reads)))
    params = sess[0].info().num_trainable_params
    for s in sess:
        s.stop()
    return idle, out, int(params)


# ------------------------------------------------------------------ plot
def plot(res: dict, path: Path) -> None:
    """One PNG, 2 x 3 log-log panels: service (solid) and baseline (dashed) per curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    def fmt(v, _pos=None) -> str:
        """Ticks as 128, 2k, 1.2M, 0.05 instead of 10^x."""
        for div, suf in ((1e6, "M"), (1e3, "k")):
            if abs(v) >= div:
                return f"{v / div:.3g}{suf}"
        return f"{v:.3g}"

    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    c = res["curves"]

    def panel(ax, key, xlabel, ylabel, title, base_label="plain in-process"):
        d = c[key]
        ax.loglog(d["x"], d["y"], "o-", label="service", color="C0")
        if d.get("baseline"):
            ax.loglog(d["x"][: len(d["baseline"])], d["baseline"], "s--", label=base_label, color="C1")
        if d.get("reference"):
            ax.loglog(d["x"], d["reference"], ":", label=d["reference_label"], color="gray")
        flag = ("  FLAG: super-linear" if d["kind"] == "cost" else "  FLAG: falls with work") \
            if d.get("superlinear") else ""
        ax.set_title(f"{title}\nexponent {d['exponent']:.2f} (expected {d['expected']}){flag}", fontsize=10)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xticks(d["x"])
        ax.xaxis.set_major_formatter(FuncFormatter(fmt))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FuncFormatter(fmt))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ys = [v for v in list(d["y"]) + list(d.get("baseline") or []) + list(d.get("reference") or []) if v > 0]
        ticks: list[float] = []
        for v in sorted({float(f"{v:.2g}") for v in (min(ys), max(ys), *d["y"])}):
            if not ticks or v / ticks[-1] > 1.15:  # labels closer than 15% overlap
                ticks.append(v)
        ax.set_yticks(ticks)
        ax.legend(fontsize=8)

    panel(axes[0, 0], "step", "tokens per batch", "forward_backward seconds", "step time vs tokens")
    panel(axes[0, 1], "train_sessions", "concurrent sessions", "aggregate training tokens/s",
          "training throughput vs sessions", "plain peft loop, 1 adapter")
    panel(axes[0, 2], "sample_concurrency", "concurrent sample requests", "generated tokens/s",
          "sampling throughput vs concurrency", "batched model.generate")
    panel(axes[1, 0], "sample_replicas", "generator replicas", "generated tokens/s",
          f"sampling vs replicas ({c['sample_replicas']['concurrency']} requests)")
    panel(axes[1, 1], "sync", "adapter bytes", "weights_sync ms", "weights_sync vs adapter bytes",
          "raw gRPC stream")
    panel(axes[1, 2], "rss", "sessions added after the first", "trainer RSS - RSS with 1 session (MiB)",
          "memory vs sessions (allocator trimmed)")
    fig.suptitle(f"together-train scaling ({res['model']}, fp32, {res['threads']} threads"
                 f"{', --quick' if res['quick'] else ''}; 1-min load {res['load_before']:.1f} before, "
                 f"{res['load_after']:.1f} after)", fontsize=12)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def make_curves(raw: dict) -> dict:
    """Curves (x, y, baseline, expected, exponent, flag) from the raw measurements of ``main``."""
    mib = 2**20
    n_rss = len(raw["rss"])
    curves = {
        "step": {"x": raw["tokens"], "y": raw["step_s"], "baseline": raw["plain_step_s"], "expected": "<= 1",
                 "kind": "cost"},
        "train_sessions": {"x": raw["sessions"], "y": raw["train_tok_s"],
                           "baseline": [raw["plain_train_tok_s"]] * len(raw["sessions"]), "expected": "~0",
                           "kind": "throughput"},
        "sample_concurrency": {"x": raw["concurrency"], "y": raw["sample_tok_s"],
                               "baseline": raw["batched_generate_tok_s"], "expected": "0..1", "kind": "throughput"},
        "sample_replicas": {"x": [1, 2], "y": [raw["sample_tok_s"][-1], raw["sample_tok_s_2_replicas"]],
                            "expected": "0..1", "kind": "throughput", "concurrency": raw["concurrency"][-1]},
        "sync": {"x": raw["sync_bytes"], "y": raw["sync_ms"], "baseline": raw["raw_stream_ms"], "expected": "<= 1",
                 "kind": "cost"},
        # memory added by sessions 2..n over the first one (the first also brings the activations' workspace)
        "rss": {"x": list(range(1, n_rss)), "y": [max((r - raw["rss"][0]) / mib, 1e-3) for r in raw["rss"][1:]],
                "reference": [k * raw["trainable_params"] * 16 / mib for k in range(1, n_rss)],
                "reference_label": "state: params x 16 B per added session", "expected": "<= 1", "kind": "cost"},
    }
    for d in curves.values():
        d["exponent"] = fit_exponent(d["x"], d["y"])
        if d.get("baseline"):
            d["baseline_exponent"] = fit_exponent(d["x"][: len(d["baseline"])], d["baseline"])
        # a cost growing faster than linear, or a throughput falling as work is added
        d["superlinear"] = d["exponent"] > 1.1 if d["kind"] == "cost" else d["exponent"] < -0.1
    return curves


def report(raw: dict, png: Path) -> dict:
    """Print the key=value lines and write the PNG; returns the curves."""
    curves = make_curves(raw)
    plot({**raw, "curves": curves}, png)
    names = {"step": "exp_step_vs_tokens", "train_sessions": "exp_train_throughput_vs_sessions",
             "sample_concurrency": "exp_sample_vs_concurrency", "sample_replicas": "exp_sample_vs_replicas",
             "sync": "exp_sync_vs_bytes", "rss": "exp_rss_vs_added_sessions"}
    for key, name in names.items():
        d = curves[key]
        extra = f" baseline={round(d['baseline_exponent'], 2) + 0.0:.2f}" if "baseline_exponent" in d else ""
        print(f"{name}={round(d['exponent'], 2) + 0.0:.2f} (expected {d['expected']}){extra}")  # no "-0.00"
        if d["superlinear"]:
            why = "cost grows faster than linear" if d["kind"] == "cost" else "throughput falls as work is added"
            print(f"superlinear_{key}=yes ({why})")
    print("step_s=" + ",".join(f"{t}:{s:.3f}/{b:.3f}" for t, s, b in
                               zip(raw["tokens"], raw["step_s"], raw["plain_step_s"])) + " (tokens:service/plain)")
    print("train_tok_s=" + ",".join(f"{n}:{v:.0f}" for n, v in zip(raw["sessions"], raw["train_tok_s"]))
          + f" plain={raw['plain_train_tok_s']:.0f}")
    print("sample_tok_s=" + ",".join(f"{n}:{v:.0f}/{b:.0f}" for n, v, b in
                                     zip(raw["concurrency"], raw["sample_tok_s"], raw["batched_generate_tok_s"]))
          + " (requests:service/batched_generate)")
    print(f"sample_tok_s_replicas=1:{raw['sample_tok_s'][-1]:.0f},2:{raw['sample_tok_s_2_replicas']:.0f} "
          f"(at {raw['concurrency'][-1]} requests)")
    print("sync_ms=" + ",".join(f"{b}:{m:.1f}" for b, m in zip(raw["sync_bytes"], raw["sync_ms"]))
          + (" raw_ms=" + ",".join(f"{m:.1f}" for m in raw["raw_stream_ms"]) if raw["raw_stream_ms"] else ""))
    print("rss_added_mb=" + ",".join(f"{v:.1f}" for v in curves["rss"]["y"])
          + f" state_mb_per_session={raw['trainable_params'] * 16 / 2**20:.1f}")
    print(f"png={png}")
    print(f"seconds_total={raw['seconds_total']:.0f} load_before={raw['load_before']:.2f} "
          f"load_after={raw['load_after']:.2f}")
    return curves


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small random model, fewer points (a few minutes)")
    ap.add_argument("--model", default=None, help="model directory (default: embedded SmolLM2; --quick: random)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json-out", default="runs/bench/scaling.json")
    ap.add_argument("--png-out", default=str(ROOT / "docs" / "scaling.png"))
    ap.add_argument("--replot", default=None, help="redraw the PNG and lines from a JSON written earlier; no runs")
    args = ap.parse_args(argv)
    if args.replot:
        report(json.loads(Path(args.replot).read_text())["raw"], Path(args.png_out))
        return 0
    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from together_train_server.engines.memory import ENV_VAR as TRIM_ENV
    from together_train_server.engines.model_loading import resolve_model_dir

    t_start = time.perf_counter()
    load_before = os.getloadavg()[0]
    tmp = tempfile.TemporaryDirectory(prefix="tt-scaling-")
    if args.model:
        model_dir = resolve_model_dir(args.model)
    elif args.quick:
        model_dir = build_small_model(Path(tmp.name) / "small-llama")
    else:
        model_dir = resolve_model_dir(None)
    q = args.quick
    tokens = [128, 512, 2048] if q else [128, 512, 2048, 8192]
    sess_counts = [1, 2, 4, 8]
    conc = [1, 4, 16, 64] if q else [1, 2, 4, 8, 16, 32, 64]
    new_tokens = 8 if q else 32
    ranks = [4, 16, 64] if q else [4, 8, 16, 32, 64, 128]
    step_tokens, steps = (256, 2) if q else (1024, 3)
    repeats = 2 if q else 3
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    prompt = [int(t) for t in tok("Write a short poem about the sea and the moon.")["input_ids"]]
    vocab = len(tok)

    # baselines first (this process), then the service (its own processes), so they never overlap
    plain = PlainPeft(model_dir, args.threads)
    rng = np.random.default_rng(0)
    plain.forward_backward(rng.integers(0, vocab, size=(1, ROW + 1)))  # warm-up
    base_step = []
    for n in tokens:
        ids = rng.integers(0, vocab, size=(n // ROW, ROW + 1))
        ts = [plain.forward_backward(ids) for _ in range(repeats)]
        plain.model.zero_grad(set_to_none=True)
        base_step.append(statistics.median(ts))
    ids = rng.integers(0, vocab, size=(step_tokens // ROW, ROW + 1))
    base_thr = step_tokens * steps / sum(plain.step(ids) for _ in range(steps))
    del plain
    baseline_generate(model_dir, prompt, 1, 2, args.threads, pad)  # warm-up
    base_gen = [n * new_tokens / baseline_generate(model_dir, prompt, n, new_tokens, args.threads, pad)
                for n in conc]
    _GEN_CACHE.clear()

    with launch(model_dir, 1, args.threads) as client:
        svc_step = measure_step(client, vocab, tokens, repeats)
        svc_thr = measure_sessions(client, vocab, sess_counts, step_tokens, steps)
        svc_gen = measure_sampling(client, prompt, conc, new_tokens)
        sync_bytes, sync_ms = measure_sync(client, ranks, repeats)
    with launch(model_dir, 2, args.threads) as client:
        gen2 = measure_sampling(client, prompt, [conc[-1]], new_tokens)[0]
    with launch(model_dir, 0, args.threads, env={TRIM_ENV: "optim_step"}) as client:
        idle, rss, n_params = measure_rss(client, client.local_resource.process.pid, vocab, 8)
    raw_ms = []
    try:
        from benchmarks.raw_grpc_stream import measure as raw_measure
        from together_train_server.wire.replica_client import CHUNK_BYTES

        raw_ms = [raw_measure(b, CHUNK_BYTES, repeats)["raw_stream_ms"] for b in sync_bytes]
    except ImportError as e:
        print(f"note: no raw gRPC stream baseline ({e})")

    raw = {"model": model_dir.name, "threads": args.threads, "quick": q, "load_before": load_before,
           "tokens": tokens, "step_s": svc_step, "plain_step_s": base_step,
           "sessions": sess_counts, "train_tok_s": svc_thr, "plain_train_tok_s": base_thr,
           "concurrency": conc, "sample_tok_s": svc_gen, "batched_generate_tok_s": base_gen,
           "sample_tok_s_2_replicas": gen2, "sync_bytes": sync_bytes, "sync_ms": sync_ms, "raw_stream_ms": raw_ms,
           "rss_idle": idle, "rss": rss, "trainable_params": n_params,
           "load_after": os.getloadavg()[0], "seconds_total": time.perf_counter() - t_start}
    Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json_out).write_text(json.dumps({"raw": raw, "curves": make_curves(raw)}, indent=2))
    report(raw, Path(args.png_out))
    print(f"json={args.json_out}")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
