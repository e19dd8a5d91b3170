"""The trainer's per-layer adapter table (engines/lora_layers.py) against peft's own add_adapter.

An adapter added through `LoraLayerIndex` must be the adapter peft's ``add_adapter`` makes with the
same seed, bit for bit, with its parameters in ``named_parameters`` order; training it must match a
plain peft model trained alone (test_engines_trainer covers the numbers against a reference); and
adding, activating or dropping one must not touch the other adapters.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from _models import random_samples, tiny_model
from together_train_server.engines.types import AdamParams, LoraConfig


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory.mktemp("tiny") / "llama")


def _engine(model_dir, fast: bool):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    e = TorchTrainerEngine(model_dir)
    e.fast_adapter_table = fast
    return e


def test_indexed_adapter_equals_peft_add_adapter(model_dir):
    """Same seed, same weights (bit for bit), same names and order as peft's add_adapter path."""
    fast, slow = _engine(model_dir, True), _engine(model_dir, False)
    for e in (fast, slow):
        for i, rank in enumerate((4, 8, 4)):
            e.create_adapter(f"a{i}", LoraConfig(rank=rank, seed=10 + i, target_modules=("q_proj", "v_proj")
                                                 if i == 1 else ()))
    for i in range(3):
        pf, ps = fast.trainable_parameters(f"a{i}"), slow.trainable_parameters(f"a{i}")
        assert list(pf) == list(ps), (list(pf)[:3], list(ps)[:3])
        for n in pf:
            assert torch.equal(pf[n], ps[n]), n
        named = [n for n, _ in fast.table.peft.named_parameters() if f".{fast._get(f'a{i}').name}." in n]
        assert list(pf) == named


def test_training_through_the_index_matches_peft_path(model_dir):
    """Two adapters trained in turn: losses and weights equal (bit for bit) to peft's own add/set path."""
    samples = random_samples([7, 12, 5], 500, seed=5)
    out = {}
    for fast in (True, False):
        e = _engine(model_dir, fast)
        for aid in ("x", "y"):
            e.create_adapter(aid, LoraConfig(rank=4, seed=3))
        losses = []
        for _ in range(2):
            for aid in ("x", "y"):
                losses.append(e.forward(aid, samples, "cross_entropy", backward=True).loss)
                e.optim_step(aid, AdamParams(learning_rate=1e-2))
        e.drop_adapter("x")
        e.create_adapter("z", LoraConfig(rank=4, seed=4))
        losses.append(e.forward("y", samples, "cross_entropy").loss)
        out[fast] = (losses, {n: p.detach().clone() for n, p in e.trainable_parameters("y").items()})
    assert out[True][0] == out[False][0], (out[True][0], out[False][0])
    for n, p in out[True][1].items():
        assert torch.equal(p, out[False][1][n]), n


def test_drop_leaves_others_and_train_unembed_falls_back(model_dir):
    """Dropping one adapter keeps the others' weights; a train_unembed adapter turns the index off."""
    e = _engine(model_dir, True)
    e.create_adapter("a", LoraConfig(rank=4, seed=1))
    e.create_adapter("b", LoraConfig(rank=4, seed=2))
    before = {n: p.detach().clone() for n, p in e.trainable_parameters("a").items()}
    e.drop_adapter("b")
    assert all(torch.equal(p, before[n]) for n, p in e.trainable_parameters("a").items())
    assert not any(".ad2." in n for n, _ in e.table.peft.named_parameters())
    e.create_adapter("u", LoraConfig(rank=4, seed=3, train_unembed=True))
    assert e.table.layer_index is not None and not e.table.layer_index.usable
    samples = random_samples([6, 9], 500, seed=1)
    assert e.forward("u", samples, "cross_entropy", backward=True).loss > 0
    e.optim_step("u", AdamParams(learning_rate=1e-2))
    e.drop_adapter("u")
    assert e.forward("a", samples, "cross_entropy").loss > 0


def test_page_out_and_in_continues_bit_exactly(model_dir, tmp_path):
    """A session written out as a page, dropped and loaded back trains on exactly as its twin that stayed.

    Both twins: same seed, LoRA dropout on (the RNG stream matters), gradients accumulated when the
    page is written (a forward_backward awaiting its optim_step), then more steps; losses, logprobs and
    weights compared bit for bit.
    """
    from together_train_server.engines.session_pages import PageCorrupt

    e = _engine(model_dir, True)
    spec = LoraConfig(rank=4, seed=7, dropout=0.1)
    samples = random_samples([9, 6, 11], 500, seed=2)
    adam = AdamParams(learning_rate=1e-2, weight_decay=0.01)
    for aid in ("twin", "paged"):
        e.create_adapter(aid, spec)
        e.forward(aid, samples, "cross_entropy", backward=True)
        e.optim_step(aid, adam)
        e.forward(aid, samples, "cross_entropy", backward=True)
    page = tmp_path / "paged.page"
    assert e.save_session("paged", page) > 0
    e.drop_adapter("paged")
    e.create_adapter("other", LoraConfig(rank=4, seed=99))   # the engine moves on meanwhile
    assert e.load_session("paged", spec, page) == 1
    out = {}
    for aid in ("twin", "paged"):
        e.optim_step(aid, adam)
        r = [e.forward(aid, samples, "cross_entropy", backward=True, return_logprobs=True) for _ in range(2)]
        e.optim_step(aid, adam)
        out[aid] = ([x.loss for x in r], [lp.tolist() for x in r for lp in x.logprobs],
                    [p.detach().clone() for p in e.trainable_parameters(aid).values()])
    assert out["twin"][0] == out["paged"][0], (out["twin"][0], out["paged"][0])
    assert out["twin"][1] == out["paged"][1]
    assert all(torch.equal(a, b) for a, b in zip(out["twin"][2], out["paged"][2]))
    # a flipped byte is refused naming the session; nothing is created
    e.drop_adapter("paged")
    raw = bytearray(page.read_bytes())
    raw[-5] ^= 0xFF
    page.write_bytes(bytes(raw))
    with pytest.raises(PageCorrupt, match="session paged.*checksum"):
        e.load_session("paged", spec, page)
    assert "paged" not in e.adapter_ids
