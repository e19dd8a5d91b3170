"""Metrics JSONL writer and PNG plot helpers."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from together_train_cookbook.metrics import MetricsWriter, column, read_metrics, write_json
from together_train_cookbook.plotting import moving_average, plot_loss, plot_metrics


def test_writer_roundtrip(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsWriter(path) as w:
        w.log(step=0, loss=np.float32(1.5), lr=1e-3)
        w.log(step=1, loss=float("nan"), lr=1e-3, grad_norm=2)
        w.log(eval_accuracy=0.5)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"step": 0, "loss": 1.5, "lr": 1e-3}
    assert json.loads(lines[1])["loss"] is None  # NaN is not JSON
    recs = read_metrics(path)
    assert len(recs) == 3 and list(recs[0])[0] == "step"
    assert column(recs, "loss") == ([0], [1.5])
    with MetricsWriter(path, append=True) as w:
        w.log(step=2, loss=0.1)
    assert len(read_metrics(path)) == 4


def test_write_json(tmp_path):
    p = write_json(tmp_path / "s.json", {"acc": np.float64(0.25), "bad": math.inf})
    assert json.loads(p.read_text()) == {"acc": 0.25, "bad": None}


def test_moving_average():
    assert moving_average([1, 3, 5, 7], 2) == [1, 2, 4, 6]


def test_plots_are_pngs(tmp_path):
    recs = [{"step": i, "loss": 2.0 / (i + 1), "grad_norm": 10.0 - i} for i in range(30)]
    p = plot_loss(recs, tmp_path / "loss.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    jsonl = tmp_path / "m.jsonl"
    with MetricsWriter(jsonl) as w:
        for r in recs:
            w.log(**r)
    p2 = plot_metrics(jsonl, tmp_path / "sub" / "all.png", keys=("loss", "grad_norm", "absent"), log_y=True)
    assert p2.exists() and p2.stat().st_size > 1000
    with pytest.raises(ValueError, match="no record"):
        plot_metrics(recs, tmp_path / "x.png", keys=("nope",))
