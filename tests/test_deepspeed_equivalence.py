"""DeepSpeed ZeRO backend (2 CPU ranks, gloo, loopback) against the single-process TorchTrainerEngine.

One 2-rank run (ZeRO-2, LoRA) of ``_deepspeed_helpers.script``: two adapters,
two forward_backward calls per optim_step (accumulation), LoRA+, weight decay,
clipping on one step, save_state after step 2 and a resume into a fresh
adapter with its optimizer. The same script runs on TorchTrainerEngine.

Tolerances (fp32, the batch is split 2/1 samples across ranks, so padding
widths and summation order differ): loss sums 1e-4 absolute, per-token
logprobs 1e-5, pre-clip grad norms 1e-5 relative, adapter weights after 3
AdamW steps 2e-5 absolute. Resume on two ranks: bit-exact. The 2-rank
checkpoint resumed on the single-process backend: 2e-5.

Needs ``deepspeed`` (in the ``dev`` extra); skipped when it is not installed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("deepspeed")
sys.path.insert(0, os.path.dirname(__file__))
import _deepspeed_helpers as H  # noqa: E402

from together_train_server.engines.testing import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    tmp = tmp_path_factory.mktemp("ds")
    model = str(tiny_model(tmp / "tiny"))
    ctx = mp.get_context("spawn")
    port = H.free_port()
    out, ck = str(tmp / "rec.pt"), str(tmp / "ck_ds")
    procs = [ctx.Process(target=H.rank_main, args=(r, 2, port, model, 2, out, ck)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=400)
        if p.is_alive():
            p.kill()
    assert os.path.exists(out), f"the 2-rank run failed (exit codes {[p.exitcode for p in procs]})"
    ds = torch.load(out, weights_only=False)
    ref = H.script(TorchTrainerEngine(model), str(tmp / "ck_ref"))
    return {"ds": ds, "ref": ref, "model": model, "ck": ck}


def _close(a, b, atol):
    if isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=atol, msg=k)
    else:
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0, atol=atol)


def test_zero2_two_ranks_match_single_process(runs):
    ds, ref = runs["ds"], runs["ref"]
    for key in ref:
        if "/loss/" in key:
            _close(ref[key], ds[key], 1e-4)
        elif "/lp/" in key:
            _close(ref[key], ds[key], 1e-5)
        elif "/norm/" in key:
            assert ds[key] == pytest.approx(ref[key], rel=1e-5), key
        elif key.endswith("weights"):
            _close(ref[key], ds[key], 2e-5)
        else:
            assert ds[key] == ref[key], key


def test_zero2_save_resume_on_two_ranks_is_exact(runs):
    ds = runs["ds"]
    assert ds["c/loaded_step"] == 2 and ds["c/stepno/2"] == ds["a/stepno/2"] == 3
    for k in (0, 1):
        assert ds[f"c/loss/2/{k}"] == ds[f"a/loss/2/{k}"]
        np.testing.assert_array_equal(ds[f"c/lp/2/{k}"], ds[f"a/lp/2/{k}"])
    assert ds["c/norm/2"] == ds["a/norm/2"]
    for name, t in ds["a/weights"].items():
        assert torch.equal(ds["c/weights"][name], t), name


def test_two_rank_checkpoint_resumes_on_single_process(runs):
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    eng = TorchTrainerEngine(runs["model"])
    eng.create_adapter("x", H.SPEC)
    assert eng.load_state("x", runs["ck"], with_optimizer=True) == 2
    rec: dict = {}
    H.train_steps(eng, "x", [2], rec, "x")
    _close(runs["ref"]["a/weights"], eng.adapter_tensors("x"), 2e-5)
    assert rec["x/norm/2"] == pytest.approx(runs["ref"]["a/norm/2"], rel=1e-5)


def test_unimplemented_modes_are_refused_before_launch():
    from together_train_server.engines.deepspeed_trainer import DeepSpeedTrainerEngine

    with pytest.raises(NotImplementedError, match="ZeRO-3"):
        DeepSpeedTrainerEngine("unused", zero_stage=3)
    with pytest.raises(NotImplementedError, match="full"):
        DeepSpeedTrainerEngine("unused", zero_stage=2, mode="full")
