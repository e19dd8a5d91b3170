"""Plain data types exchanged between the service layer and the engines.

Pure dataclasses over numpy / Python scalars (torch tensors only where an
engine hands out adapter weights). Nothing here imports gRPC or generated
wire code. Field meanings follow docs/design.md §4 (data contract), §6 (optimizer)
and §7 (sampling).

The names are the SDK's (`together_train.LoraConfig`, `AdamParams`, `SamplingParams`,
`Sample`): one name per concept. These stay plain dataclasses because the SDK's carry
their wire encoding (generated protobuf code), which engines never import.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from together_train.types.adam_params import ADAM_DEFAULTS

__all__ = [
    "LoraConfig",
    "Sample",
    "ForwardOutput",
    "AdamParams",
    "OptimOutput",
    "SamplingParams",
    "Constraint",
    "GenSequence",
    "GenOutput",
    "ranged",
    "ranged_fields",
]


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapter configuration (Hu et al. 2021, "LoRA").

    Attributes:
        rank: LoRA rank ``r`` (>= 1); A is ``[r, in]``, B is ``[out, r]``.
        alpha: scaling numerator; the update is ``(alpha / r) * B @ A``.
        dropout: dropout probability on the LoRA input path (0 = none; the
            trainer then runs the model in eval mode for determinism).
        target_modules: module-name suffixes to adapt, e.g. ``("q_proj",)``.
            Empty = every linear layer inside the decoder blocks
            (q/k/v/o/gate/up/down projections for Llama/Qwen2).
        train_unembed: also train the unembedding (``lm_head``) as a full,
            per-adapter copy (peft ``modules_to_save``).
        seed: torch seed used right before the adapter is created, so that
            the initialisation of A (Kaiming-uniform) is reproducible.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ()
    train_unembed: bool = False
    seed: int = 0


@dataclass
class Sample:
    """One training example, already validated by the service layer.

    Attributes:
        model_input: int64 ``[n]`` token ids (the full sequence minus its last
            token).
        inputs: the loss inputs, each a 1-D array of length ``n``:
            ``target_tokens`` int64 (``full[i+1]``), and float32 arrays such as
            ``weights``, ``logprobs``, ``advantages``.
    """

    model_input: np.ndarray
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardOutput:
    """Result of a forward (or forward + backward) pass over a batch.

    Attributes:
        loss: the loss summed over samples and positions (never a mean), in
            nats for ``cross_entropy``.
        logprobs: per sample a float32 ``[n_i]`` array of untempered
            ``log p(target_tokens[i] | model_input[:i+1])`` (natural log), or
            ``None`` when not requested.
        elementwise_loss: per sample a float32 ``[n_i]`` array of the loss at
            each position, or ``None`` when not requested.
        metrics: named scalars with a reduction suffix, e.g. ``"loss:sum"``,
            ``"num_tokens:sum"``, ``"weight:sum"``.
    """

    loss: float
    logprobs: list[np.ndarray] | None
    elementwise_loss: list[np.ndarray] | None
    metrics: dict[str, float]


@dataclass(frozen=True)
class AdamParams:
    """AdamW hyper-parameters, sent with every ``optim_step`` (no hidden schedule).

    Semantics are those of ``torch.optim.AdamW`` (Loshchilov & Hutter 2019,
    decoupled weight decay): ``p -= lr * weight_decay * p`` then the Adam update.
    Defaults and ranges are the SDK's (``together_train.types.adam_params``:
    ``ADAM_DEFAULTS``, ``ADAM_RANGES``), their one home.

    Attributes:
        learning_rate: lr of the LoRA A matrices (and of every non-B parameter).
        beta1, beta2: Adam moment decay rates in ``[0, 1)``.
        eps: Adam denominator epsilon (> 0).
        weight_decay: decoupled weight decay coefficient (>= 0).
        grad_clip_norm: clip the global L2 gradient norm to this value
            (``torch.nn.utils.clip_grad_norm_``); 0 = no clipping.
        lora_plus_ratio: LoRA+ (Hayou et al. 2024) ratio ``lr(B) / lr(A)``;
            1 = plain LoRA.
    """

    learning_rate: float
    beta1: float = ADAM_DEFAULTS["beta1"]
    beta2: float = ADAM_DEFAULTS["beta2"]
    eps: float = ADAM_DEFAULTS["eps"]
    weight_decay: float = ADAM_DEFAULTS["weight_decay"]
    grad_clip_norm: float = ADAM_DEFAULTS["grad_clip_norm"]
    lora_plus_ratio: float = ADAM_DEFAULTS["lora_plus_ratio"]


@dataclass
class OptimOutput:
    """Result of one optimizer step.

    Attributes:
        step: number of steps this adapter has taken, including this one.
        grad_norm: global L2 norm of the accumulated gradient before clipping.
        learning_rate: the learning rate used (of A; B used ``lr * ratio``).
    """

    step: int
    grad_norm: float
    learning_rate: float


# Smallest non-zero sampling temperature. Logits (float32) are divided by the
# temperature: below this they overflow to inf and the softmax gives NaN (at
# 1e-45 every token did), so smaller temperatures are refused, never silently
# turned greedy; ask for 0 to get greedy. vLLM switches to greedy below the same 1e-5.
MIN_TEMPERATURE = 1e-5


def ranged(default: float | int, lo: float, hi: float, doc: str) -> Any:
    """A `SamplingParams` field that is a plain number in ``[lo, hi]`` (docs/design.md §7).

    Such a field needs no code outside its engine's sampler: every API's parser reads it by name
    (``wire/sampling_fields.py``), the proto conversion copies it by name, and the service and the
    engines check its range (`ranged_fields`). ``doc`` is the field's one-line meaning.
    """
    return field(default=default, metadata={"range": (lo, hi), "doc": doc})


def ranged_fields() -> tuple[dataclasses.Field, ...]:
    """The `SamplingParams` fields declared with `ranged`, in declaration order."""
    return tuple(f for f in dataclasses.fields(SamplingParams) if "range" in f.metadata)


@dataclass(frozen=True)
class Constraint:
    """A grammar every sampled sequence must follow (constrained decoding, engines/grammar.py).

    Attributes:
        kind: ``"json_schema"`` (``spec`` is a JSON Schema, as text; JSON is written compactly,
            ``", "`` and ``": "`` separators, no other whitespace) or ``"lark"`` (``spec`` is a
            grammar in llguidance's Lark syntax, which may embed ``%json {schema}``).
        spec: the schema or grammar text.
    """

    kind: str
    spec: str


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters: the one type every API's parser builds and the engines sample with
    (docs/design.md §7, "The sampling road").

    Attributes:
        max_tokens: maximum number of new tokens (>= 1); reaching it gives
            stop reason ``"length"``.
        temperature: softmax temperature; 0 = greedy (argmax), otherwise at
            least ``MIN_TEMPERATURE`` (1e-5).
        top_k: keep the k most likely tokens; 0 = off.
        top_p: nucleus sampling mass in ``(0, 1]``; 1 = off.
        seed: seed of the random streams; the i-th sample of a request uses
            its own stream seeded from ``(seed, i)``. ``None`` = random.
        stop: stop strings; generation stops once the decoded completion
            contains one (the tokens up to and including the token that
            completed it are returned).
        stop_token_ids: token ids that end generation (included in tokens).
        ignore_eos: do not stop at the model's EOS token(s).
        min_p: keep only tokens whose probability under the temperature-scaled
            distribution is >= ``min_p * max probability`` (vLLM's min_p, applied
            before top-k/top-p); 0 = off; ignored when greedy.
        constraint: a grammar each stream follows (the logits are masked to the tokens
            it allows before sampling, so ``GenSequence.logprobs`` are of that masked
            distribution); None = unconstrained.
        top_logprobs: what is reported, not how tokens are drawn: set (``k >= 0``), each
            sequence also carries, per sampled token, its untempered logprob and the ``k`` most
            likely tokens with theirs (``GenSequence.untempered_logprobs`` / ``top_logprobs``:
            the model's own distribution, before temperature, filters and grammar, as OpenAI and
            vLLM report logprobs; vLLM's ``SamplingParams.logprobs``); None = neither.
    """

    max_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_p: float = ranged(0.0, 0.0, 1.0, "keep tokens with probability >= min_p * the largest (after temperature)")
    constraint: Constraint | None = None
    top_logprobs: int | None = None


@dataclass
class GenSequence:
    """One sampled completion.

    Attributes:
        tokens: the generated token ids (prompt excluded).
        logprobs: natural-log probability of each token under the
            temperature-scaled distribution, before top-k/top-p truncation
            (the T=1 distribution when greedy); ``len(logprobs) == len(tokens)``.
        stop_reason: ``"stop"`` (EOS, stop token or stop string) or
            ``"length"`` (max_tokens or the model's context reached).
        untempered_logprobs: with ``SamplingParams.top_logprobs`` set, each token's
            untempered ``log softmax(logits)[token]`` (no temperature, filter or grammar
            mask), ``len == len(tokens)``; else None.
        top_logprobs: with ``SamplingParams.top_logprobs = k`` set, per token the ``k`` most
            likely (token ids, untempered logprobs) at its position, most likely first
            (empty lists when ``k == 0``); else None.
    """

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str
    untempered_logprobs: list[float] | None = None
    top_logprobs: list[tuple[list[int], list[float]]] | None = None


@dataclass
class GenOutput:
    """Result of one ``generate`` call.

    Attributes:
        sequences: ``num_samples`` completions, in stream order.
        prompt_logprobs: untempered ``log p(prompt[i+1] | prompt[:i+1])`` for
            ``i`` in ``0..len(prompt)-2`` (length ``len(prompt) - 1``), or None.
        top_k_prompt_logprobs: per scored prompt position (same length as
            ``prompt_logprobs``) the ``k`` most likely token ids and their
            untempered logprobs, most likely first; or None.
        adapter_version: the ``version`` tag given to ``load_adapter`` for the
            adapter that produced every token of this request (an engine never
            switches weights inside a request), or None for the base model or
            an engine that does not track versions (the replica then reports
            the version it had recorded when the request arrived).
        prompt_cache_hit_tokens: prompt tokens whose keys/values came from the
            engine's prefix cache instead of being prefilled (0 without a cache;
            the torch engine's hits are whole blocks, see ``engines/prefix_cache.py``).
    """

    sequences: list[GenSequence]
    prompt_logprobs: list[float] | None = None
    top_k_prompt_logprobs: list[tuple[list[int], list[float]]] | None = None
    adapter_version: int | None = None
    prompt_cache_hit_tokens: int = 0
