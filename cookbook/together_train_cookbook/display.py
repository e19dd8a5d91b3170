"""What a recipe prints while it runs: a progress bar and numbers that may be missing."""

from __future__ import annotations


def progress(total: int, desc: str = "train", initial: int = 0):
    """A tqdm bar (None when tqdm is not installed)."""
    try:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=initial, desc=desc, unit="step", dynamic_ncols=True)
    except ImportError:  # tqdm is optional
        return None


def fmt_or_dash(x: float | None, spec: str) -> str:
    """`x` formatted with `spec`, or "-" when there is no value (e.g. no step ran)."""
    return "-" if x is None else format(x, spec)

