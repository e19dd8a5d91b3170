"""What an OpenAI-style completion request returns (`inference.InferenceService`): the choices, their tokens'
logprobs, the completion, and the stream of events a streamed request yields. Plain values; the service
that makes them is `inference.py`, the routes that render them wire/http/openai/ and anthropic/."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from together_train_server.service.sampling.cancellation import CallerGone


@dataclass
class SampledSequence:
    """One sequence as a replica returned it.

    Attributes:
        tokens: int token ids sampled (the stop token included when one ended it).
        stop_reason: "stop" | "length".
        logprobs: the sampler's float logprob of each token (temperature-scaled; [] when not given).
        versions: the policy version that sampled each token ([] when not given).
    """

    tokens: list[int]
    stop_reason: str  # "stop" | "length"
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)


@dataclass
class TokenLogprob:
    """A completion token with its logprob and the most likely alternatives at its position."""

    token_id: int
    token: str
    logprob: float | None  # None: the first token of an echoed prompt (nothing before it)
    top: list[tuple[int, str, float]]


@dataclass
class Choice:
    """One finished choice.

    Attributes:
        index: position in the response (prompt index * n + sample index).
        text: the completion text (stop string cut, special tokens not shown).
        tokens: every generated token id (usage counts these).
        finish_reason: "stop" (EOS or a stop string) | "length".
        logprobs: per generated token (those after the text, e.g. the stop token, included), when asked.
        token_ends: for each generated token, the length of `text` covered up to and including it.
        sampled: the replica's sequence (sampler logprobs and versions: what a rollout records).
    """

    index: int
    text: str
    tokens: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    token_ends: list[int]
    sampled: SampledSequence | None = None


@dataclass
class Completion:
    """A request's result: the choices and OpenAI's usage counts (``cached_tokens``: prompt tokens
    served from the replicas' prefix cache, OpenAI's ``usage.prompt_tokens_details.cached_tokens``)."""

    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class StreamEvent:
    """One piece of a streamed completion.

    Attributes:
        index: the choice (prompt index * n + sample index).
        delta: text to append to the choice's text ("" on the finishing event).
        logprob: the shown token's logprobs (requests with logprobs), else None.
        finish_reason: set on the choice's last event ("stop" | "length"), else None.
    """

    index: int
    delta: str
    logprob: TokenLogprob | None = None
    finish_reason: str | None = None


class CompletionStream:
    """A streamed completion: iterate for `StreamEvent`s; the counts are final once iteration ended.

    Attributes:
        prompt_tokens: tokens of every prompt.
        completion_tokens: generated tokens of every choice (grows while iterating).
        cached_tokens: prompt tokens served from the replicas' prefix cache (final once iterated).
        last_sampled_at: Unix seconds (the replica's clock) when the last token so far was
            sampled; 0 when the replica answered the request as a whole.
    """

    def __init__(self, events: Iterator[StreamEvent], prompt_tokens: int, gone: CallerGone | None = None) -> None:
        self._events = events
        self._gone = gone
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.last_sampled_at = 0.0
        self.choices: list[Choice] = []  # the finished choices, in the order they finished

    def __iter__(self) -> Iterator[StreamEvent]:
        return self._events

    def cancel(self) -> None:
        """The client went away: cancel the replica call in flight (the replica drops the request at its
        next decode step) and any later one; iterating raises `SampleCancelled` from then on. Thread-safe."""
        if self._gone is not None:
            self._gone.set()

    def close(self) -> None:
        """End iteration early (the client went away): the replica call, if any, is cancelled and its
        replica released now rather than when the generators are collected. Call it when no thread is
        iterating (a generator cannot be closed while it runs: that one is left to end by itself)."""
        self.cancel()
        close = getattr(self._events, "close", None)
        if close is not None:
            try:
                close()
            except ValueError:  # being iterated on another thread: `cancel` ends it there
                pass
