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
- takes the request's settings as `InferenceParams` (built by the OpenAI parser,
  wire/http/openai/params.py) holding the one `SamplingParams`, checked against the
  resource's limits by the sampler (`ReplicaSampler.request`);
- samples through the resource's one sampling road (`SamplingRoad`: `ops.Sampling`, whose ``request``
  checks the limits and the memory budget as for every other API; ``together-train deploy``, which has
  no trainer, a bare `ReplicaSampler`) and turns tokens into text: stop strings are cut from the text (as OpenAI
  does; the engine stops after the token that completed one), a special
  end-of-sequence token is not shown;
- logprobs: the sampling call itself reports them (``SamplingParams.top_logprobs``:
  each sampled token's untempered logprob and the k most likely tokens', taken by
  the replica as it samples), so a request with logprobs costs one replica call
  and the values are the model's own distribution (untempered, as OpenAI/vLLM
  report them) whatever the sampling temperature; at temperature 1 they equal
  the sampler's logprobs. ``echo`` asks the same call for the prompt's logprobs.
  With logprobs the completion is capped so prompt + completion stays below the
  context length (the vLLM engine scores prompt + completion as a prompt, which
  needs one free position).

Streaming (``stream=true``, `InferenceService.stream`): the replica sends
tokens as it samples them (``SampleStream``), and each choice's text is sent
as it grows: the decoded text so far, less a trailing incomplete UTF-8
character and the last ``len(longest stop string) - 1`` characters (which
may begin a stop string), so the deltas concatenate to exactly the
non-streamed text. With ``logprobs`` the values come with the finished answer
(the streamed token messages carry none), so such a request is streamed when it
ends (`stream_pieces`).
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterator, Mapping, Protocol, Sequence

from together_train_server.service.sampling import chat_tools
from together_train_server.service.sampling import rollouts as rollout_calls
from together_train_server.engines.types import GenSequence, SamplingParams
from together_train_server.service import validation
from together_train_server.service.sampling.cancellation import CallerGone
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.sampling.model_catalog import (  # noqa: F401 - the OpenAI routes' names
    FixedCatalog,
    ModelCatalog,
    ModelEntry,
    ResourceCatalog,
)
from together_train_server.service.sampling.replica_sampler import SampleOutput, SampleRequest, TokenBatch
from together_train_server.service.sampling.completions import (  # the value types, named here as well
    Choice,
    Completion,
    CompletionStream,
    SampledSequence,
    StreamEvent,
    TokenLogprob,
)
from together_train_server.service.sampling.inference_params import InferenceParams
from together_train_server.service.sampling.rollouts import RolloutStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ROLES = ("system", "user", "assistant", "tool", "developer")


class _GrowingText:
    """The shown text of one choice as its tokens arrive (what `InferenceService._choice` would show)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
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
        text = decode(self.tokenizer, self.tokens, skip_special_tokens=True)
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


class SamplingRoad(Protocol):
    """What `InferenceService` samples through: `ops.Sampling` (limits and memory admission, then the
    replicas), or a bare `replica_sampler.ReplicaSampler` (``together-train deploy``: no trainer, no budget)."""

    def request(self, key: str, prompt: Sequence[int], params: SamplingParams, *, num_samples: int = 1,
                prompt_logprobs: bool = False, top_k_prompt_logprobs: int = 0,
                sample_index: int | None = None, gone: CallerGone | None = None) -> SampleRequest:
        """A checked `SampleRequest`. Raises ServiceError (INVALID_ARGUMENT, RESOURCE_EXHAUSTED)."""
        ...

    def sample(self, request: SampleRequest, *, scope: str = "", record: str | None = None) -> SampleOutput:
        """Sample on a replica. Raises ServiceError."""
        ...

    def sample_stream(self, request: SampleRequest, *, scope: str = "",
                      record: str | None = None) -> Iterator[TokenBatch | SampleOutput]:
        """`sample`, yielding token batches as they come, then the `SampleOutput`."""
        ...


class InferenceService:
    """Completions and chat completions on the replicas (see the module docstring).

    Args:
        catalog: which models are served and their adapter keys.
        tokenizer: the base model's transformers tokenizer (its chat template renders chats).
        limits: the resource's request limits (context length, max_new_tokens, ...).
        sampler: the sampling road (`SamplingRoad`: checks, admission, routing, error translation); its
            ``sample_stream`` yields the tokens as they come.
        rollouts: the store of calls made under ``/v1/rollouts/{id}`` (None: such calls are refused).
    """

    def __init__(self, catalog: ModelCatalog, tokenizer: PreTrainedTokenizerBase, limits: validation.Limits,
                 sampler: SamplingRoad, rollouts: RolloutStore | None = None) -> None:
        self.catalog = catalog
        self.tokenizer = tokenizer
        self.limits = limits
        self._sampler = sampler
        self.rollouts = rollouts  # calls under /v1/rollouts/{id} are recorded here (None: refused)
        self.responses: Any = None  # stored Responses (`responses.ResponseStore`, set by the HTTP app)

    # ----- replicas ----------------------------------------------------------------------------
    def _sample(self, req: SampleRequest) -> SampleOutput:
        """One checked request on the replicas (`ReplicaSampler.sample`)."""
        return self._sampler.sample(req)

    def _sample_stream(self, req: SampleRequest) -> Iterator[TokenBatch | SampleOutput]:
        """`_sample`, streamed: `TokenBatch`es as the replica samples them, the `SampleOutput` last."""
        return self._sampler.sample_stream(req)

    # ----- tools -------------------------------------------------------------------------------
    def tools(self, tools: Any, tool_choice: Any) -> list[dict[str, Any]] | None:
        """The request's tools to render, checked against the chat template (`chat_tools.check_tools`)."""
        return chat_tools.check_tools(self.tokenizer, tools, tool_choice)

    def reply(self, prompt: list[int], choice: Choice, tools: list[dict[str, Any]] | None,
              one_call: bool = False) -> chat_tools.ParsedReply:
        """A chat choice's content and tool calls, parsed in the template's format (`chat_tools.parse_reply`);
        `one_call` (``parallel_tool_calls: false``): the first call only."""
        rep = chat_tools.parse_reply(self.tokenizer, prompt, choice.tokens, choice.text, tools)
        if one_call:
            rep.tool_calls = rep.tool_calls[:1]
        return rep

    # ----- rollouts ----------------------------------------------------------------------------
    def check_rollout(self, rollout_id: str, owner: str = "") -> None:
        """Refuse, before sampling, a call that could not be recorded under `rollout_id`.

        Raises:
            ServiceError: INVALID_ARGUMENT (bad id), NOT_FOUND (another key's rollout),
                FAILED_PRECONDITION (this server records no rollouts).
        """
        if self.rollouts is None:
            raise ServiceError("FAILED_PRECONDITION", "this server does not record rollouts", key="rollout_id")
        self.rollouts.check_writable(owner, rollout_id)

    def record(self, rollout_id: str, owner: str, model: str, prompts: list[list[int]], choices: list[Choice],
               n: int, messages: Any = None) -> None:
        """Append a finished request to rollout `rollout_id` (`rollouts.calls_of`). Raises as `check_rollout`."""
        self.check_rollout(rollout_id, owner)
        assert self.rollouts is not None  # check_rollout refused otherwise
        floor = 0 if self.catalog.is_session(model, owner) else None
        self.rollouts.record(owner, rollout_id, rollout_calls.calls_of(model, prompts, choices, n, messages, floor))

    # ----- prompts ---------------------------------------------------------------------------
    def chat_prompt(self, messages: Any, tools: list[dict[str, Any]] | None = None,
                    options: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a chat rendered with the model's chat template, ready for the assistant's turn.

        Args:
            messages: OpenAI messages: ``{"role", "content"}`` with content a string or a list of
                ``{"type": "text", "text"}`` parts; an assistant's ``tool_calls`` and a tool message's
                ``tool_call_id`` / ``name`` are passed to the template (`chat_tools`).
            tools: tools to render (`chat_tools.check_tools`), None = none.
            options: more ``apply_chat_template`` keyword arguments (vLLM's ``chat_template_kwargs``,
                ``add_generation_prompt``, ``continue_final_message``: wire/http/openai/vllm_extras.py).

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
            msg = {"role": "system" if role == "developer" else role, "content": content}
            if role == "assistant" and m.get("tool_calls"):
                msg["tool_calls"] = chat_tools.template_tool_calls(m["tool_calls"], f"messages[{i}].tool_calls")
            msg.update({k: m[k] for k in ("tool_call_id", "name") if role == "tool" and isinstance(m.get(k), str)})
            rendered.append(msg)
        if not getattr(self.tokenizer, "chat_template", None):
            raise ServiceError("FAILED_PRECONDITION", "this model's tokenizer has no chat template: use /v1/completions")
        extra = {"add_generation_prompt": True, **(options or {}), **({"tools": tools} if tools else {})}
        if extra.get("continue_final_message") and rendered[-1]["role"] != "assistant":
            raise invalid("continue_final_message needs a last message of role assistant", key="messages")
        enc = self.tokenizer.apply_chat_template(rendered, tokenize=True, return_dict=True, **extra)
        assert isinstance(enc, Mapping)  # return_dict=True: a BatchEncoding
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

    def complete(self, model: Any, prompts: list[list[int]], params: InferenceParams, owner: str = "",
                 key: str | None = None) -> Completion:
        """Sample `params.n` choices for each prompt with `model`.

        Every prompt is validated before any is sampled (the resource's limits, naming
        ``prompt[i]`` for a batch), so a bad request samples nothing.

        Args:
            key: the adapter key `model_key` gave for `model` (None: resolved here).

        Raises:
            ServiceError: INVALID_ARGUMENT / NOT_FOUND (key "model", "prompt", "max_tokens", ...);
                UNAVAILABLE when no replica answers.
        """
        key, reqs = self._prepare(model, prompts, params, owner, key=key)
        choices: list[Choice] = []
        completion_tokens = cached = 0
        for i, (prompt, req) in enumerate(zip(prompts, reqs)):
            res: SampleOutput | None = None
            if req is None:  # echo with max_tokens 0: the prompt is only scored
                seqs, version = [GenSequence([], [], "length") for _ in range(params.n)], -1
            else:
                res = self._sample(req)
                seqs, version = res.sequences, res.policy_version
                cached += int(getattr(res, "prompt_cache_hit_tokens", 0))
            head = self._prompt_logprobs(key, prompt, res, params.top_logprobs) if params.echo and params.logprobs \
                else None
            for j, seq in enumerate(seqs):
                ch = self._choice(i * params.n + j, key, prompt, seq, params, version)
                choices.append(self._echoed(prompt, ch, head) if params.echo else ch)
                completion_tokens += len(seq.tokens)
        return Completion(choices, sum(len(p) for p in prompts), completion_tokens, cached)

    def _prompt_logprobs(self, key: str, prompt: list[int], res: SampleOutput | None, k: int) -> list[TokenLogprob]:
        """The echoed prompt's logprobs: none for its first token (``token_logprobs[0]`` is null, as in
        OpenAI's legacy API), then those the sampling call `res` reported (``prompt_logprobs``); a prompt
        that is only scored (`res` None) is scored by one replica call."""
        first = TokenLogprob(prompt[0], decode(self.tokenizer, [prompt[0]]), None, [])
        if res is None or len(res.prompt_logprobs) != len(prompt) - 1:
            return [first] + self._score(key, prompt[:1], prompt[1:], k)
        return [first] + self._token_logprobs(prompt[1:], res.prompt_logprobs, res.top_k_prompt_logprobs, k)

    def _echoed(self, prompt: list[int], ch: Choice, head: list[TokenLogprob] | None) -> Choice:
        """`ch` after its prompt (``echo``): text, token ends and logprobs of prompt + completion (`head`:
        the prompt's logprobs, `_prompt_logprobs`; None without logprobs)."""
        dec = functools.partial(decode, self.tokenizer)
        text = dec(prompt, skip_special_tokens=False)
        ends, at = [], 0
        for t in prompt:  # each token's own text (a character split over tokens counts where it ends)
            at = min(len(text), at + len(dec([t], skip_special_tokens=False).rstrip("\ufffd")))
            ends.append(at)
        ends[-1] = len(text)
        logprobs = None if head is None else head + (ch.logprobs or [])
        return Choice(ch.index, text + ch.text, list(ch.tokens), ch.finish_reason, logprobs,
                      ends + [len(text) + e for e in ch.token_ends], ch.sampled)

    def stream(self, model: Any, prompts: list[list[int]], params: InferenceParams, owner: str = "",
               key: str | None = None) -> CompletionStream:
        """`complete`, answered as it is generated: the prompts one after another, the choices of a
        prompt interleaved as their tokens come (see the module docstring).

        The request is validated here, before anything is sampled; errors while
        iterating (a replica lost) are ServiceErrors. `CompletionStream.cancel` (the client
        disconnected) cancels the replica call in flight: iterating then raises `SampleCancelled`.

        Raises:
            ServiceError: as `complete`.
        """
        gone = CallerGone()
        key, reqs = self._prepare(model, prompts, params, owner, gone, key)

        def finished() -> Iterator[Choice]:
            if params.echo:
                done = self.complete(model, prompts, params, owner, key)
                out.cached_tokens = done.cached_tokens
                yield from done.choices
                return
            for i, (prompt, req) in enumerate(zip(prompts, reqs)):
                assert req is not None  # max_tokens 0 only with echo
                res = self._sample(req)
                out.cached_tokens += int(getattr(res, "prompt_cache_hit_tokens", 0))
                for j, seq in enumerate(res.sequences):
                    yield self._choice(i * params.n + j, key, prompt, seq, params, res.policy_version)

        def whole() -> Iterator[StreamEvent]:
            for ch in finished():
                out.completion_tokens += len(ch.tokens)
                out.choices.append(ch)
                for delta, lp in stream_pieces(ch):
                    yield StreamEvent(ch.index, delta, lp)
                yield StreamEvent(ch.index, "", None, ch.finish_reason)

        def growing() -> Iterator[StreamEvent]:
            for i, (prompt, req) in enumerate(zip(prompts, reqs)):
                assert req is not None  # max_tokens 0 only with echo
                texts = [_GrowingText(self.tokenizer, params.sampling.stop) for _ in range(params.n)]
                for item in self._sample_stream(req):
                    if isinstance(item, SampleOutput):
                        out.cached_tokens += int(getattr(item, "prompt_cache_hit_tokens", 0))
                        for j, seq in enumerate(item.sequences):
                            ch = self._choice(i * params.n + j, key, prompt, seq, params, item.policy_version)
                            out.completion_tokens += len(seq.tokens)
                            out.choices.append(ch)
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

        whole_only = params.logprobs or params.echo
        out = CompletionStream(whole() if whole_only else growing(), sum(len(p) for p in prompts), gone)
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

    def _prepare(self, model: Any, prompts: list[list[int]], params: InferenceParams, owner: str,
                 gone: CallerGone | None = None, key: str | None = None) -> tuple[str, list[SampleRequest | None]]:
        """The adapter key serving `model` (`key` when the route already resolved it, `model_key`) and each
        prompt's checked `SampleRequest` (see `complete`); None for a prompt that is only scored (echo with
        max_tokens 0)."""
        key = self.model_key(model, owner) if key is None else key
        lim = self.limits
        reqs: list[SampleRequest | None] = []
        for i, prompt in enumerate(prompts):
            left = lim.max_seq_len - len(prompt) - (1 if params.logprobs else 0)
            if left < 1:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise invalid(f"{where} has {len(prompt)} tokens, which leaves no room to generate within the "
                              f"context length {lim.max_seq_len}" + (" (logprobs need one more position)"
                                                                     if params.logprobs else ""), key="prompt")
            max_tokens = min(params.sampling.max_tokens, lim.max_new_tokens, left)
            # checked as 1 when 0 (echo only); the call reports the logprobs asked for (one replica call)
            sampling = replace(params.sampling, max_tokens=max(max_tokens, 1),
                               top_logprobs=params.top_logprobs if params.logprobs else None)
            echo_lp = params.echo and params.logprobs
            try:
                req = self._sampler.request(key, prompt, sampling, num_samples=params.n, gone=gone,
                                            prompt_logprobs=echo_lp, top_k_prompt_logprobs=params.top_logprobs
                                            if echo_lp else 0)
            except ServiceError as e:
                if len(prompts) > 1:
                    raise ServiceError(e.code, f"prompt[{i}]: {e.message}", key=e.key, sample_index=i) from None
                raise
            reqs.append(req if max_tokens > 0 else None)
        return key, reqs

    def _choice(self, index: int, key: str, prompt: list[int], seq: GenSequence, params: InferenceParams,
                version: int) -> Choice:
        """A replica's sequence as a finished `Choice` (the one translation of a sampled answer: text, token
        ends, logprobs when asked; `Choice.sampled` keeps tokens, sampler logprobs, `version` per token)."""
        tok = self.tokenizer
        text = decode(tok, seq.tokens, skip_special_tokens=True)
        finish = seq.stop_reason
        cut = min((text.find(s) for s in params.sampling.stop if s in text), default=-1)
        if cut >= 0:
            text, finish = text[:cut], "stop"
        # Shown tokens: those starting inside the text; token_ends[i] = text covered through token i.
        ends: list[int] = []
        prev = 0
        for i in range(len(seq.tokens)):
            if prev >= len(text) and (text or i > 0):
                break
            piece = decode(tok, seq.tokens[: i + 1], skip_special_tokens=True)
            upto = _common_prefix(piece, text)
            if upto == prev and decode(tok, [seq.tokens[i]], skip_special_tokens=True) == "":
                break  # a special token (EOS) ends what is shown
            ends.append(upto)
            prev = upto
        if ends:
            ends[-1] = len(text)
        # Tokens past the shown text (a stop token, the rest of a stop string) end at its end: logprobs
        # have one entry per generated token, as usage counts them.
        ends += [len(text)] * (len(seq.tokens) - len(ends))
        logprobs = self._sampled_logprobs(key, prompt, seq, params.top_logprobs) if params.logprobs else None
        sampled = SampledSequence(list(seq.tokens), seq.stop_reason, list(seq.logprobs), [int(version)] * len(seq.tokens))
        return Choice(index, text, list(seq.tokens), finish, logprobs, ends, sampled)

    def _sampled_logprobs(self, key: str, prompt: list[int], seq: GenSequence, k: int) -> list[TokenLogprob]:
        """A sampled sequence's logprobs as the sampling call reported them (``SamplingParams.top_logprobs``:
        untempered, with `k` alternatives); a replica that reported none (an older one) is asked again
        (`_score`)."""
        if seq.untempered_logprobs is None or (k and seq.top_logprobs is None):
            return self._score(key, prompt, list(seq.tokens), k)
        return self._token_logprobs(list(seq.tokens), seq.untempered_logprobs, seq.top_logprobs, k)

    def _token_logprobs(self, tokens: list[int], lps: list[float],
                        tops: list[tuple[list[int], list[float]]] | None, k: int) -> list[TokenLogprob]:
        """`TokenLogprob`s of `tokens` from their untempered logprobs `lps` and, per position, the most likely
        (token ids, logprobs) `tops` (at most `k` kept; None or k = 0: no alternatives)."""
        dec = functools.partial(decode, self.tokenizer)
        rows = tops if k and tops is not None else [([], [])] * len(tokens)
        return [TokenLogprob(t, dec([t]), float(lp), [(int(a), dec([int(a)]), float(b)) for a, b in zip(*top)][:k])
                for t, lp, top in zip(tokens, lps, rows)]

    def _score(self, key: str, prompt: list[int], tokens: list[int], k: int) -> list[TokenLogprob]:
        """Logprobs (and top-k alternatives) of `tokens` after `prompt` under the served model, untempered, by
        one replica call (prompt logprobs of prompt + tokens): an echoed prompt that is only scored."""
        if not tokens:
            return []
        scoring = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        res = self._sample(self._sampler.request(key, prompt + tokens, scoring, prompt_logprobs=True,
                                                 top_k_prompt_logprobs=k))
        p = len(prompt)
        lps = res.prompt_logprobs[p - 1: p - 1 + len(tokens)]
        return self._token_logprobs(tokens, lps, res.top_k_prompt_logprobs[p - 1: p - 1 + len(tokens)], k)


def decode(tokenizer: PreTrainedTokenizerBase, ids: list[int], skip_special_tokens: bool = False) -> str:
    """``tokenizer.decode(ids, skip_special_tokens=...)``: one sequence of ids decodes to one string."""
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)
    return text


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
