"""Metrics logging for recipes: one JSON object per line (JSONL).

Each `MetricsWriter.log(step=..., **values)` appends one line such as
``{"step": 3, "loss": 0.42, "lr": 0.001, "grad_norm": 12.5, "seconds": 2.1}``
and flushes, so a crashed run keeps every finished step and `tail -f` works.
`read_metrics(path)` reads the file back as a list of dicts.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterable


def _jsonable(value: Any) -> Any:
    """numpy scalars -> Python; NaN/inf -> None (JSON has no NaN)."""
    if hasattr(value, "item") and callable(value.item) and getattr(value, "ndim", 0) == 0:
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


class MetricsWriter:
    """Append-only JSONL metrics file. Use as a context manager or call `close`.

    Args:
        path: file to write; parent folders are created. An existing file is
            truncated unless `append=True`.
    """

    def __init__(self, path: str | os.PathLike, append: bool = False) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a" if append else "w", encoding="utf-8")
        self.records: list[dict[str, Any]] = []

    def log(self, step: int | None = None, **values: Any) -> dict[str, Any]:
        """Write one record (`step` first when given) and return it."""
        record: dict[str, Any] = {} if step is None else {"step": int(step)}
        record.update({k: _jsonable(v) for k, v in values.items()})
        self._f.write(json.dumps(record, default=str) + "\n")
        self._f.flush()
        self.records.append(record)
        return record

    def close(self) -> None:
        if not self._f.closed:
            self._f.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of a JSONL metrics file (blank lines skipped)."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    """Write `obj` as indented JSON (e.g. a run summary); returns the path."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(_jsonable(obj), indent=2, default=str) + "\n", encoding="utf-8")
    return p


def column(records: Iterable[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of `key` over the records that have both a step and a non-null value."""
    xs, ys = [], []
    for i, r in enumerate(records):
        v = r.get(key)
        if v is None:
            continue
        xs.append(r.get("step", i))
        ys.append(float(v))
    return xs, ys
