"""SDK arguments checked client-side and turned into wire requests (no RPC here).

`ResourceClient`, `Session` and `Snapshot` call these before sending; with ``validate=False`` the arguments go
out as given, so the server's own checks can be exercised. Every check raises `InvalidArgumentError` naming the
argument (``key``) and, for batches, the sample index.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from together_train._proto import generator_pb2, session_pb2
from together_train.errors import InvalidArgumentError
from together_train.tensors import to_tensor
from together_train.types import (
    LossSpec,
    Sample,
    SamplingParams,
    TokenArray,
    loss_config_to_proto,
    validate_samples,
)
from together_train.types._checks import as_token_array

__all__ = ["SOURCES", "sample_request", "logprobs_request", "forward_request", "custom_forward_backward_request"]

#: ``compute_logprobs``'s ``source`` names and their wire values.
SOURCES = {"base": generator_pb2.BASE, "session": generator_pb2.SESSION, "checkpoint": generator_pb2.CHECKPOINT,
           "snapshot": generator_pb2.SNAPSHOT}


def sample_request(
    session_id: str,
    prompt_tokens: TokenArray,
    sampling_params: SamplingParams,
    num_samples: int,
    prompt_logprobs: bool,
    top_k_prompt_logprobs: int,
    validate: bool,
    *,
    checkpoint_uri: str = "",
    snapshot_id: str = "",
) -> generator_pb2.SampleRequest:
    """A ``Sample`` request; `sampling_params` must be a `SamplingParams` even when not validating."""
    if not isinstance(sampling_params, SamplingParams):
        raise InvalidArgumentError("sampling_params must be a SamplingParams", key="sampling_params")
    if validate:
        prompt = as_token_array(prompt_tokens, what="prompt_tokens", sample_index=None, key="prompt")
        sampling_params.validate()
        if not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
            raise InvalidArgumentError(f"num_samples must be an integer >= 1, got {num_samples!r}", key="num_samples")
        if top_k_prompt_logprobs < 0:
            raise InvalidArgumentError(f"top_k_prompt_logprobs must be >= 0, got {top_k_prompt_logprobs!r}",
                                       key="top_k_prompt_logprobs")
    else:
        prompt = np.asarray(prompt_tokens).reshape(-1).astype(np.int64)
    return generator_pb2.SampleRequest(
        session_id=session_id,
        prompt=prompt.tolist(),
        params=sampling_params.to_proto(),
        num_samples=int(num_samples),
        prompt_logprobs=bool(prompt_logprobs),
        top_k_prompt_logprobs=int(top_k_prompt_logprobs),
        checkpoint_uri=checkpoint_uri,
        snapshot_id=snapshot_id,
    )


def logprobs_request(
    session_id: str,
    sequences: Sequence[TokenArray],
    source: str,
    checkpoint_uri: str | None,
    *,
    snapshot_id: str = "",
) -> generator_pb2.ComputeLogprobsRequest:
    """A ``ComputeLogprobs`` request: `source` one of `SOURCES`, with the URI or snapshot id it needs."""
    if source not in SOURCES:
        raise InvalidArgumentError(f"source must be one of {sorted(SOURCES)}, got {source!r}", key="source")
    if source == "snapshot" and not snapshot_id:
        raise InvalidArgumentError("source='snapshot' needs a snapshot (Snapshot.compute_logprobs)",
                                   key="snapshot_id")
    if source == "checkpoint" and not checkpoint_uri:
        raise InvalidArgumentError("source='checkpoint' needs checkpoint_uri", key="checkpoint_uri")
    if isinstance(sequences, np.ndarray) and sequences.ndim == 1:
        raise InvalidArgumentError("sequences must be a list of token sequences", key="sequences")
    seqs = [
        as_token_array(s, what=f"sequences[{i}]", sample_index=i, key="sequences") for i, s in enumerate(sequences)
    ]
    if not seqs:
        raise InvalidArgumentError("sequences is empty", key="sequences")
    return generator_pb2.ComputeLogprobsRequest(
        session_id=session_id,
        sequences=[generator_pb2.TokenSequence(tokens=s.tolist()) for s in seqs],
        source=SOURCES[source],
        checkpoint_uri=checkpoint_uri or "",
        snapshot_id=snapshot_id,
    )


def forward_request(
    losses: dict[str, LossSpec] | None,
    samples: Iterable[Sample],
    loss_fn: str,
    loss_fn_config: Mapping[str, Any] | None,
    return_logprobs: bool,
    return_elementwise_loss: bool,
    validate: bool,
) -> session_pb2.ForwardRequest:
    """A ``Forward`` / ``ForwardBackward`` request, checked against the resource's `losses` (None: unknown)."""
    listed = losses.get(loss_fn) if losses else None
    # listed but not served (stable_reinforce): no client-side input checks; the resource refuses it saying why
    spec = listed if listed is not None and listed.available else None
    if validate:
        if not isinstance(loss_fn, str) or not loss_fn:
            raise InvalidArgumentError("loss_fn must be a loss name such as 'cross_entropy'", key="loss_fn")
        if losses is not None and listed is None:
            raise InvalidArgumentError(
                f"unknown loss {loss_fn!r}; this resource offers {sorted(losses)}", key="loss_fn"
            )
    protos = validate_samples(samples, spec=spec, validate=validate)
    return session_pb2.ForwardRequest(
        samples=protos,
        loss_fn=loss_fn,
        loss_fn_config=loss_config_to_proto(loss_fn_config, spec, validate=validate),
        outputs=session_pb2.OutputOptions(logprobs=return_logprobs, elementwise_loss=return_elementwise_loss),
    )


def custom_forward_backward_request(
    samples: Sequence[Sample],
    gradients: Sequence[Sequence[float] | np.ndarray],
    return_logprobs: bool,
    return_elementwise_loss: bool,
    validate: bool,
) -> session_pb2.CustomForwardBackwardRequest:
    """A ``CustomForwardBackward`` request: one finite float32 [n_i] gradient per sample."""
    protos = validate_samples(samples, validate=validate)
    if validate and len(gradients) != len(protos):
        raise InvalidArgumentError(
            f"{len(gradients)} gradients for {len(protos)} samples", key="gradients"
        )
    tensors = []
    if not validate:  # send exactly what was given (count, dtype), to exercise the server's checks
        tensors = [to_tensor(np.asarray(g)) for g in gradients]
    for i, (g, s) in enumerate(zip(gradients, protos) if validate else ()):
        arr = np.asarray(g, dtype=np.float32) if not isinstance(g, np.ndarray) else g.astype(np.float32, copy=False)
        if arr.ndim != 1 or arr.shape[0] != len(s.model_input):
            raise InvalidArgumentError(
                f"gradient has shape {list(arr.shape)}, sample has length {len(s.model_input)}",
                sample_index=i,
                key="gradients",
            )
        if not np.all(np.isfinite(arr)):
            raise InvalidArgumentError("gradient holds NaN/inf", sample_index=i, key="gradients")
        tensors.append(to_tensor(arr))
    return session_pb2.CustomForwardBackwardRequest(
        samples=protos,
        gradients=tensors,
        outputs=session_pb2.OutputOptions(logprobs=return_logprobs, elementwise_loss=return_elementwise_loss),
    )
