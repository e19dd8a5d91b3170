"""The push segments shared by a resource's same-host replicas (`wire.weights.SegmentPool`), and the
trainer's snapshot in the wire dtype.

1. Pushes of one snapshot (the same tensors dict, the same wire dtype) share one segment, packed once:
   its bytes are the tensors rounded to the wire dtype, its checksum is xxh3-128 of them; another
   snapshot gets another segment while the first is out.
2. A segment whose pushes were all answered is reused (the smallest free one that fits, least recently
   used dropped beyond `keep_free`); one with a failed push is never handed out again, even while
   another push of it is still out.
3. `adapter_tensors(id, "bfloat16")` is one flat bf16 buffer equal to the float32 snapshot rounded
   (what a push converted before), so a push sends it as it is.
"""

from __future__ import annotations

import pytest
import torch

from together_train_server.engines.generator_base import contiguous_run
from together_train_server.wire import weights as wt

pytestmark = pytest.mark.skipif(not wt.shared_memory_available(), reason="no memfd on this system")


def snapshot(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(n, 3, generator=g), "b": torch.randn(2, n, generator=g)}


def test_one_segment_per_snapshot_packed_once():
    pool = wt.SegmentPool()
    try:
        t = snapshot(64, 0)
        first = pool.acquire(t, "bfloat16")
        second = pool.acquire(t, "bfloat16")
        assert second is first and pool.held() == 1
        want = torch.cat([v.reshape(-1) for v in t.values()]).to(torch.bfloat16)
        got = first.segment.data[: first.nbytes].view(torch.bfloat16)
        assert torch.equal(got, want), (got[:4], want[:4])
        assert first.digest == wt.checksum(want.view(torch.uint8).numpy())
        assert [m.name for m in first.metas] == ["a", "b"] and first.nbytes == want.numel() * 2
        other = pool.acquire(snapshot(64, 1), "bfloat16")
        assert other.segment is not first.segment and pool.held() == 2
        as_f32 = pool.acquire(t, "float32")  # another wire dtype: another segment
        assert as_f32.segment is not first.segment and as_f32.nbytes == first.nbytes * 2
        for lease in (first, second, other, as_f32):
            pool.release(lease, answered=True)
    finally:
        pool.close()
    assert pool.held() == 0


def test_reuse_after_answers_never_after_a_failure():
    pool = wt.SegmentPool(keep_free=2)
    try:
        small, big = pool.acquire(snapshot(16, 0), "float32"), pool.acquire(snapshot(512, 1), "float32")
        small_seg, big_seg = small.segment, big.segment
        pool.release(small, True)
        pool.release(big, True)
        again = pool.acquire(snapshot(8, 2), "float32")
        assert again.segment is small_seg  # the smallest that fits, not the big one
        pool.release(again, True)
        third = pool.acquire(snapshot(2048, 3), "float32")  # fits neither: a new one
        assert third.segment is not small_seg and third.segment is not big_seg
        third_seg = third.segment
        pool.release(third, True)  # three free > keep_free: the least recently used (big) goes
        assert pool.held() == 2
        mid = pool.acquire(snapshot(512, 4), "float32")
        assert mid.segment is not big_seg and mid.segment is third_seg
        pool.release(mid, True)

        t = snapshot(32, 5)
        a, b = pool.acquire(t, "float32"), pool.acquire(t, "float32")
        seg = a.segment
        pool.release(a, answered=False)  # one replica's push failed; the other is still reading
        assert b.segment is seg
        pool.release(b, answered=True)
        for _ in range(3):
            lease = pool.acquire(snapshot(32, 6), "float32")
            assert lease.segment is not seg
            pool.release(lease, True)
    finally:
        pool.close()


def test_snapshot_in_wire_dtype_is_the_rounded_float32_one(tiny_model_dir):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.engines.types import LoraConfig

    eng = TorchTrainerEngine(tiny_model_dir)
    eng.create_adapter("a", LoraConfig(rank=4, alpha=8.0, seed=0))
    with torch.no_grad():
        for p in eng.trainable_parameters("a").values():
            p.normal_()
    f32, bf16 = eng.adapter_tensors("a"), eng.adapter_tensors("a", "bfloat16")
    assert list(f32) == list(bf16)
    for k in f32:
        assert bf16[k].dtype == torch.bfloat16 and torch.equal(bf16[k], f32[k].to(torch.bfloat16)), k
    run = contiguous_run(list(bf16.values()))
    assert run is not None and run.numel() == sum(v.numel() for v in f32.values())
    with pytest.raises(ValueError, match="int8"):
        eng.adapter_tensors("a", "int8")


def test_snapshots_follow_the_parameters_even_after_their_storage_moves(tiny_model_dir):
    """adapter_tensors keeps its source views between snapshots (`FlatSource`): each snapshot still equals
    peft's own state dict of that moment, also after a parameter got new storage (``.data`` replaced)."""
    from peft import get_peft_model_state_dict

    from together_train_server.engines.lora import FlatTensors, tensor_bytes
    from together_train_server.engines.torch_trainer import TorchTrainerEngine
    from together_train_server.engines.types import LoraConfig

    eng = TorchTrainerEngine(tiny_model_dir)
    eng.create_adapter("a", LoraConfig(rank=4, alpha=8.0, seed=0))
    name = eng._get("a").name

    def reference() -> dict[str, torch.Tensor]:  # peft's keys and values, converted by plain torch
        sd = get_peft_model_state_dict(eng.table.peft, adapter_name=name, save_embedding_layers=False)
        return {k: v.detach().to(torch.bfloat16) for k, v in sd.items()}

    params = list(eng.trainable_parameters("a").values())
    for step in range(3):
        with torch.no_grad():
            for p in params:
                p.normal_()
        if step == 2:
            params[0].data = params[0].data.clone() + 1  # new storage: the cached view would be stale
        snap = eng.adapter_tensors("a", "bfloat16")
        assert isinstance(snap, FlatTensors)
        assert tensor_bytes(snap) == 2 * sum(p.numel() for p in params) and snap._views is None  # no views cut
        ref = reference()
        assert list(snap) == list(ref)
        for k, v in ref.items():
            assert torch.equal(snap[k], v), (step, k, (snap[k].float() - v.float()).abs().max())
    with pytest.raises(KeyError):
        snap["not a key"]
    fresh = eng.adapter_tensors("a", "bfloat16")
    assert "not a key" not in fresh and next(iter(ref)) in fresh and fresh._views is None  # `in` cuts no views


def test_a_flat_source_sees_a_view_of_the_same_memory_replace_a_parameter():
    """A parameter whose .data becomes a transpose or a reshape of its own memory (same address, other
    strides) is snapshotted as it is now, with its shape now (checked against plain torch)."""
    from together_train_server.engines.lora import FlatSource

    sq, rect = torch.nn.Parameter(torch.randn(3, 3)), torch.nn.Parameter(torch.randn(2, 3))
    src = FlatSource({"sq": sq, "rect": rect})
    first = src.copy(torch.float32)
    assert torch.equal(first["sq"], sq.detach()) and torch.equal(first["rect"], rect.detach())
    sq.data, rect.data = sq.data.t(), rect.data.view(3, 2)
    again = src.copy(torch.float32)
    assert torch.equal(again["sq"], sq.detach()) and torch.equal(again["rect"], rect.detach())
    assert again["rect"].shape == (3, 2) and torch.equal(again.flat, torch.cat([sq.detach().reshape(-1),
                                                                                rect.detach().reshape(-1)]))
