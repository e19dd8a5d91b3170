"""The chat template the server renders chats with: the model's own, the embedded model's with tools, or an operator's.

The embedded SmolLM2-135M-Instruct GGUF ships a plain ChatML template that never reads
``tools``, so a request with tools would be refused (`chat_tools.check_tools`). The server
serves it (and any model whose template is exactly that one, such as the tiny test models
built on its tokenizer) with ``templates/chatml_tools.jinja``: the same text when no tools
are given, and Qwen2.5's Hermes-style tool rendering when they are (``<tools>`` in the
system turn, ``<tool_call>`` blocks, ``<tool_response>`` turns), the format `chat_tools`
parses and `structured` forces. ``serve --chat-template FILE`` (and ``deploy``) replaces any
model's template with FILE's text.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["TOOLS_TEMPLATE", "install", "serving_template"]

TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "chatml_tools.jinja"


def serving_template(current: str | None, file: str | Path | None = None) -> str | None:
    """The template to serve: FILE's text, else the tools template for the embedded model's own, else `current`.

    Raises:
        ValueError: FILE cannot be read or is empty.
    """
    if file is not None:
        try:
            text = Path(file).read_text()
        except OSError as e:
            raise ValueError(f"--chat-template {file}: {e.strerror or e}") from None
        if not text.strip():
            raise ValueError(f"--chat-template {file}: the file is empty")
        return text
    tools = TOOLS_TEMPLATE.read_text()
    if isinstance(current, str) and current and "tools" not in current and tools.endswith(current + "{%- endif %}\n"):
        return tools  # the embedded model's plain ChatML: the same text, plus tools
    return current


def install(tokenizer: PreTrainedTokenizerBase, file: str | Path | None = None) -> None:
    """Set ``tokenizer.chat_template`` to `serving_template` (see the module docstring). Raises as it."""
    template = serving_template(getattr(tokenizer, "chat_template", None), file)
    if template is not None:
        tokenizer.chat_template = template
