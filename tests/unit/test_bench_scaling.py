"""benchmarks/scaling.py: power-law exponents, the super-linear flags and the PNG (no server: synthetic numbers)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import scaling


def _raw(step_exp: float = 1.0) -> dict:
    tokens = [128, 512, 2048]
    return {"model": "synthetic", "threads": 2, "quick": True, "load_before": 0.1, "load_after": 0.2,
            "seconds_total": 1.0, "tokens": tokens, "step_s": [1e-3 * t**step_exp for t in tokens],
            "plain_step_s": [1e-3 * t for t in tokens], "sessions": [1, 2, 4, 8], "train_tok_s": [100.0] * 4,
            "plain_train_tok_s": 90.0, "concurrency": [1, 4, 16, 64], "sample_tok_s": [10.0, 30.0, 80.0, 150.0],
            "batched_generate_tok_s": [9.0, 25.0, 60.0, 100.0], "sample_tok_s_2_replicas": 160.0,
            "sync_bytes": [10**5, 10**6, 10**7], "sync_ms": [2.0, 20.0, 200.0], "raw_stream_ms": [1.0, 10.0, 100.0],
            "rss_idle": 0, "rss": [2**20 * (100 + 5 * k) for k in range(8)], "trainable_params": 2**20 // 16 * 5}


def test_fit_exponent_recovers_a_power_law():
    xs = [1, 2, 4, 8, 16]
    assert scaling.fit_exponent(xs, [3.0 * x**1.5 for x in xs]) == pytest.approx(1.5, abs=1e-9)


def test_linear_costs_are_not_flagged_and_super_linear_ones_are():
    c = scaling.make_curves(_raw(1.0))
    assert c["step"]["exponent"] == pytest.approx(1.0, abs=1e-9) and not c["step"]["superlinear"]
    assert c["sync"]["exponent"] == pytest.approx(1.0, abs=1e-9) and not c["sync"]["superlinear"]
    assert c["rss"]["exponent"] == pytest.approx(1.0, abs=1e-9)  # 5 MiB per added session = the state
    assert c["rss"]["reference"] == pytest.approx(c["rss"]["y"])
    assert not c["train_sessions"]["superlinear"]
    assert scaling.make_curves(_raw(1.3))["step"]["superlinear"]


def test_falling_throughput_is_flagged():
    raw = _raw()
    raw["train_tok_s"] = [100.0, 70.0, 50.0, 35.0]
    assert scaling.make_curves(raw)["train_sessions"]["superlinear"]


def test_report_writes_png_and_lines(tmp_path, capsys):
    png = tmp_path / "s.png"
    scaling.report(_raw(), png)
    out = capsys.readouterr().out
    assert png.stat().st_size > 10_000
    for key in ("exp_step_vs_tokens=1.00", "exp_sync_vs_bytes=1.00", "exp_sample_vs_concurrency=",
                "exp_train_throughput_vs_sessions=0.00", "exp_rss_vs_added_sessions=1.00"):
        assert key in out, out
    assert "superlinear_" not in out, out
