"""PNG plots of recipe metrics (matplotlib, Agg backend: no display needed).

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


def plot_metrics(
    records: Sequence[dict[str, Any]] | str | os.PathLike,
    path: str | os.PathLike,
    keys: Sequence[str] = ("loss",),
    title: str | None = None,
    smooth: int | None = None,
    log_y: bool = False,
    ylabels: dict[str, str] | None = None,
) -> Path:
    """Plot one panel per key against "step" and save a PNG.

    Args:
        records: metric dicts (as written by `MetricsWriter`) or a JSONL path.
        path: output PNG file (parent folders are created).
        keys: metric names; keys absent from every record are skipped.
        smooth: if > 1, also draw a trailing moving average over that many steps.
        log_y: logarithmic y axis (skipped for a panel with values <= 0).
        ylabels: optional axis label per key.

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
    series = [(k, *column(records, k)) for k in keys]
    series = [(k, xs, ys) for k, xs, ys in series if ys]
    if not series:
        raise ValueError(f"no record has any of the keys {list(keys)}")
    fig, axes = plt.subplots(len(series), 1, figsize=(7, 3.2 * len(series)), squeeze=False)
    for ax, (k, xs, ys) in zip(axes[:, 0], series):
        ax.plot(xs, ys, marker="." if len(xs) <= 60 else None, lw=1, alpha=0.6 if smooth else 1.0, label=k)
        if smooth and smooth > 1 and len(ys) > smooth:
            ax.plot(xs, moving_average(ys, smooth), lw=2, label=f"{k} (mean of {smooth})")
            ax.legend()
        if log_y and all(y > 0 and math.isfinite(y) for y in ys):
            ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel((ylabels or {}).get(k, k))
        ax.grid(True, alpha=0.3)
    if title:
        axes[0, 0].set_title(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_loss(
    records: Sequence[dict[str, Any]] | str | os.PathLike,
    path: str | os.PathLike,
    key: str = "loss",
    title: str = "training loss per token",
) -> Path:
    """The loss curve of a run as a PNG (see `plot_metrics`)."""
    recs = read_metrics(records) if isinstance(records, (str, os.PathLike)) else records
    smooth = 5 if len(recs) >= 20 else None
    return plot_metrics(recs, path, keys=(key,), title=title, smooth=smooth)
