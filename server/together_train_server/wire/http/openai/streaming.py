"""Server-sent events for ``stream: true``, and the ``openai completion`` log event of every request."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Callable, Iterator

from fastapi.responses import StreamingResponse

from together_train_server.service.errors import ServiceError
from together_train_server.service.interfaces import CompletionStream, log_event
from together_train_server.wire.http.openai.routing import error_response


def sse(obj: Any) -> str:
    """One server-sent event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj)}\n\n"


def log_completion(rid: str, model: Any, prompt_tokens: int, completion_tokens: int, t0: float, **more: Any) -> None:
    """The ``openai completion`` event: counts and seconds since the request arrived."""
    log_event("openai completion", id=rid, model=model, prompt_tokens=prompt_tokens,
              completion_tokens=completion_tokens, **more, seconds=time.perf_counter() - t0)


async def stream_response(stream: CompletionStream, chunks: Iterator[dict[str, Any]], rid: str, model: Any,
                          t0: float, on_done: Callable[[], None] | None = None) -> StreamingResponse:
    """Server-sent events of `chunks` (built from `stream`), then ``[DONE]``.

    The first chunk is made before the response starts, so a request refused
    when its first tokens are asked for (no replica, unknown adapter) gets an
    HTTP error; a failure later ends the events with OpenAI's ``{"error": ...}``.
    Logs ``openai completion`` with ``first_token_s`` (request to the first
    chunk with text) and ``last_sampled_at`` (the replica's clock when the
    last token was sampled). `on_done` runs once every chunk was made (a rollout's record).
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
                yield sse(head)
            for c in it:
                yield sse(c)
            if on_done is not None:
                on_done()
        except ServiceError as err:
            yield sse(json.loads(error_response(err).body))
        finally:
            log_completion(rid, model, stream.prompt_tokens, stream.completion_tokens, t0, stream=True,
                           first_token_s=first_text[0] if first_text else None,
                           last_sampled_at=stream.last_sampled_at)
        yield "data: [DONE]\n\n"

    return _CancellingResponse(stream, events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


class _CancellingResponse(StreamingResponse):
    """A StreamingResponse that cancels its completion once the client is gone.

    Starlette (ASGI spec 2.3, as uvicorn serves it) reads ``http.disconnect`` while it sends; seeing it
    here cancels the replica call at once (`CompletionStream.cancel`), so a thread waiting for the next
    token wakes and the replica drops the request at its next decode step, instead of generating to
    ``max_tokens`` for nobody. However the response ends, the generators are closed afterwards, which
    releases the replica in the pool.
    """

    def __init__(self, stream: CompletionStream, content: Iterator[str], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._stream, self._content = stream, content

    async def __call__(self, scope, receive, send) -> None:
        async def watched():
            message = await receive()
            if message["type"] == "http.disconnect":
                self._stream.cancel()
            return message

        try:
            await super().__call__(scope, watched, send)
        finally:
            self._stream.cancel()  # nothing in flight after a stream that ended: then a no-op
            try:
                self._content.close()
            except ValueError:  # still running on a worker thread: the cancel above ends it there
                pass
            self._stream.close()
