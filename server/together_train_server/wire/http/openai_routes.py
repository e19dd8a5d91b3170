"""OpenAI-compatible inference: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``.

JSON <-> `service.inference` only: the models, prompts, limits, sampling and
text live in `InferenceService`; this module reads OpenAI's request shapes,
writes OpenAI's response shapes (also as server-sent events for
``stream: true``) and errors in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``, and routes a sample
request to a generator replica (`replica_sampler`). ``model`` is the base
model's id (``GET /v1/models``) or an inference checkpoint's URI
(``together-train://<session>/weights/<name>``). API keys: ``Authorization:
Bearer <key>`` (the official ``openai`` client's ``api_key``), checked by the
app (`app.create_app`), which answers a refused key in this module's error
shape (`ERROR_PREFIXES`, `error_response`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Callable, Iterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.inference import (
    Choice,
    Completion,
    CompletionStream,
    InferenceService,
    ResourceCatalog,
    SampledSequence,
    SampleFn,
    SampleResult,
    StreamFn,
    TokenBatch,
    openai_params,
)
from together_train_server.service.telemetry import log_event

router = APIRouter()

# Paths whose errors (auth included) take OpenAI's shape; /v1/rl/... is the Together API's.
ERROR_PREFIXES = ("/v1/models", "/v1/completions", "/v1/chat/completions")

_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNIMPLEMENTED": 400,
           "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429,
           "ABORTED": 409, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 409: "conflict_error", 429: "rate_limit_error"}


def error_response(err: ServiceError) -> JSONResponse:
    """OpenAI's error shape for a ServiceError: ``{"error": {"message", "type", "param", "code"}}``.

    ``param`` is the request field at fault (our error's key); ``code`` is
    ``model_not_found`` for an unknown model, else our status code's name
    (lower case); 5xx are ``server_error``.
    """
    status = _STATUS.get(err.code, 500)
    code = "model_not_found" if err.code == "NOT_FOUND" and err.key == "model" else err.code.lower()
    if err.code == "UNAUTHENTICATED":
        code = "invalid_api_key"
    body = {"error": {"message": err.message, "type": _TYPE.get(status, "server_error"), "param": err.key,
                      "code": code}}
    return JSONResponse(body, status_code=status)


def _sample_request(key: str, prompt: list[int], kw: dict[str, Any], n: int, prompt_lp: bool = False,
                    top_k: int = 0) -> Any:
    from together_train._proto import common_pb2, generator_pb2

    sp = common_pb2.SamplingParams(max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_k=kw["top_k"],
                                   top_p=kw["top_p"], stop=kw["stop"], stop_token_ids=kw["stop_token_ids"],
                                   ignore_eos=kw["ignore_eos"])
    if kw["seed"] is not None:
        sp.seed = kw["seed"]
    return generator_pb2.SampleRequest(session_id=key, prompt=prompt, params=sp, num_samples=n,
                                       prompt_logprobs=prompt_lp, top_k_prompt_logprobs=top_k)


def _sample_result(resp: Any) -> SampleResult:
    from together_train._proto import generator_pb2

    return SampleResult(
        [SampledSequence(list(s.tokens), "length" if s.stop_reason == generator_pb2.LENGTH else "stop")
         for s in resp.sequences],
        list(resp.prompt_logprobs),
        [(list(t.token_ids), list(t.logprobs)) for t in resp.top_k_prompt_logprobs],
    )


def _replica_error(e: Exception) -> ServiceError:
    """A replica's gRPC status as a ServiceError with its code."""
    code = getattr(e, "code", None)
    name = code().name if callable(code) else "INTERNAL"
    details = e.details() if callable(getattr(e, "details", None)) else str(e)
    return ServiceError(name, f"sampling failed on a replica: {details}")


def replica_sampler(pool: Any) -> SampleFn:
    """A `SampleFn` that sends a generator ``SampleRequest`` to the least-loaded replica of `pool`.

    The pool re-pushes an adapter a replica lost (``key``) and retries on
    another replica when one is down; a replica's gRPC error becomes a
    ServiceError with its status code.
    """

    def sample(key: str, prompt: list[int], kw: dict[str, Any], n: int, prompt_lp: bool, top_k: int) -> SampleResult:
        req = _sample_request(key, prompt, kw, n, prompt_lp, top_k)
        try:
            return _sample_result(pool.route(lambda c: c.sample(req), key=key))
        except ServiceError:
            raise
        except Exception as e:
            raise _replica_error(e) from None

    return sample


def replica_stream_sampler(pool: Any) -> StreamFn:
    """A `StreamFn`: a generator ``SampleStream`` on the least-loaded replica of `pool` (``pool.route_stream``).

    Yields a `TokenBatch` per message of new tokens, then the `SampleResult`.
    Failures before the first tokens are retried as `replica_sampler`'s; a
    replica's gRPC error becomes a ServiceError with its status code.
    """

    def stream(key: str, prompt: list[int], kw: dict[str, Any], n: int) -> Iterator[TokenBatch | SampleResult]:
        req = _sample_request(key, prompt, kw, n)
        try:
            for chunk in pool.route_stream(lambda c: c.sample_stream(req), key=key):
                if chunk.HasField("done"):
                    yield _sample_result(chunk.done)
                    return
                t = chunk.tokens
                yield TokenBatch(list(zip(t.sequence, t.token_ids)), t.sampled_at)
        except ServiceError:
            raise
        except Exception as e:
            raise _replica_error(e) from None

    return stream


def inference_for_resource(resource: Any) -> InferenceService:
    """The `InferenceService` of a running resource: its base model, checkpoints, tokenizer, limits, replicas."""
    tokenizer = getattr(resource.engine, "tokenizer", None)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(resource.engine.model_dir))
    return InferenceService(ResourceCatalog(resource), tokenizer, resource.limits, replica_sampler(resource.pool),
                            replica_stream_sampler(resource.pool))


def install(app: Any, resource: Any) -> None:
    """Set ``app.state.inference``: the resource's own (``together-train deploy``) or one built for it."""
    app.state.inference = getattr(resource, "inference", None) or inference_for_resource(resource)


def _service(request: Request) -> tuple[InferenceService, str]:
    return request.app.state.inference, getattr(request.state, "owner", "")


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await request.body() or b"{}")
    except ValueError as e:
        raise invalid(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _handled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Answer ServiceErrors in OpenAI's shape (the app's handler answers in the Tinker shape)."""
    import functools

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return await fn(*args, **kwargs)
        except ServiceError as err:
            return error_response(err)

    return wrapper


# ----- models --------------------------------------------------------------------------------
def _model_json(m: Any) -> dict[str, Any]:
    out = {"id": m.id, "object": "model", "created": m.created, "owned_by": "together-train"}
    if m.parent:
        out["parent"] = out["root"] = m.parent
    else:
        out["root"] = m.id
    return out


@router.get("/v1/models")
@_handled
async def list_models(request: Request) -> Any:
    """The base model, then the caller's inference checkpoints (newest first)."""
    svc, owner = _service(request)
    models = await asyncio.to_thread(svc.models, owner)
    return {"object": "list", "data": [_model_json(m) for m in models]}


@router.get("/v1/models/{model:path}")
@_handled
async def retrieve_model(model: str, request: Request) -> Any:
    svc, owner = _service(request)
    for m in await asyncio.to_thread(svc.models, owner):
        if m.id == model:
            return _model_json(m)
    raise ServiceError("NOT_FOUND", f"model {model!r} does not exist (see GET /v1/models)", key="model")


# ----- completions ---------------------------------------------------------------------------
def _usage(c: Completion) -> dict[str, int]:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens}


def _stream_usage(s: CompletionStream) -> dict[str, int]:
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens}


def _legacy_logprobs(ch: Choice) -> dict[str, Any] | None:
    """/v1/completions' logprobs object: tokens, token_logprobs, top_logprobs, text_offset."""
    if ch.logprobs is None:
        return None
    starts = [0] + ch.token_ends[:-1]
    return {"tokens": [t.token for t in ch.logprobs], "token_logprobs": [t.logprob for t in ch.logprobs],
            "top_logprobs": [{s: lp for _, s, lp in t.top} for t in ch.logprobs],
            "text_offset": starts[: len(ch.logprobs)]}


def _chat_logprobs(items: list[Any]) -> dict[str, Any]:
    def tok(s: str, lp: float) -> dict[str, Any]:
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**tok(t.token, t.logprob), "top_logprobs": [tok(s, lp) for _, s, lp in t.top]}
                        for t in items]}


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _log(rid: str, model: Any, prompt_tokens: int, completion_tokens: int, t0: float, **more: Any) -> None:
    """The ``openai completion`` event: counts and seconds since the request arrived."""
    log_event("openai completion", id=rid, model=model, prompt_tokens=prompt_tokens,
              completion_tokens=completion_tokens, **more, seconds=time.perf_counter() - t0)


async def _stream(stream: CompletionStream, chunks: Iterator[dict[str, Any]], rid: str, model: Any,
                  t0: float) -> StreamingResponse:
    """Server-sent events of `chunks` (built from `stream`), then ``[DONE]``.

    The first chunk is made before the response starts, so a request refused
    when its first tokens are asked for (no replica, unknown adapter) gets an
    HTTP error; a failure later ends the events with OpenAI's ``{"error": ...}``.
    Logs ``openai completion`` with ``first_token_s`` (request to the first
    chunk with text) and ``last_sampled_at`` (the replica's clock when the
    last token was sampled).
    """
    first_text: list[float] = []

    def timed() -> Iterator[dict[str, Any]]:
        for c in chunks:
            if not first_text and any(ch.get("text") or (ch.get("delta") or {}).get("content")
                                      for ch in c.get("choices", ())):
                first_text.append(time.perf_counter() - t0)
            yield c

    it = timed()
    head = await asyncio.to_thread(next, it, None)

    def events() -> Iterator[str]:
        try:
            if head is not None:
                yield _sse(head)
            for c in it:
                yield _sse(c)
        except ServiceError as err:
            yield _sse(json.loads(error_response(err).body))
        finally:
            _log(rid, model, stream.prompt_tokens, stream.completion_tokens, t0, stream=True,
                 first_token_s=first_text[0] if first_text else None, last_sampled_at=stream.last_sampled_at)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


@router.post("/v1/completions")
@_handled
async def completions(request: Request) -> Any:
    """Text completion of a prompt (string, strings, or token ids); choice index = prompt index * n + i."""
    svc, owner = _service(request)
    body = await _body(request)
    await asyncio.to_thread(svc.model_key, body.get("model"), owner)  # the model before the payload
    params = openai_params(body, chat=False, limits=svc.limits)
    prompts = await asyncio.to_thread(svc.text_prompts, body.get("prompt"))
    model = body.get("model")
    rid, created, t0 = f"cmpl-{uuid.uuid4().hex}", int(time.time()), time.perf_counter()
    head = {"id": rid, "object": "text_completion", "created": created, "model": model}
    if not params.stream:
        done = await asyncio.to_thread(svc.complete, model, prompts, params, owner)
        _log(rid, model, done.prompt_tokens, done.completion_tokens, t0, stream=False)
        return {**head, "choices": [{"index": ch.index, "text": ch.text, "logprobs": _legacy_logprobs(ch),
                                     "finish_reason": ch.finish_reason} for ch in done.choices],
                "usage": _usage(done)}
    stream = await asyncio.to_thread(svc.stream, model, prompts, params, owner)

    def chunks() -> Iterator[dict[str, Any]]:
        offset: dict[int, int] = {}  # text sent so far per choice (logprobs' text_offset)
        for ev in stream:
            lps = None
            if ev.logprob is not None:
                lp = ev.logprob
                lps = {"tokens": [lp.token], "token_logprobs": [lp.logprob],
                       "top_logprobs": [{s: v for _, s, v in lp.top}], "text_offset": [offset.get(ev.index, 0)]}
            offset[ev.index] = offset.get(ev.index, 0) + len(ev.delta)
            yield {**head, "choices": [{"index": ev.index, "text": ev.delta, "logprobs": lps,
                                        "finish_reason": ev.finish_reason}]}
        if params.include_usage:
            yield {**head, "choices": [], "usage": _stream_usage(stream)}

    return await _stream(stream, chunks(), rid, model, t0)


@router.post("/v1/chat/completions")
@_handled
async def chat_completions(request: Request) -> Any:
    """A chat completion: messages rendered with the model's chat template, the reply as the assistant's."""
    svc, owner = _service(request)
    body = await _body(request)
    await asyncio.to_thread(svc.model_key, body.get("model"), owner)  # the model before the payload
    params = openai_params(body, chat=True, limits=svc.limits)
    prompt = await asyncio.to_thread(svc.chat_prompt, body.get("messages"))
    model = body.get("model")
    rid, created, t0 = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), time.perf_counter()
    if not params.stream:
        done = await asyncio.to_thread(svc.complete, model, [prompt], params, owner)
        _log(rid, model, done.prompt_tokens, done.completion_tokens, t0, stream=False)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": model}
        return {**head, "choices": [
            {"index": ch.index, "message": {"role": "assistant", "content": ch.text},
             "logprobs": _chat_logprobs(ch.logprobs) if ch.logprobs is not None else None,
             "finish_reason": ch.finish_reason} for ch in done.choices], "usage": _usage(done)}
    stream = await asyncio.to_thread(svc.stream, model, [prompt], params, owner)
    head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunks() -> Iterator[dict[str, Any]]:
        started: set[int] = set()
        for ev in stream:
            if ev.index not in started:  # each choice opens with the assistant's role (as OpenAI streams)
                started.add(ev.index)
                yield {**head, "choices": [{"index": ev.index, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]}
            delta = {"content": ev.delta} if ev.finish_reason is None else {}
            yield {**head, "choices": [{"index": ev.index, "delta": delta,
                                        "logprobs": _chat_logprobs([ev.logprob]) if ev.logprob is not None else None,
                                        "finish_reason": ev.finish_reason}]}
        if params.include_usage:
            yield {**head, "choices": [], "usage": _stream_usage(stream)}

    return await _stream(stream, chunks(), rid, model, t0)
