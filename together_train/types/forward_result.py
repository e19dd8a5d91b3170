"""`ForwardResult`: result of forward, forward_backward and custom_forward_backward."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from together_train._proto import session_pb2
from together_train.tensors import from_tensor, to_tensor

__all__ = ["ForwardResult"]


@dataclass
class ForwardResult:
    """Result of `forward`, `forward_backward` and `custom_forward_backward`.

    Attributes:
        loss: the loss **summed** over all samples and positions (never a mean).
        logprobs: when requested, one float32 [n_i] array per sample: the
            untempered logprob of ``target_tokens[j]`` at every position j
            (whatever its weight); else None.
        elementwise_loss: when requested, one float32 [n_i] array per sample
            with each position's loss contribution (sums to the sample's loss); else None.
        metrics: e.g. ``"loss:sum"``, ``"num_tokens:sum"``, ``"weight:sum"``, clip
            fractions, ratio means, KL (suffix names the reduction).
    """

    loss: float
    logprobs: list[np.ndarray] | None = None
    elementwise_loss: list[np.ndarray] | None = None
    metrics: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_proto(cls, msg: session_pb2.ForwardResult) -> "ForwardResult":
        outs = list(msg.outputs)
        logprobs = [from_tensor(o.logprobs) for o in outs] if outs and any(o.HasField("logprobs") for o in outs) else None
        elem = (
            [from_tensor(o.elementwise_loss) for o in outs]
            if outs and any(o.HasField("elementwise_loss") for o in outs)
            else None
        )
        return cls(loss=float(msg.loss), logprobs=logprobs, elementwise_loss=elem, metrics=dict(msg.metrics))

    def to_proto(self) -> session_pb2.ForwardResult:
        msg = session_pb2.ForwardResult(loss=self.loss, metrics=self.metrics)
        n = max(len(self.logprobs or ()), len(self.elementwise_loss or ()))
        for i in range(n):
            out = msg.outputs.add()
            if self.logprobs is not None:
                out.logprobs.CopyFrom(to_tensor(np.asarray(self.logprobs[i], dtype=np.float32)))
            if self.elementwise_loss is not None:
                out.elementwise_loss.CopyFrom(to_tensor(np.asarray(self.elementwise_loss[i], dtype=np.float32)))
        return msg
