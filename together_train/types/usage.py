"""`Usage`: what one API key or one session used on a resource."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import resource_pb2

__all__ = ["Usage"]


@dataclass(frozen=True)
class Usage:
    """What one API key (``session_id`` "") or one session used, summed since it began (kept across restarts
    of the resource). A key reads its own; an admin key (``serve --admin-key-file``) every key's.

    Attributes:
        key: the key's owner tag (a sha256 tag of the API key, never the key; "" without API keys).
        session_id: the session, or "" for a key's sums.
        prefill_tokens: prompt tokens the replicas computed for sample calls (prompt minus prefix-cache hits),
            and every token scored by the session's ``compute_logprobs``.
        prefix_cache_tokens: prompt tokens served from a replica's prefix cache.
        sampled_tokens: tokens generated (every sequence of every call).
        trained_tokens: model_input tokens of succeeded ``forward_backward`` (and custom) operations.
        forward_tokens: model_input tokens of succeeded ``forward`` operations.
        optimizer_steps: succeeded ``optim_step`` operations.
        trainer_seconds: wall seconds the trainer spent running the operations (any outcome).
        sampler_seconds: wall seconds of succeeded sample and compute_logprobs calls on the replicas.
        checkpoint_bytes: bytes of checkpoints in storage now (a deleted one no longer counts).
    """

    key: str
    session_id: str
    prefill_tokens: int
    prefix_cache_tokens: int
    sampled_tokens: int
    trained_tokens: int
    forward_tokens: int
    optimizer_steps: int
    trainer_seconds: float
    sampler_seconds: float
    checkpoint_bytes: int

    @classmethod
    def from_proto(cls, msg: resource_pb2.Usage) -> "Usage":
        return cls(
            key=msg.key, session_id=msg.session_id, prefill_tokens=int(msg.prefill_tokens),
            prefix_cache_tokens=int(msg.prefix_cache_tokens), sampled_tokens=int(msg.sampled_tokens),
            trained_tokens=int(msg.trained_tokens), forward_tokens=int(msg.forward_tokens),
            optimizer_steps=int(msg.optimizer_steps), trainer_seconds=float(msg.trainer_seconds),
            sampler_seconds=float(msg.sampler_seconds), checkpoint_bytes=int(msg.checkpoint_bytes),
        )
