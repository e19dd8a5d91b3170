"""OpenAI-style inference over the generator replicas: models, prompts, sampling settings, results.

The service behind ``/v1/models``, ``/v1/completions`` and
``/v1/chat/completions`` (the package ``wire/http/openai/``, which only
translates JSON) and behind ``together-train deploy``. It

- names what can be served (`ModelCatalog`): the base model and the
  inference checkpoints (``save_weights`` PEFT adapters) of the caller. A
  checkpoint is loaded on the replicas as an adapter on first use under the
  key ``ckpt:<uri>`` (the key ``compute_logprobs`` uses, least recently used
  ones dropped: `Resource.checkpoint_scoring_key`);
- turns requests into token prompts: text through the tokenizer, chat
  messages through the model's own chat template
  (``tokenizer.apply_chat_template(..., add_generation_prompt=True)``);
- checks OpenAI's sampling fields (`openai_params`), with errors naming the
  field, then the resource's limits (`validation.validate_sampling`);
- samples through a `SampleFn` (the wire layer routes it to a replica) and
  turns tokens into text: stop strings are cut from the text (as OpenAI
  does; the engine stops after the token that completed one), a special
  end-of-sequence token is not shown;
- logprobs: the tokens of each choice are scored by one more replica pass
  (prompt + completion as a prompt, with prompt logprobs and top-k), so the
  reported values are the model's own distribution (untempered, as
  OpenAI/vLLM report them) whatever the sampling temperature; at
  temperature 1 they equal the sampler's logprobs. With logprobs the
  completion is capped so prompt + completion stays below the context
  length (the scoring pass needs one free position).

Streaming (``stream=true``, `InferenceService.stream`): the replica sends
tokens as it samples them (``SampleStream``), and each choice's text is sent
as it grows: the decoded text so far, less a trailing incomplete UTF-8
character and the last ``len(longest stop string) - 1`` characters (which
may begin a stop string), so the deltas concatenate to exactly the
non-streamed text. With ``logprobs`` the values come from a scoring pass over
the finished choice, so such a request is streamed when it ends
(`stream_pieces`), as is every request when no streaming sampler is given.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol, Sequence

from together_train_server.service import validation
from together_train_server.service.errors import ServiceError, invalid

# OpenAI's bounds: chat top_logprobs <= 20, completions logprobs <= 5.
MAX_CHAT_TOP_LOGPROBS = 20
MAX_COMPLETION_LOGPROBS = 5
# /v1/completions' max_tokens default (OpenAI's); chat defaults to what the context leaves.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Request fields we do not implement: refused when set to anything but their neutral value.
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "echo": False, "suffix": None,
               "best_of": 1, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
               "response_format": None}
ROLES = ("system", "user", "assistant", "tool", "developer")


@dataclass(frozen=True)
class ModelEntry:
    """One servable model.

    Attributes:
        id: the name to pass as ``model`` (the base model's id, or a checkpoint URI).
        created: unix seconds (the checkpoint's write time; the server's start for the base).
        parent: the base model id for a checkpoint, None for the base.
    """

    id: str
    created: int
    parent: str | None = None


class ModelCatalog(Protocol):
    """What `InferenceService` serves: ids -> replica adapter keys."""

    base_id: str

    def list(self, owner: str) -> list[ModelEntry]:
        """Servable models visible to `owner`, the base model first."""
        ...

    def adapter_key(self, model: str, owner: str) -> str:
        """The replica adapter key serving `model` ("" = base), loading it on the replicas if needed.

        Raises:
            ServiceError: NOT_FOUND (key "model") for an unknown model; INVALID_ARGUMENT for one
                that cannot be served here (the message says what to do instead).
        """
        ...


class ResourceCatalog:
    """The models of a running resource: its base model and the caller's inference checkpoints.

    Args:
        resource: the `Resource` (its engine's ``model_id`` / ``model_dir``, its checkpoint store).
    """

    def __init__(self, resource: Any) -> None:
        self.resource = resource
        self.base_id = str(resource.engine.model_id)
        model_dir = resource.engine.model_dir
        # The model directory (what tinker/together clients name) is an alias of the base id.
        self.aliases = {self.base_id, "base"} | ({str(model_dir)} if model_dir else set())
        self.started = int(time.time())

    def list(self, owner: str) -> list[ModelEntry]:
        out = [ModelEntry(self.base_id, self.started)]
        ckpts = [c for c in self.resource.list_checkpoints(owner=owner) if c.kind == "weights" and not c.merged]
        for c in sorted(ckpts, key=lambda c: c.created_at, reverse=True):  # newest first
            out.append(ModelEntry(c.uri, int(c.created_at), self.base_id))
        return out

    def adapter_key(self, model: str, owner: str) -> str:
        if model in self.aliases:
            return ""
        if not model.startswith("together-train://"):
            raise ServiceError("NOT_FOUND", f"model {model!r} does not exist: this server serves {self.base_id!r} "
                               "and its inference checkpoints (together-train://<session>/weights/<name>, "
                               "see GET /v1/models)", key="model")
        try:
            ckpt = self.resource.get_checkpoint(model, owner)
        except ServiceError as e:
            if e.code == "INVALID_ARGUMENT":
                raise invalid(f"model {model!r}: {e.message}", key="model") from None
            raise ServiceError("NOT_FOUND", f"model {model!r} does not exist (no such checkpoint; see GET /v1/models)",
                               key="model") from None
        if ckpt.kind != "weights":
            raise invalid(f"model {model!r} is a training checkpoint (save_state); serve an inference checkpoint "
                          "from save_weights", key="model")
        if ckpt.merged:
            raise invalid(f"model {model!r} is a merged model: serve it on its own with "
                          f"`together-train deploy {model}` (or vllm serve its directory)", key="model")
        key, _step = self.resource.checkpoint_scoring_key(model, owner)
        return key


class FixedCatalog:
    """A fixed set of models (``together-train deploy``): the base and adapters pushed at startup.

    Args:
        base_id: the base model's id.
        adapters: served name -> replica adapter key (already on the replicas).
        aliases: more names of the base model.
        names_only: serve only `adapters` (the base is not listed or served) when True.
    """

    def __init__(self, base_id: str, adapters: Mapping[str, str], aliases: Sequence[str] = (),
                 names_only: bool = False) -> None:
        self.base_id = base_id
        self.adapters = dict(adapters)
        self.aliases = set() if names_only else {base_id, *aliases}
        self.started = int(time.time())

    def list(self, owner: str) -> list[ModelEntry]:
        base = [] if not self.aliases else [ModelEntry(self.base_id, self.started)]
        return base + [ModelEntry(n, self.started, self.base_id) for n in self.adapters]

    def adapter_key(self, model: str, owner: str) -> str:
        if model in self.adapters:
            return self.adapters[model]
        if model in self.aliases:
            return ""
        served = sorted(self.adapters) + sorted(self.aliases)
        raise ServiceError("NOT_FOUND", f"model {model!r} does not exist: this server serves {served}", key="model")


@dataclass(frozen=True)
class InferenceParams:
    """A request's sampling settings after OpenAI's conventions were applied.

    Attributes:
        max_tokens: None = what the context leaves (chat), bounded by the resource's max_new_tokens.
        temperature: 0 = greedy.
        top_p: nucleus mass in (0, 1].
        n: choices per prompt.
        seed: None = unseeded; choice i uses its own stream of the seed.
        stop: stop strings (cut from the text).
        logprobs: report per-token logprobs.
        top_logprobs: alternatives per position (0..20 chat, 0..5 completions).
        stream: answer as server-sent events.
        include_usage: (stream) a last chunk with the usage counts.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    stream: bool = False
    include_usage: bool = False


def _field(body: Mapping[str, Any], name: str, kind: type, default: Any) -> Any:
    """A typed field of an OpenAI request body (None = absent); INVALID_ARGUMENT naming it otherwise."""
    v = body.get(name, None)
    if v is None:
        return default
    if kind is bool:
        if not isinstance(v, bool):
            raise invalid(f"{name} must be a boolean, got {v!r}", key=name)
        return v
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise invalid(f"{name} must be a number, got {v!r}", key=name)
    if kind is int:
        if not float(v).is_integer():
            raise invalid(f"{name} must be an integer, got {v!r}", key=name)
        return int(v)
    if not math.isfinite(float(v)):
        raise invalid(f"{name} must be a finite number, got {v!r}", key=name)
    return float(v)


def openai_params(body: Mapping[str, Any], *, chat: bool, limits: validation.Limits) -> InferenceParams:
    """Read OpenAI's sampling fields of a request body.

    Chat: ``max_completion_tokens`` (or ``max_tokens``), ``logprobs`` (bool)
    with ``top_logprobs`` (0-20). Completions: ``max_tokens`` (default 16),
    ``logprobs`` (int 0-5 = alternatives per position). Both: temperature
    (0-2), top_p, n, seed, stop (a string or a list of up to the resource's
    max_stop_sequences strings), stream, stream_options.include_usage.

    Raises:
        ServiceError: INVALID_ARGUMENT naming the field (key) for a wrong type or
            value, or a set field this server does not implement.
    """
    for name, neutral in UNSUPPORTED.items():
        v = body.get(name)
        if v is not None and v != neutral and not (isinstance(v, (list, dict)) and not v):
            raise invalid(f"{name} is not supported by this server", key=name)
    max_tokens = _field(body, "max_completion_tokens", int, None) if chat else None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", int, None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS)
    if max_tokens is not None and max_tokens < 1:
        key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
        raise invalid(f"{key} must be at least 1, got {max_tokens}", key=key)
    if max_tokens is not None and max_tokens > limits.max_new_tokens:
        raise invalid(f"max_tokens {max_tokens} exceeds this server's limit {limits.max_new_tokens}", key="max_tokens")
    temperature = _field(body, "temperature", float, 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise invalid(f"temperature must be in [0, 2], got {temperature}", key="temperature")
    if 0 < temperature < validation.MIN_TEMPERATURE:
        temperature = 0.0  # OpenAI accepts any value in [0, 2]; ours this small would divide by ~0: greedy
    top_p = _field(body, "top_p", float, 1.0)
    if not 0.0 < top_p <= 1.0:
        raise invalid(f"top_p must be in (0, 1], got {top_p}", key="top_p")
    n = _field(body, "n", int, 1)
    if not 1 <= n <= limits.max_num_samples:
        raise invalid(f"n must be in [1, {limits.max_num_samples}], got {n}", key="n")
    seed = _field(body, "seed", int, None)
    stop_v = body.get("stop")
    if stop_v is None:
        stop: tuple[str, ...] = ()
    elif isinstance(stop_v, str):
        stop = (stop_v,)
    elif isinstance(stop_v, list) and all(isinstance(s, str) for s in stop_v):
        stop = tuple(stop_v)
    else:
        raise invalid(f"stop must be a string or a list of strings, got {stop_v!r}", key="stop")
    if any(not s for s in stop):
        raise invalid("stop strings must not be empty", key="stop")
    if len(stop) > limits.max_stop_sequences:
        raise invalid(f"at most {limits.max_stop_sequences} stop strings, got {len(stop)}", key="stop")
    if chat:
        logprobs = bool(_field(body, "logprobs", bool, False))
        top = _field(body, "top_logprobs", int, 0)
        if not 0 <= top <= MAX_CHAT_TOP_LOGPROBS:
            raise invalid(f"top_logprobs must be in [0, {MAX_CHAT_TOP_LOGPROBS}], got {top}", key="top_logprobs")
        if top and not logprobs:
            raise invalid("top_logprobs needs logprobs: true", key="top_logprobs")
    else:
        lp = _field(body, "logprobs", int, None)
        if lp is not None and not 0 <= lp <= MAX_COMPLETION_LOGPROBS:
            raise invalid(f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {lp}", key="logprobs")
        logprobs, top = lp is not None, lp or 0
    top = min(top, limits.max_top_k_prompt_logprobs)
    stream = bool(_field(body, "stream", bool, False))
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise invalid(f"stream_options must be an object, got {opts!r}", key="stream_options")
    return InferenceParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, n=n, seed=seed, stop=stop,
                           logprobs=logprobs, top_logprobs=top, stream=stream,
                           include_usage=bool(opts.get("include_usage", False)))


@dataclass
class SampledSequence:
    """One sequence as a replica returned it."""

    tokens: list[int]
    stop_reason: str  # "stop" | "length"


@dataclass
class SampleResult:
    """A replica's answer.

    Attributes:
        sequences: one per requested sample.
        prompt_logprobs: len(prompt) - 1 values, logprob of prompt[i+1] (when asked).
        top_k: per prompt position i+1, (token ids, logprobs) of the k most likely tokens (when asked).
    """

    sequences: list[SampledSequence]
    prompt_logprobs: list[float] = field(default_factory=list)
    top_k: list[tuple[list[int], list[float]]] = field(default_factory=list)


# (adapter key, prompt, sampling kwargs of validate_sampling, num_samples, prompt_logprobs, top_k_prompt_logprobs)
SampleFn = Callable[[str, list[int], dict[str, Any], int, bool, int], SampleResult]


@dataclass
class TokenBatch:
    """Tokens a replica sampled since its previous batch.

    Attributes:
        tokens: (sequence index, token id) pairs in the order sampled.
        sampled_at: Unix seconds (the replica's clock) when the last of them was sampled.
    """

    tokens: list[tuple[int, int]]
    sampled_at: float = 0.0


# (adapter key, prompt, sampling kwargs, num_samples) -> TokenBatch items as they come, the whole
# answer (a SampleResult) last.
StreamFn = Callable[[str, list[int], dict[str, Any], int], Iterator["TokenBatch | SampleResult"]]


@dataclass
class TokenLogprob:
    """A completion token with its logprob and the most likely alternatives at its position."""

    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]]


@dataclass
class Choice:
    """One finished choice.

    Attributes:
        index: position in the response (prompt index * n + sample index).
        text: the completion text (stop string cut, special tokens not shown).
        tokens: every generated token id (usage counts these).
        finish_reason: "stop" (EOS or a stop string) | "length".
        logprobs: per shown token (those that start inside `text`), when asked.
        token_ends: for each shown token, the length of `text` covered up to and including it.
    """

    index: int
    text: str
    tokens: list[int]
    finish_reason: str
    logprobs: list[TokenLogprob] | None
    token_ends: list[int]


@dataclass
class Completion:
    """A request's result: the choices and OpenAI's usage counts."""

    choices: list[Choice]
    prompt_tokens: int
    completion_tokens: int


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
        last_sampled_at: Unix seconds (the replica's clock) when the last token so far was
            sampled; 0 when the replica answered the request as a whole.
    """

    def __init__(self, events: Iterator[StreamEvent], prompt_tokens: int) -> None:
        self._events = events
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self.last_sampled_at = 0.0

    def __iter__(self) -> Iterator[StreamEvent]:
        return self._events


class _GrowingText:
    """The shown text of one choice as its tokens arrive (what `InferenceService._choice` would show)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.hold = max((len(x) for x in stop), default=1) - 1
        self.tokens: list[int] = []
        self.sent = ""
        self.stopped = False

    def add(self, tokens: list[int]) -> str:
        """Append tokens; returns the text that is now certain and not sent yet."""
        self.tokens += tokens
        if self.stopped:
            return ""
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        cut = min((text.find(x) for x in self.stop if x in text), default=-1)
        if cut >= 0:
            safe, self.stopped = text[:cut], True
        else:
            safe = text.rstrip("\ufffd")  # an incomplete UTF-8 character so far
            safe = safe[: max(0, len(safe) - self.hold)]
        return self._send(safe)

    def _send(self, safe: str) -> str:
        if len(safe) <= len(self.sent) or not safe.startswith(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, text: str) -> str:
        """The rest of the finished choice's `text`."""
        return self._send(text)


class InferenceService:
    """Completions and chat completions on the replicas (see the module docstring).

    Args:
        catalog: which models are served and their adapter keys.
        tokenizer: the base model's transformers tokenizer (its chat template renders chats).
        limits: the resource's request limits (context length, max_new_tokens, ...).
        sample: routes one request to a replica (`SampleFn`).
        sample_stream: routes one request to a replica and yields its tokens as they come
            (`StreamFn`); None = streamed requests are answered when they end.
    """

    def __init__(self, catalog: ModelCatalog, tokenizer: Any, limits: validation.Limits, sample: SampleFn,
                 sample_stream: StreamFn | None = None) -> None:
        self.catalog = catalog
        self.tokenizer = tokenizer
        self.limits = limits
        self._sample = sample
        self._sample_stream = sample_stream

    # ----- prompts ---------------------------------------------------------------------------
    def chat_prompt(self, messages: Any) -> list[int]:
        """Token ids of a chat rendered with the model's chat template, ready for the assistant's turn.

        Args:
            messages: OpenAI messages: ``{"role", "content"}`` with content a string or a list of
                ``{"type": "text", "text"}`` parts.

        Raises:
            ServiceError: INVALID_ARGUMENT naming ``messages[i].role`` / ``messages[i].content``;
                FAILED_PRECONDITION when the tokenizer has no chat template.
        """
        if not isinstance(messages, list) or not messages:
            raise invalid("messages must be a non-empty list of {role, content} objects", key="messages")
        rendered = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict):
                raise invalid(f"messages[{i}] must be an object with role and content", key=f"messages[{i}]")
            role = m.get("role")
            if role not in ROLES:
                raise invalid(f"messages[{i}].role must be one of {list(ROLES)}, got {role!r}", key=f"messages[{i}].role")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, p in enumerate(content):
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise invalid(f"messages[{i}].content[{j}] must be a text part {{type: 'text', text}} "
                                      "(this server serves text models)", key=f"messages[{i}].content")
                    parts.append(p["text"])
                content = "".join(parts)
            if content is None and role == "assistant":
                content = ""
            if not isinstance(content, str):
                raise invalid(f"messages[{i}].content must be a string or a list of text parts, got {content!r}",
                              key=f"messages[{i}].content")
            rendered.append({"role": "system" if role == "developer" else role, "content": content})
        if not getattr(self.tokenizer, "chat_template", None):
            raise ServiceError("FAILED_PRECONDITION", "this model's tokenizer has no chat template: use /v1/completions")
        enc = self.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=True, return_dict=True)
        return [int(t) for t in enc["input_ids"]]

    def text_prompts(self, prompt: Any) -> list[list[int]]:
        """Token ids of /v1/completions' ``prompt``: a string, a list of strings, token ids, or lists of them.

        Raises:
            ServiceError: INVALID_ARGUMENT (key "prompt") for another shape or an empty prompt.
        """
        def one(p: Any, where: str) -> list[int]:
            if isinstance(p, str):
                ids = [int(t) for t in self.tokenizer(p, add_special_tokens=False)["input_ids"]]
            elif isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
                ids = list(p)
            else:
                raise invalid(f"{where} must be a string or a list of token ids", key="prompt")
            if not ids:
                raise invalid(f"{where} is empty", key="prompt")
            return ids

        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            return [one(prompt, "prompt")]
        if isinstance(prompt, list) and prompt:
            return [one(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
        raise invalid("prompt must be a string, a list of strings, or token ids", key="prompt")

    # ----- sampling --------------------------------------------------------------------------
    def models(self, owner: str = "") -> list[ModelEntry]:
        """The models `owner` may name (base first, then inference checkpoints newest first)."""
        return self.catalog.list(owner)

    def complete(self, model: Any, prompts: list[list[int]], params: InferenceParams, owner: str = "") -> Completion:
        """Sample `params.n` choices for each prompt with `model`.

        Every prompt is validated before any is sampled (the resource's limits, naming
        ``prompt[i]`` for a batch), so a bad request samples nothing.

        Raises:
            ServiceError: INVALID_ARGUMENT / NOT_FOUND (key "model", "prompt", "max_tokens", ...);
                UNAVAILABLE when no replica answers.
        """
        key, kws = self._prepare(model, prompts, params, owner)
        choices: list[Choice] = []
        completion_tokens = 0
        for i, (prompt, kw) in enumerate(zip(prompts, kws)):
            res = self._sample(key, prompt, kw, params.n, False, 0)
            for j, seq in enumerate(res.sequences):
                choices.append(self._choice(i * params.n + j, key, prompt, seq, params))
                completion_tokens += len(seq.tokens)
        return Completion(choices, sum(len(p) for p in prompts), completion_tokens)

    def stream(self, model: Any, prompts: list[list[int]], params: InferenceParams, owner: str = "") -> CompletionStream:
        """`complete`, answered as it is generated: the prompts one after another, the choices of a
        prompt interleaved as their tokens come (see the module docstring).

        The request is validated here, before anything is sampled; errors while
        iterating (a replica lost) are ServiceErrors.

        Raises:
            ServiceError: as `complete`.
        """
        key, kws = self._prepare(model, prompts, params, owner)

        def whole() -> Iterator[StreamEvent]:
            for i, (prompt, kw) in enumerate(zip(prompts, kws)):
                res = self._sample(key, prompt, kw, params.n, False, 0)
                for j, seq in enumerate(res.sequences):
                    ch = self._choice(i * params.n + j, key, prompt, seq, params)
                    out.completion_tokens += len(seq.tokens)
                    for delta, lp in stream_pieces(ch):
                        yield StreamEvent(ch.index, delta, lp)
                    yield StreamEvent(ch.index, "", None, ch.finish_reason)

        def growing() -> Iterator[StreamEvent]:
            for i, (prompt, kw) in enumerate(zip(prompts, kws)):
                texts = [_GrowingText(self.tokenizer, params.stop) for _ in range(params.n)]
                for item in self._sample_stream(key, prompt, kw, params.n):
                    if isinstance(item, SampleResult):
                        for j, seq in enumerate(item.sequences):
                            ch = self._choice(i * params.n + j, key, prompt, seq, params)
                            out.completion_tokens += len(seq.tokens)
                            rest = texts[j].finish(ch.text)
                            if rest:
                                yield StreamEvent(ch.index, rest)
                            yield StreamEvent(ch.index, "", None, ch.finish_reason)
                        break
                    out.last_sampled_at = item.sampled_at
                    new: dict[int, list[int]] = {}
                    for j, t in item.tokens:
                        new.setdefault(j, []).append(t)
                    for j, toks in sorted(new.items()):
                        delta = texts[j].add(toks)
                        if delta:
                            yield StreamEvent(i * params.n + j, delta)
                else:
                    raise ServiceError("UNAVAILABLE", "the replica's answer ended without its result", retryable=True)

        whole_only = self._sample_stream is None or params.logprobs
        out = CompletionStream(whole() if whole_only else growing(), sum(len(p) for p in prompts))
        return out  # the generators read `out` when iterated, after this assignment

    def model_key(self, model: Any, owner: str = "") -> str:
        """The adapter key serving `model` for `owner` ("" = the base model); the routes call it before
        they read the rest of the body, so an unknown model is NOT_FOUND whatever the body holds.

        Raises:
            ServiceError: INVALID_ARGUMENT without a model, NOT_FOUND for one `owner` may not use.
        """
        if not isinstance(model, str) or not model:
            raise invalid("model is required (see GET /v1/models)", key="model")
        return self.catalog.adapter_key(model, owner)

    def _prepare(self, model: Any, prompts: list[list[int]], params: InferenceParams,
                 owner: str) -> tuple[str, list[dict[str, Any]]]:
        """The adapter key serving `model` and each prompt's checked sampling kwargs (see `complete`)."""
        key = self.model_key(model, owner)
        lim = self.limits
        kws = []
        for i, prompt in enumerate(prompts):
            left = lim.max_seq_len - len(prompt) - (1 if params.logprobs else 0)
            if left < 1:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise invalid(f"{where} has {len(prompt)} tokens, which leaves no room to generate within the "
                              f"context length {lim.max_seq_len}" + (" (logprobs need one more position)"
                                                                     if params.logprobs else ""), key="prompt")
            max_tokens = min(params.max_tokens or lim.max_new_tokens, lim.max_new_tokens, left)
            kw = {"max_tokens": max_tokens, "temperature": params.temperature, "top_k": 0, "top_p": params.top_p,
                  "seed": params.seed, "stop": list(params.stop), "stop_token_ids": [], "ignore_eos": False}
            try:
                validation.validate_sampling(prompt, num_samples=params.n, top_k_prompt_logprobs=0, limits=lim, **kw)
            except ServiceError as e:
                if len(prompts) > 1:
                    raise ServiceError(e.code, f"prompt[{i}]: {e.message}", key=e.key, sample_index=i) from None
                raise
            kws.append(kw)
        return key, kws

    def _choice(self, index: int, key: str, prompt: list[int], seq: SampledSequence, params: InferenceParams) -> Choice:
        tok = self.tokenizer
        text = tok.decode(seq.tokens, skip_special_tokens=True)
        finish = seq.stop_reason
        cut = min((text.find(s) for s in params.stop if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        # Shown tokens: those starting inside the text; token_ends[i] = text covered through token i.
        ends: list[int] = []
        prev = 0
        for i in range(len(seq.tokens)):
            if prev >= len(text) and (text or i > 0):
                break
            piece = tok.decode(seq.tokens[: i + 1], skip_special_tokens=True)
            upto = _common_prefix(piece, text)
            if upto == prev and tok.decode([seq.tokens[i]], skip_special_tokens=True) == "":
                break  # a special token (EOS) ends what is shown
            ends.append(upto)
            prev = upto
        if ends:
            ends[-1] = len(text)
        logprobs = self._score(key, prompt, seq.tokens[: len(ends)], params.top_logprobs) if params.logprobs else None
        return Choice(index, text, list(seq.tokens), finish, logprobs, ends)

    def _score(self, key: str, prompt: list[int], tokens: list[int], k: int) -> list[TokenLogprob]:
        """Logprobs (and top-k alternatives) of `tokens` after `prompt` under the served model, untempered."""
        if not tokens:
            return []
        kw = {"max_tokens": 1, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "stop": [],
              "stop_token_ids": [], "ignore_eos": True}
        res = self._sample(key, prompt + tokens, kw, 1, True, k)
        p = len(prompt)
        lps = res.prompt_logprobs[p - 1: p - 1 + len(tokens)]
        tops = res.top_k[p - 1: p - 1 + len(tokens)] if k else [([], [])] * len(tokens)
        dec = self.tokenizer.decode
        return [TokenLogprob(t, dec([t]), float(lp), [(int(a), dec([int(a)]), float(b)) for a, b in zip(*top)][:k])
                for t, lp, top in zip(tokens, lps, tops)]


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def stream_pieces(choice: Choice) -> Iterator[tuple[str, TokenLogprob | None]]:
    """Per-token text deltas of a finished choice, concatenating to exactly ``choice.text``.

    Yields ``(delta, token logprob or None)`` for each shown token; a delta is
    "" while a token only completes part of a character (bytes of one UTF-8
    character spread over tokens).
    """
    prev = 0
    for i, end in enumerate(choice.token_ends):
        lp = choice.logprobs[i] if choice.logprobs is not None and i < len(choice.logprobs) else None
        yield choice.text[prev:end], lp
        prev = end
    if prev < len(choice.text):
        yield choice.text[prev:], None
