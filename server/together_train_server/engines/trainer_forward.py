"""The parts of a trainer forward: per-sample scoring into one result, and the gradient stash.

`ScoreSheet` turns a micro-batch's target logprobs into each sample's loss (``losses.compute_loss``)
and collects a request's total, metric sums and per-sample arrays into one ``ForwardOutput``;
`GradStash` makes a failed forward_backward leave the accumulated gradient exactly as it was.
Shared by `TorchTrainerEngine`, the DeepSpeed workers and the cross-session pass.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from . import losses as _losses
from .length_batching import restore_order
from .types import ForwardOutput, Sample

__all__ = ["GradStash", "ScoreSheet"]


class ScoreSheet:
    """A request's results, collected micro-batch by micro-batch (samples in pass order).

    Args:
        return_logprobs / return_elementwise: keep per-sample float32 arrays of each.
    """

    def __init__(self, return_logprobs: bool, return_elementwise: bool) -> None:
        self.return_logprobs = return_logprobs
        self.return_elementwise = return_elementwise
        self.total = 0.0
        self.acc: dict[str, float] = {}
        self.logprobs: list[np.ndarray] = []
        self.elementwise: list[np.ndarray] = []

    def score(self, lp_flat: torch.Tensor, samples: Sequence[Sample], lens: Sequence[int], loss_fn: str,
              params: Mapping[str, Any], batch: Any, device: torch.device) -> torch.Tensor:
        """The summed loss (a 0-d tensor, in the autograd graph) of ``samples`` whose target logprobs are the
        consecutive rows of ``lp_flat`` (``[sum lens]`` float32, ``lens[i]`` rows each); adds metrics and arrays.

        ``total`` is not updated (the caller adds the value once its backward is settled).
        Raises what ``losses.compute_loss`` raises.
        """
        start, total = 0, None
        for s, n in zip(samples, lens):
            inputs = {k: torch.as_tensor(np.asarray(v)).to(device) for k, v in s.inputs.items()}
            lp = lp_flat[start: start + n]
            res = _losses.compute_loss(loss_fn, lp, inputs, params, batch)
            s_loss = res.elementwise.sum()
            total = s_loss if total is None else total + s_loss
            for k, v in res.metrics.items():
                self.acc[k] = self.acc.get(k, 0.0) + float(v)
            if self.return_logprobs:
                self.logprobs.append(lp.detach().float().cpu().numpy().astype(np.float32))
            if self.return_elementwise:
                self.elementwise.append(res.elementwise.detach().float().cpu().numpy().astype(np.float32))
            start += n
        assert total is not None, "a micro-batch holds at least one sample"
        return total

    def check_finite(self, loss_fn: str) -> None:
        """Raise FloatingPointError when the total loss is not finite."""
        if not math.isfinite(self.total):
            raise FloatingPointError(
                f"the {loss_fn} loss of this batch is not finite ({self.total}); nothing was accumulated "
                "(check advantages and sampler logprobs: r = exp(p - q) may overflow)"
            )

    def output(self, order: Sequence[int]) -> ForwardOutput:
        """The ``ForwardOutput``, arrays back in request order (``order[k]``: the request index of the k-th
        scored sample); ``metrics`` from ``losses.finalize_metrics`` plus ``loss:sum``."""
        metrics = _losses.finalize_metrics(self.acc)
        metrics["loss:sum"] = self.total
        return ForwardOutput(
            loss=self.total,
            logprobs=restore_order(self.logprobs, order) if self.return_logprobs else None,
            elementwise_loss=restore_order(self.elementwise, order) if self.return_elementwise else None,
            metrics=metrics,
        )


class GradStash:
    """The accumulated gradients of ``params``, set aside while a forward_backward runs.

    The backward passes accumulate into fresh ``.grad``; `merge` adds the stash back (old + new:
    the same float operation autograd's accumulation does), `restore` puts it back unchanged.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter]) -> None:
        self.params = list(params)
        self.old = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None

    def check_finite(self, loss_fn: str) -> None:
        """Raise FloatingPointError when a new gradient is not finite."""
        for p in self.params:
            if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                raise FloatingPointError(f"the {loss_fn} gradient of this batch is not finite; nothing was accumulated")

    def restore(self) -> None:
        """Failure: the gradients as they were before."""
        for p, old in zip(self.params, self.old):
            p.grad = old

    def merge(self) -> None:
        """Success: old + new."""
        for p, old in zip(self.params, self.old):
            if old is not None:
                p.grad = old if p.grad is None else old.add_(p.grad)
