"""Rows of a dataset the user already has: our JSONL, or Hugging Face ``datasets`` on local disk.

    rows = load_rows("chats.jsonl")                 # one JSON object per line
    rows = load_rows("train.parquet")               # datasets.load_dataset("parquet", data_files=...)
    rows = load_rows("data.json")                   # datasets.load_dataset("json", data_files=...)
    rows = load_rows("saved/")                      # datasets.load_from_disk (a save_to_disk dir)
    rows = load_rows("saved/", split="test")        # one split of a saved DatasetDict

Never a hub download: a name that is not a local file or directory (``"org/name"``) is refused
with an error saying how to save it locally once. ``datasets`` is imported only for the
non-JSONL sources, so JSONL needs nothing beyond the standard library.

`iter_rows` yields each row with where it came from (``"chats.jsonl:7"``, ``"train.parquet row
3"``), for errors that name the row.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterator

from together_train_cookbook.jsonl import DataError, read_jsonl

__all__ = ["SUFFIXES", "check_local", "iter_rows", "load_rows"]

#: File suffixes read as files (a directory is read with ``datasets.load_from_disk``).
SUFFIXES = (".jsonl", ".json", ".parquet")


def check_local(path: str | os.PathLike) -> Path:
    """`path` as a local source `load_rows` can read: an existing file with a suffix in
    `SUFFIXES` or an existing directory.

    Raises:
        DataError: no such file or directory (with how to save a hub dataset locally), or an
            unsupported file suffix.
    """
    p = Path(path).expanduser()
    if p.is_dir():
        return p
    if p.is_file():
        if p.suffix.lower() not in SUFFIXES:
            raise DataError(f"{path}: unsupported file type {p.suffix!r}; expected one of "
                             f"{', '.join(SUFFIXES)} or a datasets.save_to_disk directory")
        return p
    raise DataError(
        f"{path}: no such file or directory (datasets are read from local disk only, never downloaded "
        f"from the hub; save one once with `datasets.load_dataset(NAME).save_to_disk(DIR)` and pass DIR)"
    )


def _hf_rows(p: Path, split: str | None) -> tuple[list[dict[str, Any]], str]:
    """Rows of a parquet / JSON file or a ``save_to_disk`` directory, and the split read."""
    import datasets  # the Hugging Face library; only for these sources

    if p.is_dir():
        try:
            ds = datasets.load_from_disk(str(p))
        except FileNotFoundError as e:
            raise DataError(f"{p}: not a datasets.save_to_disk directory ({e})") from None
        if isinstance(ds, datasets.DatasetDict):
            names = list(ds)
            if split is None:
                split = names[0] if len(names) == 1 else "train" if "train" in ds else None
                if split is None:
                    raise DataError(f"{p}: a DatasetDict with splits {names}; pass split=")
            if split not in ds:
                raise DataError(f"{p}: no split {split!r} (splits: {names})")
            ds = ds[split]
        elif split is not None:
            raise DataError(f"{p}: a single Dataset, no splits; got split={split!r}")
    else:
        builder = "parquet" if p.suffix.lower() == ".parquet" else "json"
        ds = datasets.load_dataset(builder, data_files=str(p), split=split or "train")
    return ds.to_list(), split or "train"


def iter_rows(path: str | os.PathLike, split: str | None = None) -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``(where, row)`` for each row of `path` (see `load_rows`); `where` names the row
    for error messages: ``"<path>:<line>"`` for JSONL, ``"<path> row <i>"`` (0-based) otherwise.

    Raises:
        DataError: as `load_rows`.
    """
    p = check_local(path)
    if p.is_file() and p.suffix.lower() == ".jsonl":
        if split not in (None, "train"):
            raise DataError(f"{path}: a JSONL file has no split {split!r}")
        for lineno, rec in read_jsonl(p):
            if not isinstance(rec, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            yield f"{path}:{lineno}", rec
        return
    rows, _ = _hf_rows(p, split)
    for i, rec in enumerate(rows):
        yield f"{path} row {i}", rec


def load_rows(path: str | os.PathLike, split: str | None = None) -> list[dict[str, Any]]:
    """Every row of a local dataset as a dict (column name -> value), in file order.

    Args:
        path: a ``.jsonl`` file (one JSON object per line, blank lines skipped), a ``.json`` or
            ``.parquet`` file (``datasets.load_dataset("json" | "parquet", data_files=path)``),
            or a directory written by ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``
            (``datasets.load_from_disk``).
        split: for a saved ``DatasetDict``, the split to read (default: its only split, else
            ``"train"``); for a file, a ``datasets`` split expression such as ``"train[:100]"``
            (JSONL: only None / ``"train"``).

    Returns:
        list of row dicts (nested lists such as chat ``messages`` come back as lists of dicts).

    Raises:
        ValueError: `path` is not a local file or directory (a hub name is never downloaded),
            an unsupported suffix, a JSONL line that is not a JSON object (naming the line), or
            a missing split.
    """
    return [row for _, row in iter_rows(path, split)]
