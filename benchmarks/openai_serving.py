"""The OpenAI endpoint's cost: chat completions through the official `openai` client vs our SDK's `sample`, one run.

One local resource (SmolLM2-135M-Instruct by default, CPU, one generator
replica) serves both protocols (`launch_local(http_port=0)`). The same
``prompts`` chats, rendered with the model's chat template, are sampled with
the same settings (``n`` choices, ``max_tokens``, temperature 1, a seed per
prompt: both paths produce the same tokens) through
``/v1/chat/completions`` (all requests in flight at once, one thread each)
and through ``Session.sample`` (all futures submitted at once). Blocks
alternate between the two (and which goes first) so load from other
processes hits both; throughput per path = generated tokens / its fastest
block. Time to first token: streamed chat requests one at a time, from the
request to the first chunk with content (median), beside the streamed
request's total time (the replica streams tokens as it samples them, so the
first one arrives long before the last). Rollout capture: the same chat call
through ``/v1`` and through a fresh ``/v1/rollouts/{id}`` base URL (recorded:
prompt and sampled tokens, sampler logprobs, versions), one call at a time,
alternating (which goes first too), the same seed (the same tokens);
``rollout_overhead`` = median over the pairs of (rollout latency / /v1 latency) - 1
(target <= 0.05; under load the pairs' noise dwarfs it), and ``rollout_capture_fraction``:
the recording's own cost per call (measured in this process on the recorded calls) / the
median /v1 call. Prints ``openai_ratio=`` (OpenAI throughput / SDK's, target
>= 0.9), ``ttft_median_s=``, ``rollout_overhead=`` and writes JSON.

    python benchmarks/openai_serving.py            # 8 chats x 2 choices x 32 tokens, 4 blocks each
    python benchmarks/openai_serving.py --quick    # 4 x 2 x 16, 2 blocks each
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = ["What is the capital of France?", "Write a haiku about rain.", "Explain gravity in one sentence.",
             "Name three primes.", "What does a compiler do?", "Give me a synonym for happy.",
             "How many legs does a spider have?", "Say hello in Spanish."]


@dataclass
class Config:
    prompts: int = 8
    n: int = 2
    max_tokens: int = 32
    blocks: int = 4
    ttft_requests: int = 4
    rollout_pairs: int = 24
    model: str = "embedded"
    json_out: str = "runs/bench/openai_serving.json"


def _capture_seconds(rollouts: list, repeats: int = 200) -> float:
    """What capturing one call costs the server, measured here on the recorded calls: building its
    records (`rollouts.calls_of` on equivalent choices) and appending them to a `RolloutStore`."""
    from types import SimpleNamespace

    from together_train_server.service.sampling.rollouts import RolloutStore, calls_of

    calls = [c for r in rollouts for c in r.calls]
    store = RolloutStore()
    t0 = time.perf_counter()
    for k in range(repeats):
        for j, c in enumerate(calls):
            chs = [SimpleNamespace(index=i, tokens=ch.tokens, finish_reason=ch.finish_reason, text=ch.text,
                                   sampled=SimpleNamespace(logprobs=ch.logprobs, versions=ch.policy_versions))
                   for i, ch in enumerate(c.choices)]
            store.record("", f"r{k}-{j}", calls_of(c.model, [c.prompt_tokens], chs, len(chs), c.messages))
    return (time.perf_counter() - t0) / (repeats * len(calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="4 chats x 2 x 16 tokens, 2 blocks each")
    parser.add_argument("--model", default=None, help="model directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--json-out", default=None)
    args = parser.parse_args()
    cfg = Config()
    if args.quick:
        cfg.prompts, cfg.max_tokens, cfg.blocks, cfg.ttft_requests, cfg.rollout_pairs = 4, 16, 2, 3, 12
    cfg.model = args.model or cfg.model
    cfg.json_out = args.json_out or cfg.json_out

    import openai
    from transformers import AutoTokenizer

    import together_train as tt
    from together_train_server.engines.model_loading import resolve_model_dir

    model_dir = resolve_model_dir(None if cfg.model == "embedded" else cfg.model)
    tok = AutoTokenizer.from_pretrained(model_dir)
    chats = [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}] for i in range(cfg.prompts)]
    prompts = [list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
               for c in chats]
    with tt.launch_local(model=str(model_dir), generators=1, http_port=0,
                         extra_args=["--trainer-threads", "1"]) as client:
        oai = openai.OpenAI(base_url=f"{client.http_url}/v1", api_key="none", max_retries=0, timeout=600)
        base_id = oai.models.list().data[0].id
        session = client.create_session(lora=tt.LoraConfig(rank=8))  # step 0: the base model

        def via_openai() -> int:
            def one(i: int) -> int:
                r = oai.chat.completions.create(model=base_id, messages=chats[i], n=cfg.n, max_tokens=cfg.max_tokens,
                                                temperature=1.0, seed=i)
                return r.usage.completion_tokens

            with ThreadPoolExecutor(len(chats)) as ex:
                return sum(ex.map(one, range(len(chats))))

        def via_sdk() -> int:
            futs = [session.sample(p, tt.SamplingParams(max_tokens=cfg.max_tokens, temperature=1.0, seed=i), cfg.n)
                    for i, p in enumerate(prompts)]
            return sum(len(s.tokens) for f in futs for s in f.result(timeout=600).sequences)

        via_openai(), via_sdk()  # warm-up (first requests, thread pools)
        times: dict[str, list[float]] = {"openai": [], "sdk": []}
        tokens: dict[str, int] = {}
        for b in range(cfg.blocks):
            order = [("openai", via_openai), ("sdk", via_sdk)]
            for name, fn in (order if b % 2 == 0 else order[::-1]):
                t0 = time.perf_counter()
                tokens[name] = fn()
                times[name].append(time.perf_counter() - t0)
        ttft, total = [], []
        for i in range(cfg.ttft_requests):
            t0 = time.perf_counter()
            first = None
            for chunk in oai.chat.completions.create(model=base_id, messages=chats[i % len(chats)], stream=True,
                                                     max_tokens=cfg.max_tokens, temperature=1.0, seed=i):
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - t0
            ttft.append(first if first is not None else float("nan"))
            total.append(time.perf_counter() - t0)
        ratios, plain_s, rollout_s = [], [], []
        for i in range(cfg.rollout_pairs):
            rollout = openai.OpenAI(base_url=f"{client.http_url}/v1/rollouts/bench-{i}", api_key="none",
                                    max_retries=0, timeout=600)
            pair = {}
            for name, c in ([("plain", oai), ("rollout", rollout)] if i % 2 == 0 else [("rollout", rollout), ("plain", oai)]):
                t0 = time.perf_counter()
                c.chat.completions.create(model=base_id, messages=chats[i % len(chats)], max_tokens=cfg.max_tokens,
                                          temperature=1.0, seed=i)
                pair[name] = time.perf_counter() - t0
            plain_s.append(pair["plain"])
            rollout_s.append(pair["rollout"])
            ratios.append(pair["rollout"] / pair["plain"])
        rollouts = [client.get_rollout(f"bench-{i}") for i in range(cfg.rollout_pairs)]
        recorded = sum(len(ch.tokens) for r in rollouts for call in r.calls for ch in call.choices)
        capture_s = _capture_seconds(rollouts)
        session.stop()
    tput = {k: tokens[k] / min(v) for k, v in times.items()}
    result = {
        "config": asdict(cfg),
        "tokens_per_block": tokens,
        "block_seconds": times,
        "tokens_per_s": tput,
        "openai_ratio": tput["openai"] / tput["sdk"],
        "ttft_s": ttft,
        "ttft_median_s": statistics.median(ttft),
        "stream_total_median_s": statistics.median(total),
        "rollout_pair_ratios": ratios,
        "rollout_call_median_s": statistics.median(rollout_s),
        "plain_call_median_s": statistics.median(plain_s),
        "rollout_recorded_tokens": recorded,
        "rollout_overhead": statistics.median(ratios) - 1.0,
        "rollout_capture_s": capture_s,
        "rollout_capture_fraction": capture_s / statistics.median(plain_s),
        "uptime": os.getloadavg(),
    }
    out = Path(cfg.json_out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"tokens/s openai={tput['openai']:.1f} sdk={tput['sdk']:.1f} (same tokens: {tokens['openai']} vs {tokens['sdk']})")
    print(f"openai_ratio={result['openai_ratio']:.3f}")
    print(f"ttft_median_s={result['ttft_median_s']:.3f} (streamed request total {result['stream_total_median_s']:.3f} s)")
    print(f"chat call median {result['plain_call_median_s']:.3f} s via /v1, {result['rollout_call_median_s']:.3f} s via "
          f"/v1/rollouts/{{id}} ({cfg.rollout_pairs} pairs, {recorded} tokens recorded); load {os.getloadavg()[0]:.1f}")
    print(f"rollout_overhead={result['rollout_overhead']:.3f}")
    print(f"rollout_capture_fraction={result['rollout_capture_fraction']:.5f} (the recording itself: "
          f"{capture_s * 1e6:.0f} us per call, in this process)")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
