"""The tokenizer (and its chat-template codec) a recipe renders prompts with: the resource's own
(when connected), a local model or tokenizer directory, or the embedded model converted once by
the server package.

Imports transformers and the server package inside functions only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from together_train_cookbook.codec import Codec, get_codec


def model_dir(model: str | None) -> Path:
    """A local model (or tokenizer) directory: `model` if it is one, else the embedded model
    converted once by the server package (imported here, not at module level).

    Raises:
        ConfigError: `model` is not a local directory (or the embedded model is missing)."""
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
    from together_train_cookbook.cli import ConfigError

    try:
        return resolve_model_dir(model)
    except FileNotFoundError as e:  # a recipe's cli() prints ConfigError as one line
        raise ConfigError(f"--model: {e}") from None


def load_codec(model: str | None) -> Codec:
    """The chat-template codec of `model`'s tokenizer (see `model_dir`)."""
    from transformers import AutoTokenizer

    return get_codec(AutoTokenizer.from_pretrained(str(model_dir(model))))


def codec_for(cfg: Any, client: Any = None) -> Codec:
    """The codec a recipe renders with. Connected to a resource (`client`, or ``cfg.address``):
    the resource's own tokenizer (`ResourceClient.get_tokenizer`: fetched once and cached on
    disk; needs neither torch nor the model). Else `load_codec` of ``cfg.model``."""
    if client is None and getattr(cfg, "address", None):
        import together_train as tt

        with tt.ResourceClient(cfg.address, api_key=getattr(cfg, "api_key", None)) as c:
            return get_codec(c.get_tokenizer())
    if client is not None:
        return get_codec(client.get_tokenizer())
    return load_codec(cfg.model)
