"""Estimated peak memory of one trainer forward / forward_backward, from the model's config.

The estimate is an upper bound on what one operation adds to the trainer
process's resident memory (peak RSS minus RSS before it), checked against
measurements (tests/conformance/test_memory_admission.py on a tiny model; the
``est_mb_<n>k`` lines of benchmarks/long_context.py on SmolLM2-135M). A
request is split into micro-batches (``length_batching``) that run one after
the other, so its peak is the largest micro-batch's. For a micro-batch of
``B`` samples padded to ``T`` (``P = B * T`` positions), with ``H`` hidden,
``I`` MLP width, ``kv`` key/value width (``kv_heads * head_dim``), ``L``
decoder layers, ``V`` vocabulary, ``s`` bytes per activation element (the
model dtype; 4 for float32) and ``rows`` the head's chunk:

* one decoder layer's activations kept for backward, per position:
  ``A = (11 H + 2 kv + 4 I) * s`` (two RMSNorms 2H each, RoPE'd q/k 2H + 2kv,
  SDPA's saved q/k/v/out with k/v repeated to H 4H, o_proj input H, MLP
  gate/up/SiLU/product 4I; LoRA's rank-r intermediates are negligible);
* backward keeping everything (checkpointing off): ``L * A * P``;
  with checkpointing: each layer's input and its attention output (kept by
  selective recomputation, ``activation_checkpointing``), ``2 * L * H * s * P``,
  plus one layer recomputed and differentiated at a time, ``2 * A * P``;
* forward only: activations are freed layer by layer, ``2 * A * P``;
* the final hidden states, their gather to the real positions and their
  gradients: ``4 * H * 4 * P``;
* the chunked head: ``4 * rows * V * 4`` bytes (a chunk's float32 logits,
  their exponentials, the gradient and the matmul's output); with backward,
  up to ``chunked_logprobs.PLAIN_HEAD_POSITIONS`` positions run unchunked and
  keep their logits: ``4 * P * V * 4``;
* gradient buffers of the session's parameters (with backward): the LoRA
  matrices, and ``V * H * s`` for a ``train_unembed`` head copy.

Scoring on a generator replica (``compute_logprobs``, prompt logprobs of a
sample; ``scoring_estimate``): one batch of ``B`` sequences right-padded to
the longest ``T`` (the generator does not split it), a forward without
backward as above (``2 * A * P``, hidden states, the head in chunks of
``chunk_rows(V)`` positions), plus, when the sequences' lengths differ, the
padding mask SDPA gets as a float ``[B, 1, T, T]`` tensor beside its boolean
source: ``5 * B * T^2`` bytes (measured: 4 x 4,096 positions, one long and
three short, peaked 356 MB against 100 MB for equal lengths on the tiny
test model); and, for a sample, the KV cache of the prompt and of its
``n`` streams up to ``max_tokens`` more positions:
``(n + 1) * L * 2 * kv * s * (T + max_tokens)``.

The sum is multiplied by ``SAFETY`` (allocator rounding and fragmentation;
glibc keeps freed blocks below its mmap threshold, which the server lowers
to 1 MiB at start, ``memory.set_mmap_threshold``; micro-batches of at most 512
padded tokens run with 32 MiB on their own arena, ``memory.run_sized``, and
stayed within this estimate too; so did tcmalloc, ``allocator``) and ``FIXED_BYTES`` is added
(per-operation Python/torch bookkeeping, input tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .chunked_logprobs import PLAIN_HEAD_POSITIONS

__all__ = ["SAFETY", "FIXED_BYTES", "ModelDims", "dims_of", "micro_batch_bytes", "MicroBatchEstimate",
           "request_estimate", "engine_estimate", "scoring_estimate"]

SAFETY = 1.5
FIXED_BYTES = 96 << 20


@dataclass(frozen=True)
class ModelDims:
    """The sizes the estimate needs (from a transformers config)."""

    layers: int
    hidden: int
    intermediate: int
    kv: int
    vocab: int
    act_bytes: int


def dims_of(config: Any, dtype: str = "float32") -> ModelDims:
    """``ModelDims`` of a transformers config (text config of a multimodal one); ``dtype`` of the weights."""
    cfg = getattr(config, "get_text_config", lambda: config)()
    hidden = int(getattr(cfg, "hidden_size", None) or cfg.n_embd)
    heads = int(getattr(cfg, "num_attention_heads", None) or cfg.n_head)
    head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
    inter = int(getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * hidden)
    layers = int(getattr(cfg, "num_hidden_layers", None) or cfg.n_layer)
    act = {"float32": 4, "float64": 8}.get(dtype, 2)
    return ModelDims(layers, hidden, inter, kv_heads * head_dim, int(cfg.vocab_size), act)


def micro_batch_bytes(d: ModelDims, positions: int, *, backward: bool, checkpointed: bool, rows: int,
                      param_grad_bytes: int = 0) -> int:
    """Estimated peak bytes one micro-batch of ``positions`` (``B * T``) adds (formula in the module doc)."""
    a = (11 * d.hidden + 2 * d.kv + 4 * d.intermediate) * d.act_bytes
    if not backward:
        body = 2 * a * positions
    elif checkpointed:
        body = 2 * d.layers * d.hidden * d.act_bytes * positions + 2 * a * positions
    else:
        body = d.layers * a * positions
    hidden = 4 * d.hidden * 4 * positions
    head_rows = positions if backward and positions <= PLAIN_HEAD_POSITIONS else min(rows, positions)
    head = 4 * head_rows * d.vocab * 4
    grads = param_grad_bytes if backward else 0
    return int(SAFETY * (body + hidden + head + grads)) + FIXED_BYTES


@dataclass(frozen=True)
class MicroBatchEstimate:
    """The largest micro-batch of a request: its estimated bytes, its samples and its longest sample."""

    bytes: int
    positions: int
    samples: tuple[int, ...]
    longest_index: int
    longest_len: int
    checkpointed: bool


def request_estimate(d: ModelDims, lens: Sequence[int], groups: Sequence[Sequence[int]], *, backward: bool,
                     checkpointed: Any, rows: int, param_grad_bytes: int = 0) -> MicroBatchEstimate:
    """The request's peak = its largest micro-batch's estimate.

    Args:
        d: model sizes.
        lens: sample lengths; ``groups``: the engine's micro-batches (indices into ``lens``).
        checkpointed: ``f(positions, backward) -> bool`` (the engine's checkpointing decision).
        rows: the head's chunk (positions).
    """
    best: MicroBatchEstimate | None = None
    for g in groups:
        longest = max(g, key=lambda i: (int(lens[i]), -i))
        pos = len(g) * int(lens[longest])
        ck = bool(checkpointed(pos, backward))
        b = micro_batch_bytes(d, pos, backward=backward, checkpointed=ck, rows=rows,
                              param_grad_bytes=param_grad_bytes)
        if best is None or b > best.bytes:
            best = MicroBatchEstimate(b, pos, tuple(g), longest, int(lens[longest]), ck)
    assert best is not None, "empty request"
    return best


def engine_estimate(engine: Any, lens: Sequence[int], backward: bool, adapter: Any = None) -> MicroBatchEstimate:
    """``request_estimate`` for a ``TorchTrainerEngine`` (its micro-batching, checkpointing decision and
    head chunk); ``adapter``: the session's record, whose parameters' gradient buffers count."""
    from .trainer_batching import micro_batches

    grad = 4 * sum(int(getattr(p, "ds_numel", p.numel())) for p in adapter.params) if adapter is not None else 0
    groups = micro_batches(lens, engine.micro_batch_tokens, engine.max_padding_fraction)
    return request_estimate(engine.model_dims(), lens, groups, backward=backward,
                            checkpointed=engine.checkpointing.wanted, rows=engine.logprob_chunk_rows,
                            param_grad_bytes=grad)


def scoring_estimate(d: ModelDims, lens: Sequence[int], *, num_samples: int = 0,
                     max_tokens: int = 0) -> MicroBatchEstimate:
    """Estimated peak bytes a generator replica adds to score ``lens`` in one batch (formula in the module doc).

    Args:
        d: model sizes (the generator's dtype in ``act_bytes``).
        lens: token counts of the sequences scored together (``compute_logprobs``: every sequence;
            prompt logprobs: the one prompt).
        num_samples: streams sampled after the prompt (0: scoring only, no KV cache kept).
        max_tokens: the sample's max new tokens (its cache grows by that much).

    Returns:
        ``MicroBatchEstimate`` (``samples``: every index; ``longest_*``: the first longest sequence).

    Raises:
        ValueError: no sequence.
    """
    from .chunked_logprobs import chunk_rows

    if not lens:
        raise ValueError("no sequence to estimate")
    lens = [int(n) for n in lens]
    t = max(lens)
    longest = lens.index(t)
    b = len(lens)
    positions = b * t
    mask = 5 * b * t * t if min(lens) != t else 0
    cache = (num_samples + 1) * d.layers * 2 * d.kv * d.act_bytes * (t + max_tokens) if num_samples > 0 else 0
    base = micro_batch_bytes(d, positions, backward=False, checkpointed=False, rows=chunk_rows(d.vocab))
    return MicroBatchEstimate(base + int(SAFETY * (mask + cache)), positions, tuple(range(b)), longest, t, False)
