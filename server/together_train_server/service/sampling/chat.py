"""The chat use case: one typed call, whatever API it came from.

OpenAI's chat completions (wire/http/openai/chat.py), OpenAI's Responses (openai/responses.py) and
Anthropic's Messages (wire/http/anthropic/messages.py) each parse their body into one `ChatCall`
(chat messages in OpenAI's shape, tools, sampling settings) and hand it to
`Chats.chat` (or its streaming twin `Chats.chat_stream`), which runs the steps every chat takes,
in this order, on the resource's `InferenceService`:

1. the tools, checked against the chat template (`chat_tools.check_tools`);
2. the constraint: a response format, forced tool calls (`structured.chat_constraint`);
3. the prompt: the messages through the model's chat template (`InferenceService.chat_prompt`);
4. sampling through the resource's `Sampling` road (`ops.Sampling.request`: limits, memory
   admission; then the replicas), exactly as the gRPC and Tinker APIs sample;
5. the record under ``/v1/rollouts/{id}`` (`InferenceService.record`);
6. each choice's reply parsed in the template's format (content, tool calls: `chat_tools.parse_reply`)
   and the stop string that ended it.

The route then renders the `ChatResult` (or the `ChatStream`'s events) in its API's shape. The model
is resolved once, before the body is read (`Chats.resolve`: an unknown model is NOT_FOUND whatever
the body holds), and travels in the call as a `ResolvedModel`. A new chat feature is a `ChatCall`
field, a line in each API's parser and a step here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable

from together_train_server.service.sampling import structured
from together_train_server.service.sampling.chat_tools import ParsedReply
from together_train_server.service.sampling.inference import Choice, CompletionStream, InferenceService, decode
from together_train_server.service.sampling.inference_params import InferenceParams

__all__ = ["ChatCall", "ChatResult", "ChatStream", "Chats", "ResolvedModel"]


@dataclass(frozen=True)
class ResolvedModel:
    """A request's ``model`` as the caller named it and the adapter key serving it ("" = the base model)."""

    name: str
    key: str


@dataclass(frozen=True)
class ChatCall:
    """One chat request, parsed from any API.

    Attributes:
        model: the resolved model (`Chats.resolve`).
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
        choices: the finished choices (text, tokens, logprobs, finish_reason).
        replies: per choice, its content and tool calls (`chat_tools.ParsedReply`).
        stop_sequences: per choice, the stop string that ended it (None: EOS, length, or a tool call).
        prompt_tokens, completion_tokens, cached_tokens: usage counts (`inference.Completion`).
    """

    prompt: list[int]
    tools: list[dict[str, Any]] | None
    choices: list[Choice]
    replies: list[ParsedReply]
    stop_sequences: list[str | None] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


class ChatStream:
    """A streamed chat (`Chats.chat_stream`): either text as it is sampled (`events`, then
    `finish`) or, for a reply with tools (parsed before anything is sent), the finished `result`.

    Attributes:
        prompt: the rendered prompt's token ids.
        events: the live `CompletionStream` (None when `result` is set).
        result: the finished chat (tools: sent once parsed), else None until `finish`.
    """

    def __init__(self, prompt: list[int], events: CompletionStream | None, result: ChatResult | None,
                 finish: Callable[[CompletionStream], ChatResult] | None) -> None:
        self.prompt, self.events, self.result = prompt, events, result
        self._finish = finish

    def finish(self) -> ChatResult:
        """Once `events` were iterated: record the call (rollouts) and parse the replies (once)."""
        if self.result is None:
            assert self.events is not None and self._finish is not None
            self.result = self._finish(self.events)
        return self.result


class Chats:
    """The chat use case (see the module docstring) on an `InferenceService`, whose sampler is the
    resource's `ops.Sampling` (limits and memory admission as for every API).

    Args:
        inference: the OpenAI-style service (tools, chat template, sampling, rollouts).
    """

    def __init__(self, inference: InferenceService) -> None:
        self.inference = inference

    def resolve(self, model: Any, owner: str = "") -> ResolvedModel:
        """`model` and the adapter key serving it for `owner` (`model_key`): the routes resolve it once,
        before they read the rest of the body.

        Raises:
            ServiceError: INVALID_ARGUMENT without a model, NOT_FOUND for one `owner` may not use.
        """
        return ResolvedModel(str(model), self.inference.model_key(model, owner))

    def _start(self, call: ChatCall) -> tuple[list[dict[str, Any]] | None, InferenceParams, list[int]]:
        """Steps 1-3 of a chat (module docstring): (checked tools, params with the constraint, prompt)."""
        tools = self.inference.tools(call.tools, call.tool_choice)
        constraint = structured.chat_constraint(call.response_format, tools, call.tool_choice,
                                                call.parallel_tool_calls, format_key=call.format_key)
        params = replace(call.params, sampling=replace(call.params.sampling, constraint=constraint))
        return tools, params, self.inference.chat_prompt(call.messages, tools, call.template_options)

    def _end(self, call: ChatCall, prompt: list[int], tools: list[dict[str, Any]] | None,
             choices: list[Choice], prompt_tokens: int, completion_tokens: int, cached: int) -> ChatResult:
        """Steps 5-6 of a chat (module docstring): record under the call's rollout, parse each reply."""
        if call.rollout is not None:
            self.inference.record(call.rollout, call.owner, call.model.name, [prompt], choices, call.params.n,
                                  call.messages)
        replies = [self.inference.reply(prompt, ch, tools, call.one_call) for ch in choices]
        stops = [None if rep.tool_calls else self._stop_string(ch, call.params.sampling.stop)
                 for ch, rep in zip(choices, replies)]
        return ChatResult(prompt, tools, choices, replies, stops, prompt_tokens, completion_tokens, cached)

    def chat(self, call: ChatCall) -> ChatResult:
        """Run a chat (module docstring): tools, constraint, prompt, sampling through the
        resource's `Sampling` road (limits, memory admission), record, parsed replies.

        Raises:
            ServiceError: INVALID_ARGUMENT naming the field; RESOURCE_EXHAUSTED over the memory budget;
                NOT_FOUND (another key's rollout); UNAVAILABLE when no replica answers.
        """
        tools, params, prompt = self._start(call)
        done = self.inference.complete(call.model.name, [prompt], params, call.owner, call.model.key)
        return self._end(call, prompt, tools, done.choices, done.prompt_tokens, done.completion_tokens,
                         done.cached_tokens)

    def chat_stream(self, call: ChatCall) -> ChatStream:
        """`chat`, streamed: the text as it is sampled (`ChatStream.events`, then `ChatStream.finish`
        records and parses), or, for a request with tools, the finished result (`ChatStream.result`:
        tool calls are parsed from the whole reply). Raises as `chat`."""
        tools, params, prompt = self._start(call)
        if tools:
            done = self.inference.complete(call.model.name, [prompt], params, call.owner, call.model.key)
            return ChatStream(prompt, None, self._end(call, prompt, tools, done.choices, done.prompt_tokens,
                                                      done.completion_tokens, done.cached_tokens), None)
        events = self.inference.stream(call.model.name, [prompt], params, call.owner, call.model.key)
        return ChatStream(prompt, events, None, lambda s: self._end(
            call, prompt, None, s.choices, s.prompt_tokens, s.completion_tokens, s.cached_tokens))

    def _stop_string(self, ch: Choice, stops: tuple[str, ...]) -> str | None:
        """The stop string that ended `ch` (None: EOS, length): the decoded tokens past the shown text."""
        if ch.finish_reason != "stop" or not stops:
            return None
        rest = decode(self.inference.tokenizer, ch.tokens, skip_special_tokens=True)[len(ch.text):]
        return next((s for s in stops if rest.startswith(s)), None)
