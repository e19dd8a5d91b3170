"""`LoraZero3Worker`: LoRA sessions over a ZeRO-3 partitioned base (``--zero-stage 3``).

The frozen base is partitioned once, before peft wraps it, by a DeepSpeed
engine without optimizer (``DeepSpeedZeRoOffload``): each rank stores ~1/k of
every base tensor and ZeRO-3's module hooks gather a layer's weights for its
forward and backward. peft's LoRA modules are added afterwards, so every
adapter's A/B (small) stay ordinary replicated tensors outside ZeRO, and
adapters come and go without touching DeepSpeed (two DeepSpeed engines over
one model do not train under stage 3). Each rank backpropagates its chunk's
*sum* loss; ``optim_step`` all-reduces (SUM) the adapter's gradients, which is
exactly the gradient of the request's sum loss, then clips and steps the
adapter's own ``torch.optim.AdamW`` identically on every rank (the
TorchTrainerEngine code path). Checkpoints are the single-device format,
written by rank 0. ``train_unembed`` is refused (peft would copy a partitioned
``lm_head``). The model is loaded already partitioned (deepspeed/loading.py).

Long sequences: the head is applied in chunks of positions (chunked_logprobs)
with its weight gathered once per micro-batch (``gathered_head``: one
collective, then the chunks and their recomputation in backward call a plain
``F.linear`` on the gathered copy, no ZeRO hook), and decoder layers are
checkpointed with one decision for all ranks per micro-batch
(``DeepSpeedWorker._agreed_checkpointing``). Every rank runs as many
micro-batches as the others (one-token pad forwards through the same path),
so every rank issues the same gathers in the same order whatever its lengths.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..adamw import check_adam
from ..types import AdamParams, LoraConfig, OptimOutput
from .errors import FullModeError
from .worker import DeepSpeedWorker

__all__ = ["LoraZero3Worker", "check_partitioned", "gathered_head"]


@contextlib.contextmanager
def gathered_head(head: torch.nn.Module) -> Iterator[Callable[[torch.Tensor], torch.Tensor]]:
    """``h [N, H] -> logits [N, V]`` with a ZeRO-3 partitioned ``nn.Linear`` head's weight gathered once.

    Collective (every rank, same point): ``deepspeed.zero.GatheredParameters`` all-gathers the weight
    (and bias); a detached copy (``V x H`` in the model dtype, as a gathered head during a forward)
    lives as long as the logprobs' autograd graph, so backward's recomputed chunks need no gather.
    The head is frozen here (``train_unembed`` is refused), so no gradient goes to it.

    Raises:
        RuntimeError: the head is not a plain ``nn.Linear`` (peft never wraps it under ZeRO-3 LoRA).
    """
    import deepspeed

    if type(head) is not torch.nn.Linear:
        raise RuntimeError(f"ZeRO-3 chunked head expects a plain nn.Linear head, got {type(head).__name__}")
    params = [p for p in (head.weight, head.bias) if p is not None]
    with deepspeed.zero.GatheredParameters(params):
        w = head.weight.detach().clone()
        b = head.bias.detach().clone() if head.bias is not None else None
    yield lambda h: F.linear(h, w, b)


def check_partitioned(model: torch.nn.Module) -> None:
    """Raise RuntimeError naming parameters ZeRO-3 loading left unpartitioned."""
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    loose = [n for n, p in model.named_parameters() if not is_zero_param(p)]
    if loose:
        raise RuntimeError(f"ZeRO-3 loading left parameters unpartitioned: {loose[:5]}")


class LoraZero3Worker(DeepSpeedWorker):
    """LoRA adapters (replicated, plain AdamW) over a ZeRO-3 partitioned frozen base."""

    def head_for(self, head: torch.nn.Module) -> Any:
        """The chunked head's callable: `gathered_head` (see the module docstring)."""
        return gathered_head(head)

    def __init__(self, model_dir: Any, **kwargs: Any) -> None:
        import deepspeed

        super().__init__(model_dir, **kwargs)
        for p in self._base.parameters():      # tied weights appear once
            p.requires_grad_(False)
        check_partitioned(self._base)
        # No optimizer: DeepSpeed only partitions (DeepSpeedZeRoOffload) and gathers in the hooks.
        self._base_eng, _, _, _ = deepspeed.initialize(model=self._base, config=self._ds_config())

    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        """As TorchTrainerEngine (the adapter's tensors on this rank's device). Collective.

        Raises:
            FullModeError: ``train_unembed`` (the lm_head copy would be a partitioned tensor).
        """
        if spec.train_unembed:
            raise FullModeError("train_unembed is not available with --zero-stage 3 (the lm_head copy "
                                "would be a partitioned tensor); use --zero-stage 1 or 2")
        n = super().create_adapter(adapter_id, spec)
        for p in self._get(adapter_id).params:   # peft follows the base's (empty) partition device
            if p.device != self.device:
                p.data = p.data.to(self.device)
        return n

    def optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        """All-reduce (sum) the adapter's gradients, then TorchTrainerEngine's clip + AdamW step on every rank."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        st = self._get(adapter_id)
        check_adam(cfg)
        has = torch.tensor([0.0 if p.grad is None else 1.0 for p in st.params])
        dist.all_reduce(has, op=dist.ReduceOp.MAX)
        grads = []
        for p, h in zip(st.params, has.tolist()):
            if h > 0:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(p.grad)
        if grads:
            # Each rank holds the gradient of its chunk's sum loss: their sum is the request's.
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            for g, r in zip(grads, _unflatten_dense_tensors(flat, grads)):
                g.copy_(r)
            # Checked here, with the same verdict on every rank, before the torch step's own check.
            if not bool(torch.isfinite(flat).all()):
                self.zero_grad(adapter_id)
                raise FloatingPointError("non-finite gradient norm (nan or inf gradient); step skipped, "
                                         "gradients dropped")
        return super().optim_step(adapter_id, cfg)
