"""TorchGeneratorEngine prefix cache: same tokens as without it, exact block-rounded hits, bounded, never stale.

The reference is the same model in an engine built with ``prefix_cache_mb=0``
(every prompt prefilled in full). With the cache, greedy tokens must be
identical and logprobs within the batched-vs-unbatched bound of
tests/engines/test_engines_batching.py (1e-5 in float32: reusing cached keys/values
only changes matmul shapes). Seeded temperature-1 sampling is compared in
float64, where token equality is a property of the engine (in float32 a
last-bit difference flips ~1 % of tokens of the near-uniform tiny model,
see test_engines_batching.gen64).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch

from _models import tiny_model
from together_train_server.engines.prefix_cache import PrefixCache
from together_train_server.engines.types import LoraConfig, SamplingParams

ATOL = 1e-5          # test_engines_batching.BATCH_ATOL
BS = 16              # the engine's default block size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(scope="module")
def adapters(model_dir):
    """PEFT state-dict tensors with random values (B not zero, so an adapter changes the outputs)."""
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    t = TorchTrainerEngine(model_dir)
    specs = {"a": LoraConfig(rank=4, alpha=8.0), "b": LoraConfig(rank=2, train_unembed=True, seed=3)}
    shapes = {}
    for k, spec in specs.items():
        t.create_adapter(k, spec)
        shapes[k] = {n: v.shape for n, v in t.adapter_tensors(k).items()}
    g = torch.Generator().manual_seed(0)

    def draw(k):
        return specs[k], {n: torch.randn(sh, generator=g) * 0.5 for n, sh in shapes[k].items()}

    return {"a1": draw("a"), "a2": draw("a"), "b1": draw("b")}


def _engines(model_dir, adapters, dtype="float32", mb=8.0):
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    out = []
    for m in (0, mb):
        g = TorchGeneratorEngine(model_dir, dtype=dtype, prefix_cache_mb=m)
        g.load_adapter("a", *adapters["a1"], version=1)
        g.load_adapter("b", *adapters["b1"], version=1)
        out.append(g)
    assert out[0].prefix_cache is None and out[1].prefix_cache is not None
    return out


def _same(ref, got, atol=ATOL):
    assert got.adapter_version == ref.adapter_version
    assert [s.tokens for s in got.sequences] == [s.tokens for s in ref.sequences]
    for a, b in zip(ref.sequences, got.sequences):
        np.testing.assert_allclose(b.logprobs, a.logprobs, atol=atol, rtol=0)


def _hit(prompt_len: int, cached: int) -> int:
    """Expected hit: whole cached blocks, leaving at least the last prompt token to prefill."""
    return min(cached, prompt_len - 1) // BS * BS


def _lcp(a, b) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _expected_hit(prompt, cached_seqs) -> int:
    """The rule: the longest common prefix of ``prompt`` with any sequence whose blocks the cache holds (same
    weights), at most ``len(prompt) - 1``, rounded down to whole blocks. A finished stream leaves its prompt
    + completion minus the last sampled token (never fed forward)."""
    return _hit(len(prompt), max((_lcp(prompt, s) for s in cached_seqs), default=0))


def _batch(engine, reqs):
    with engine._state:                                   # hold admission: one prefill group
        futs = [engine.submit(**r) for r in reqs]
    return [f.result(timeout=120) for f in futs]


def test_multiturn_mixed_adapters_num_samples_same_tokens_exact_hits(model_dir, adapters):
    ref_eng, eng = _engines(model_dir, adapters)
    try:
        rng = np.random.default_rng(0)
        system = rng.integers(0, 2000, 37).tolist()       # shared: 2 whole blocks
        convs = [system + rng.integers(0, 2000, 4 + i).tolist() for i in range(4)]
        who = [None, "a", "b", "a"]
        cached: list[list] = [[] for _ in range(4)]       # per conversation: sequences whose blocks are cached
        for turn in range(4):
            reqs = [dict(prompt=c, params=SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                         num_samples=1 + i % 2, adapter=who[i]) for i, c in enumerate(convs)]
            ref = _batch(ref_eng, reqs)
            got = _batch(eng, reqs)
            for i, (a, b) in enumerate(zip(ref, got)):
                _same(a, b)
                assert a.prompt_cache_hit_tokens == 0
                # turn 0: conversation 3 follows conversation 1 (same adapter) and reuses the system prompt;
                # later turns reuse the previous prompt and the answer's fed tokens (all but its last)
                shared = [system] if turn == 0 and i == 3 else []
                assert b.prompt_cache_hit_tokens == _expected_hit(convs[i], cached[i] + shared), (turn, i)
            if turn > 0:
                assert sum(b.prompt_cache_hit_tokens for b in got) > 0
            cached = [[c + s.tokens[:-1] for s in a.sequences] for c, a in zip(convs, ref)]
            convs = [c + a.sequences[0].tokens + rng.integers(0, 2000, 3).tolist() for c, a in zip(convs, ref)]
        # the base model's and each adapter's blocks are kept apart: same system prompt, three namespaces
        assert len({k[0] for k in eng.prefix_cache._by_key}) == 3
    finally:
        ref_eng.close()
        eng.close()


def test_next_turn_hits_the_previous_answer_same_as_a_fresh_prefill(model_dir, adapters):
    """Turn k+1 = turn k's prompt + answer + a user message: it reuses the answer's blocks (exact count by the
    rule of `_expected_hit`), and its tokens/logprobs equal an engine without a cache (full prefills).

    In float64: in float32 the batch shapes alone (no cache: one request at a time vs these four batched)
    move adapter b's logprobs by up to 7.2e-5 here (its trained unembedding makes large logits), past the
    1e-5 bound; the float32 path is covered by the multi-turn test above and by the block comparison below.
    """
    ref_eng, eng = _engines(model_dir, adapters, dtype="float64")
    try:
        rng = np.random.default_rng(11)
        # different lengths and adapters in one batch: rows are left-padded, cached and uncached parts leave gaps
        convs = [rng.integers(0, 2000, n).tolist() for n in (20, 33, 47, 9)]
        who = ["a", None, "a", "b"]
        cached: list[list] = [[] for _ in convs]
        prev_len = [0] * len(convs)                       # the previous turn's prompt length
        beyond_prompt = 0
        for turn in range(3):
            reqs = [dict(prompt=c, params=SamplingParams(max_tokens=37 + 3 * i, temperature=0.0, ignore_eos=True),
                         num_samples=1, adapter=who[i]) for i, c in enumerate(convs)]
            ref = _batch(ref_eng, reqs)
            got = _batch(eng, reqs)
            for i, (a, b) in enumerate(zip(ref, got)):
                _same(a, b)
                want = _expected_hit(convs[i], cached[i])
                assert b.prompt_cache_hit_tokens == want, (turn, i, b.prompt_cache_hit_tokens, want)
                beyond_prompt += want - _hit(len(convs[i]), prev_len[i])    # over the previous prompt alone
            cached = [[c + s.tokens[:-1] for s in a.sequences] for c, a in zip(convs, ref)]
            prev_len = [len(c) for c in convs]
            convs = [c + a.sequences[0].tokens + rng.integers(0, 2000, 2 + i).tolist()
                     for i, (c, a) in enumerate(zip(convs, ref))]
        assert beyond_prompt >= 2 * 4 * BS, beyond_prompt     # 37+ answer tokens: at least 2 more blocks a turn
        assert eng.stats["cached_sequences"] == 12
    finally:
        ref_eng.close()
        eng.close()


def test_cached_answer_blocks_equal_a_plain_transformers_prefill(model_dir):
    """The answer's keys/values the cache keeps are those of one forward of plain transformers over prompt +
    answer (float32, atol 1e-5): decode steps put each token at the position a prefill would."""
    from transformers import AutoModelForCausalLM

    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    eng = TorchGeneratorEngine(model_dir, prefix_cache_mb=8)
    try:
        prompt = np.random.default_rng(3).integers(0, 2000, 21).tolist()
        # batched with a longer prompt that finishes first: the row is left-padded, then its padding trimmed
        _, out = _batch(eng, [dict(prompt=list(range(5, 60)), params=SamplingParams(max_tokens=9, ignore_eos=True)),
                              dict(prompt=prompt, params=SamplingParams(max_tokens=50, temperature=1.0, seed=1,
                                                                        ignore_eos=True))])
        seq = prompt + out.sequences[0].tokens[:-1]       # 70 fed tokens: 4 whole blocks
        blocks = eng.prefix_cache.lookup(0, seq + [0], len(seq))
        assert len(blocks) == len(seq) // BS == 4
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
        with torch.no_grad():
            past = model(torch.tensor([seq]), use_cache=True).past_key_values
        for j, kv in enumerate(blocks):
            for li, layer in enumerate(past.layers):
                cols = slice(j * BS, (j + 1) * BS)
                for got, want in ((kv[li, 0], layer.keys[0, :, cols]), (kv[li, 1], layer.values[0, :, cols])):
                    err = (got - want).abs().max().item()
                    assert err <= ATOL, (j, li, err)
    finally:
        eng.close()


def test_next_turn_from_each_stream_seeded_float64(model_dir, adapters):
    """num_samples=2 at temperature 1: each stream's answer is cached; the next turn continuing stream 1 hits its
    blocks and samples the same tokens as an engine without a cache (float64)."""
    ref_eng, eng = _engines(model_dir, adapters, dtype="float64")
    try:
        prompt = list(range(300, 331))
        p = SamplingParams(max_tokens=30, temperature=1.0, seed=7, ignore_eos=True)
        for adapter in (None, "b"):
            a, b = ref_eng.generate(prompt, p, 2, adapter), eng.generate(prompt, p, 2, adapter)
            _same(a, b)
            assert a.sequences[0].tokens != a.sequences[1].tokens
            cached = [prompt + s.tokens[:-1] for s in a.sequences]
            for s in (1, 0):
                nxt = prompt + a.sequences[s].tokens + [17, 18, 19]
                a2, b2 = ref_eng.generate(nxt, p, 2, adapter), eng.generate(nxt, p, 2, adapter)
                _same(a2, b2)
                assert b2.prompt_cache_hit_tokens == _expected_hit(nxt, cached) == 48, s
                cached += [nxt + q.tokens[:-1] for q in a2.sequences]
    finally:
        ref_eng.close()
        eng.close()


def test_requests_admitted_together_prefill_a_shared_prefix_once(model_dir, adapters):
    ref_eng, eng = _engines(model_dir, adapters)
    try:
        system = list(range(1000, 1050))                  # 50 tokens: 3 whole blocks
        p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
        reqs = [dict(prompt=system + [3 + i] * (2 + i), params=p, num_samples=1 + i % 2, adapter=ad)
                for i, ad in enumerate(["a", "a", None, "a", None])]
        ref = _batch(ref_eng, reqs)
        before = eng.stats["prefills"]
        got = _batch(eng, reqs)
        for a, b in zip(ref, got):
            _same(a, b)
        # the first request of each weights prefills the prefix; the others follow in a second forward
        assert [g.prompt_cache_hit_tokens for g in got] == [0, 48, 0, 48, 48]
        assert eng.stats["prefills"] - before == 2
    finally:
        ref_eng.close()
        eng.close()


def test_shared_prefix_across_requests_and_joining_mid_decode(model_dir, adapters):
    ref_eng, eng = _engines(model_dir, adapters)
    try:
        system = list(range(100, 164))                    # 64 tokens = 4 blocks
        first = dict(prompt=system + [7, 8], params=SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                     adapter="a")
        late = [dict(prompt=system + [9 + i] * (i + 1), params=SamplingParams(max_tokens=5, temperature=0.0),
                     num_samples=2, adapter="a") for i in range(3)]
        ref = [ref_eng.generate(**r) for r in [first, *late]]
        f_long = eng.submit(**first)
        while eng.stats["decode_steps"] < 3:              # the late ones join a batch that is decoding
            pass
        got_late = [eng.generate(**r) for r in late]
        got = [f_long.result(timeout=120), *got_late]
        for a, b in zip(ref, got):
            _same(a, b)
        assert [g.prompt_cache_hit_tokens for g in got] == [0, 64, 64, 64]
    finally:
        ref_eng.close()
        eng.close()


def test_seeded_sampling_same_tokens_float64(model_dir, adapters):
    ref_eng, eng = _engines(model_dir, adapters, dtype="float64")
    try:
        prompt = list(range(300, 340))
        p = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=5, ignore_eos=True)
        for _ in range(2):                                # second round: hits (32 of 40 tokens)
            for adapter in (None, "b"):
                a = ref_eng.generate(prompt, p, 2, adapter)
                b = eng.generate(prompt, p, 2, adapter)
                _same(a, b)
        assert b.prompt_cache_hit_tokens == 32
    finally:
        ref_eng.close()
        eng.close()


def test_weights_change_never_reuses_old_blocks(model_dir, adapters):
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    ref_eng, eng = _engines(model_dir, adapters)
    fresh = TorchGeneratorEngine(model_dir, prefix_cache_mb=0)
    try:
        prompt = np.random.default_rng(5).integers(0, 2000, 50).tolist()
        p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        v1 = eng.generate(prompt, p, 1, "a")
        assert eng.generate(prompt, p, 1, "a").prompt_cache_hit_tokens == 48
        eng.load_adapter("a", *adapters["a2"], version=2)            # in place (idle)
        after = eng.generate(prompt, p, 1, "a")
        fresh.load_adapter("a", *adapters["a2"], version=2)
        _same(fresh.generate(prompt, p, 1, "a"), after)
        assert after.prompt_cache_hit_tokens == 0 and after.adapter_version == 2
        assert [s.tokens for s in after.sequences] != [s.tokens for s in v1.sequences]
        assert eng.generate(prompt, p, 1, "a").prompt_cache_hit_tokens == 48   # the new weights' blocks
        # the other adapter's and the base model's blocks stay valid across a's change
        assert eng.generate(prompt, p, 1, None).prompt_cache_hit_tokens == 0
        assert eng.generate(prompt, p, 1, None).prompt_cache_hit_tokens == 48
        eng.drop_adapter("a")                                        # a's blocks freed, the base model's kept
        assert {k[0] for k in eng.prefix_cache._by_key} == {0}
        eng.load_adapter("a", *adapters["a1"], version=3)
        ref_eng.load_adapter("a", *adapters["a1"], version=3)
        _same(ref_eng.generate(prompt, p, 1, "a"), eng.generate(prompt, p, 1, "a"))
    finally:
        for g in (ref_eng, eng, fresh):
            g.close()


def test_answers_never_cross_weights_or_adapters(model_dir, adapters):
    """A cached answer belongs to the weights that decoded it: another adapter or the base model never hits it,
    a weights change (in place, as a weights_sync) drops it, and a request decoding while its adapter is
    replaced leaves nothing behind."""
    ref_eng, eng = _engines(model_dir, adapters)
    try:
        pc = eng.prefix_cache
        rng = np.random.default_rng(8)
        prompt = rng.integers(0, 2000, 25).tolist()
        p = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        out = eng.generate(prompt, p, 1, "a")
        nxt = prompt + out.sequences[0].tokens + [5, 6]
        assert _expected_hit(nxt, [prompt + out.sequences[0].tokens[:-1]]) == 64
        for adapter in ("b", None):                                   # same tokens, other weights
            assert eng.generate(nxt, p, 1, adapter).prompt_cache_hit_tokens == 0, adapter
        old_ns = eng._adapters["a"].ns
        eng.load_adapter("a", *adapters["a2"], version=2)            # in place (idle): a weights_sync
        ref_eng.load_adapter("a", *adapters["a2"], version=2)
        assert old_ns not in {k[0] for k in pc._by_key}
        after = eng.generate(nxt, p, 1, "a")
        _same(ref_eng.generate(nxt, p, 1, "a"), after)
        assert after.prompt_cache_hit_tokens == 0 and after.adapter_version == 2
        # replaced while decoding: the request finishes on version 2, whose blocks are gone with it
        v2_ns = eng._adapters["a"].ns
        long = eng.submit(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True), 1, "a")
        steps = eng.stats["decode_steps"]
        while eng.stats["decode_steps"] < steps + 3:
            pass
        eng.load_adapter("a", *adapters["a1"], version=3)            # pinned: a new peft adapter
        res = long.result(timeout=120)
        assert res.adapter_version == 2 and len(res.sequences[0].tokens) == 60
        assert {k[0] for k in pc._by_key}.isdisjoint({old_ns, v2_ns})
        nxt2 = prompt + res.sequences[0].tokens + [9]
        assert eng.generate(nxt2, p, 1, "a").prompt_cache_hit_tokens == 0
    finally:
        ref_eng.close()
        eng.close()


def test_bound_holds_with_answers_cached(model_dir):
    """Conversations whose prompt + answer outgrow the whole cache (6 blocks): never over the bound, same
    tokens as without a cache, no orphan block."""
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    ref_eng = TorchGeneratorEngine(model_dir, prefix_cache_mb=0)
    eng = TorchGeneratorEngine(model_dir, prefix_cache_mb=6 * 8192 / 2**20)          # 8 KiB a block
    try:
        pc = eng.prefix_cache
        rng = np.random.default_rng(4)
        convs = [rng.integers(0, 2000, n).tolist() for n in (18, 30, 45)]
        p = SamplingParams(max_tokens=35, temperature=0.0, ignore_eos=True)
        for _ in range(3):
            for i, c in enumerate(convs):
                a, b = ref_eng.generate(c, p), eng.generate(c, p)
                _same(a, b)
                # the answer just cached is kept first (others evicted): its first blocks, at most the whole bound
                seq = c + a.sequences[0].tokens[:-1]
                assert pc.match(0, seq, len(seq)) == min(len(seq) // BS, 6) * BS
                assert 0 < pc.bytes <= pc.max_bytes, (pc.bytes, pc.max_bytes)
                assert pc.bytes == sum(x.nbytes for x in pc._lru.values()) == len(pc) * 8192
                ids = set(pc._lru)
                assert all(x.key[1] == -1 or x.key[1] in ids for x in pc._lru.values())
                convs[i] = c + a.sequences[0].tokens + [1, 2]
        assert max(len(c) for c in convs) > 6 * BS and pc.stats["evicted_blocks"] > 0
    finally:
        ref_eng.close()
        eng.close()


def test_prompt_logprobs_request_prefills_in_full(model_dir, adapters):
    ref_eng, eng = _engines(model_dir, adapters)
    try:
        prompt = list(range(700, 740))
        p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        eng.generate(prompt, p)
        a = ref_eng.generate(prompt, p, prompt_logprobs=True, top_k_prompt_logprobs=2)
        b = eng.generate(prompt, p, prompt_logprobs=True, top_k_prompt_logprobs=2)
        _same(a, b)
        np.testing.assert_allclose(b.prompt_logprobs, a.prompt_logprobs, atol=ATOL, rtol=0)
        assert b.prompt_cache_hit_tokens == 0
    finally:
        ref_eng.close()
        eng.close()


def test_cache_never_exceeds_its_bound(model_dir, adapters):
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    # tiny llama: 2 layers x 2 (K, V) x 2 heads x 16 head_dim x 4 bytes = 512 B a token, 8 KiB a block
    ref_eng = TorchGeneratorEngine(model_dir, prefix_cache_mb=0)
    eng = TorchGeneratorEngine(model_dir, prefix_cache_mb=5 * 8192 / 2**20)          # 5 blocks
    try:
        pc = eng.prefix_cache
        rng = np.random.default_rng(1)
        p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        prompts = [rng.integers(0, 2000, int(n)).tolist() for n in rng.integers(17, 70, 12)]
        for prompt in prompts + prompts[::-1]:
            _same(ref_eng.generate(prompt, p), eng.generate(prompt, p))
            assert 0 < pc.bytes <= pc.max_bytes, (pc.bytes, pc.max_bytes)
            assert pc.bytes == sum(b.nbytes for b in pc._lru.values()) == len(pc) * 8192
        assert pc.stats["evicted_blocks"] > 0
        # every cached block is reachable from the root (no orphan kept after its parent went)
        ids = set(pc._lru)
        assert all(b.key[1] == -1 or b.key[1] in ids for b in pc._lru.values())
    finally:
        ref_eng.close()
        eng.close()


def test_lru_evicts_least_recent_and_descendants():
    kv = torch.zeros(1, 2, 1, 2, 1)                       # 16 bytes a block
    pc = PrefixCache(max_bytes=64, block_size=2)
    pc.insert(0, [1, 2, 3, 4, 5, 6], 0, lambda j: kv.clone())       # chain of 3
    pc.insert(0, [9, 9], 0, lambda j: kv.clone())                   # 4th block: full
    assert len(pc.lookup(0, [1, 2, 3, 4, 5, 6, 7], 6)) == 3
    pc.insert(0, [8, 8], 0, lambda j: kv.clone())                   # evicts [9, 9] (least recent)
    assert len(pc.lookup(0, [9, 9, 1], 2)) == 0 and len(pc.lookup(0, [8, 8, 1], 2)) == 1
    pc.insert(1, [1, 2, 3, 4], 0, lambda j: kv.clone())             # evicts the chain's two deepest blocks
    assert pc.bytes == 64
    assert len(pc.lookup(1, [1, 2, 3, 4, 0], 4)) == 2 and len(pc.lookup(0, [1, 2, 3, 4, 5, 6], 6)) == 1
    assert len(pc.lookup(0, [8, 8, 1], 2)) == 1
    pc.insert(0, [7, 7], 0, lambda j: kv.clone())                   # evicts namespace 1's leaf: least recent now
    assert len(pc.lookup(1, [1, 2, 3, 4, 0], 4)) == 1 and len(pc.lookup(0, [1, 2, 3], 2)) == 1
    pc.drop_namespace(1)
    assert len(pc.lookup(1, [1, 2, 3, 4, 0], 4)) == 0 and pc.bytes == 16 * len(pc)
    assert pc.insert(2, list(range(12)), 0, lambda j: kv.clone()) == 4      # 6 blocks: the first 4 fill the bound
    assert pc.bytes == 64 and len(pc) == 4 and pc.match(2, list(range(12)), 12) == 8
    with pytest.raises(ValueError, match="max_bytes"):
        PrefixCache(0)
