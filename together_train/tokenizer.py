"""The resource's tokenizer on the client: fetched once (``GetTokenizer``), cached on disk, loaded with transformers.

A script against a remote resource needs neither the model weights nor torch
to tokenize: `ResourceClient.get_tokenizer` returns a ``transformers``
tokenizer built from the base model's own tokenizer files (tokenizer.json,
tokenizer_config.json, special tokens, chat template, ...). transformers'
tokenizers load without torch; install it with ``pip install
'together-train[tokenizer]'`` (or ``pip install transformers``).

Cache layout: ``<cache>/tokenizers/<model id>/<sha256>/`` where ``<cache>`` is
``$TOGETHER_TRAIN_CACHE`` or ``~/.cache/together-train`` (`together_train.cache`) and ``<sha256>`` the
files' content hash, which `Capabilities.tokenizer_sha256` announces: a
client that finds that folder loads it without calling ``GetTokenizer``.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import shutil
import tempfile
from typing import TYPE_CHECKING, Any

from together_train._proto import resource_pb2
from together_train.cache import cache_root
from together_train.errors import FailedPreconditionError, InternalError

if TYPE_CHECKING:
    from together_train._client_handle import ClientHandle

__all__ = ["cache_root", "cached_tokenizer_dir", "fetch_tokenizer_dir", "load_tokenizer", "content_sha256"]

_COMPLETE = ".complete"  # written last: a folder without it is a partial copy and is ignored
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def content_sha256(files: list[tuple[str, bytes]]) -> str:
    """sha256 hex over the files in name order, each as ``name NUL len(data) NUL data``
    (the hash the resource announces; see resource.proto GetTokenizerResponse)."""
    h = hashlib.sha256()
    for name, data in sorted(files):
        h.update(name.encode() + b"\0" + str(len(data)).encode() + b"\0")
        h.update(data)
    return h.hexdigest()


def cached_tokenizer_dir(model_id: str, sha256: str) -> pathlib.Path:
    """Where the tokenizer of `model_id` with content hash `sha256` is cached (it may not exist yet)."""
    return cache_root() / "tokenizers" / (_SAFE.sub("_", model_id).strip("._") or "model") / sha256


def fetch_tokenizer_dir(client: "ClientHandle") -> pathlib.Path:
    """A local folder holding the resource's tokenizer files: the cached copy when the
    capabilities announce a hash already cached (no ``GetTokenizer`` call), else fetched and cached.

    Raises:
        NotFoundError: the resource's model directory has no tokenizer files.
        InternalError: the files received do not match their announced hash, or a file name
            is not a plain name.
    """
    caps = client.get_capabilities()
    if caps.tokenizer_sha256:
        cached = cached_tokenizer_dir(caps.model_id, caps.tokenizer_sha256)
        if (cached / _COMPLETE).is_file():
            return cached
    msg = client._call(client._resource.GetTokenizer, resource_pb2.GetTokenizerRequest(), what="GetTokenizer")
    files = [(f.name, bytes(f.data)) for f in msg.files]
    for name, _ in files:
        if not name or name != pathlib.PurePath(name).name or name in (".", ".."):
            raise InternalError(f"GetTokenizer sent a file named {name!r}: not a plain file name")
    got = content_sha256(files)
    if got != msg.sha256:
        raise InternalError(f"GetTokenizer files hash to {got}, the resource announced {msg.sha256}")
    dest = cached_tokenizer_dir(msg.model_id, got)
    if (dest / _COMPLETE).is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".partial-", dir=dest.parent))
    try:
        for name, data in files:
            (tmp / name).write_bytes(data)
        (tmp / _COMPLETE).write_text(got + "\n")
        if dest.exists():  # a partial folder left by a killed writer (no marker): replace it
            shutil.rmtree(dest, ignore_errors=True)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / _COMPLETE).is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def load_tokenizer(folder: str | os.PathLike) -> Any:
    """``transformers.AutoTokenizer`` from a local folder of tokenizer files (no hub access, no torch).

    Raises:
        FailedPreconditionError: transformers is not installed.
    """
    try:
        from transformers import AutoTokenizer  # lazy: the SDK itself does not need transformers
    except ImportError as err:
        raise FailedPreconditionError(
            f"get_tokenizer needs transformers (pip install 'together-train[tokenizer]'): {err}", key="transformers"
        ) from None
    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
