"""Memory admission: refuse a training/scoring request whose estimated peak exceeds the budget.

All sessions share one trainer process; one operation that runs it out of
memory would get it OOM-killed with every session on it. So each forward /
forward_backward / custom_forward_backward request is estimated when it is
submitted (``engine.memory_estimate``: the largest micro-batch's peak, formula
in ``engines/memory_estimate.py``) and, above the budget, refused then: the
operation ends FAILED with ``RESOURCE_EXHAUSTED`` naming the sample (index
and length) that fixes the micro-batch's size and the budget. It never
reaches the trainer, so no state changes, and the session's next request
and every other session proceed.

Scoring on the generator replicas is admitted the same way (``check_scoring``):
``compute_logprobs`` (every sequence of the request in one batch) and a sample
asking for prompt logprobs (its prompt, and the KV cache of its streams),
estimated by ``memory_estimate.scoring_estimate`` from the trainer's model
sizes and dtype (the replicas serve the same base model; a bfloat16 replica
needs less, so the estimate stays an upper bound for it) and refused with the
same ``RESOURCE_EXHAUSTED`` before any replica is asked. The budget is then
what one scoring call may add to a replica process.

The budget (``serve --memory-budget-mb N``) bounds one operation's peak above
the trainer's resident memory before it. Default: ``DEFAULT_FRACTION`` of the
memory available when the server starts (``MemAvailable`` of
``/proc/meminfo``, read after the model has loaded), so memory other
processes take later is the operator's margin; ``0`` turns admission off.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Sequence

from together_train_server.service.errors import ServiceError

if TYPE_CHECKING:
    from together_train_server.engines.memory_estimate import MicroBatchEstimate
    from together_train_server.service.core.runtime import TrainerRuntime

__all__ = ["DEFAULT_FRACTION", "available_bytes", "default_budget_bytes", "MemoryAdmission"]

DEFAULT_FRACTION = 0.8
MB = 1 << 20


def available_bytes() -> int:
    """Memory available to new allocations now: ``MemAvailable`` (Linux), else physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def default_budget_bytes() -> int:
    """``DEFAULT_FRACTION`` of ``available_bytes()``."""
    return int(DEFAULT_FRACTION * available_bytes())


class MemoryAdmission:
    """Checks requests against a per-operation memory budget.

    Args:
        runtime: the trainer runtime (its pure ``memory_estimate`` and ``model_dims``, on the caller's thread).
        budget_bytes: the budget; ``None`` or ``0`` admits everything.
    """

    def __init__(self, runtime: TrainerRuntime, budget_bytes: int | None) -> None:
        self.runtime = runtime
        self.budget_bytes = int(budget_bytes or 0)

    def check(self, session_id: str, lens: Sequence[int], backward: bool) -> None:
        """Raise ``RESOURCE_EXHAUSTED`` (sample_index set) when the request's estimate exceeds the budget.

        Args:
            session_id: the session (its gradient buffers count).
            lens: model_input lengths of the request's samples.
            backward: forward_backward (True) or forward.
        """
        if not self.budget_bytes or not lens:
            return
        est = self.runtime.memory_estimate(list(lens), backward, session_id)
        if est.bytes <= self.budget_bytes:
            return
        self._refuse(est, est.longest_index, "forward_backward" if backward else "forward",
                     f"activation checkpointing {'on' if est.checkpointed else 'off'}")

    def admits(self, lens: Sequence[int], backward: bool) -> bool:
        """Whether samples of ``lens`` right-padded into one micro-batch (``len(lens)`` x the longest: a clock
        cycle's pass, service/training/cycle.py) are within the budget (always, without one)."""
        if not self.budget_bytes or not lens:
            return True
        return self.runtime.memory_estimate([max(lens)] * len(lens), backward).bytes <= self.budget_bytes

    def check_scoring(self, lens: Sequence[int], what: str, *, num_samples: int = 0, max_tokens: int = 0,
                      sample_index: int | None = None) -> None:
        """Raise ``RESOURCE_EXHAUSTED`` when scoring ``lens`` on a generator replica would exceed the budget.

        Args:
            lens: token counts scored in one batch (``compute_logprobs``: every sequence; a sample: its prompt).
            what: the operation, for the message ("compute_logprobs", "prompt logprobs").
            num_samples, max_tokens: a sample's streams and new tokens (their KV cache); 0 for scoring only.
            sample_index: the index the error names when ``lens`` is one prompt of a batch (default:
                the longest sequence's index in ``lens``).
        """
        if not self.budget_bytes or not lens:
            return
        from together_train_server.engines.memory_estimate import scoring_estimate

        est = scoring_estimate(self.runtime.model_dims(), list(lens), num_samples=num_samples, max_tokens=max_tokens)
        if est.bytes > self.budget_bytes:
            streams = f"{num_samples} stream{'s' if num_samples != 1 else ''}"
            extra = f"{streams} of up to {max_tokens} new tokens" if num_samples else "scored in one batch"
            self._refuse(est, est.longest_index if sample_index is None else sample_index, what, extra)

    def _refuse(self, est: MicroBatchEstimate, index: int, what: str, detail: str) -> None:
        group = f"{len(est.samples)} samples x {est.longest_len} padded tokens" if len(est.samples) > 1 \
            else "it runs alone"
        raise ServiceError(
            "RESOURCE_EXHAUSTED",
            f"sample {index} ({est.longest_len} tokens) needs an estimated {est.bytes / MB:.0f} MB "
            f"for its {what} ({group}; {detail}), over this resource's per-operation memory budget of "
            f"{self.budget_bytes / MB:.0f} MB (serve --memory-budget-mb); send shorter samples or fewer "
            "long ones per request",
            sample_index=index,
        )
