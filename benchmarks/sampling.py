"""Sampling benchmark: the service's generator vs plain in-process generation; weights_sync cost.

    python benchmarks/sampling.py [--quick] [--dtype float32|bfloat16] [--threads N] [--json-out F]

(a) torch engine through the service (a real `together-train serve` with one
    generator replica; all sample requests submitted at once as futures so the
    engine batches them) vs in-process ``model.generate`` on the same prompts
    and the same dtype/thread budget:
      ratio_vs_generate          service tok/s / one generate call per prompt
                                 (num_return_sequences=4), as a user writes it
      ratio_vs_batched_generate  service tok/s / one left-padded generate call
                                 over all prompts
      engine_tok_s               the same engine in this process, every request
                                 submitted at once (service_vs_engine = what RPC,
                                 routing and spread-out arrivals cost)
    Every completion is exactly max_new_tokens long (ignore_eos / min_new_tokens),
    temperature 1, no top-k/top-p, on both sides.
(b) vLLM: when ``import vllm`` works, the service with ``--engine vllm`` vs the
    same ``vllm.LLM`` used directly (ratio_vs_vllm); else ratio_vs_vllm=skipped.
(c) weights_sync of a rank 8/32/128 adapter (all linear layers of the blocks):
    the first push to a replica creates the peft adapter; later pushes copy in
    place. sync_ms_rankR is the steady state (median of the later syncs, 5 in
    --quick, 9 in a full run; sync_spread_ms_rankR their min-max;
    client-observed latency of weights_sync().result()); MB/s = adapter bytes
    pushed (in the replica's dtype) / server-side push seconds. Same-host
    replicas get pushes through shared memory; --sync-stream forces the gRPC
    stream. raw_stream_ms_rank32: the same bytes through a plain gRPC client
    stream between two processes (benchmarks/raw_grpc_stream.py);
    sync_vs_raw_rank32 = sync_ms_rank32 / raw_stream_ms_rank32.

Full: 64 prompts x 4 samples x 64 new tokens (SmolLM2-135M-Instruct, the
embedded model). --quick: 16 x 4 x 16, same keys. Prints ``key=value`` lines
and writes JSON (--json-out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]

TOPICS = ["the sea", "prime numbers", "a red bicycle", "bread", "the moon", "rainy cities", "chess openings",
          "old maps", "honeybees", "volcanoes", "jazz", "glaciers", "lighthouses", "paper planes", "tea", "clocks"]


def make_prompts(tokenizer, n: int) -> list[list[int]]:
    """n chat prompts of varied length (deterministic)."""
    out = []
    for i in range(n):
        text = f"Write {1 + i % 5} short sentences about {TOPICS[i % len(TOPICS)]}" + (
            ", mentioning the number " + str(17 * i) if i % 2 else "") + (" and why it matters." if i % 3 else ".")
        msgs = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        out.append([int(t) for t in ids])
    return out


def bench_hf(model_dir: Path, prompts, n_samples: int, new_tokens: int, dtype: str, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    td = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=td, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
              min_new_tokens=new_tokens, num_return_sequences=n_samples, pad_token_id=pad)
    total = len(prompts) * n_samples * new_tokens
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), attention_mask=torch.ones(1, len(prompts[0]), dtype=torch.long),
                       **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})  # warm-up
        torch.manual_seed(0)
        t0 = time.perf_counter()
        for p in prompts:
            out = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), **kw)
            assert out.shape[1] == len(p) + new_tokens
        per_prompt = time.perf_counter() - t0
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), pad, dtype=torch.long)
        mask = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            mask[i, L - len(p):] = 1
        t0 = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, **kw)
        batched = time.perf_counter() - t0
        assert out.shape == (len(prompts) * n_samples, L + new_tokens)
    return {"generate_s": per_prompt, "generate_tok_s": total / per_prompt,
            "batched_generate_s": batched, "batched_generate_tok_s": total / batched}


def bench_engine(model_dir: Path, prompts, n_samples: int, new_tokens: int, dtype: str, threads: int) -> dict:
    """The torch engine in this process, every request submitted at once: the service minus RPC and routing."""
    import torch
    from together_train_server.engines.torch_generator import TorchGeneratorEngine
    from together_train_server.engines.types import SamplingParams

    torch.set_num_threads(threads)
    eng = TorchGeneratorEngine(model_dir, dtype=dtype)
    try:
        eng.generate(prompts[0], SamplingParams(max_tokens=2, seed=0))  # warm-up
        t0 = time.perf_counter()
        futs = [eng.submit(p, SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, ignore_eos=True), n_samples)
                for i, p in enumerate(prompts)]
        outs = [f.result() for f in futs]
        el = time.perf_counter() - t0
    finally:
        eng.close()
    assert all(len(s.tokens) == new_tokens for o in outs for s in o.sequences)
    return {"engine_s": el, "engine_tok_s": len(prompts) * n_samples * new_tokens / el}


def bench_service_sampling(client, prompts, n_samples: int, new_tokens: int) -> dict:
    import together_train as tt

    client.sample(prompts[0], tt.SamplingParams(max_tokens=2, seed=0)).result(timeout=600)  # warm-up
    t0 = time.perf_counter()
    futs = [client.sample(p, tt.SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, ignore_eos=True),
                          num_samples=n_samples) for i, p in enumerate(prompts)]
    results = [f.result(timeout=3600) for f in futs]
    el = time.perf_counter() - t0
    assert all(len(s.tokens) == new_tokens for r in results for s in r.sequences)
    total = len(prompts) * n_samples * new_tokens
    return {"service_s": el, "service_tok_s": total / el}


def bench_sync(client, ranks, repeats: int) -> dict:
    import together_train as tt

    out = {}
    for r in ranks:
        s = client.create_session(lora=tt.LoraConfig(rank=r, alpha=2.0 * r, seed=0))
        try:
            t0 = time.perf_counter()
            first = s.weights_sync().result(timeout=600)
            first_ms = (time.perf_counter() - t0) * 1e3
            lat, server = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                res = s.weights_sync().result(timeout=600)
                lat.append((time.perf_counter() - t0) * 1e3)
                server.append(res.seconds)
            ms = statistics.median(lat)
            out[r] = {"sync_ms": ms, "first_sync_ms": first_ms, "server_push_ms": statistics.median(server) * 1e3,
                      "sync_all_ms": lat, "sync_spread_ms": (min(lat), max(lat)),
                      "bytes": first.num_bytes, "MB_per_s": first.num_bytes / 1e6 / max(statistics.median(server), 1e-9)}
        finally:
            s.stop()
    return out


def bench_vllm(model_dir: Path, prompts, n_samples: int, new_tokens: int, dtype: str, threads: int) -> dict | None:
    """Hook for the vLLM engine: service (--engine vllm) vs vllm.LLM directly. None when vllm is absent."""
    try:
        import vllm  # noqa: F401
    except Exception:
        return None
    import together_train as tt
    from vllm import LLM, SamplingParams as VllmSamplingParams

    total = len(prompts) * n_samples * new_tokens
    llm = LLM(model=str(model_dir), dtype=dtype, seed=0, enforce_eager=True)
    sp = [VllmSamplingParams(n=n_samples, max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=i)
          for i in range(len(prompts))]
    llm.generate([{"prompt_token_ids": prompts[0]}], VllmSamplingParams(max_tokens=2))
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    direct = time.perf_counter() - t0
    del llm
    with tt.launch_local(model=str(model_dir), generators=1, dtype=dtype,
                         extra_args=["--engine", "vllm", "--trainer-threads", "1",
                                     "--generator-threads", str(threads)]) as client:
        svc = bench_service_sampling(client, prompts, n_samples, new_tokens)
    return {"vllm_direct_tok_s": total / direct, "vllm_service_tok_s": svc["service_tok_s"],
            "ratio_vs_vllm": svc["service_tok_s"] / (total / direct)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 prompts x 4 x 16 tokens, ranks 8/32/128, 5 syncs each")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", help="float32 | bfloat16 (both sides)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads on both sides")
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: hf,engine,service,vllm,sync")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--sync-stream", action="store_true",
                    help="weights_sync by gRPC stream even to same-host replicas (TOGETHER_TRAIN_PUSH_SHM=0)")
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    import together_train as tt
    from together_train_server.engines.model_loading import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    n_prompts = args.prompts or (16 if args.quick else 64)
    new_tokens = args.new_tokens or (16 if args.quick else 64)
    skip = set(filter(None, args.skip.split(",")))
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True), n_prompts)
    res: dict = {"model": model_dir.name, "dtype": args.dtype, "threads": args.threads, "prompts": n_prompts,
                 "samples": args.samples, "new_tokens": new_tokens, "quick": args.quick,
                 "mean_prompt_len": sum(map(len, prompts)) / len(prompts)}

    if "hf" not in skip:
        res.update(bench_hf(model_dir, prompts, args.samples, new_tokens, args.dtype, args.threads))
    if "engine" not in skip:
        res.update(bench_engine(model_dir, prompts, args.samples, new_tokens, args.dtype, args.threads))
    if not ({"service", "sync"} <= skip):
        if args.sync_stream:
            os.environ["TOGETHER_TRAIN_PUSH_SHM"] = "0"  # inherited by the server: pushes stream
        with tt.launch_local(model=str(model_dir), generators=1, dtype=args.dtype,
                             extra_args=["--trainer-threads", "1", "--generator-threads", str(args.threads),
                                         "--max-sessions", "8",
                                         # a backstop only: on a loaded machine the default (30 s + 0.1 s
                                         # a token) cut samples that were batching fine, and retried them
                                         "--replica-timeout-s", "900"]) as client:
            if "service" not in skip:
                res.update(bench_service_sampling(client, prompts, args.samples, new_tokens))
            if "sync" not in skip:
                res["sync"] = bench_sync(client, (8, 32, 128), 5 if args.quick else 9)
                res["sync_transport"] = "stream" if args.sync_stream else "shared memory (same host)"
        if "sync" in res:  # the same bytes through a plain gRPC stream between two processes
            from benchmarks.raw_grpc_stream import measure
            from together_train_server.wire.replica_client import CHUNK_BYTES

            res.update(measure(res["sync"][32]["bytes"], CHUNK_BYTES, 5 if args.quick else 9))
    if "vllm" not in skip:
        v = bench_vllm(model_dir, prompts, args.samples, new_tokens, args.dtype, args.threads)
        if v:
            res.update(v)

    lines = []
    if "service_tok_s" in res and "generate_tok_s" in res:
        res["ratio_vs_generate"] = res["service_tok_s"] / res["generate_tok_s"]
        res["ratio_vs_batched_generate"] = res["service_tok_s"] / res["batched_generate_tok_s"]
        lines.append(f"service_tok_s={res['service_tok_s']:.1f} generate_tok_s={res['generate_tok_s']:.1f} "
                     f"batched_generate_tok_s={res['batched_generate_tok_s']:.1f}")
        lines.append(f"ratio_vs_generate={res['ratio_vs_generate']:.2f} (target >= 1.5)")
        lines.append(f"ratio_vs_batched_generate={res['ratio_vs_batched_generate']:.2f} (target >= 1.3)")
    if "engine_tok_s" in res:
        line = f"engine_tok_s={res['engine_tok_s']:.1f}"
        if "batched_generate_tok_s" in res:
            line += f" engine_vs_batched_generate={res['engine_tok_s'] / res['batched_generate_tok_s']:.2f}"
        if "service_tok_s" in res:
            line += f" service_vs_engine={res['service_tok_s'] / res['engine_tok_s']:.2f} (RPC, routing, arrival)"
        lines.append(line)
    lines.append(f"ratio_vs_vllm={res['ratio_vs_vllm']:.2f} (target >= 0.9)" if "ratio_vs_vllm" in res
                 else "ratio_vs_vllm=skipped")
    if "sync" in res:
        s = res["sync"]
        lines.append(" ".join(f"sync_ms_rank{r}={s[r]['sync_ms']:.1f}" for r in s)
                     + f" (steady state, median of {len(s[32]['sync_all_ms'])} syncs: in-place copy; first push "
                     "creates the adapter)")
        lines.append(" ".join(f"sync_spread_ms_rank{r}={s[r]['sync_spread_ms'][0]:.1f}-{s[r]['sync_spread_ms'][1]:.1f}"
                              for r in s) + " (min-max)")
        lines.append(" ".join(f"sync_MBps_rank{r}={s[r]['MB_per_s']:.0f}" for r in s)
                     + " " + " ".join(f"first_sync_ms_rank{r}={s[r]['first_sync_ms']:.1f}" for r in s)
                     + " " + " ".join(f"bytes_rank{r}={s[r]['bytes']}" for r in s))
        lines.append(f"raw_stream_ms_rank32={res['raw_stream_ms']:.1f} sync_vs_raw_rank32="
                     f"{s[32]['sync_ms'] / res['raw_stream_ms']:.2f} (transport: {res['sync_transport']}; "
                     "target <= 1.2 streamed, < 1 with shared memory)")
    res["load_avg"] = [round(x, 2) for x in os.getloadavg()]  # the machine's load: these numbers hold when idle
    print(f"# {res['model']} {res['dtype']} threads={res['threads']} {n_prompts} prompts x {args.samples} "
          f"x {new_tokens} tokens{' (quick)' if args.quick else ''} load_avg={res['load_avg']} (1/5/15 min)")
    for line in lines:
        print(line)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
