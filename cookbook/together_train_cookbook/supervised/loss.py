"""What the supervised loop does with a batch before each ``optim_step``: a loss object.

`SupervisedLoss.forward_backward(session, batch, step)` accumulates the gradient of one batch
in the session and returns a function that, called later, gives the step's metrics (so a
loss the resource computes stays pipelined: its future is read only when the loop collects the
step). `CrossEntropy` is the built-in one; a client-side loss (e.g. DPO, see
`supervised.dpo.DPO`) runs ``forward`` + ``custom_forward_backward`` through
`custom_loss.forward_backward_custom` and may open sessions of its own in `setup`.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Callable

import together_train as tt

__all__ = ["CrossEntropy", "Metrics", "SupervisedLoss"]

#: Called when the loop collects a step: that step's metrics (name -> number).
Metrics = Callable[[], dict[str, Any]]


class SupervisedLoss(ABC):
    """A training objective the supervised loop applies to each batch."""

    def setup(self, client: tt.ResourceClient, policy: tt.Session, *, init_uri: str | None,
              lora: tt.LoraConfig, stack: contextlib.ExitStack) -> None:
        """Called once after the policy session exists (fresh or resumed), before the start
        evaluation. A loss that needs sessions of its own (DPO's frozen reference) creates them
        here, from the same start (`init_uri`, or a fresh adapter `lora`), and enters them in
        `stack` so they are stopped however the run ends."""

    @abstractmethod
    def forward_backward(self, session: tt.Session, batch: Sequence[Any], step: int) -> Metrics:
        """Accumulate the gradient of `batch` (step `step`) in `session`; the loop submits
        ``optim_step`` right after. Returns the step's metrics as a function called later."""


class CrossEntropy(SupervisedLoss):
    """The resource's ``cross_entropy`` on `together_train.Sample` batches (weights = the
    trained-token mask).

    Metrics: ``loss`` = ``loss:sum / weight sum`` (mean negative log-likelihood per trained
    token, NaN for a batch without weight), ``loss_sum`` (what the resource returns; its
    gradient is the one the optimizer sees, and Adam is invariant to that scale up to eps and
    clipping), ``weight_sum``.
    """

    def forward_backward(self, session: tt.Session, batch: Sequence[tt.Sample], step: int) -> Metrics:
        wsum = float(sum(float(s.loss_fn_inputs["weights"].sum()) for s in batch))
        fut = session.forward_backward(list(batch), loss_fn="cross_entropy")

        def metrics() -> dict[str, Any]:
            loss_sum = fut.result().loss
            return {"loss": loss_sum / wsum if wsum > 0 else float("nan"), "loss_sum": loss_sum, "weight_sum": wsum}

        return metrics
