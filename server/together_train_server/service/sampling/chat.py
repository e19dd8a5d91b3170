"""The chat use case: one typed call, whatever API it came from.

OpenAI's chat completions (wire/http/openai/chat.py), OpenAI's Responses (openai/responses.py) and
Anthropic's Messages (wire/http/anthropic/messages.py) each parse their body into one `ChatCall`
(chat messages in OpenAI's shape, tools, sampling settings) and hand it to
`InferenceService.chat` (or its streaming twin `InferenceService.chat_stream`), which runs the
steps every chat takes, in this order:

1. the tools, checked against the chat template (`chat_tools.check_tools`);
2. the constraint: a response format, forced tool calls (`structured.chat_constraint`);
3. the prompt: the messages through the model's chat template (`InferenceService.chat_prompt`);
4. sampling through the resource's `Sampling` road (`ops.Sampling.request`: limits, memory
   admission; then the replicas), exactly as the gRPC and Tinker APIs sample;
5. the record under ``/v1/rollouts/{id}`` (`InferenceService.record`);
6. each choice's reply parsed in the template's format (content, tool calls: `chat_tools.parse_reply`)
   and the stop string that ended it.

The route then renders the `ChatResult` (or the `ChatStream`'s events) in its API's shape. The model
is resolved once, before the body is read (`InferenceService.resolve`: an unknown model is NOT_FOUND
whatever the body holds), and travels in the call as a `ResolvedModel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from together_train_server.service.sampling.chat_tools import ParsedReply
from together_train_server.service.sampling.inference_params import InferenceParams

__all__ = ["ChatCall", "ChatResult", "ResolvedModel"]


@dataclass(frozen=True)
class ResolvedModel:
    """A request's ``model`` as the caller named it and the adapter key serving it ("" = the base model)."""

    name: str
    key: str


@dataclass(frozen=True)
class ChatCall:
    """One chat request, parsed from any API.

    Attributes:
        model: the resolved model (`InferenceService.resolve`).
        owner: the caller's owner tag (API key tag; "" without keys).
        messages: chat messages in OpenAI's shape (``{"role", "content"}``, an assistant's ``tool_calls``,
            a tool message's ``tool_call_id``), as rendered (an API's system text first) and as recorded.
        params: the request's settings (no constraint yet: step 2 sets it).
        tools: OpenAI function tools (``{"type": "function", "function": {...}}``), None = none.
        tool_choice: OpenAI's ``tool_choice`` ("auto", "none", "required", a named function) or None.
        parallel_tool_calls: OpenAI's field (None = true); False keeps the first tool call only.
        response_format: OpenAI's ``response_format`` / the Responses API's ``text.format`` (None = text).
        format_key: the field `response_format` came from, named by its errors.
        template_options: more ``apply_chat_template`` keyword arguments (vLLM's extras), None = none.
        rollout: the rollout id the call is recorded under (already checked writable), None = not recorded.
    """

    model: ResolvedModel
    owner: str
    messages: list[dict[str, Any]]
    params: InferenceParams
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None
    format_key: str = "response_format"
    template_options: dict[str, Any] | None = None
    rollout: str | None = None

    @property
    def one_call(self) -> bool:
        """``parallel_tool_calls: false``: a reply keeps its first tool call only."""
        return self.parallel_tool_calls is False


@dataclass
class ChatResult:
    """A finished chat: what every API renders.

    Attributes:
        prompt: the rendered prompt's token ids.
        tools: the tools rendered (checked; None = none, or ``tool_choice: "none"``).
        choices: the finished choices (`inference.Choice`: text, tokens, logprobs, finish_reason).
        replies: per choice, its content and tool calls (`chat_tools.ParsedReply`).
        stop_sequences: per choice, the stop string that ended it (None: EOS, length, or a tool call).
        prompt_tokens, completion_tokens, cached_tokens: usage counts (`inference.Completion`).
    """

    prompt: list[int]
    tools: list[dict[str, Any]] | None
    choices: list[Any]
    replies: list[ParsedReply]
    stop_sequences: list[str | None] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
