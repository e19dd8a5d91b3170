"""The vLLM replica's adapter versions (engines/vllm_adapters.py) without vLLM: which version serves a key,
how holds pin a version until its last request, and which tensors a push must carry.

vLLM itself is not needed: `AdapterVersions` is the bookkeeping and the PEFT directories the engine hands
to vLLM (tests/server/test_vllm_engine.py runs the engine where vLLM is installed); `LoraShapes` must expect
exactly the keys and shapes the trainer's ``adapter_tensors`` produces.
"""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def shapes(tiny_model_dir):
    from transformers import AutoConfig

    from together_train_server.engines.vllm_adapters import LoraShapes

    return LoraShapes(AutoConfig.from_pretrained(str(tiny_model_dir)), tiny_model_dir)


def _stage(versions, shapes, key, version):
    from together_train_server.engines.types import LoraConfig

    spec = LoraConfig(rank=4, alpha=8.0)
    tensors = {k: torch.zeros(s) for k, s in shapes.expected(spec).items()}
    return versions.stage(key, shapes.config(spec), tensors, version)


def test_expected_shapes_are_what_the_trainer_pushes(tiny_model_dir, shapes):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.engines.types import LoraConfig

    trainer = TorchTrainerEngine(tiny_model_dir)
    for spec in (LoraConfig(rank=4, alpha=8.0), LoraConfig(rank=2, alpha=4.0, target_modules=("q_proj", "v_proj"))):
        trainer.create_adapter(f"r{spec.rank}", spec)
        pushed = {k: tuple(v.shape) for k, v in trainer.adapter_tensors(f"r{spec.rank}").items()}
        assert shapes.expected(spec) == pushed, (spec, sorted(set(pushed) ^ set(shapes.expected(spec))))
    assert shapes.target_modules == trainer.lora_target_modules


def test_a_staged_version_is_a_peft_directory(tmp_path, shapes):
    from together_train_server.engines.vllm_adapters import AdapterVersions

    versions = AdapterVersions(tmp_path / "adapters")
    ad = _stage(versions, shapes, "sess", 3)
    assert ad.name == f"sess@{ad.lora_id}" and ad.version == 3
    assert json.loads((ad.path / "adapter_config.json").read_text())["r"] == 4
    assert (ad.path / "adapter_model.safetensors").stat().st_size > 0
    assert versions.keys() == []   # staged, not serving until installed
    versions.discard(ad)
    assert not ad.path.exists()


def test_holds_pin_a_version_until_its_last_request(tmp_path, shapes):
    from together_train_server.engines.vllm_adapters import AdapterVersions, LoraHold

    versions = AdapterVersions(tmp_path / "adapters")
    assert versions.hold(None, 3) == LoraHold()   # the base model: nothing to pin
    v1 = _stage(versions, shapes, "sess", 1)
    assert versions.install("sess", v1) is None   # nothing replaced
    hold = versions.hold("sess", 2)               # two requests in flight on version 1
    assert (hold.lora_id, hold.version, hold.path) == (v1.lora_id, 1, str(v1.path))

    v2 = _stage(versions, shapes, "sess", 2)
    assert versions.install("sess", v2) is None   # version 1 is held: retired, not removed yet
    assert versions.current("sess").version == 2 and versions.keys() == ["sess"]
    assert versions.release(hold.lora_id) is None  # one request still runs on it
    assert versions.release(hold.lora_id) == v1    # the last one: the engine removes it now
    assert versions.release(None) is None

    v3 = _stage(versions, shapes, "sess", 3)
    assert versions.install("sess", v3) == v2      # nothing held version 2: removed at once
    assert len({v1.lora_id, v2.lora_id, v3.lora_id}) == 3   # every load is a new vLLM id


def test_drop_waits_for_running_requests(tmp_path, shapes):
    from together_train_server.engines.vllm_adapters import AdapterVersions

    versions = AdapterVersions(tmp_path / "adapters")
    a = _stage(versions, shapes, "a", None)
    b = _stage(versions, shapes, "b", None)
    versions.install("a", a)
    versions.install("b", b)
    hold = versions.hold("a", 1)
    assert versions.pop("a") is None and versions.keys() == ["b"]   # retired until the request ends
    assert versions.release(hold.lora_id) == a
    assert versions.pop("b") == b                                   # idle: removed now
    for missing in ("a", "nope"):
        with pytest.raises(KeyError, match=f"unknown adapter '{missing}'"):
            versions.pop(missing)
        with pytest.raises(KeyError, match=f"unknown adapter '{missing}'"):
            versions.hold(missing, 1)
    versions.close()
    assert not versions.root.exists()
