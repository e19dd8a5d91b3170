"""Sample builders: one value per *token* in, shifted per-*position* arrays out.

The service never shifts arrays (docs/design.md §4): position i of a sample is scored
on predicting ``target_tokens[i] = full[i+1]`` from ``model_input[:i+1]``. An
array trimmed from the wrong end still has the right length and trains on the
wrong tokens without any error, so build samples here: the builders take one
value per token of the full sequence, drop the first value (nothing predicts
the first token) exactly as ``target_tokens`` drops the first token, and
reject arrays whose length does not match.

Example (six tokens t0..t5, train on t3..t5)::

    tokens  = [t0, t1, t2, t3, t4, t5]
    weights = [0,  0,  0,  1,  1,  1 ]          # one per token
    s = build_cross_entropy_sample(tokens, weights)
    s.model_input                    == [t0, t1, t2, t3, t4]
    s.loss_fn_inputs["target_tokens"] == [t1, t2, t3, t4, t5]
    s.loss_fn_inputs["weights"]       == [0,  0,  1,  1,  1 ]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import together_train as tt

from together_train_cookbook.codec import Codec


def _tokens_array(tokens: Any) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"tokens must be 1-D, got shape {list(arr.shape)}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"tokens must be integer ids, got dtype {arr.dtype}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"tokens must be >= 0, got {int(arr.min())}")
    if arr.shape[0] < 2:
        raise ValueError(
            f"a sample needs at least 2 tokens (one input, one target), got {arr.shape[0]}"
        )
    return arr.astype(np.int64)


def _per_token(values: Any, n_tokens: int, name: str) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D (one value per token), got shape {list(arr.shape)}")
    if arr.shape[0] != n_tokens:
        raise ValueError(
            f"{name} has {arr.shape[0]} values but tokens has {n_tokens}: give one value per "
            f"token of the full sequence (the builder drops the first one)"
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} holds NaN or inf")
    return arr.astype(np.float32)


def build_cross_entropy_sample(tokens: Sequence[int] | np.ndarray, weights: Any) -> tt.Sample:
    """Build a ``cross_entropy`` sample from a full sequence and one weight per token.

    Args:
        tokens: int ids, shape [m], m >= 2 (prompt + completion, e.g. `Codec.render().tokens`).
        weights: floats, shape [m]; ``weights[j]`` scales the loss of predicting ``tokens[j]``
            (e.g. `Codec.render().train_mask`). ``weights[0]`` is dropped.

    Returns:
        `together_train.Sample` with, all of length n = m - 1:
        ``model_input = tokens[:-1]`` (int64), ``loss_fn_inputs["target_tokens"] = tokens[1:]``
        (int64) and ``loss_fn_inputs["weights"] = weights[1:]`` (float32). The server's loss is
        ``-sum_i weights[i] * log p(target_tokens[i] | model_input[:i+1])``.

    Raises:
        ValueError: fewer than 2 tokens, tokens not 1-D non-negative integers,
            ``len(weights) != len(tokens)`` (the message names both lengths), NaN/inf weights.
    """
    toks = _tokens_array(tokens)
    w = _per_token(weights, toks.shape[0], "weights")
    return tt.Sample(
        model_input=toks[:-1].copy(),
        loss_fn_inputs={"target_tokens": toks[1:].copy(), "weights": w[1:].copy()},
    )


def build_policy_sample(
    tokens: Sequence[int] | np.ndarray,
    logprobs: Any,
    advantages: Any,
    *,
    weights: Any | None = None,
    mask: Any | None = None,
    reference_logprobs: Any | None = None,
) -> tt.Sample:
    """Build a policy-loss sample (``importance_sampling``, ``ppo``, ``cispo``, ``dro``, ``grpo``).

    Every array has one value per token of the full sequence (``[m]``), aligned with
    ``tokens``: ``logprobs[j]`` is the sampler's logprob of ``tokens[j]`` (prompt tokens,
    which were not sampled, may hold anything finite, e.g. 0, and should be masked out),
    ``advantages[j]`` the advantage of ``tokens[j]``. The first value of each array is
    dropped, exactly as ``target_tokens = tokens[1:]`` drops the first token.

    Args:
        tokens: int ids, shape [m], m >= 2 (prompt + completion).
        logprobs: floats [m], sampler logprobs q (of the temperature-scaled distribution the
            tokens were sampled from, as `SampleResult` reports them).
        advantages: floats [m], or one float broadcast to every token (e.g. a group-relative
            sequence advantage).
        weights: optional floats [m]; the server multiplies each token's loss term by
            ``weights * mask`` (fractional values scale the term and its gradient; 0 = not trained).
        mask: optional floats [m] (typically 0 for prompt tokens, 1 for sampled ones).
        reference_logprobs: optional floats [m], reference-policy logprobs (grpo with beta > 0).

    Returns:
        `together_train.Sample` of length n = m - 1 with ``model_input = tokens[:-1]`` and
        ``loss_fn_inputs``: ``target_tokens`` (int64) and float32 ``logprobs``, ``advantages``
        and the optional arrays given, each ``values[1:]``.

    Raises:
        ValueError: fewer than 2 tokens, tokens not 1-D non-negative integers, an array whose
            length differs from ``len(tokens)`` (the message names both lengths), NaN/inf.
    """
    toks = _tokens_array(tokens)
    m = toks.shape[0]
    adv = np.asarray(advantages, dtype=np.float64)
    if adv.ndim == 0:
        adv = np.full(m, float(adv))
    per_token: dict[str, Any] = {"logprobs": logprobs, "advantages": adv}
    for key, values in (("weights", weights), ("mask", mask), ("reference_logprobs", reference_logprobs)):
        if values is not None:
            per_token[key] = values
    return build_sample(toks, per_token)


def build_sample(
    tokens: Sequence[int] | np.ndarray,
    per_token_inputs: Mapping[str, Any],
    int_keys: Sequence[str] = (),
) -> tt.Sample:
    """General builder: every array in `per_token_inputs` has one value per token ([m]);
    each is trimmed to ``[1:]`` like ``target_tokens``. Keys in `int_keys` become int64,
    the rest float32. ``target_tokens`` is always added (``tokens[1:]``).

    Raises:
        ValueError: as `build_cross_entropy_sample`, for any key.
    """
    toks = _tokens_array(tokens)
    m = toks.shape[0]
    inputs: dict[str, np.ndarray] = {"target_tokens": toks[1:].copy()}
    for key, values in per_token_inputs.items():
        if key == "target_tokens":
            raise ValueError("target_tokens is derived from tokens; do not pass it")
        if key in int_keys:
            arr = np.asarray(values)
            if arr.ndim != 1 or arr.shape[0] != m:
                raise ValueError(
                    f"{key} has shape {list(arr.shape)} but tokens has {m}: give one value per token"
                )
            inputs[key] = arr[1:].astype(np.int64)
        else:
            inputs[key] = _per_token(values, m, key)[1:].copy()
    return tt.Sample(model_input=toks[:-1].copy(), loss_fn_inputs=inputs)


def conversation_to_sample(
    codec: Codec, messages: Sequence[Mapping[str, Any]], max_length: int | None = None
) -> tt.Sample:
    """Render a chat with `codec` and build a ``cross_entropy`` sample that trains on the
    assistant turns only (weights = the codec's train mask).

    Args:
        max_length: if given, keep only the first `max_length` tokens of the rendering
            (so the sample has at most max_length - 1 positions).

    Raises:
        ValueError: the truncated conversation has no trained token left, or as
            `Codec.render` / `build_cross_entropy_sample`.
    """
    rendered = codec.render(messages)
    tokens, mask = rendered.tokens, rendered.train_mask
    if max_length is not None:
        tokens, mask = tokens[:max_length], mask[:max_length]
    if sum(mask[1:]) == 0:
        raise ValueError(
            "conversation has no assistant token to train on"
            + (f" within max_length={max_length}" if max_length is not None else "")
        )
    return build_cross_entropy_sample(tokens, mask)


def conversation_to_samples(
    codec: Codec, messages: Sequence[Mapping[str, Any]], max_length: int | None = None
) -> list[tt.Sample]:
    """Like `conversation_to_sample`, through `Codec.render_turns`: one sample for a
    prefix-stable chat template, else one per assistant turn (each trained against the history
    the model sees at inference, e.g. with earlier ``<think>`` blocks stripped).

    Turns left without a trained token by `max_length` are dropped.

    Raises:
        ValueError: no turn has a trained token left, or as `Codec.render_turns`.
    """
    out = []
    for rendered in codec.render_turns(messages):
        tokens, mask = rendered.tokens, rendered.train_mask
        if max_length is not None:
            tokens, mask = tokens[:max_length], mask[:max_length]
        if sum(mask[1:]) > 0:
            out.append(build_cross_entropy_sample(tokens, mask))
    if not out:
        raise ValueError(
            "conversation has no assistant token to train on"
            + (f" within max_length={max_length}" if max_length is not None else "")
        )
    return out
