"""LoRA target modules come from the loaded model (peft's all-linear), not from a list of Llama names.

GPT-2 (fused ``c_attn``, transformers ``Conv1D`` layers) runs end to end on a
real server process with a real replica; Phi-3 (fused ``qkv_proj`` and
``gate_up_proj``) runs on the service layer in process. In both, capabilities
list the model's own names, a session targeting them trains a step that
changes the adapted layers, and a name the model does not have (a Llama
name) is refused naming it and the valid list.
"""

from __future__ import annotations

import numpy as np
import pytest

import together_train as tt
from together_train import errors

GPT2_TARGETS = ("c_attn", "c_fc", "c_proj")
PHI3_TARGETS = ("down_proj", "gate_up_proj", "o_proj", "qkv_proj")


def batch(vocab: int) -> list[tt.Sample]:
    rng = np.random.default_rng(0)
    toks = rng.integers(0, vocab, size=(2, 9))
    return [
        tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": np.ones(8, np.float32)})
        for t in toks
    ]


@pytest.fixture(scope="module")
def gpt2_resource(tmp_path_factory):
    from _models import build_tiny_model

    model = build_tiny_model(tmp_path_factory.mktemp("tiny-gpt2"), arch="gpt2", seed=0)
    with tt.launch_local(
        model=str(model),
        generators=1,
        storage_dir=tmp_path_factory.mktemp("storage"),
        extra_args=["--trainer-threads", "1", "--generator-threads", "1"],
    ) as client:
        yield client


def test_gpt2_capabilities_list_the_models_own_layers(gpt2_resource):
    caps = gpt2_resource.get_capabilities()
    assert tuple(caps.lora_target_modules) == GPT2_TARGETS


def test_gpt2_session_on_fused_conv1d_layers_trains_and_samples(gpt2_resource):
    caps = gpt2_resource.get_capabilities()
    s = gpt2_resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, target_modules=("c_attn", "c_proj", "c_fc")))
    try:
        fb = s.forward_backward(batch(caps.vocab_size), "cross_entropy").result(timeout=300)
        assert np.isfinite(fb.loss) and fb.loss > 0
        out = s.optim_step(tt.AdamParams(learning_rate=1e-2)).result(timeout=300)
        assert out.step == 1 and out.grad_norm > 0
        # B starts at zero: after one step the adapted model scores the batch differently.
        after = s.forward(batch(caps.vocab_size), "cross_entropy").result(timeout=300)
        assert after.loss != pytest.approx(fb.loss, rel=1e-6)
        s.weights_sync().result(timeout=300)
        res = s.sample([1, 2, 3], tt.SamplingParams(max_tokens=3, seed=0)).result(timeout=300)
        assert res.policy_version == 1 and len(res.sequences[0].tokens) == 3
    finally:
        s.stop()


def test_gpt2_unknown_target_is_refused_naming_it_and_the_valid_list(gpt2_resource):
    with pytest.raises(errors.InvalidArgumentError) as info:
        gpt2_resource.create_session(lora=tt.LoraConfig(rank=4, target_modules=("c_attn", "q_proj")))
    err = info.value
    assert err.key == "target_modules"
    assert "'q_proj'" in str(err) and "'c_attn'" not in str(err).split("this model has")[0]
    for name in GPT2_TARGETS:
        assert name in str(err).split("this model has")[1]
    assert all("q_proj" not in x.lora.target_modules for x in gpt2_resource.list_sessions())


def test_phi3_fused_layers_on_the_service_layer(tmp_path):
    from _models import build_tiny_model
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.engines.types import LoraConfig
    from together_train_server.service.errors import ServiceError
    from together_train_server.service.replicas.pool import ReplicaPool
    from together_train_server.service.resource import Resource

    engine = TorchTrainerEngine(build_tiny_model(tmp_path / "phi3", arch="phi3", seed=0))
    res = Resource(engine, ReplicaPool([]), tmp_path / "storage")
    try:
        assert tuple(res.capabilities()["lora_target_modules"]) == PHI3_TARGETS
        s = res.sessions.create_session(LoraConfig(rank=4, alpha=8.0, target_modules=("qkv_proj", "gate_up_proj")))
        samples = [(x.model_input, dict(x.loss_fn_inputs)) for x in batch(engine.vocab_size)]
        fb = res.submissions.submit_forward(s.session_id, 0, "", samples=samples, loss_fn="cross_entropy", loss_params={},
                                backward=True, return_logprobs=False, return_elementwise=False)
        rec = res.book.wait(fb.operation_id, 300)
        assert rec.status == "SUCCEEDED", rec.error
        op = res.submissions.submit_optim_step(s.session_id, 1, "", {"learning_rate": 1e-2})
        rec = res.book.wait(op.operation_id, 300)
        assert rec.status == "SUCCEEDED", rec.error
        assert rec.result.step == 1 and rec.result.grad_norm > 0
        names = engine.adapter_tensors(s.session_id)
        assert any(".qkv_proj.lora_B" in k for k in names) and any(".gate_up_proj.lora_B" in k for k in names)
        assert not any(".o_proj." in k for k in names)
        assert all(float(v.abs().sum()) > 0 for k, v in names.items() if "lora_B" in k)
        before = len(res.session_table.list_sessions())
        with pytest.raises(ServiceError) as info:
            res.sessions.create_session(LoraConfig(rank=4, target_modules=("q_proj",)))
        assert info.value.code == "INVALID_ARGUMENT" and info.value.key == "target_modules"
        assert "'q_proj'" in info.value.message
        assert all(n in info.value.message for n in PHI3_TARGETS)
        assert len(res.session_table.list_sessions()) == before
    finally:
        res.close()
