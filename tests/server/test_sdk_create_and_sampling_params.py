"""Silently ignored or bare-ValueError inputs on session creation and sampling: each is refused naming the key."""

from __future__ import annotations

import pytest

import together_train as tt
from together_train import errors


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"seed": 2**70}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"top_k": 2**31}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
    ],
)
def test_sampling_params_out_of_wire_range_name_the_field(kwargs, key):
    params = tt.SamplingParams(**{"max_tokens": 4, **kwargs})
    with pytest.raises(errors.InvalidArgumentError) as info:
        params.validate()
    assert info.value.key == key


def test_sampling_params_in_range_still_pass(resource):
    """The extremes of the wire ranges pass validation, reach the wire unchanged, and the server samples with them."""
    edge = tt.SamplingParams(max_tokens=4, seed=-(2**63), top_k=2**31 - 1, ignore_eos=True)
    assert edge.validate() is edge
    msg = edge.to_proto()
    assert (msg.seed, msg.top_k, msg.max_tokens) == (-(2**63), 2**31 - 1, 4)
    assert tt.SamplingParams.from_proto(msg) == edge
    top = tt.SamplingParams(max_tokens=4, seed=2**63 - 1, ignore_eos=True)
    assert top.validate().to_proto().seed == 2**63 - 1
    unseeded = tt.SamplingParams(max_tokens=4, seed=None)
    assert unseeded.validate() is unseeded and not unseeded.to_proto().HasField("seed")
    for params in (edge, top):
        out = resource.sample([1, 2, 3], params).result(timeout=120)
        assert [len(s.tokens) for s in out.sequences] == [4]
        # same seed, same tokens: the seed was used, not dropped
        assert resource.sample([1, 2, 3], params).result(timeout=120).sequences[0].tokens == out.sequences[0].tokens


@pytest.mark.parametrize("validate", [True, False])
def test_with_optimizer_without_checkpoint_is_refused(resource, validate):
    """It used to create a fresh session silently (a resume that did not resume)."""
    before = {s.session_id for s in resource.list_sessions()}
    with pytest.raises(errors.InvalidArgumentError) as info:
        resource.create_session(lora=tt.LoraConfig(rank=2), with_optimizer=True, validate=validate)
    assert info.value.key == "with_optimizer"
    assert {s.session_id for s in resource.list_sessions()} == before
