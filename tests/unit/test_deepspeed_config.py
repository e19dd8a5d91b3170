"""`deepspeed_config` overrides of the DeepSpeed trainer: merged recursively, engine-owned keys refused."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from together_train_server.engines.deepspeed import DeepSpeedTrainerEngine, merge_config


def test_merge_config_is_recursive_and_copies():
    base = {"zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": False}}
    over = {"zero_optimization": {"stage3_max_live_parameters": 0}, "bf16": {"enabled": True}, "x": 1}
    got = merge_config(base, over)
    assert got == {"zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_max_live_parameters": 0},
                   "bf16": {"enabled": True}, "x": 1}
    assert base == {"zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": False}}


@pytest.mark.parametrize("bad, named", [
    ({"train_batch_size": 8}, "train_batch_size"),
    ({"gradient_clipping": 1.0}, "gradient_clipping"),
    ({"optimizer": {"type": "Adam"}}, "optimizer"),
    ({"zero_optimization": {"stage": 1}}, "zero_optimization.stage"),
])
def test_engine_owned_keys_are_refused_before_any_rank_starts(tmp_path, bad, named):
    # Raised before init_distributed: no launcher env is needed to see the error.
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        DeepSpeedTrainerEngine(tmp_path, zero_stage=3, deepspeed_config=bad)


def test_one_worker_class_per_layout_and_the_trainer_interface():
    """engines/deepspeed: the executor facade has every TrainerEngine method; each layout is its own worker."""
    from together_train_server.engines.deepspeed.engine import worker_class
    from together_train_server.engines.deepspeed.full import FullWorker
    from together_train_server.engines.deepspeed.lora_zero3 import LoraZero3Worker
    from together_train_server.engines.deepspeed.lora_zero12 import LoraZero12Worker
    from together_train_server.engines.interfaces import TRAINER_METHODS

    assert all(callable(getattr(DeepSpeedTrainerEngine, m, None)) for m in TRAINER_METHODS)
    assert DeepSpeedTrainerEngine.backend_name == "DeepSpeedTrainerEngine"
    assert [worker_class("lora", z) for z in (1, 2, 3)] == [LoraZero12Worker, LoraZero12Worker, LoraZero3Worker]
    assert {worker_class("full", z) for z in (1, 2, 3)} == {FullWorker}
    assert FullWorker.mode == "full" and LoraZero3Worker.mode == LoraZero12Worker.mode == "lora"
