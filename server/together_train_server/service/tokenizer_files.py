"""The base model's tokenizer files, read from its model directory (served by GetTokenizer).

A client rebuilds the tokenizer from these files alone (``transformers.AutoTokenizer``
on a folder holding them), so it needs neither the model weights nor torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from together_train_server.service.errors import ServiceError

__all__ = ["TOKENIZER_FILE_NAMES", "TokenizerFiles", "read_tokenizer_files", "content_sha256"]

#: Files of a Hugging Face model directory that define its tokenizer and chat template
#: (config.json: AutoTokenizer reads the model type from it when tokenizer_config.json names no class).
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "config.json",
)


@dataclass(frozen=True)
class TokenizerFiles:
    """A model's tokenizer files.

    Attributes:
        model_id: the resource's model id (what capabilities report).
        sha256: `content_sha256` of `files` ("" when there are none).
        files: (file name, bytes), in name order.
    """

    model_id: str
    sha256: str
    files: tuple[tuple[str, bytes], ...]


def content_sha256(files: tuple[tuple[str, bytes], ...] | list[tuple[str, bytes]]) -> str:
    """sha256 hex over the files in name order, each as ``name NUL len(data) NUL data``
    (the SDK computes the same to check what it received)."""
    h = hashlib.sha256()
    for name, data in sorted(files):
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def read_tokenizer_files(model_dir: str | Path | None, model_id: str) -> TokenizerFiles:
    """Read the tokenizer files present in `model_dir` (those of `TOKENIZER_FILE_NAMES`).

    Raises:
        ServiceError: NOT_FOUND when `model_dir` is None or holds none of them.
    """
    if model_dir is None:
        raise ServiceError("NOT_FOUND", "this resource's trainer has no model directory to read a tokenizer from")
    folder = Path(model_dir)
    files = tuple((name, (folder / name).read_bytes()) for name in sorted(TOKENIZER_FILE_NAMES) if (folder / name).is_file())
    if not any(name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json") for name, _ in files):
        raise ServiceError("NOT_FOUND", f"the model directory {folder} holds no tokenizer files "
                                        f"(looked for {', '.join(TOKENIZER_FILE_NAMES[:4])}, ...)")
    return TokenizerFiles(model_id=model_id, sha256=content_sha256(files), files=files)
