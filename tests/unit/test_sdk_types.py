"""SDK types: proto round trips and client-side validation."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import together_train as tt
from together_train._proto import common_pb2, generator_pb2, resource_pb2, session_pb2
from together_train.tensors import to_tensor
from together_train.types import loss_config_to_proto, validate_samples


def test_lora_config_round_trip_and_defaults():
    cfg = tt.LoraConfig(rank=8, alpha=16.0, dropout=0.1, target_modules=["q_proj", "v_proj"], train_unembed=True, seed=7)
    assert cfg.target_modules == ("q_proj", "v_proj")
    assert tt.LoraConfig.from_proto(cfg.to_proto()) == cfg
    assert tt.LoraConfig() == tt.LoraConfig(rank=16, alpha=32.0, dropout=0.0, target_modules=(), train_unembed=False, seed=0)
    assert tt.LoraConfig(target_modules="q_proj").target_modules == ("q_proj",)
    for bad in (dict(rank=0), dict(alpha=0.0), dict(dropout=1.0)):
        with pytest.raises(tt.InvalidArgumentError) as ei:
            tt.LoraConfig(**bad).validate()
        assert ei.value.key == next(iter(bad))


def test_adam_params_sent_in_full():
    p = tt.AdamParams(learning_rate=3e-4, grad_clip_norm=1.0, lora_plus_ratio=16.0)
    msg = p.to_proto()
    for f in ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm", "lora_plus_ratio"):
        assert msg.HasField(f), f
    assert msg.beta2 == 0.999 and msg.eps == 1e-8 and msg.weight_decay == 0.0
    assert tt.AdamParams.from_proto(msg) == p
    with pytest.raises(TypeError):
        tt.AdamParams()  # learning_rate is required
    for key, bad in (("learning_rate", float("nan")), ("beta1", 1.0), ("eps", 0.0), ("lora_plus_ratio", 0.0)):
        with pytest.raises(tt.InvalidArgumentError) as ei:
            tt.AdamParams(**{"learning_rate": 1e-3, key: bad}).validate()
        assert ei.value.key == key


def test_sampling_params_round_trip():
    p = tt.SamplingParams(max_tokens=16, temperature=0.7, top_k=20, top_p=0.9, seed=3, stop="\n", stop_token_ids=[2], ignore_eos=True)
    assert p.stop == ("\n",) and p.stop_token_ids == (2,)
    msg = p.to_proto()
    assert msg.HasField("seed") and msg.seed == 3
    assert tt.SamplingParams.from_proto(msg) == p
    unseeded = tt.SamplingParams(max_tokens=4).to_proto()
    assert not unseeded.HasField("seed") and unseeded.temperature == 1.0 and unseeded.top_p == 1.0
    assert tt.SamplingParams.from_proto(unseeded) == tt.SamplingParams(max_tokens=4)
    for kw, key in (
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=4, temperature=-1.0), "temperature"),
        (dict(max_tokens=4, top_p=0.0), "top_p"),
        (dict(max_tokens=4, top_k=-1), "top_k"),
    ):
        with pytest.raises(tt.InvalidArgumentError) as ei:
            tt.SamplingParams(**kw).validate()
        assert ei.value.key == key


def test_sample_round_trip_dtypes():
    s = tt.Sample(
        model_input=[5, 6, 7],
        loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1, 0, 1], "advantages": np.array([0.5, -1.0, 2.0])},
    )
    assert s.length == 3
    msg = s.to_proto()
    assert list(msg.model_input) == [5, 6, 7]
    assert msg.loss_fn_inputs["target_tokens"].dtype == common_pb2.INT64
    assert msg.loss_fn_inputs["weights"].dtype == common_pb2.FLOAT32  # ints cast to float for non-token keys
    assert msg.loss_fn_inputs["advantages"].dtype == common_pb2.FLOAT32
    back = tt.Sample.from_proto(msg)
    np.testing.assert_array_equal(back.model_input, [5, 6, 7])
    np.testing.assert_array_equal(back.loss_fn_inputs["weights"], np.array([1, 0, 1], dtype=np.float32))
    assert back.loss_fn_inputs["target_tokens"].dtype == np.int64
    # the loss spec's dtypes win
    msg2 = s.to_proto(input_dtypes={"weights": "int64"})
    assert msg2.loss_fn_inputs["weights"].dtype == common_pb2.INT64


def test_for_cross_entropy_shifts_and_trims():
    s = tt.Sample.for_cross_entropy([10, 11, 12, 13], weights=[0, 0, 1, 1])
    np.testing.assert_array_equal(s.model_input, [10, 11, 12])
    np.testing.assert_array_equal(s.loss_fn_inputs["target_tokens"], [11, 12, 13])
    np.testing.assert_array_equal(s.loss_fn_inputs["weights"], [0, 1, 1])
    with pytest.raises(tt.InvalidArgumentError):
        tt.Sample.for_cross_entropy([1])
    with pytest.raises(tt.InvalidArgumentError) as ei:
        tt.Sample.for_cross_entropy([1, 2, 3], weights=[1, 1])
    assert ei.value.key == "weights"


def _ok(n=4):
    return tt.Sample(model_input=list(range(1, n + 1)), loss_fn_inputs={"target_tokens": list(range(2, n + 2)), "weights": [1.0] * n})


@pytest.mark.parametrize(
    "mutate, key, fragment",
    [
        (lambda s: s.loss_fn_inputs.update(weights=[1.0, 1.0, 1.0]), "weights", "length 3"),
        (lambda s: s.loss_fn_inputs.update(target_tokens=[2, 3, 4, 5, 6]), "target_tokens", "length 5"),
        (lambda s: s.loss_fn_inputs.update(weights=[1.0, float("nan"), 1.0, 1.0]), "weights", "non-finite"),
        (lambda s: s.loss_fn_inputs.update(weights=[1.0, float("inf"), 1.0, 1.0]), "weights", "non-finite"),
        (lambda s: s.loss_fn_inputs.update(advantages=np.ones((4, 1))), "advantages", "1-D"),
        (lambda s: s.loss_fn_inputs.update(target_tokens=[2, -1, 4, 5]), "target_tokens", "negative"),
        (lambda s: s.loss_fn_inputs.update(target_tokens=[2.5, 3, 4, 5]), "target_tokens", "integer"),
        (lambda s: s.loss_fn_inputs.update(weights=["a", "b", "c", "d"]), "weights", "numeric"),
        (lambda s: setattr(s, "model_input", [1, -2, 3, 4]), "model_input", "negative"),
        (lambda s: setattr(s, "model_input", [[1, 2], [3, 4]]), "model_input", "1-D"),
        (lambda s: setattr(s, "model_input", []), "model_input", "empty"),
        (lambda s: setattr(s, "model_input", ["x", "y", "z", "w"]), "model_input", "integer"),
    ],
)
def test_validation_names_sample_index_and_key(mutate, key, fragment):
    samples = [_ok(), _ok(), _ok()]
    mutate(samples[2])
    with pytest.raises(tt.InvalidArgumentError) as ei:
        validate_samples(samples)
    err = ei.value
    assert err.sample_index == 2, err
    assert err.key == key, err
    assert fragment in err.message, err.message
    assert err.code == "INVALID_ARGUMENT" and not err.retryable
    assert "sample 2" in str(err) and repr(key) in str(err)


def test_validate_samples_batch_level():
    with pytest.raises(tt.InvalidArgumentError) as ei:
        validate_samples([])
    assert ei.value.key == "samples" and ei.value.sample_index is None
    with pytest.raises(tt.InvalidArgumentError) as ei:
        validate_samples([_ok(), "nope"])
    assert ei.value.sample_index == 1
    protos = validate_samples([_ok(), {"model_input": [1, 2], "loss_fn_inputs": {"target_tokens": [2, 3], "weights": [1, 1]}}])
    assert len(protos) == 2 and list(protos[1].model_input) == [1, 2]


def test_loss_config():
    msg = loss_config_to_proto({"clip_low_threshold": 0.8, "ratio_type": "sequence", "beta": np.float32(0.5), "n": 3})
    d = dict(msg.params)
    assert d == {"clip_low_threshold": 0.8, "ratio_type": "sequence", "beta": 0.5, "n": 3.0}
    assert not loss_config_to_proto(None).HasField("params")
    with pytest.raises(tt.InvalidArgumentError) as ei:
        loss_config_to_proto({"beta": float("nan")})
    assert ei.value.key == "beta"
    with pytest.raises(tt.InvalidArgumentError):
        loss_config_to_proto({"beta": [1, 2]})


def test_forward_result_round_trip():
    r = tt.ForwardResult(
        loss=12.5,
        logprobs=[np.array([-1.0, -2.0], dtype=np.float32), np.array([-0.5], dtype=np.float32)],
        elementwise_loss=[np.array([1.0, 2.0], dtype=np.float32), np.array([0.5], dtype=np.float32)],
        metrics={"loss:sum": 12.5, "num_tokens:sum": 3.0},
    )
    back = tt.ForwardResult.from_proto(r.to_proto())
    assert back.loss == 12.5 and back.metrics == r.metrics
    for a, b in zip(back.logprobs, r.logprobs):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(back.elementwise_loss, r.elementwise_loss):
        np.testing.assert_array_equal(a, b)
    only_loss = tt.ForwardResult.from_proto(session_pb2.ForwardResult(loss=1.0, outputs=[session_pb2.SampleOutput()]))
    assert only_loss.logprobs is None and only_loss.elementwise_loss is None


def test_small_results_round_trip():
    o = tt.OptimStepResult(step=3, grad_norm=0.25, learning_rate=1e-4)
    assert tt.OptimStepResult.from_proto(o.to_proto()) == o
    w = tt.WeightsSyncResult(policy_version=3, num_replicas=2, num_bytes=1000, seconds=0.5)
    assert tt.WeightsSyncResult.from_proto(w.to_proto()) == w
    c = tt.CheckpointInfo(uri="together-train://s/weights/a", session_id="s", kind="weights", name="a", size_bytes=10, step=3)
    assert tt.CheckpointInfo.from_proto(c.to_proto()) == c and c.path is None
    c2 = tt.CheckpointInfo.from_proto(common_pb2.CheckpointInfo(uri="u", path="/store/s/weights/a"))
    assert c2.path == pathlib.Path("/store/s/weights/a") and (c2.path / "adapter_config.json").name == "adapter_config.json"
    assert tt.CheckpointInfo.from_proto(c2.to_proto()) == c2
    assert tt.LoadStateResult.from_proto(session_pb2.LoadStateResult(step=4, with_optimizer=True)) == tt.LoadStateResult(4, True)


def test_sample_result_from_proto():
    msg = generator_pb2.SampleResponse(
        sequences=[
            generator_pb2.SampledSequence(
                tokens=[1, 2], logprobs=[-0.1, -0.2], stop_reason=generator_pb2.STOP,
                version_spans=[generator_pb2.VersionSpan(start=0, end=2, policy_version=4)],
            ),
            generator_pb2.SampledSequence(tokens=[3], logprobs=[-0.3], stop_reason=generator_pb2.LENGTH),
        ],
        prompt_logprobs=[-1.0, -2.0],
        top_k_prompt_logprobs=[generator_pb2.TopKLogprobs(token_ids=[5, 6], logprobs=[-0.1, -2.0])] * 2,
        policy_version=4,
        replica_id="r1",
    )
    r = tt.SampleResult.from_proto(msg)
    assert [s.stop_reason for s in r.sequences] == ["stop", "length"]
    assert r.sequences[0].tokens == [1, 2] and r.sequences[0].logprobs == pytest.approx([-0.1, -0.2])
    assert r.sequences[0].version_spans == [tt.VersionSpan(0, 2, 4)]
    assert r.prompt_logprobs == [-1.0, -2.0]
    assert r.top_k_prompt_logprobs[0][0] == [5, 6]
    assert r.policy_version == 4 and r.replica_id == "r1"
    bare = tt.SampleResult.from_proto(generator_pb2.SampleResponse(policy_version=-1))
    assert bare.prompt_logprobs is None and bare.top_k_prompt_logprobs is None and bare.sequences == []


def test_session_info_and_capabilities_from_proto():
    info = tt.SessionInfo.from_proto(
        resource_pb2.SessionInfo(
            session_id="s1", name="n", lora=common_pb2.LoraConfig(rank=4, alpha=8), state=resource_pb2.EXPIRED,
            step=5, synced_version=4, next_seq_id=11, num_trainable_params=99,
        )
    )
    assert info.state == "expired" and info.lora.rank == 4 and info.next_seq_id == 11 and info.synced_version == 4
    caps = tt.Capabilities.from_proto(
        resource_pb2.Capabilities(
            model_id="m", vocab_size=100, max_seq_len=2048, mode="lora",
            losses=[
                resource_pb2.LossSpec(
                    name="ppo",
                    inputs=[resource_pb2.InputSpec(name="target_tokens", dtype="int64", required=True)],
                    params=[resource_pb2.ParamSpec(name="clip_low_threshold", type="float", default="0.8")],
                    available=False,
                )
            ],
            adam_defaults=common_pb2.AdamParams(eps=1e-8),
        )
    )
    ppo = caps.losses["ppo"]
    assert not ppo.available and ppo.params[0].default == "0.8" and ppo.input_dtypes == {"target_tokens": "int64"}
    assert caps.adam_defaults == {"eps": 1e-8} and caps.vocab_size == 100


def test_tensor_codec_is_what_samples_use():
    t = to_tensor(np.array([1.5, 2.5], dtype=np.float64))
    assert t.dtype == common_pb2.FLOAT32 and list(t.shape) == [2]
