"""The remaining bad-input kinds, each its own test.

Server-side kinds go over the wire without the SDK's checks (``validate=False``
or a raw stub) to a real resource process; each must answer INVALID_ARGUMENT
naming the field, and leave the session exactly as it was: the gradient
accumulated before the bad request gives the same pre-clip norm at the next
optim_step as in a session that never saw it, and the session keeps working.
SDK kinds (values of the wrong type) must raise the SDK's InvalidArgumentError
naming the field before anything is sent.
"""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

import together_train as tt
from together_train import errors
from together_train._proto import session_pb2, session_pb2_grpc
from together_train.errors import from_rpc_error

# The good batch and the untouched session's grad norm are the older bad-input suite's (one definition).
from test_e2e_bad_input import baseline_grad_norm, good_batch  # noqa: F401


@pytest.fixture()
def primed(resource):
    """A session holding the gradient of good_batch(), stopped after the test."""
    s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
    s.forward_backward(good_batch(), "cross_entropy").result(timeout=120)
    yield s
    s.stop()


def assert_unchanged(session, baseline_grad_norm):
    info = session.info()
    assert info.step == 0 and info.synced_version == 0
    out = session.optim_step(tt.AdamParams(learning_rate=1e-3)).result(timeout=120)
    assert out.step == 1
    assert out.grad_norm == pytest.approx(baseline_grad_norm, rel=1e-6)
    assert session.forward(good_batch(), "cross_entropy").result(timeout=120).loss > 0


# ----------------------------------------------------------------------------- server side


@pytest.mark.parametrize("key, value", [("learning_rate", 1e300), ("lora_plus_ratio", 1e200)])
def test_adam_value_beyond_float32_names_the_key(primed, baseline_grad_norm, key, value):
    """It used to fail INTERNAL: 'value cannot be converted to type float without overflow'."""
    with pytest.raises(errors.InvalidArgumentError) as info:
        primed.optim_step(tt.AdamParams(**{"learning_rate": 1e-3, key: value}), validate=False).result(timeout=120)
    assert info.value.code == "INVALID_ARGUMENT" and info.value.key == key
    assert "float32" in str(info.value) and not info.value.retryable
    assert_unchanged(primed, baseline_grad_norm)


def ppo_batch() -> list[tt.Sample]:
    out = []
    for s in good_batch():
        n = len(s.model_input)
        inputs = dict(s.loss_fn_inputs)
        inputs.pop("weights")
        inputs["logprobs"] = np.full(n, -3.0, np.float32)
        inputs["advantages"] = np.ones(n, np.float32)
        out.append(tt.Sample(model_input=s.model_input, loss_fn_inputs=inputs))
    return out


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_loss_param_as_raw_struct_number_names_the_parameter(primed, baseline_grad_norm, value):
    """It used to answer protobuf's 'Fail to serialize NaN for Value.number_value' without the name."""
    with pytest.raises(errors.InvalidArgumentError) as info:
        primed.forward_backward(
            ppo_batch(), "ppo", loss_fn_config={"clip_high_threshold": value}, validate=False
        ).result(timeout=120)
    assert info.value.key == "clip_high_threshold"
    assert "'clip_high_threshold'" in str(info.value) and "finite" in str(info.value)
    assert_unchanged(primed, baseline_grad_norm)


def test_weights_sync_unknown_mode_is_refused(primed, baseline_grad_norm):
    """mode=99 used to run as synchronous."""
    before = primed.info()
    with grpc.insecure_channel(primed.client.address) as channel:
        stub = session_pb2_grpc.SessionServiceStub(channel)
        req = session_pb2.WeightsSyncRequest(mode=99)
        req.header.session_id, req.header.seq_id = primed.session_id, before.next_seq_id
        with pytest.raises(grpc.RpcError) as info:
            stub.WeightsSync(req)
    err = from_rpc_error(info.value)
    assert isinstance(err, errors.InvalidArgumentError) and err.key == "mode"
    assert "99" in str(err) and "BACKGROUND" in str(err)
    after = primed.info()
    assert after.next_seq_id == before.next_seq_id and after.synced_version == 0
    assert_unchanged(primed, baseline_grad_norm)
    # the known modes still work after the refusal
    assert primed.weights_sync().result(timeout=120).policy_version == 1


def test_temperature_too_small_to_divide_by_is_refused_never_nan(primed, baseline_grad_norm):
    """1e-45 used to give NaN logprobs and the last vocabulary id for every token."""
    params = tt.SamplingParams(max_tokens=4, temperature=1e-45, seed=0)
    with pytest.raises(errors.InvalidArgumentError) as info:
        primed.sample([1, 2, 3], params, validate=False).result(timeout=120)
    assert info.value.key == "temperature" and "0 for greedy" in str(info.value)
    with pytest.raises(errors.InvalidArgumentError) as info:  # the SDK refuses it too, before sending
        primed.sample([1, 2, 3], params)
    assert info.value.key == "temperature"
    # The smallest temperature allowed samples without NaN: effectively the argmax of the base model.
    low = primed.sample([1, 2, 3], tt.SamplingParams(max_tokens=4, temperature=tt.MIN_TEMPERATURE, seed=0)).result(
        timeout=120
    )
    greedy = primed.sample([1, 2, 3], tt.SamplingParams(max_tokens=4, temperature=0.0)).result(timeout=120)
    assert all(math.isfinite(x) for x in low.sequences[0].logprobs)
    assert low.sequences[0].tokens == greedy.sequences[0].tokens
    assert_unchanged(primed, baseline_grad_norm)


# ----------------------------------------------------------------------------- SDK side

SDK_WRONG_TYPES = {
    "adam_learning_rate_str": (lambda: tt.AdamParams(learning_rate="0.1"), "learning_rate"),
    "adam_learning_rate_none": (lambda: tt.AdamParams(learning_rate=None), "learning_rate"),
    "sampling_temperature_str": (lambda: tt.SamplingParams(max_tokens=4, temperature="hot"), "temperature"),
    "sampling_stop_token_ids_str": (lambda: tt.SamplingParams(max_tokens=4, stop_token_ids=["x"]), "stop_token_ids"),
    "lora_alpha_str": (lambda: tt.LoraConfig(alpha="8"), "alpha"),
}


@pytest.mark.parametrize("case", sorted(SDK_WRONG_TYPES))
def test_sdk_wrong_type_names_the_field(case):
    make, key = SDK_WRONG_TYPES[case]
    value = make()  # constructing is fine: the check runs where the value is used
    with pytest.raises(errors.InvalidArgumentError) as info:
        value.validate()
    assert info.value.key == key and key in str(info.value)
    # validate=False paths encode the message: they must not raise a bare TypeError/ValueError either
    with pytest.raises(errors.InvalidArgumentError) as info:
        value.to_proto()
    assert info.value.key == key


@pytest.mark.parametrize("case", sorted(SDK_WRONG_TYPES))
def test_sdk_wrong_type_through_the_client_names_the_field(session, case):
    """Through the public calls that take these values; nothing reaches the server."""
    make, key = SDK_WRONG_TYPES[case]
    value = make()
    before = session.info().next_seq_id
    with pytest.raises(errors.InvalidArgumentError) as info:
        if isinstance(value, tt.AdamParams):
            session.optim_step(value)
        elif isinstance(value, tt.SamplingParams):
            session.sample([1, 2, 3], value)
        else:
            session.client.create_session(lora=value)
    assert info.value.key == key
    assert session.info().next_seq_id == before


@pytest.mark.parametrize("validate", [True, False])
def test_sdk_loss_params_as_list_of_pairs_names_the_field(session, validate):
    """Used to raise AttributeError: 'list' object has no attribute 'items'."""
    before = session.info().next_seq_id
    with pytest.raises(errors.InvalidArgumentError) as info:
        session.forward_backward(ppo_batch(), "ppo", loss_fn_config=[("clip_high_threshold", 1.2)], validate=validate)
    assert info.value.key == "loss_fn_config" and "dict" in str(info.value)
    assert session.info().next_seq_id == before
