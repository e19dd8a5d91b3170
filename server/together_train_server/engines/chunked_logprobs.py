"""Target-token logprobs without a ``[tokens, vocab]`` logits tensor (bounded head memory).

A causal LM's head turns the final hidden states ``h`` ``[N, H]`` into logits
``z = head(h)`` ``[N, V]``; the trainer needs only ``p_t = z_t[y_t] -
logsumexp(z_t)`` ``[N]`` (float32, nats). For a long sequence the full logits
dominate memory: 8,192 positions x 49,152 vocabulary x 4 bytes = 1.6 GB, held
three times over (logits, log-softmax, its gradient). Here the head, the
log-softmax and the target gather run on ``rows`` positions at a time; with
gradients each chunk is a ``torch.utils.checkpoint`` (non-reentrant) region,
so backward recomputes that chunk's logits instead of keeping them. Peak head
memory is O(rows x V) whatever N is; the values are those of the unchunked
formula (each position's logits are computed by the same head on the same
hidden state; only the matmul's blocking may differ, float32 rounding).

The head is the model's own output-embedding *module*, called per chunk, so
whatever it is stays in charge: a peft ``ModulesToSaveWrapper`` (a session's
trained ``lm_head`` copy, which then receives its gradient), LoRA on the head,
and ZeRO-3 LoRA passes a stand-in that calls the head weight gathered once
(``trainer_batching.model_target_logprobs``' ``head_for``;
deepspeed/lora_zero3.gathered_head), since ZeRO-3's hooks would gather per call.

``head_input`` finds that module and the hidden states that reach it: a
forward pre-hook takes the head's input and hands the model a zero-length
slice instead, so the model's forward computes no logits at all (``[B, 0, V]``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["DEFAULT_CHUNK_BYTES", "PLAIN_HEAD_POSITIONS", "HeadCapture", "chunk_rows", "head_input", "target_logprobs",
           "head_module", "prompt_logprobs"]

# One [rows, V] float32 buffer; the backward of a chunk holds about three of them.
DEFAULT_CHUNK_BYTES = 32 << 20
# With gradients, up to this many positions run the head unchunked, its logits kept for backward
# (about 3 x N x V x 4 bytes: 300 MB at 512 x 49,152): a short step then pays no second head matmul.
# SmolLM2, 4 x 64 tokens: the head took 347 ms of a 1.93 s forward_backward (170 + 86 rows, each
# recomputed) against 181 ms unchunked; the plain torch loop's step is 1.71 s (2 idle cores).
PLAIN_HEAD_POSITIONS = 512


def chunk_rows(vocab_size: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Positions per chunk so that one ``[rows, vocab_size]`` float32 buffer is ``chunk_bytes`` (>= 1).

    SmolLM2 (V = 49,152) at the default 32 MiB: 170 rows.
    """
    return max(1, int(chunk_bytes) // (4 * max(1, int(vocab_size))))


def _chunk_logprobs(head: torch.nn.Module, h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    z = head(h).float()
    return z.gather(-1, t[:, None]).squeeze(-1) - torch.logsumexp(z, dim=-1)


def target_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *,
                    rows: int) -> torch.Tensor:
    """``log softmax(head(hidden))[targets]`` per position, ``rows`` positions at a time.

    Args:
        head: the output-embedding module (``hidden [.., H] -> logits [.., V]``).
        hidden: ``[N, H]`` final hidden states (the head's input), any float dtype.
        targets: ``[N]`` int64 token ids in ``[0, V)``.
        rows: positions per chunk (``chunk_rows``). ``N <= rows``, or with grad mode on
            ``N <= PLAIN_HEAD_POSITIONS``, runs the plain formula once (no recomputation:
            short requests pay nothing).

    Returns:
        ``[N]`` float32 logprobs (nats), differentiable with respect to
        ``hidden`` and the head's parameters when grad mode is on.
    """
    n = int(hidden.shape[0])
    grad = torch.is_grad_enabled()
    if n <= rows or (grad and n <= PLAIN_HEAD_POSITIONS):
        return _chunk_logprobs(head, hidden, targets)
    parts = []
    for s in range(0, n, rows):
        h, t = hidden[s: s + rows], targets[s: s + rows]
        if grad:
            # Saves h (a view) and t; the chunk's logits are recomputed in backward.
            parts.append(checkpoint(_chunk_logprobs, head, h, t, use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(head, h, t))
    return torch.cat(parts)


def head_module(model: torch.nn.Module) -> torch.nn.Module:
    """The output-embedding module of ``model`` (a transformers model, a PeftModel or a DeepSpeed engine).

    Raises:
        ValueError: the model has no output embeddings.
    """
    inner = getattr(model, "module", model)   # DeepSpeedEngine wraps the model as .module
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no output embeddings (lm_head)")
    return head


@dataclass
class HeadCapture:
    """What ``head_input`` caught: the head module and its input ``[B, T, H]`` (None before the forward)."""

    head: torch.nn.Module
    hidden: torch.Tensor | None = None
    armed: bool = True


@contextlib.contextmanager
def head_input(model: torch.nn.Module, on_hidden: Callable[[torch.nn.Module, torch.Tensor], None] | None = None,
               keep_last: bool = False) -> Iterator[HeadCapture]:
    """Run a forward of ``model`` inside this to catch the hidden states its head would get.

    The first head call inside the block gets a zero-length slice of its input
    (so the model's ``logits`` are ``[B, 0, V]``), or with ``keep_last`` the last
    position only (``[B, 1, V]``: what a sampler needs next, from a contiguous
    copy of that position's hidden states); the full input is
    kept in ``capture.hidden``. ``on_hidden(head, hidden)``, when given, runs
    inside that call, i.e. within the forward's adapter context (a peft
    ``disable_adapter`` block, the active adapter). Later head calls
    (``target_logprobs``) run normally. The hook is removed on exit.
    """
    cap = HeadCapture(head_module(model))

    def pre(module, args, kwargs):
        if not cap.armed:
            return None
        cap.armed = False
        key = None if args else next(iter(kwargs))
        h = args[0] if args else kwargs[key]
        cap.hidden = h
        if on_hidden is not None:
            on_hidden(cap.head, h)
        # contiguous: a [B, 1, H] view of [B, S, H] sends the head's matmul through bmm with the
        # weight expanded and copied B times (5.4 s for B = 16 on SmolLM2's 49k x 576 head, one
        # thread, vs 12 ms contiguous; the same values), which transformers' logits_to_keep=1 hits
        cut = h[..., -1:, :].contiguous() if keep_last else h[..., :0, :]
        return ((cut, *args[1:]), kwargs) if args else (args, {**kwargs, key: cut})

    # prepend: before other pre-hooks, so the captured hidden state is the model's own tensor. DeepSpeed
    # ZeRO-3's pre-hook wraps the head's input in a function whose backward releases the head; captured
    # after it, our chunks' gradient would fire that release for a head whose output never got one
    # (measured: AssertionError "active_backward_submodules is empty during backward pass").
    handle = cap.head.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)
    try:
        yield cap
    finally:
        handle.remove()


def prompt_logprobs(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, rows: int,
                    top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Inference only: ``(logprobs [N], top-k values [N, k], top-k ids [N, k])`` of ``log softmax(head(hidden))``,
    ``rows`` positions at a time (no ``[N, V]`` tensor). ``hidden`` ``[N, H]``, ``targets`` ``[N]``;
    the top-k parts are None when ``top_k == 0``."""
    lps, vals, idxs = [], [], []
    for s in range(0, int(hidden.shape[0]), rows):
        logp = torch.log_softmax(head(hidden[s: s + rows]).float(), dim=-1)
        lps.append(logp.gather(-1, targets[s: s + rows, None]).squeeze(-1))
        if top_k > 0:
            v, i = torch.topk(logp, min(top_k, logp.shape[-1]), dim=-1)
            vals.append(v)
            idxs.append(i)
    lp = torch.cat(lps) if lps else hidden.new_zeros((0,), dtype=torch.float32)
    if top_k <= 0:
        return lp, None, None
    return lp, torch.cat(vals), torch.cat(idxs)
