"""Multi-turn benchmark: the torch engine with its prefix cache vs with ``--prefix-cache-mb 0``, one run.

    python benchmarks/multiturn.py [--quick] [--cache-only] [--new-tokens N] [--dtype float32|bfloat16]
                                   [--threads N] [--json-out F]

8 concurrent conversations of 4 turns each on the embedded SmolLM2-135M-Instruct,
every one starting with the same 1,024-token system prompt; each turn sends the
whole conversation so far (the previous prompt + the model's answer + a short
new user message, concatenated as tokens, as multi-turn RL rollouts do) and
samples a short greedy answer (--quick: 8 new tokens, full: 32). A
conversation's next turn starts when its answer arrives; the 8 run in parallel
threads against one resource (a real ``together-train serve``, one torch
replica). The same conversations run twice, on a resource with the cache
(default ``--prefix-cache-mb``) and on one without; greedy decoding makes
both sides send the very same prompts (checked: ``same_tokens``).

Prints ``key=value`` lines:
  multiturn_speedup         wall time without the cache / with it (target >= 2.5; not with --cache-only)
  prefill_tokens_saved_frac prompt tokens served from the cache / all prompt tokens (cache run)
  cache_hit_tokens          sum of SampleResult.prompt_cache_hit_tokens (cache run)
  per turn k (cache run, summed over the conversations):
  prefill_tokens_turn{k}    prompt tokens the replica computed (prompt minus hit)
  prefix_hit_tokens_turn{k} prompt tokens served from the cache
  reusable_tokens_turn{k}   what turn k could reuse of turn k-1's prompt and answer: per conversation the
                            longest common prefix of (prompt_{k-1} + answer_{k-1} but its last token, the one
                            token never fed forward, so without keys/values) and prompt_k, at most
                            len(prompt_k) - 1, rounded down to whole 16-token blocks (turn 1: the shared
                            system prompt, 1,024 tokens, once warm)
  turn_s_turn{k}            mean seconds a turn-k call took (submit to answer)
  multiturn_vllm            the same for ``--engine vllm`` when vLLM imports, else "skipped"
and the machine's load (``uptime``): this machine is shared, timings move with it.
--cache-only runs the cached side only (a before/after comparison of the cache itself).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

ROOT = Path(__file__).resolve().parents[1]

CONVERSATIONS, TURNS, SYSTEM_TOKENS = 8, 4, 1024
TOPICS = ["the sea", "prime numbers", "a red bicycle", "bread", "the moon", "rainy cities", "chess", "old maps"]


def system_prompt(tokenizer, n_tokens: int) -> list[int]:
    """Token ids of a chat system message of exactly ``n_tokens`` tokens (deterministic text, trimmed)."""
    rules = " ".join(f"Rule {i}: answer briefly, stay polite, never invent facts about item {i}."
                     for i in range(400))
    head = tokenizer.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False).split("x")[0]
    ids = tokenizer(head + rules, add_special_tokens=False)["input_ids"]
    end = tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
    return ids[: n_tokens - len(end)] + end


def user_turn(tokenizer, conv: int, turn: int, first: bool) -> list[int]:
    """Tokens closing the previous answer (unless first), a short user message and the assistant header."""
    text = ("" if first else "<|im_end|>\n") + (
        f"<|im_start|>user\nTell me one thing about {TOPICS[conv % len(TOPICS)]}, part {turn + 1}.<|im_end|>\n"
        "<|im_start|>assistant\n")
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def reusable_tokens(previous: list[int], prompt: list[int], block: int = 16) -> int:
    """Longest common prefix of ``previous`` and ``prompt``, at most ``len(prompt) - 1``, in whole blocks."""
    n = min(len(previous), len(prompt) - 1)
    i = 0
    while i < n and previous[i] == prompt[i]:
        i += 1
    return i // block * block


def per_turn(run: dict) -> dict:
    """Per turn k (1-based), summed over the conversations: prefill, hit and reusable tokens, mean seconds."""
    convs = run["conversations"]
    out = {}
    for t in range(TURNS):
        out[f"prefill_tokens_turn{t + 1}"] = sum(o["prompt_tokens"][t] - o["hits"][t] for o in convs)
        out[f"prefix_hit_tokens_turn{t + 1}"] = sum(o["hits"][t] for o in convs)
        out[f"reusable_tokens_turn{t + 1}"] = sum(o["reusable"][t] for o in convs)
        out[f"turn_s_turn{t + 1}"] = sum(o["turn_s"][t] for o in convs) / len(convs)
    return out


def run_conversations(client, tokenizer, system: list[int], new_tokens: int) -> dict:
    """The 8 conversations, concurrently; returns wall seconds, per-turn prompt lengths, hits and answers."""
    import together_train as tt

    params = tt.SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    client.sample(system[:8], tt.SamplingParams(max_tokens=1)).result(timeout=600)      # warm-up (no shared prefix)
    out: list[dict] = [{} for _ in range(CONVERSATIONS)]
    errors: list[BaseException] = []

    def conversation(c: int) -> None:
        try:
            prompt = list(system)
            prompts, hits, answers, reusable, secs = [], [], [], [], []
            before = list(system)                # turn 1 may reuse the shared system prompt
            for t in range(TURNS):
                prompt = prompt + user_turn(tokenizer, c, t, first=t == 0)
                t0 = time.perf_counter()
                res = client.sample(prompt, params).result(timeout=1800)
                secs.append(time.perf_counter() - t0)
                answer = list(res.sequences[0].tokens)
                prompts.append(len(prompt))
                hits.append(res.prompt_cache_hit_tokens)
                answers.append(answer)
                reusable.append(reusable_tokens(before, prompt))
                before = prompt + answer[:-1]    # the tokens the replica fed forward
                prompt = prompt + answer
            out[c] = {"prompt_tokens": prompts, "hits": hits, "answers": answers, "reusable": reusable,
                      "turn_s": secs}
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=conversation, args=(c,)) for c in range(CONVERSATIONS)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return {"wall_s": wall, "conversations": out,
            "prompt_tokens": sum(sum(o["prompt_tokens"]) for o in out),
            "cache_hit_tokens": sum(sum(o["hits"]) for o in out)}


def bench(model_dir: Path, tokenizer, system, new_tokens: int, dtype: str, threads: int, engine_args: list[str]) -> dict:
    """One resource with ``engine_args``; the conversations on it."""
    import together_train as tt

    with tt.launch_local(model=str(model_dir), generators=1, dtype=dtype,
                         extra_args=["--trainer-threads", "1", "--generator-threads", str(threads),
                                     "--replica-timeout-s", "1800", *engine_args]) as client:
        return run_conversations(client, tokenizer, system, new_tokens)


def compare(model_dir: Path, tokenizer, system, new_tokens: int, dtype: str, threads: int, engine: list[str],
            without: list[str] | None) -> dict:
    """The conversations without the cache (unless ``without`` is None) and with it."""
    # without the cache first: the page cache / model conversion warm-up then favours the cache-less side
    off = bench(model_dir, tokenizer, system, new_tokens, dtype, threads, engine + without) if without else None
    on = bench(model_dir, tokenizer, system, new_tokens, dtype, threads, engine)
    res = {"off": off, "on": on, "per_turn": per_turn(on),
           "prefill_tokens_saved_frac": on["cache_hit_tokens"] / on["prompt_tokens"],
           "cache_hit_tokens": on["cache_hit_tokens"]}
    if off is not None:
        res.update(multiturn_speedup=off["wall_s"] / on["wall_s"], off_cache_hit_tokens=off["cache_hit_tokens"],
                   same_tokens=[o["answers"] for o in off["conversations"]]
                   == [o["answers"] for o in on["conversations"]])
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 new tokens a turn (full: 32)")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32", help="float32 | bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads of the replica")
    ap.add_argument("--new-tokens", type=int, default=None, help="new tokens a turn (default: 8 quick, 32 full)")
    ap.add_argument("--cache-only", action="store_true", help="skip the resource without the cache")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from transformers import AutoTokenizer

    from together_train_server.engines.model_loading import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    new_tokens = args.new_tokens or (8 if args.quick else 32)
    system = system_prompt(tokenizer, SYSTEM_TOKENS)
    assert len(system) == SYSTEM_TOKENS, len(system)

    load_before = os.getloadavg()
    res = {"model": model_dir.name, "dtype": args.dtype, "threads": args.threads, "new_tokens": new_tokens,
           "quick": args.quick, "torch": compare(model_dir, tokenizer, system, new_tokens, args.dtype, args.threads,
                                                  ["--engine", "torch"],
                                                  None if args.cache_only else ["--prefix-cache-mb", "0"])}
    try:
        import vllm  # noqa: F401
        # vLLM keeps its prefix cache on; the comparison side turns it off through the engine's flag
        res["vllm"] = compare(model_dir, tokenizer, system, new_tokens, args.dtype, args.threads,
                              ["--engine", "vllm"], None if args.cache_only else ["--prefix-cache-mb", "0"])
    except ImportError:
        res["vllm"] = None
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    res["uptime"] = uptime

    t = res["torch"]
    print(f"# {res['model']} {args.dtype} threads={args.threads} {CONVERSATIONS} conversations x {TURNS} turns, "
          f"{SYSTEM_TOKENS}-token shared system prompt, {new_tokens} new tokens a turn{' (quick)' if args.quick else ''}")
    if t["off"] is not None:
        print(f"multiturn_speedup={t['multiturn_speedup']:.2f} (target >= 2.5) "
              f"wall_s_with_cache={t['on']['wall_s']:.1f} wall_s_without={t['off']['wall_s']:.1f}")
    else:
        print(f"wall_s_with_cache={t['on']['wall_s']:.1f} (--cache-only: no run without the cache)")
    print(f"prefill_tokens_saved_frac={t['prefill_tokens_saved_frac']:.3f} cache_hit_tokens={t['cache_hit_tokens']} "
          f"prompt_tokens={t['on']['prompt_tokens']}"
          + (f" cache_hit_tokens_without={t['off_cache_hit_tokens']} same_tokens={t['same_tokens']}"
             if t["off"] is not None else ""))
    for k, v in t["per_turn"].items():
        print(f"{k}={v:.2f}" if k.startswith("turn_s") else f"{k}={v}")
    if res["vllm"]:
        v = res["vllm"]
        print(f"vllm_prefill_tokens_saved_frac={v['prefill_tokens_saved_frac']:.3f} "
              f"vllm_cache_hit_tokens={v['cache_hit_tokens']}"
              + (f" multiturn_vllm_speedup={v['multiturn_speedup']:.2f}" if v["off"] is not None else ""))
    else:
        print("multiturn_vllm=skipped (vllm not importable)")
    print(f"load_before={load_before[0]:.2f} uptime: {uptime} (shared machine: timings move with the load)")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
