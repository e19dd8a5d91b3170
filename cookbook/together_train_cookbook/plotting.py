"""PNG plots of recipe metrics (matplotlib, Agg backend: no display needed): panels stacked on one
step axis, the start evaluation at step 0, noisy curves drawn faint with their moving average,
the loss and the gradient norm on every plot.

matplotlib is imported inside the functions, so importing the cookbook stays
cheap and works where matplotlib is not installed.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Sequence

from together_train_cookbook.metrics import column, read_metrics


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` values (shorter at the start)."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def evaluation_keys(records: Sequence[dict[str, Any]]) -> set[str]:
    """The keys of the start evaluation's record (``step`` -1): the evaluation metrics of a run."""
    return {k for r in records if r.get("step") == -1 for k in r if k != "step"}


def _series(records: Sequence[dict[str, Any]], key: str, is_eval: bool) -> tuple[list[float], list[float]]:
    """(x, y) of `key`, x = optimizer steps completed when the value was measured: a training
    metric of step k at k (measured during step k, on the weights after k updates); an evaluation
    logged with step k (run after step k's update) at k + 1, so the start evaluation (step -1) is
    at 0."""
    xs, ys = column(records, key)
    if is_eval:
        xs = [x + 1 for x in xs]
    return xs, ys


def auto_smooth_window(n: int) -> int | None:
    """The moving-average window of a curve of `n` points: 5 from 20 points on, growing to n / 20
    for long runs (a 1000-step curve is averaged over 50 steps); None (no smoothing) below 20."""
    return max(5, n // 20) if n >= 20 else None


def plot_metrics(
    records: Sequence[dict[str, Any]] | str | os.PathLike,
    path: str | os.PathLike,
    keys: Sequence[str] = ("loss",),
    title: str | None = None,
    smooth: int | None = None,
    log_y: bool = False,
    ylabels: dict[str, str] | None = None,
    always: Sequence[str] = ("loss", "grad_norm"),
    eval_keys: Sequence[str] | None = None,
) -> Path:
    """One panel per key, stacked on a shared x axis (optimizer steps, integer ticks), saved as a PNG.

    x = optimizer steps completed when the value was measured: a training metric logged with step k
    is drawn at k, an evaluation logged with step k (it runs after step k's update) at k + 1, and
    the start evaluation (logged as step -1) at 0, so an evaluation curve starts where training does.
    A curve of 20 points or more is drawn raw (faint) with its trailing moving average on top
    (unless every value is an integer: counts, staleness).

    Args:
        records: metric dicts (as written by `MetricsWriter`) or a JSONL path.
        path: output PNG file (parent folders are created).
        keys: metric names; keys absent from every record are skipped.
        smooth: the moving-average window; None: `auto_smooth_window` per curve; 0 or 1: none.
        log_y: logarithmic y axis (skipped for a panel with values <= 0).
        ylabels: optional axis label per key.
        always: keys added after `keys` when the records have them (the loss and the gradient
            norm: the health of the optimization, on every plot).
        eval_keys: the evaluation metrics (drawn one step later, see above); None: the keys of
            the start evaluation's record (`evaluation_keys`).

    Returns:
        The PNG path.

    Raises:
        ValueError: no record has any of `keys`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if isinstance(records, (str, os.PathLike)):
        records = read_metrics(records)
    evals = set(evaluation_keys(records) if eval_keys is None else eval_keys)
    wanted = list(dict.fromkeys([*keys, *always]))
    series = [(k, *_series(records, k, k in evals)) for k in wanted]
    series = [(k, xs, ys) for k, xs, ys in series if ys]
    if not any(k in keys for k, _, _ in series):
        raise ValueError(f"no record has any of the keys {list(keys)}")
    fig, axes = plt.subplots(len(series), 1, figsize=(7, 0.6 + 2.4 * len(series)), sharex=True, squeeze=False)
    for ax, (k, xs, ys) in zip(axes[:, 0], series):
        _draw_panel(ax, k, xs, ys, smooth, log_y, (ylabels or {}).get(k, k) + (" (eval)" if k in evals else ""))
    axes[-1, 0].set_xlabel("step")
    if title:
        axes[0, 0].set_title(title)
    return _save(fig, Path(path))


def _save(fig: Any, out: Path) -> Path:
    """Lay out ``fig``, write it as a PNG at ``out`` (parent folders created) and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _draw_panel(ax: Any, key: str, xs: Sequence[float], ys: Sequence[float], smooth: int | None, log_y: bool,
                ylabel: str) -> None:
    """One metric's panel: the raw curve, its moving average on top when smoothed (see `plot_metrics`)."""
    from matplotlib.ticker import MaxNLocator

    window = auto_smooth_window(len(ys)) if smooth is None else smooth
    if smooth is None and all(float(y).is_integer() for y in ys):
        window = None  # counts, staleness, versions: a mean of them reads as a value never taken
    smoothed = bool(window and window > 1 and len(ys) > window)
    ax.plot(xs, ys, marker="." if len(xs) <= 60 else None, lw=1, alpha=0.35 if smoothed else 1.0, label=key)
    if smoothed:
        ax.plot(xs, moving_average(ys, window), lw=2, color=ax.get_lines()[0].get_color(),
                label=f"{key} (mean of {window})")
        ax.legend(loc="best", fontsize="small")
    if log_y and all(y > 0 and math.isfinite(y) for y in ys):
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def plot_loss(
    records: Sequence[dict[str, Any]] | str | os.PathLike,
    path: str | os.PathLike,
    key: str = "loss",
    title: str = "training loss per token",
) -> Path:
    """The loss curve of a run as a PNG, with the gradient norm and the run's evaluation metrics
    (the keys of its start evaluation) below it on the same steps (see `plot_metrics`)."""
    recs = read_metrics(records) if isinstance(records, (str, os.PathLike)) else records
    return plot_metrics(recs, path, keys=(key, *sorted(evaluation_keys(recs))), title=title)
