"""Metric sinks (`together_train_cookbook.ml_log`): a short real training run (tiny model, real
resource) logs through `setup_logging` to metrics.jsonl, TensorBoard and W&B (offline); each sink,
read back with its own reader (TensorBoard's EventAccumulator; W&B's record protobuf from the
offline run file), holds the values of metrics.jsonl."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct
from pathlib import Path

import numpy as np
import pytest

import together_train as tt
from together_train_cookbook.cli import ConfigError
from together_train_cookbook.metrics import read_metrics
from together_train_cookbook.ml_log import JsonLogger, setup_logging, tensorboard_tag

VOCAB = 49152  # the tiny model uses the SmolLM2 tokenizer
STEPS = 4
#: TensorBoard stores a scalar as float32: relative rounding error <= 2**-24.
F32_REL = 2.0**-23


@dataclasses.dataclass
class RunConfig:
    learning_rate: float = 1e-2
    steps: int = STEPS
    seed: int = 0


def _batch(seed: int) -> list[tt.Sample]:
    toks = np.random.default_rng(seed).integers(0, VOCAB, size=(2, 11))
    return [tt.Sample(model_input=t[:-1], loss_fn_inputs={"target_tokens": t[1:], "weights": np.ones(10, np.float32)})
            for t in toks]


@pytest.fixture(scope="module")
def run_dir(resource, tmp_path_factory):
    """A 4-step LoRA run on the tiny model, logged to JSONL + TensorBoard + W&B (offline): a start
    evaluation (step -1), then per step the loss, the server's loss metrics, grad norm, lr, a bool
    and a string."""
    out = tmp_path_factory.mktemp("ml_log") / "run"
    saved = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT")}
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
    cfg = RunConfig()
    try:
        log = setup_logging(out, cfg, tensorboard=True, wandb_project="together-train-tests")
        s = resource.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0))
        try:
            log.log_metrics({"held_out_loss": s.forward(_batch(99)).result(timeout=120).loss}, step=-1)
            for k in range(STEPS):
                fb = s.forward_backward(_batch(k)).result(timeout=120)
                opt = s.optim_step(tt.AdamParams(learning_rate=cfg.learning_rate)).result(timeout=120)
                log.log_metrics({"loss": fb.loss, **fb.metrics, "grad_norm": opt.grad_norm,
                                 "lr": opt.learning_rate, "clipped": False, "note": f"step {k}"}, step=k)
        finally:
            s.stop()
            log.close()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def _numeric(records: list[dict]) -> dict[tuple[str, int], float]:
    """(key, step) -> value of every number in metrics.jsonl (bools as 0/1; null = NaN skipped)."""
    out = {}
    for r in records:
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)):
                out[(k, r["step"])] = float(v)
    return out


def test_metrics_jsonl_has_every_step_and_the_config(run_dir):
    recs = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in recs] == [-1, *range(STEPS)]
    assert all(r["note"] == f"step {r['step']}" and r["clipped"] is False for r in recs[1:])
    assert json.loads((run_dir / "config.json").read_text()) == dataclasses.asdict(RunConfig())


def test_tensorboard_event_files_hold_the_jsonl_values(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    want = _numeric(read_metrics(run_dir / "metrics.jsonl"))
    ea = EventAccumulator(str(run_dir / "tensorboard"))
    ea.Reload()
    got = {(tag, e.step): e.value for tag in ea.Tags()["scalars"] for e in ea.Scalars(tag)}
    assert set(got) == {(tensorboard_tag(k), step) for k, step in want}, (sorted(got), sorted(want))
    for (k, step), v in want.items():
        assert got[(tensorboard_tag(k), step)] == pytest.approx(v, rel=F32_REL), (k, step, got[(tensorboard_tag(k), step)], v)
    assert any(":" in k for k, _ in want), "the server's loss metrics (name:reduction) are among the tags"


def _wandb_records(run_file: str) -> list:
    """The protobuf records of an offline W&B run file: a 7-byte header, then LevelDB-log blocks of
    32 KiB whose chunks (crc32, length, type FULL=1 / FIRST=2 / MIDDLE=3 / LAST=4) join into one
    serialized `wandb_internal_pb2.Record` each."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = Path(run_file).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, buf, out = 32768, 7, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append(rec)
            buf = b""
    return out


def test_wandb_offline_run_holds_history_summary_and_config(run_dir):
    recs = read_metrics(run_dir / "metrics.jsonl")
    runs = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1, runs
    assert Path(runs[0]).name == f"run-{(run_dir / 'wandb_run_id').read_text().strip()}.wandb"
    history, summary, config = [], {}, {}
    for r in _wandb_records(runs[0]):
        kind = r.WhichOneof("record_type")
        if kind == "history":
            history.append({"/".join(it.nested_key) or it.key: json.loads(it.value_json) for it in r.history.item})
        elif kind == "summary":
            summary.update({"/".join(u.nested_key) or u.key: json.loads(u.value_json) for u in r.summary.update})
        elif kind == "config":
            config.update({u.key: json.loads(u.value_json) for u in r.config.update})
    rows = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    want = [{k: (float(v) if isinstance(v, bool) else v) for k, v in r.items()} for r in recs]
    assert len(rows) == len(want), (rows, want)
    for row, rec in zip(rows, want):
        assert row.keys() == rec.keys(), (row, rec)
        for k, v in rec.items():
            assert row[k] == (pytest.approx(v, rel=1e-12) if isinstance(v, float) else v), (k, row[k], v)
    last = want[-1]  # the summary holds each metric's last value
    for k in ("loss", "grad_norm", "lr", "step"):
        assert summary[k] == pytest.approx(last[k], rel=1e-12), (k, summary[k], last[k])
    assert summary["held_out_loss"] == pytest.approx(want[0]["held_out_loss"], rel=1e-12)
    assert {k: config[k] for k in ("learning_rate", "steps", "seed")} == dataclasses.asdict(RunConfig())


def test_json_logger_resume_keeps_earlier_steps(tmp_path):
    with JsonLogger(tmp_path) as log:
        for k in range(-1, 5):
            log.log_metrics({"loss": 1.0 / (k + 2), "nan": math.nan}, step=k)
    with JsonLogger(tmp_path, start_step=3) as log:  # resumed at step 3: steps 3, 4 run again
        log.log_metrics({"loss": 0.0}, step=3)
        assert [r["step"] for r in log.records] == [-1, 0, 1, 2, 3]
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["loss"]) for r in recs] == [(-1, 1.0), (0, 0.5), (1, 1 / 3), (2, 0.25), (3, 0.0)]
    assert recs[0]["nan"] is None  # JSON has no NaN


def test_a_missing_sink_package_names_the_flag(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"--tensorboard: needs tensorboardX \(pip install 'together-train\[loggers\]'\)"):
        setup_logging(tmp_path, None, tensorboard=True)
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match=r"--wandb-project p: needs wandb"):
        setup_logging(tmp_path, None, wandb_project="p")


def test_importing_ml_log_loads_no_sink_package_nor_torch():
    """The sinks' packages load only when their logger is made (a run without the flags needs neither)."""
    import subprocess
    import sys

    code = ("import sys, together_train_cookbook.ml_log\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'tensorboardX', 'tensorboard', 'wandb', 'together_train_server'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", out.stdout
