"""The clock cycle: forwards of several sessions' adapters in one pass over the frozen base.

``TorchTrainerEngine.forward_many(items)`` runs each item (one session's
``forward`` / ``forward_backward``) as it would run alone, but the items that
can share a pass (`joins_pass`) run together: their rows are stacked into one
right-padded ``[B, T]`` batch, each op's rows contiguous and in the order its
own micro-batch has alone (longest first), and each row goes through its own
adapter (`row_lora.RowLora`: per-row LoRA A/B/scale, own dropout stream). The
head runs in chunks over all real positions as alone; then each op's loss is
its own loss function over its own rows, with its own request-wide counts
(grpo's normalisers), summed in its own sample order. One ``backward`` of the
sum of the training ops' losses sends each op's gradient to its own adapter
only: rows never mix (row-wise base projections and norms, causal attention
within a row, per-row LoRA), so the gradient of adapter k is that of op k's
loss alone.

Equal to alone up to float32 summation order: the base GEMMs see ``B * T``
rows instead of ``B_k * T_k`` (the reduction over the input features is the
same dot product, but a kernel may block it differently), the LoRA terms go
through ``bmm`` instead of ``linear``, and padded rows change the head's
chunking. Each of these is a reordering of a float32 sum of ``K`` products,
whose error is bounded by ``K * eps * sum |terms|`` (``eps = 2^-24``), i.e. a
relative difference of order ``1e-6`` per layer, compounding over the layers
(tests/server/test_clock_cycle.py states the bound it checks).

Isolation: each op is checked (``check_forward``) before the pass, so a bad
request fails alone; a loss that raises or is not finite, or a gradient that is
not finite, fails only its op, whose adapter's accumulated gradient is put back
exactly as it was (the others' gradients add up as usual). An error of the
pass itself (found late, e.g. in the model) leaves every gradient as it was,
and the ops then run one by one, each failing or succeeding on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from . import losses as _losses
from .short_steps import run_sized
from .row_lora import RowLora, Slot, requires_grad, unsupported_layer
from .trainer_batching import check_forward, micro_batches, model_target_logprobs, right_pad
from .trainer_forward import GradStash, ScoreSheet
from .types import ForwardOutput, Sample

__all__ = ["CYCLE_MAX_PADDING", "ForwardItem", "forward_many", "joins_pass"]

# Largest share of a pass's positions that may be padding (rows right-padded to the pass's longest).
# Short rows pay for their padding in every layer, but a second pass reads (and on a CPU packs)
# every base weight again, which costs more than the padding for the short steps a cycle is for.
CYCLE_MAX_PADDING = 0.5


@dataclass
class ForwardItem:
    """One session's forward or forward_backward in a cycle (the arguments of ``TrainerEngine.forward``)."""

    adapter_id: str
    samples: Sequence[Sample]
    loss_fn: str
    loss_params: Mapping[str, Any] | None = None
    backward: bool = False
    return_logprobs: bool = False
    return_elementwise: bool = False


@dataclass
class _Op:
    """An item admitted to a pass: its adapter state, loss params, rows order and running results."""

    index: int
    item: ForwardItem
    st: Any                         # trainer_adapters.TrainerAdapter
    params: dict[str, Any]
    lens: list[int]
    order: list[int]                # its samples in alone micro-batch order (longest first)
    stash: GradStash | None = None   # its accumulated gradient, set aside during the pass
    loss: Any = None                # summed loss tensor
    result: ForwardOutput | None = None
    error: BaseException | None = None


def joins_pass(engine: Any, item: ForwardItem, lens: Sequence[int]) -> list[int] | None:
    """The op's rows in alone order (its micro-batches' order, longest first) when ``item`` can share a pass;
    None when it runs alone: its adapter has a ``train_unembed`` head copy (a pass shares the base
    head), or it trains with LoRA dropout and alone it is more than one micro-batch (the dropout masks
    are drawn per micro-batch), or one of its micro-batches alone would use layer checkpointing."""
    st = engine.table.get(item.adapter_id)
    if st.spec.train_unembed:
        return None
    groups = micro_batches(lens, engine.micro_batch_tokens, engine.max_padding_fraction)
    if len(groups) > 1 and item.backward and st.spec.dropout > 0:
        return None
    if any(engine.checkpointing.wanted(len(g) * max(lens[i] for i in g), item.backward) for g in groups):
        return None
    return [i for g in groups for i in g]


def _fits(engine: Any, ops: Sequence[_Op]) -> bool:
    """One pass of ``ops`` stays within the micro-batch token budget, without layer checkpointing, and
    pads at most ``CYCLE_MAX_PADDING`` of its positions."""
    rows = sum(len(o.lens) for o in ops)
    padded = rows * max(max(o.lens) for o in ops)
    real = sum(sum(o.lens) for o in ops)
    backward = any(o.item.backward for o in ops)
    return (padded <= engine.micro_batch_tokens and not engine.checkpointing.wanted(padded, backward)
            and padded - real <= CYCLE_MAX_PADDING * padded)


def _plan(engine: Any, items: Sequence[ForwardItem]) -> tuple[list[list[_Op]], list[int], dict[int, Any]]:
    """``(passes, alone, results)``: ops bucketed by length into passes that `_fits`, indices run alone
    (after the passes; an adapter's ops after its first alone one stay alone, so each session's
    order holds), and the results already known (a failed ``check_forward``)."""
    alone: list[int] = []
    results: dict[int, Any] = {}
    ops: list[_Op] = []
    seen: set[str] = set()
    for i, it in enumerate(items):
        try:
            st = engine._get(it.adapter_id)
            params, lens = check_forward(it.samples, it.loss_fn, it.loss_params, engine.max_seq_len)
        except Exception as e:
            results[i] = e
            continue
        order = None if it.adapter_id in seen else joins_pass(engine, it, lens)
        seen.add(it.adapter_id)
        if order is None:
            alone.append(i)
        else:
            ops.append(_Op(i, it, st, params, lens, order))
    passes: list[list[_Op]] = []
    for op in sorted(ops, key=lambda o: -max(o.lens)):   # longest first: similar lengths share a pass
        if passes and _fits(engine, passes[-1] + [op]):
            passes[-1].append(op)
        else:
            passes.append([op])
    alone += [p[0].index for p in passes if len(p) == 1]
    return [p for p in passes if len(p) > 1], sorted(alone), results


def forward_many(engine: Any, items: Sequence[ForwardItem]) -> list[ForwardOutput | BaseException]:
    """Run ``items`` (distinct sessions' ops; a repeated adapter runs after, alone) as passes and alone ops.

    Returns:
        One entry per item, in order: its ``ForwardOutput``, or the exception it raised (the same
        kinds as ``TorchTrainerEngine.forward``).
    """
    passes, alone, results = _plan(engine, items)
    for ops in passes:
        why = unsupported_layer(engine.table.peft, [o.st.name for o in ops])
        if why is None:
            try:
                rows = [n for op in ops for n in op.lens]   # short: heap reuse on its own arena (engines/memory.py)
                run_sized(len(rows) * max(rows), _run_pass, engine, ops)
                for op in ops:
                    results[op.index] = op.error if op.error is not None else op.result
                continue
            except Exception:
                pass
        alone.extend(o.index for o in ops)
    for i in sorted(alone):
        it = items[i]
        try:
            results[i] = engine.forward(it.adapter_id, it.samples, it.loss_fn, it.loss_params, backward=it.backward,
                                        return_logprobs=it.return_logprobs, return_elementwise=it.return_elementwise)
        except Exception as e:
            results[i] = e
    return [results[i] for i in range(len(items))]


def _slots(ops: Sequence[_Op]) -> list[Slot]:
    slots, row = [], 0
    for op in ops:
        n = len(op.lens)
        p = float(op.st.spec.dropout)
        gen = None
        if op.item.backward and p > 0:
            gen = torch.Generator()
            gen.set_state(op.st.rng_state)
        slots.append(Slot(op.st.name, row, row + n, max(op.lens), op.item.backward, p, gen))
        row += n
    return slots


# The LoRA products of a pass (`RowLora`'s matmul): "auto" = grouped on a GPU that runs them, else bmm.
ROW_LORA_MATMUL = "auto"


def _run_pass(engine: Any, ops: list[_Op]) -> None:
    """One pass over ``ops`` (module docstring). Sets each op's ``error`` or its result; raises when the
    pass itself fails (every op's gradient then as before)."""
    train = [op for op in ops if op.item.backward]
    for op in train:   # accumulate into fresh .grad; the stash goes back after (as forward does)
        op.stash = GradStash(op.st.params)
    engine.table.activate(ops[0].st)   # no train_unembed in a pass: the head is the base's
    engine.table.peft.eval()
    engine.checkpointing.enabled = False
    slots = _slots(ops)
    samples = [op.item.samples[i] for op in ops for i in op.order]
    lens = [op.lens[i] for op in ops for i in op.order]
    try:
        ids, mask, targets = right_pad(samples, lens, engine.device)
        with torch.set_grad_enabled(bool(train)), requires_grad([p for op in train for p in op.st.params]), \
                RowLora(engine.table.peft, slots, ROW_LORA_MATMUL):
            lp_flat = model_target_logprobs(engine.table.head_model(), lambda: engine.table.peft(input_ids=ids, use_cache=False),
                                            mask, targets, engine.logprob_chunk_rows, engine.head_for)
            _losses_of(engine, ops, lp_flat)
            live = [op.loss for op in train if op.error is None]
            if live:
                torch.stack(live).sum().backward() if len(live) > 1 else live[0].backward()
    except BaseException:
        for op in train:
            assert op.stash is not None
            op.stash.restore()
        raise
    finally:
        for s, op in zip(slots, ops):
            if s.generator is not None:   # the stream advanced as alone (also on a failure)
                op.st.rng_state = s.generator.get_state()
    for op in train:
        _settle_grads(op)


def _settle_grads(op: _Op) -> None:
    """Check op's new gradient; put the stash back (failed: as it was; else old + new, as ``forward``)."""
    assert op.stash is not None
    if op.error is None:
        try:
            op.stash.check_finite(op.item.loss_fn)
        except FloatingPointError as e:
            op.error = e
    if op.error is not None:
        op.stash.restore()
    else:
        op.stash.merge()


def _losses_of(engine: Any, ops: list[_Op], lp_flat: torch.Tensor) -> None:
    """Each op's loss over its rows of ``lp_flat`` (``[sum n]``, rows in pass order); sets ``op.loss`` and
    its result, or ``op.error`` (a raising or non-finite loss)."""
    off = 0
    for op in ops:
        n_rows = sum(op.lens)
        mine = lp_flat[off: off + n_rows]
        off += n_rows
        try:
            _loss_of(engine, op, mine)
        except Exception as e:
            op.error, op.loss = e, None


def _loss_of(engine: Any, op: _Op, lp: torch.Tensor) -> None:
    """Op's summed loss (``op.loss``, in the graph) and its ``ForwardOutput`` over its rows ``lp`` (alone
    order); raises as ``forward`` does for a non-finite loss."""
    it = op.item
    sheet = ScoreSheet(it.return_logprobs, it.return_elementwise)
    total = sheet.score(lp, [it.samples[i] for i in op.order], [op.lens[i] for i in op.order], it.loss_fn,
                        op.params, _losses.batch_stats([s.inputs for s in it.samples]), engine.device)
    sheet.total = float(total.detach())
    sheet.check_finite(it.loss_fn)
    op.loss = total
    op.result = sheet.output(op.order)
