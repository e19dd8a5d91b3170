"""`InferenceParams`: an OpenAI-style request's settings, as `InferenceService` takes them."""

from __future__ import annotations

from dataclasses import dataclass

from together_train_server.engines.types import SamplingParams


@dataclass(frozen=True)
class InferenceParams:
    """A completions / chat completions request's settings (the OpenAI parser, wire/http/openai/params.py,
    builds them).

    Attributes:
        sampling: the one `SamplingParams`; its max_tokens is capped per prompt to what the context
            leaves (`InferenceService`), and may be 0 with ``echo`` (the prompt is only scored).
        n: choices per prompt.
        logprobs: report per-token logprobs.
        top_logprobs: alternatives per position (0..20 chat, 0..5 completions).
        stream: answer as server-sent events.
        include_usage: (stream) a last chunk with the usage counts.
        echo: (completions) the prompt's tokens come first in each choice (with their logprobs).
    """

    sampling: SamplingParams
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
