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


@pytest.fixture()
def saved_figures(monkeypatch):
    """Every matplotlib Figure saved during the test (the plot helpers close them after saving)."""
    from matplotlib.figure import Figure

    figs = []
    save = Figure.savefig

    def spy(self, *args, **kwargs):
        figs.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", spy)
    return figs


def _line_pixels(png, line, tol=0.08):
    """Boolean [H, W] mask of the PNG's pixels within `tol` of `line`'s colour as drawn on white (its alpha blended)."""
    import matplotlib.image as mpimg
    from matplotlib.colors import to_rgb

    alpha = line.get_alpha() if line.get_alpha() is not None else 1.0
    rgb = alpha * np.asarray(to_rgb(line.get_color())) + (1 - alpha) * 1.0
    img = mpimg.imread(png)[..., :3]
    return (np.abs(img - rgb) < tol).all(-1)


def test_plots_are_pngs(tmp_path, saved_figures):
    recs = [{"step": i, "loss": 2.0 / (i + 1), "grad_norm": 10.0 - i} for i in range(30)]
    p = plot_loss(recs, tmp_path / "loss.png")
    assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = saved_figures
    ax, ax_gn = fig.axes  # the loss, then the gradient norm (on every plot) on the same steps
    assert ax.get_shared_x_axes().joined(ax, ax_gn) and ax_gn.get_ylabel() == "grad_norm"
    raw, smooth = ax.get_lines()  # 30 records >= 20: the raw curve and its 5-step mean
    np.testing.assert_array_equal(raw.get_xdata(), range(30))
    np.testing.assert_allclose(raw.get_ydata(), [2.0 / (i + 1) for i in range(30)])
    np.testing.assert_allclose(smooth.get_ydata(), moving_average([2.0 / (i + 1) for i in range(30)], 5))
    assert raw.get_alpha() < 1 and smooth.get_alpha() is None  # raw faint, its mean on top
    assert ax.get_title() == "training loss per token" and ax_gn.get_xlabel() == "step"
    # The decoded PNG shows both curves: pixels of each line's colour, inside the axes box, spread over its width.
    h, w = fig.canvas.get_width_height()[::-1]
    x0, y0, x1, y1 = ax.get_window_extent().extents  # display pixels, origin bottom-left
    for line in (raw, smooth):
        mask = _line_pixels(p, line)
        assert mask.shape == (h, w)
        ys, xs = np.nonzero(mask)
        inside = (xs >= x0) & (xs <= x1) & (h - ys >= y0) & (h - ys <= y1)
        assert inside.sum() > 50, line.get_label()
        assert np.ptp(xs[inside]) > 0.8 * (x1 - x0), line.get_label()  # drawn across the panel
    # The loss falls: the raw line's pixels start high on the left and end low on the right.
    ys, xs = np.nonzero(_line_pixels(p, raw))
    left, right = ys[xs < np.percentile(xs, 10)], ys[xs > np.percentile(xs, 90)]
    assert left.mean() < right.mean()  # image rows grow downwards

    jsonl = tmp_path / "m.jsonl"
    with MetricsWriter(jsonl) as w:
        for r in recs:
            w.log(**r)
    p2 = plot_metrics(jsonl, tmp_path / "sub" / "all.png", keys=("loss", "grad_norm", "absent"), log_y=True)
    assert p2.exists()
    fig2 = saved_figures[1]
    assert [a.get_ylabel() for a in fig2.axes] == ["loss", "grad_norm"]  # "absent" has no panel
    for a, key, scale in zip(fig2.axes, ("loss", "grad_norm"), ("log", "linear")):
        line, *mean = a.get_lines()  # raw and its moving average; grad_norm here is integer-valued: raw only
        np.testing.assert_allclose(line.get_ydata(), [r[key] for r in recs])
        if key == "loss":
            np.testing.assert_allclose(mean[0].get_ydata(), moving_average([r[key] for r in recs], 5))
        else:
            assert mean == []
        assert a.get_yscale() == scale  # grad_norm goes below 0: no log axis for it
    assert _line_pixels(p2, fig2.axes[1].get_lines()[0]).sum() > 50
    with pytest.raises(ValueError, match="no record"):
        plot_metrics(recs, tmp_path / "x.png", keys=("nope",))


def test_plot_start_evaluation_at_step_zero_on_integer_shared_steps(tmp_path, saved_figures):
    """A run of 6 steps with the start evaluation (logged as step -1) and one after steps 2 and 5
    (logged with steps 2 and 5): the accuracy curve is drawn at 0, 3, 6 (steps completed), the loss
    at 0..5, on one x axis with integer ticks only."""
    recs = [{"step": -1, "accuracy": 0.1}]
    for k in range(6):
        recs.append({"step": k, "loss": 3.0 - 0.4 * k, "grad_norm": 1.0 + k, **({"accuracy": 0.1 + 0.1 * k} if k in (2, 5) else {})})
    plot_metrics(recs, tmp_path / "run.png", keys=("accuracy",))
    (fig,) = saved_figures
    axes = fig.axes
    assert [a.get_ylabel() for a in axes] == ["accuracy (eval)", "loss", "grad_norm"]
    (acc,) = axes[0].get_lines()  # 3 points: not smoothed
    np.testing.assert_array_equal(acc.get_xdata(), [0, 3, 6])
    np.testing.assert_allclose(acc.get_ydata(), [0.1, 0.3, 0.6])
    np.testing.assert_array_equal(axes[1].get_lines()[0].get_xdata(), range(6))
    assert all(axes[0].get_shared_x_axes().joined(axes[0], a) for a in axes[1:])
    assert [a.get_xlabel() for a in axes] == ["", "", "step"]
    ticks = axes[-1].get_xticks()
    assert len(ticks) >= 3 and all(float(t).is_integer() for t in ticks), ticks
    assert axes[-1].get_xlim()[0] <= 0 <= 6 <= axes[-1].get_xlim()[1]

    # plot_loss takes the evaluation keys from the start evaluation's record
    plot_loss(recs, tmp_path / "loss.png")
    assert [a.get_ylabel() for a in saved_figures[1].axes] == ["loss", "accuracy (eval)", "grad_norm"]
