"""Our JSONL data files: numbered records with errors naming the line, and a record's ``prompt``."""

from __future__ import annotations

import json
import os
from typing import Any


class DataError(ValueError):
    """A data file (``--data``, ``--eval-data``) that cannot be used; the message names the file, and the
    line or row where there is one. Recipes' ``cli()`` prints it as one line instead of a traceback."""


def read_jsonl(path: str | os.PathLike):
    """Yield ``(line_number, record)`` for each non-blank line of a JSONL file (1-based numbers).

    Raises:
        DataError: a line that is not JSON (``"<path>:<line>: not JSON (...)"``).
    """
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not JSON ({e})") from None


def prompt_messages(prompt: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A JSONL ``prompt``: a string is one user message; a message list is kept as is."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

