"""`deepspeed_config` overrides of the DeepSpeed trainer: merged recursively, engine-owned keys refused."""

from __future__ import annotations

import pytest

pytest.importorskip("deepspeed")

from together_train_server.engines.deepspeed_trainer import DeepSpeedTrainerEngine, merge_config


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
