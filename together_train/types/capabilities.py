"""`Capabilities`: what a resource offers, with its `SamplingLimits`."""

from __future__ import annotations

from dataclasses import dataclass

from together_train._proto import resource_pb2
from together_train.types.adam_params import ADAM_FIELDS
from together_train.types.loss_spec import LossSpec

__all__ = ["Capabilities", "SamplingLimits"]


@dataclass(frozen=True)
class SamplingLimits:
    """Per-request sampling limits of the resource."""

    max_tokens: int = 0
    max_num_samples: int = 0
    max_stop_sequences: int = 0
    max_top_k_prompt_logprobs: int = 0


@dataclass(frozen=True)
class Capabilities:
    """What a resource offers (``GetCapabilities``).

    Attributes:
        protocol_version, model_id, dtype: identity of the resource and its model.
        vocab_size: token ids must be < vocab_size.
        max_seq_len: longest sample / prompt + completion, in tokens.
        mode: ``"lora"`` or ``"full"``.
        operations: operation names served.
        max_lora_rank, lora_target_modules, max_sessions: LoRA limits.
        losses: name -> `LossSpec` (inputs with dtypes, parameters, availability).
        sampling: `SamplingLimits`.
        num_replicas: generator replicas behind the resource.
        max_tokens_per_batch, max_samples_per_batch: batch limits (0 = none).
        adam_defaults: defaults the server applies to unset AdamParams fields.
        generator_engine, trainer_backend: engine names.
        tokenizer_sha256: content hash of the model's tokenizer files (the cache key of
            `ResourceClient.get_tokenizer`; "" when the resource has none).
        trainer_capabilities: what the trainer engine can do beyond the operations: any of
            ``"paging"`` (idle sessions written out and read back), ``"clock_cycle"`` (several
            sessions' forwards in one pass), ``"full_weight"``, ``"long_context"``.
    """

    protocol_version: str
    model_id: str
    vocab_size: int
    max_seq_len: int
    mode: str
    operations: tuple[str, ...]
    max_lora_rank: int
    lora_target_modules: tuple[str, ...]
    max_sessions: int
    losses: dict[str, LossSpec]
    sampling: SamplingLimits
    num_replicas: int
    max_tokens_per_batch: int
    max_samples_per_batch: int
    adam_defaults: dict[str, float]
    generator_engine: str
    trainer_backend: str
    dtype: str
    tokenizer_sha256: str = ""
    trainer_capabilities: tuple[str, ...] = ()

    @classmethod
    def from_proto(cls, msg: resource_pb2.Capabilities) -> "Capabilities":
        s = msg.sampling
        return cls(
            protocol_version=msg.protocol_version,
            model_id=msg.model_id,
            vocab_size=int(msg.vocab_size),
            max_seq_len=int(msg.max_seq_len),
            mode=msg.mode,
            operations=tuple(msg.operations),
            max_lora_rank=int(msg.max_lora_rank),
            lora_target_modules=tuple(msg.lora_target_modules),
            max_sessions=int(msg.max_sessions),
            losses={spec.name: LossSpec.from_proto(spec) for spec in msg.losses},
            sampling=SamplingLimits(s.max_tokens, s.max_num_samples, s.max_stop_sequences, s.max_top_k_prompt_logprobs),
            num_replicas=int(msg.num_replicas),
            max_tokens_per_batch=int(msg.max_tokens_per_batch),
            max_samples_per_batch=int(msg.max_samples_per_batch),
            adam_defaults={f: getattr(msg.adam_defaults, f) for f in ADAM_FIELDS if msg.adam_defaults.HasField(f)},
            generator_engine=msg.generator_engine,
            trainer_backend=msg.trainer_backend,
            dtype=msg.dtype,
            tokenizer_sha256=msg.tokenizer_sha256,
            trainer_capabilities=tuple(msg.trainer_capabilities),
        )
