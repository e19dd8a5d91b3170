"""TorchGeneratorEngine's per-token hook (``submit(..., on_token=)``), which streamed sampling is built on.

Reference: the same request's own GenOutput (the hook must report exactly its
tokens and logprobs, stream by stream, in order) and an unstreamed request
with the same seed (the hook must not change what is sampled).
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from together_train_server.engines.types import SamplingParams

PROMPT = [1, 504, 3458, 314, 260, 3575, 282, 4649, 47, 2]


@pytest.fixture(scope="module")
def gen(tiny_model_dir):
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    engine = TorchGeneratorEngine(tiny_model_dir)
    yield engine
    engine.close()


def test_on_token_reports_each_token_before_the_request_ends(gen):
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True)
    events: list[tuple[int, int, float, bool]] = []
    holder: dict = {}

    def on_token(stream: int, token: int, logprob: float) -> None:
        events.append((stream, token, logprob, holder["fut"].done()))

    holder["fut"] = fut = gen.submit(PROMPT, params, 3, on_token=on_token)
    out = fut.result(timeout=120)
    for s, seq in enumerate(out.sequences):
        mine = [(t, lp) for (st, t, lp, _) in events if st == s]
        assert [t for t, _ in mine] == list(seq.tokens), f"stream {s}"
        assert [lp for _, lp in mine] == list(seq.logprobs), f"stream {s}"
    # every token was reported while the request was still running (before its future resolved)
    assert len(events) == 3 * 24 and not any(done for *_, done in events)
    # the hook changes nothing: the same seed without it samples the same tokens
    plain = gen.generate(PROMPT, params, 3)
    assert [list(s.tokens) for s in plain.sequences] == [list(s.tokens) for s in out.sequences]


def test_a_failing_hook_does_not_fail_the_request(gen):
    calls = []

    def broken(stream: int, token: int, logprob: float) -> None:
        calls.append(token)
        raise RuntimeError("listener gone")

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    out = gen.submit(PROMPT, params, 1, on_token=broken).result(timeout=120)
    assert len(out.sequences[0].tokens) == 8 and len(calls) == 1  # called once, then dropped
    assert list(out.sequences[0].tokens) == list(gen.generate(PROMPT, params, 1).sequences[0].tokens)
