"""Client-side losses through ``forward`` + ``custom_forward_backward`` (DPO as the example).

The resource differentiates only losses it knows. Any other loss that is a
function of the per-token logprobs ``p`` runs in two operations:

1. ``session.forward(samples, return_logprobs=True)`` gives ``p`` (untempered,
   float32 ``[n_i]`` per sample) under the current weights;
2. the client computes its loss ``L(p)`` and ``g = dL/dp`` (numpy, any code),
   and ``session.custom_forward_backward(samples, g)`` makes the server
   backpropagate ``sum g·p``, which has exactly the gradient ``dL/dtheta``.

Both operations are queued on the same session in order, so no
``optim_step`` can run between them unless the caller submitted one.

`dpo_loss` is the DPO objective (Rafailov et al. 2023, arXiv:2305.18290,
eq. 7), summed over pairs (never averaged).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import together_train as tt

__all__ = [
    "CustomLossResult",
    "LossFn",
    "current_logprobs",
    "forward_backward_custom",
    "sequence_logprobs",
    "dpo_loss",
]

#: A client loss: (samples, per-sample float64 logprobs [n_i]) -> (loss value, per-sample dL/dp [n_i], metrics).
LossFn = Callable[[Sequence[tt.Sample], list[np.ndarray]], tuple[float, list[np.ndarray], dict[str, float]]]


@dataclass
class CustomLossResult:
    """Outcome of `forward_backward_custom`.

    Attributes:
        loss: the client loss L (as the loss function computed it).
        surrogate: ``sum g·p`` the server backpropagated (reported by the server; a sum).
        logprobs: per-sample float32 [n_i] logprobs the loss was computed from.
        gradients: per-sample float32 [n_i] ``dL/dp`` sent to the server.
        metrics: the loss function's metrics.
    """

    loss: float
    surrogate: float
    logprobs: list[np.ndarray]
    gradients: list[np.ndarray]
    metrics: dict[str, float] = field(default_factory=dict)


def _targets_only(samples: Sequence[tt.Sample]) -> list[tt.Sample]:
    return [
        tt.Sample(model_input=s.model_input, loss_fn_inputs={"target_tokens": s.loss_fn_inputs["target_tokens"]})
        for s in samples
    ]


def _zero_weight(samples: Sequence[tt.Sample]) -> list[tt.Sample]:
    out = []
    for s in samples:
        tgt = s.loss_fn_inputs["target_tokens"]
        out.append(tt.Sample(model_input=s.model_input,
                             loss_fn_inputs={"target_tokens": tgt, "weights": np.zeros(len(tgt), np.float32)}))
    return out


def current_logprobs(session: Any, samples: Sequence[tt.Sample], timeout: float | None = None) -> list[np.ndarray]:
    """Per-sample float32 [n_i] target-token logprobs under the session's current weights."""
    res = session.forward(_zero_weight(samples), "cross_entropy", return_logprobs=True).result(timeout)
    return [np.asarray(lp, dtype=np.float32) for lp in res.logprobs]


def sequence_logprobs(session: Any, samples: Sequence[tt.Sample], timeout: float | None = None) -> np.ndarray:
    """``sum_t weights_t * p_t`` per sample (float64 [num_samples]); ``weights`` default 1.

    Call it before training (or on a frozen session) to get DPO's reference logprobs.
    """
    lps = current_logprobs(session, samples, timeout)
    return np.array([
        float(np.dot(np.asarray(s.loss_fn_inputs.get("weights", np.ones(len(lp))), np.float64), lp.astype(np.float64)))
        for s, lp in zip(samples, lps)
    ])


def forward_backward_custom(
    session: Any, samples: Sequence[tt.Sample], loss_fn: LossFn, timeout: float | None = None
) -> CustomLossResult:
    """Accumulate the gradient of a client-side loss of the per-token logprobs.

    Args:
        session: a `together_train.Session`.
        samples: samples with ``target_tokens`` (other ``loss_fn_inputs`` keys, e.g. weights,
            are for `loss_fn` only; the server sees target_tokens).
        loss_fn: ``(samples, logprobs) -> (L, [dL/dp per sample], metrics)``; logprobs are
            float64 copies of the server's float32 values.

    Returns:
        `CustomLossResult`. The gradient is in the session's accumulator; call `optim_step`.

    Raises:
        ValueError: the loss function returned gradients of the wrong count or shape.
    """
    lps = current_logprobs(session, samples, timeout)
    loss, grads, metrics = loss_fn(samples, [lp.astype(np.float64) for lp in lps])
    if len(grads) != len(samples):
        raise ValueError(f"loss_fn returned {len(grads)} gradients for {len(samples)} samples")
    g32 = []
    for i, (g, lp) in enumerate(zip(grads, lps)):
        g = np.asarray(g, dtype=np.float32)
        if g.shape != lp.shape:
            raise ValueError(f"gradient {i} has shape {g.shape}, the sample has {lp.shape}")
        g32.append(g)
    res = session.custom_forward_backward(_targets_only(samples), g32).result(timeout)
    return CustomLossResult(float(loss), float(res.loss), lps, g32, dict(metrics))


def _log_sigmoid(x: np.ndarray) -> np.ndarray:
    return -np.logaddexp(0.0, -x)


def dpo_loss(reference_chosen: Sequence[float], reference_rejected: Sequence[float], beta: float = 0.1) -> LossFn:
    """DPO over pairs; samples are ordered ``[chosen_0, rejected_0, chosen_1, rejected_1, ...]``.

    With ``pi = sum_t weights_t * p_t`` per sample (``weights`` = completion mask, default 1)
    and the reference sums ``ref`` of the same samples (`sequence_logprobs` before training):
    ``z_k = beta * ((pi_c - ref_c) - (pi_r - ref_r))``, ``L = -sum_k log sigmoid(z_k)``
    (a sum over pairs). Gradient: ``dL/dp_t = -beta * sigmoid(-z_k) * w_t`` on the chosen
    sample, ``+beta * sigmoid(-z_k) * w_t`` on the rejected one.

    Metrics: ``dpo_accuracy:mean`` (fraction of pairs with z > 0), ``dpo_margin:mean`` (mean z / beta).
    """
    ref_c = np.asarray(reference_chosen, dtype=np.float64)
    ref_r = np.asarray(reference_rejected, dtype=np.float64)
    if ref_c.shape != ref_r.shape or ref_c.ndim != 1:
        raise ValueError("reference_chosen and reference_rejected must be 1-D and of equal length")

    def fn(samples: Sequence[tt.Sample], logprobs: list[np.ndarray]) -> tuple[float, list[np.ndarray], dict[str, float]]:
        if len(samples) != 2 * ref_c.size:
            raise ValueError(f"{len(samples)} samples for {ref_c.size} pairs: pass chosen, rejected alternately")
        ws = [np.asarray(s.loss_fn_inputs.get("weights", np.ones(len(lp))), np.float64) for s, lp in zip(samples, logprobs)]
        pi = np.array([float(np.dot(w, lp)) for w, lp in zip(ws, logprobs)])
        z = beta * ((pi[0::2] - ref_c) - (pi[1::2] - ref_r))
        loss = float(-_log_sigmoid(z).sum())
        coef = beta / (1.0 + np.exp(z))  # beta * sigmoid(-z)
        grads = []
        for i, w in enumerate(ws):
            k = i // 2
            grads.append((-coef[k] if i % 2 == 0 else coef[k]) * w)
        return loss, grads, {"dpo_accuracy:mean": float((z > 0).mean()), "dpo_margin:mean": float((z / beta).mean())}

    return fn
