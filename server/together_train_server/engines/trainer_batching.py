"""How a trainer engine turns a forward request into model forwards: checks, micro-batches, padding, logprobs.

Shared by `TorchTrainerEngine` and the DeepSpeed engines (which run the same
micro-batches on each rank's share of the samples).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping, Sequence

import numpy as np
import torch

from .chunked_logprobs import head_input
from .chunked_logprobs import target_logprobs as chunked_target_logprobs
from .length_batching import MAX_PADDING_FRACTION, group_by_length
from .loss_specs import LOSS_SPECS, complete_params, required_inputs
from .types import Sample

__all__ = ["check_forward", "micro_batches", "right_pad", "target_logprobs", "model_target_logprobs"]


def check_forward(samples: Sequence[Sample], loss_fn: str, loss_params: Mapping[str, Any] | None,
                  max_seq_len: int) -> tuple[dict[str, Any], list[int]]:
    """Check a forward request before any state is touched; returns (loss params with defaults, sample lengths).

    Raises:
        KeyError: unknown loss. NotImplementedError: loss not available. ValueError: empty
        batch, an empty sample or one over ``max_seq_len`` tokens, a missing loss input,
        an input whose length differs from ``model_input``'s, a bad loss parameter
        (``loss_specs.ParamError``). Messages name the sample index.
    """
    spec = LOSS_SPECS.get(loss_fn)
    if spec is None:
        raise KeyError(f"unknown loss {loss_fn!r}")
    if not spec.available:
        raise NotImplementedError(f"loss {loss_fn!r} is not available in this release")
    if not samples:
        raise ValueError("empty batch")
    params = complete_params(spec, loss_params)  # ParamError (a ValueError) naming the parameter
    needed = {i.name for i in spec.inputs if i.required} | set(required_inputs(loss_fn, params))
    lens = []
    for i, s in enumerate(samples):
        n = int(len(s.model_input))
        if n == 0:
            raise ValueError(f"sample {i}: empty model_input")
        if n > max_seq_len:
            raise ValueError(f"sample {i}: {n} tokens > max_seq_len {max_seq_len}")
        for name in sorted(needed):
            if name not in s.inputs:
                raise ValueError(f"sample {i}: missing loss input {name!r}")
        for k, v in s.inputs.items():
            if len(v) != n:
                raise ValueError(f"sample {i}: {k!r} has length {len(v)} != {n}")
        lens.append(n)
    return params, lens


def micro_batches(lens: Sequence[int], budget: int, max_padding: float = MAX_PADDING_FRACTION) -> list[list[int]]:
    """Groups of sample indices by length, each of padded size (samples x longest) <= ``budget`` tokens
    and padding <= ``max_padding`` of it (``length_batching.group_by_length``; longest first).

    A single sample longer than the budget forms a group alone. Callers put per-sample results
    back in request order with ``length_batching.restore_order``.
    """
    return group_by_length(lens, budget, max_padding)


def right_pad(samples: Sequence[Sample], lens: Sequence[int],
              device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input ids, attention mask, target tokens)``, each int64 ``[B, max n_i]`` on ``device``, right-padded with 0."""
    B, T = len(samples), max(lens)
    ids = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.long)
    targets = torch.zeros((B, T), dtype=torch.long)
    for i, s in enumerate(samples):
        ids[i, : lens[i]] = torch.as_tensor(np.asarray(s.model_input, dtype=np.int64))
        targets[i, : lens[i]] = torch.as_tensor(np.asarray(s.inputs["target_tokens"], dtype=np.int64))
        mask[i, : lens[i]] = 1
    return ids.to(device), mask.to(device), targets.to(device)


def model_target_logprobs(model: torch.nn.Module, run: Callable[[], Any], mask: torch.Tensor,
                          targets: torch.Tensor, rows: int,
                          head_for: Callable[[torch.nn.Module], ContextManager[Any]] | None = None) -> torch.Tensor:
    """Target logprobs ``[sum n_i]`` (float32, sample after sample) of the real positions of a right-padded batch.

    ``run()`` runs ``model``'s forward on the batch; its head is applied afterwards in
    chunks of ``rows`` positions (``chunked_logprobs``), so no ``[B, T, vocab]`` logits exist.
    ``mask``/``targets``: int64 ``[B, T]``. ``head_for(head)``: a context manager giving the
    callable the chunks apply instead of the head module (ZeRO-3: the head weight gathered once,
    ``deepspeed/lora_zero3.gathered_head``); None: the module itself.
    """
    with head_input(model) as cap:
        run()
    real = mask.bool()
    with (head_for(cap.head) if head_for is not None else contextlib.nullcontext(cap.head)) as head:
        return chunked_target_logprobs(head, cap.hidden[real], targets[real], rows=rows)


def target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[target]`` in float32: ``[B, T]`` from logits ``[B, T, vocab]`` and targets ``[B, T]``.

    Computed as ``logit[target] - logsumexp(logits)`` for the whole batch at once:
    slicing ``[vocab]``-wide logits per sample would make backward scatter a full-size
    zero tensor per sample (~10% of an SFT step on SmolLM2-135M, CPU).
    """
    logits = logits.float()
    return logits.gather(-1, targets[..., None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
