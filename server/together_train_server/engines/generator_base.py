"""What the generator engines share: request checks, seeds, stop ids, adapter tensor checks.

`GeneratorEngineBase` is the common base of `TorchGeneratorEngine` and
`VllmGeneratorEngine` (both implement `interfaces.GeneratorEngine`): it
holds the checks every request goes through before it is queued, so the two
engines refuse the same requests with the same messages, and ``generate`` as
``submit(...).result()``. The helpers are plain functions over
`types.SamplingParams` and token lists; nothing here imports vLLM.
"""

from __future__ import annotations

import abc
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from .lora import FlatTensors
from .types import MIN_TEMPERATURE, GenOutput, SamplingParams, ranged_fields

__all__ = ["GeneratorEngineBase", "check_adapter_tensors", "flat_in_order", "check_sampling_params", "check_tokens",
           "contiguous_run", "eos_ids", "stop_token_ids", "stream_seed"]

# on_token(stream index, token id, logprob in nats)
TokenHook = Callable[[int, int, float], Any]


@dataclass(frozen=True)
class GenRequest:
    """One checked `GeneratorEngineBase.submit` call; each field as `interfaces.GeneratorEngine.submit`'s argument."""

    prompt: list[int]
    params: SamplingParams
    num_samples: int
    adapter: str | None
    prompt_logprobs: bool
    top_k_prompt_logprobs: int
    on_token: TokenHook | None


def check_tokens(tokens: Sequence[int], what: str, *, max_seq_len: int, vocab_size: int) -> None:
    """Check a prompt or scored sequence: 1..max_seq_len ids, each in [0, vocab_size).

    Raises:
        ValueError: naming ``what`` (e.g. ``"prompt"``, ``"sequence 3"``).
    """
    if len(tokens) == 0:
        raise ValueError(f"{what}: empty")
    if len(tokens) > max_seq_len:
        raise ValueError(f"{what}: {len(tokens)} tokens > max_seq_len {max_seq_len}")
    arr = np.asarray(tokens, dtype=np.int64)
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ValueError(f"{what}: token id out of range [0, {vocab_size})")


def check_sampling_params(p: SamplingParams, num_samples: int, top_k_prompt_logprobs: int) -> None:
    """Check sampling parameters the engines cannot serve.

    Raises:
        ValueError: max_tokens < 1; temperature negative, non-finite or in
            (0, MIN_TEMPERATURE); top_k < 0; top_p outside (0, 1]; a `types.ranged` field outside its range;
            num_samples < 1; top_k_prompt_logprobs < 0; top_logprobs < 0; an empty stop string.
    """
    if int(p.max_tokens) < 1:
        raise ValueError(f"max_tokens must be >= 1, got {p.max_tokens}")
    if not (p.temperature >= 0 and np.isfinite(p.temperature)):
        raise ValueError(f"temperature must be finite and >= 0, got {p.temperature}")
    if 0 < p.temperature < MIN_TEMPERATURE:  # logits / T would overflow to inf -> NaN
        raise ValueError(f"temperature must be 0 (greedy) or >= {MIN_TEMPERATURE}, got {p.temperature}")
    if p.top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {p.top_k}")
    if not 0 < p.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {p.top_p}")
    for f in ranged_fields():  # plain numbers with a declared range (types.ranged), e.g. min_p
        lo, hi = f.metadata["range"]
        if not lo <= getattr(p, f.name) <= hi:
            raise ValueError(f"{f.name} must be in [{lo}, {hi}], got {getattr(p, f.name)}")
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if top_k_prompt_logprobs < 0:
        raise ValueError(f"top_k_prompt_logprobs must be >= 0, got {top_k_prompt_logprobs}")
    if p.top_logprobs is not None and p.top_logprobs < 0:
        raise ValueError(f"top_logprobs must be >= 0 (or None), got {p.top_logprobs}")
    if any(not s for s in p.stop):
        raise ValueError("stop strings must be non-empty")


def stream_seed(seed: int, index: int) -> int:
    """63-bit seed of stream ``index`` of a request seeded with ``seed`` (any int; numpy ``SeedSequence``)."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFFFFFFFFFF, int(index)])
    return int(ss.generate_state(1, dtype=np.uint64)[0] & 0x7FFFFFFFFFFFFFFF)


def eos_ids(eos: int | Iterable[int] | None) -> tuple[int, ...]:
    """A generation config's ``eos_token_id`` (None, an id or a list of ids) as a tuple of ids."""
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


def stop_token_ids(p: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The token ids that end a stream: ``p.stop_token_ids``, then EOS unless ``p.ignore_eos`` (no repeats)."""
    ids = list(dict.fromkeys(int(t) for t in p.stop_token_ids))
    if not p.ignore_eos:
        ids += [int(e) for e in eos_token_ids if int(e) not in ids]
    return ids


def check_adapter_tensors(expected: Mapping[str, Sequence[int]], tensors: Mapping[str, torch.Tensor]) -> None:
    """Check pushed adapter tensors against the PEFT state-dict keys and shapes a LoRA config gives.

    Args:
        expected: key -> shape (``get_peft_model_state_dict`` keys of the config).
        tensors: key -> tensor (any float dtype).

    Raises:
        ValueError: missing or unexpected keys, a shape mismatch, non-finite values (naming the tensor).
    """
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"adapter tensors do not match the LoRA config: missing {missing[:3]}"
                         f"{'...' if len(missing) > 3 else ''}, unexpected {extra[:3]}"
                         f"{'...' if len(extra) > 3 else ''}")
    for k, shape in expected.items():
        t = tensors[k]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"adapter tensor {k}: shape {tuple(t.shape)} != {tuple(shape)}")
    # Finite min and max mean every value is finite (aminmax propagates NaN, inf is the max or min):
    # one pass over the push's flat buffer when the tensors lie back to back in it (a received push
    # does), ~4x faster than a float32 sum of bf16 values on CPU (measured, 9.8 M values); only when
    # it fails is each tensor checked, to name the bad one.
    run = flat_in_order(tensors, list(expected))
    if run is not None and run.numel():
        lo, hi = torch.aminmax(run)
        bad = not bool(torch.isfinite(lo) & torch.isfinite(hi))
    elif tensors:
        bad = not bool(torch.isfinite(torch.stack([t.sum(dtype=torch.float32) for t in tensors.values()]).sum()))
    else:
        bad = False
    if bad:
        for k in expected:
            if not torch.isfinite(tensors[k]).all():
                raise ValueError(f"adapter tensor {k}: non-finite values")


def flat_in_order(tensors: Mapping[str, torch.Tensor], keys: Sequence[str]) -> torch.Tensor | None:
    """The flat buffer `tensors[k] for k in keys` lie in back to back (a view), else None.

    A `FlatTensors` in `keys`' order answers from its layout; other tensors are walked (`contiguous_run`).
    """
    if isinstance(tensors, FlatTensors):
        return tensors.flat if tensors.layout.names == tuple(keys) else None
    return contiguous_run([tensors[k] for k in keys])


def contiguous_run(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A flat view of the storage ``tensors`` lie in back to back, in this order, with one dtype; else None.

    Returns a 1-D tensor of ``sum(numel)`` elements (a view: no copy), so one
    op over it (a copy, a check) covers every tensor.
    """
    if not tensors:
        return None
    first = tensors[0]
    ptr, pos = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if (t.dtype != first.dtype or t.device != first.device or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != ptr or t.storage_offset() != pos):
            return None
        pos += t.numel()
    return first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (pos - first.storage_offset(),))


class GeneratorEngineBase(abc.ABC):
    """The request checks and ``generate`` of both generator engines (see `interfaces.GeneratorEngine`).

    Subclasses set ``max_seq_len`` and ``vocab_size`` and implement ``submit``.
    """

    max_seq_len: int
    vocab_size: int

    def _check_tokens(self, tokens: Sequence[int], what: str) -> None:
        check_tokens(tokens, what, max_seq_len=self.max_seq_len, vocab_size=self.vocab_size)

    def _check_request(self, prompt: Sequence[int], params: SamplingParams, num_samples: int,
                       top_k_prompt_logprobs: int) -> None:
        """A sampling request's prompt (``1 <= len < max_seq_len``, ids in range) and parameters.

        Raises:
            ValueError: naming the prompt or the parameter.
        """
        self._check_tokens(prompt, "prompt")
        if len(prompt) >= self.max_seq_len:
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room below max_seq_len "
                             f"{self.max_seq_len}")
        check_sampling_params(params, num_samples, top_k_prompt_logprobs)

    def submit(self, prompt: list[int], params: SamplingParams, num_samples: int = 1, adapter: str | None = None,
               prompt_logprobs: bool = False, top_k_prompt_logprobs: int = 0,
               on_token: TokenHook | None = None) -> Future:
        """Queue a sampling request (documented at `interfaces.GeneratorEngine.submit`): checked here
        (`_check_request`: ValueError), then handed to the engine's `_enqueue`."""
        self._check_request(prompt, params, num_samples, top_k_prompt_logprobs)
        return self._enqueue(GenRequest(list(map(int, prompt)), params, int(num_samples), adapter,
                                        bool(prompt_logprobs), int(top_k_prompt_logprobs), on_token))

    @abc.abstractmethod
    def _enqueue(self, r: GenRequest) -> Future:
        """Queue a checked `submit` request: the engine's own part (its docstring says what differs)."""

    def generate(self, prompt: list[int], params: SamplingParams, num_samples: int = 1, adapter: str | None = None,
                 prompt_logprobs: bool = False, top_k_prompt_logprobs: int = 0) -> GenOutput:
        """``submit(...).result()``; documented at `interfaces.GeneratorEngine.generate`."""
        return self.submit(prompt, params, num_samples, adapter, prompt_logprobs, top_k_prompt_logprobs).result()
