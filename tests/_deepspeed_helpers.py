"""Shared driver for the DeepSpeed backend tests and benchmark: a fixed training script.

``script(engine, out)`` runs on rank 0 of a DeepSpeedTrainerEngine (LoRA) or on a
TorchTrainerEngine: two adapters, a gradient dropped by zero_grad, forward_backward x2 + optim_step per step
(LoRA+, weight decay, clipping), a save_state after step 2 and a resume into
a fresh adapter with its optimizer, a merged export at the end; records
losses, logprobs, grad norms, adapter tensors and the merged directory.
"""

from __future__ import annotations

import contextlib
import os
import socket

import numpy as np
import torch

from _models import random_samples
from together_train_server.engines.types import AdamParams, LoraConfig

VOCAB = 49152
SPEC = LoraConfig(rank=4, alpha=8.0, seed=3)
STEPS = 3


def batches(step: int):
    return [random_samples([5, 9, 7], VOCAB, seed=100 * step + k) for k in range(2)]


def cfg(step: int) -> AdamParams:
    return AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.5 if step == 1 else 0.0,
                      lora_plus_ratio=4.0)


def train_steps(engine, aid, steps, rec, tag, adam=None):
    """forward_backward x2 + optim_step per step; ``adam(step)`` gives the AdamParams (default ``cfg``)."""
    adam = adam or cfg
    for step in steps:
        for k, b in enumerate(batches(step)):
            out = engine.forward(aid, b, "cross_entropy", backward=True, return_logprobs=True)
            rec[f"{tag}/loss/{step}/{k}"] = out.loss
            rec[f"{tag}/lp/{step}/{k}"] = np.concatenate(out.logprobs)
        o = engine.optim_step(aid, adam(step))
        rec[f"{tag}/norm/{step}"] = o.grad_norm
        rec[f"{tag}/stepno/{step}"] = o.step


def record_adam(engine, aid: str, rec: dict, tag: str, step: int, scratch: str) -> None:
    """``rec["{tag}/adam/{step}"]`` = {name: (param, exp_avg, exp_avg_sq)} after that step (float32 CPU).

    Read back through ``save_state`` (every engine writes the full, gathered
    AdamW state in the same format), so the test can bound each weight's
    difference by what AdamW amplifies from the moments' difference.
    """
    from safetensors.torch import load_file

    out = f"{scratch}-adam-{tag}-{step}"
    engine.save_state(aid, out)
    t = load_file(os.path.join(out, "trainer_state.safetensors"))
    rec[f"{tag}/adam/{step}"] = {k[len("param::"):]: (v, t[f"opt::{k[len('param::'):]}::exp_avg"],
                                                      t[f"opt::{k[len('param::'):]}::exp_avg_sq"])
                                 for k, v in t.items() if k.startswith("param::")}


def script(engine, ckpt_dir: str) -> dict:
    rec: dict = {}
    engine.create_adapter("a", SPEC)
    engine.create_adapter("b", LoraConfig(rank=4, alpha=8.0, seed=5))
    engine.forward("a", batches(1)[0], "cross_entropy", backward=True)
    engine.zero_grad("a")   # dropped: the reference never sees this gradient
    for step in (0, 1):
        train_steps(engine, "a", [step], rec, "a")
        record_adam(engine, "a", rec, "a", step, ckpt_dir)
    train_steps(engine, "b", [0], rec, "b")
    engine.save_state("a", ckpt_dir)
    train_steps(engine, "a", [2], rec, "a")
    record_adam(engine, "a", rec, "a", 2, ckpt_dir)
    rec["a/weights"] = {k: v.clone() for k, v in engine.adapter_tensors("a").items()}
    engine.create_adapter("c", SPEC)
    rec["c/loaded_step"] = engine.load_state("c", ckpt_dir, with_optimizer=True)
    train_steps(engine, "c", [2], rec, "c")
    rec["c/weights"] = {k: v.clone() for k, v in engine.adapter_tensors("c").items()}
    rec["merged_dir"] = str(engine.save_merged("a", ckpt_dir + "-merged"))
    return rec


@contextlib.contextmanager
def served_two_ranks(tmp_path, model, *extra: str, start_timeout: float = 240):
    """``together-train serve --trainer deepspeed`` under torchrun (2 CPU ranks, ``--generators 0``,
    storage in ``tmp_path/storage``, plus ``extra`` flags); yields a ResourceClient, stops every rank after."""
    import subprocess
    import sys
    import time

    import together_train as tt

    port_file = tmp_path / "port"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           "-m", "together_train_server.cli", "serve", "--model", str(model), "--trainer", "deepspeed",
           "--generators", "0", "--port", "0", "--port-file", str(port_file),
           "--storage", str(tmp_path / "storage"), "--trainer-threads", "1", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + start_timeout
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            assert time.time() < deadline, "server did not start"
            time.sleep(0.5)
        yield tt.ResourceClient(f"127.0.0.1:{port_file.read_text().strip()}")
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_partition_numel(engine) -> tuple[int, int, int]:
    """(elements of the base this rank stores, elements of the whole base, of which ZeRO-3 keeps whole).

    Under ZeRO-3 a partitioned parameter keeps only its shard in ``ds_tensor``
    (its ``.data`` is empty between forwards) and its full size in
    ``ds_numel``; parameters under ``stage3_param_persistence_threshold``
    elements stay gathered on every rank (``ds_persist``).
    """
    local = full = persist = 0
    for name, p in engine.worker._base.named_parameters():
        if "lora_" in name:
            continue
        if hasattr(p, "ds_tensor"):
            whole = bool(getattr(p, "ds_persist", False))
            local += int(p.ds_numel) if whole else int(p.ds_tensor.numel())
            persist += int(p.ds_numel) if whole else 0
            full += int(p.ds_numel)
        else:
            local += int(p.numel())
            full += int(p.numel())
    return local, full, persist


def rank_main(rank: int, world: int, port: int, model_dir: str, stage: int, out_file: str, ckpt_dir: str,
              mode: str = "lora", driver=None) -> None:
    """torch.multiprocessing target: rank 0 runs ``driver`` (default ``script``), others follow.

    Rank 0 saves ``driver``'s record to ``out_file`` with ``rec["partition"]``
    = every rank's ``base_partition_numel`` after the run.
    """
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_WAIT_POLICY="PASSIVE")
    torch.set_num_threads(1)
    import torch.distributed as dist

    from together_train_server.engines.deepspeed import DeepSpeedTrainerEngine

    eng = DeepSpeedTrainerEngine(model_dir, zero_stage=stage, mode=mode)
    rec = None
    if rank == 0:
        try:
            rec = (driver or script)(eng, ckpt_dir)
        finally:
            eng.close()
    else:
        eng.follow()
    dist.barrier()
    parts: list = [None] * world
    dist.all_gather_object(parts, base_partition_numel(eng))
    if rank == 0:
        rec["partition"] = parts
        torch.save(rec, out_file)
    dist.barrier()
    dist.destroy_process_group()


def launch(model_dir: str, stage: int, out_file: str, ckpt_dir: str, mode: str = "lora", driver=None,
           world: int = 2, timeout: float = 400) -> dict:
    """Run ``rank_main`` on ``world`` spawned CPU ranks; returns rank 0's record."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, model_dir, stage, out_file, ckpt_dir, mode, driver))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()
    if not os.path.exists(out_file):
        raise RuntimeError(f"the {world}-rank run failed (exit codes {[p.exitcode for p in procs]})")
    return torch.load(out_file, weights_only=False)


FULL_LR = 1e-3


def full_cfg(step: int) -> AdamParams:
    """Full mode: clipping on step 1 (the global norm is ~30 on the tiny model), weight decay on every step."""
    return AdamParams(learning_rate=FULL_LR, weight_decay=0.01, grad_clip_norm=5.0 if step == 1 else 0.0)


def full_script(engine, ckpt_dir: str) -> dict:
    """Full mode on rank 0: a dropped gradient (zero_grad), 3 steps (save_state after 2), merged export,
    refusals, drop + fresh session (base weights again), resume from the checkpoint with the optimizer."""
    from together_train_server.engines.deepspeed import FullModeError

    rec: dict = {"n_params": engine.create_adapter("s", LoraConfig())}
    for key, call in (("second", lambda: engine.create_adapter("s2", LoraConfig())),
                      ("lora", lambda: engine.create_adapter("s3", LoraConfig(rank=4))),
                      ("sync", lambda: engine.adapter_tensors("s"))):
        try:
            call()
            rec[f"refused/{key}"] = None
        except FullModeError as err:
            rec[f"refused/{key}"] = str(err)
    engine.forward("s", batches(1)[0], "cross_entropy", backward=True)
    engine.zero_grad("s")   # dropped: the plain-torch reference never sees this gradient
    for step in range(STEPS):
        train_steps(engine, "s", [step], rec, "a", full_cfg)
        rec[f"a/adam/{step}"] = engine.full_adam_state("s")   # moments, for the AdamW bound of the weights
        if step == 1:
            engine.save_state("s", ckpt_dir)
    rec["a/weights"] = engine.full_weights("s")
    engine.save_merged("s", ckpt_dir + "-merged")
    engine.drop_adapter("s")
    engine.create_adapter("t", LoraConfig(seed=7))
    rec["t/fresh_loss"] = engine.forward("t", batches(0)[0], "cross_entropy").loss
    rec["c/loaded_step"] = engine.load_state("t", ckpt_dir, with_optimizer=True)
    train_steps(engine, "t", [2], rec, "c", full_cfg)
    rec["c/adam/2"] = engine.full_adam_state("t")
    rec["c/weights"] = engine.full_weights("t")
    return rec


def plain_torch_full_reference(model_dir: str) -> dict:
    """Independent full-weight reference: transformers model, torch.optim.AdamW over every parameter,
    cross-entropy sum ``-sum(w * log p(target))`` per sample, one sample per forward. Records
    ``a/adam/{step}`` = {name: (param, exp_avg, exp_avg_sq)} after each step, as `full_script`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=FULL_LR, foreach=False)
    rec: dict = {}
    for step in range(STEPS):
        for k, b in enumerate(batches(step)):
            total, lps = 0.0, []
            for s in b:
                ids = torch.as_tensor(s.model_input)[None]
                logits = model(input_ids=ids).logits[0].float()
                lp = torch.log_softmax(logits, -1).gather(-1, torch.as_tensor(s.inputs["target_tokens"])[:, None])[:, 0]
                loss = -(torch.as_tensor(s.inputs["weights"]) * lp).sum()
                loss.backward()
                total += float(loss.detach())
                lps.append(lp.detach().numpy())
            rec[f"a/loss/{step}/{k}"] = total
            rec[f"a/lp/{step}/{k}"] = np.concatenate(lps)
        c = full_cfg(step)
        if c.grad_clip_norm > 0:
            norm = torch.nn.utils.clip_grad_norm_(params, c.grad_clip_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        for g in opt.param_groups:
            g.update(lr=c.learning_rate, betas=(c.beta1, c.beta2), eps=c.eps, weight_decay=c.weight_decay)
        opt.step()
        rec[f"a/adam/{step}"] = {n: (p.detach().clone(), opt.state[p]["exp_avg"].clone(),
                                     opt.state[p]["exp_avg_sq"].clone()) for n, p in model.named_parameters()}
        opt.zero_grad(set_to_none=True)
        rec[f"a/norm/{step}"] = float(norm)
        rec[f"a/stepno/{step}"] = step + 1
    rec["a/weights"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return rec


EPS32 = float(torch.finfo(torch.float32).eps)


def adam_u(m: torch.Tensor, v: torch.Tensor, t: int, c: AdamParams) -> torch.Tensor:
    """AdamW's normalised step m_hat / (sqrt(v_hat) + eps) after t steps, float64 (Kingma & Ba, Alg. 1)."""
    m_hat = m.double() / (1 - c.beta1 ** t)
    v_hat = v.double() / (1 - c.beta2 ** t)
    return m_hat / (v_hat.sqrt() + c.eps)


def check_adam_run(ref_seq: list[dict], other_seq: list[dict], ref_w: dict, other_w: dict, what: str, *,
                   adam, lr_of, moment_rtol: float) -> dict:
    """Assert the moments agree and each weight is within AdamW's amplification of their difference.

    ``*_seq[i]`` = {name: (param, exp_avg, exp_avg_sq)} after step i+1; ``*_w`` = the final
    tensors (PEFT keys, or parameter names in full mode); ``adam(i)`` the step's AdamParams,
    ``lr_of(name)`` a parameter's learning rate. Checks, per element:

    1. each moment differs by at most ``moment_rtol * max|moment|`` of its tensor (the float32
       summation bound n * eps32 of the caller's reductions, Higham §4.2);
    2. each weight differs by at most ``sum_t lr_t * |u_t(other) - u_t(ref)|``, ``u_t =
       m_hat_t / (sqrt(v_hat_t) + eps)`` (AdamW, Loshchilov & Hutter Alg. 2; decoupled weight decay
       multiplies an earlier difference by ``1 - lr * wd <= 1``), plus float32 rounding of each
       step's update ``2 * eps32 * (|theta| + 4 * lr * |u|)``.

    Returns the per-element bound on the final weights (float64), keyed like ``*_w``. A failure
    prints the largest violation, where, and the numbers on both sides.
    """
    assert ref_w.keys() == other_w.keys(), what
    bounds: dict[str, torch.Tensor] = {}
    for key in ref_w:
        name = key if key in ref_seq[0] else next(n for n in ref_seq[0] if n.replace("base_model.model.", "") in key)
        bound = torch.zeros_like(ref_w[key], dtype=torch.float64)
        for i, (r, o) in enumerate(zip(ref_seq, other_seq)):
            (_, m_r, v_r), (_, m_o, v_o) = r[name], o[name]
            for tag, a, b in (("exp_avg", m_r, m_o), ("exp_avg_sq", v_r, v_o)):
                diff = (b.double() - a.double()).abs()
                tol = moment_rtol * float(a.double().abs().max())
                j = int(diff.argmax())
                assert float(diff.max()) <= tol, (
                    f"{what}: {tag} of {name} after step {i + 1} differs by {float(diff.max()):.3e} at flat index "
                    f"{j} (ref {float(a.flatten()[j]):.6e}, other {float(b.flatten()[j]):.6e}); "
                    f"allowed {tol:.3e} = {moment_rtol:.3e} x max|{tag}|")
            c = adam(i)
            u_r, u_o = adam_u(m_r, v_r, i + 1, c), adam_u(m_o, v_o, i + 1, c)
            lr = lr_of(name)
            theta = r[name][0].double().abs()
            bound += lr * (u_o - u_r).abs() + 2 * EPS32 * (theta + 4 * lr * u_r.abs())
        diff = (other_w[key].double() - ref_w[key].double()).abs()
        excess = diff - bound
        j = int(excess.argmax())
        assert float(excess.max()) <= 0, (
            f"{what}: {key} differs by {float(diff.flatten()[j]):.3e} at flat index {j} (ref "
            f"{float(ref_w[key].flatten()[j]):.8e}, other {float(other_w[key].flatten()[j]):.8e}), more than "
            f"AdamW's amplification of the moments' difference allows ({float(bound.flatten()[j]):.3e}); "
            f"largest difference anywhere {float(diff.max()):.3e}")
        bounds[key] = bound
    return bounds


# Long samples (tests/long/test_deepspeed_long.py): 2 ranks split these 3/2 (array_split), so rank 0 runs
# [2100], [40], [30] (a long micro-batch: checkpointing under auto, 13 head chunks of 170 positions) and
# rank 1 [50], [20] and one pad forward.
LONG_LENS = (2100, 30, 40, 50, 20)


def long_script(engine, ckpt_dir: str) -> dict:
    """One step to make LoRA B non-zero, then forward_backward + forward of LONG_LENS and a step;
    records losses, logprobs, the pre-clip grad norm, the AdamW moments and whether rank 0's first
    decoder layer ran checkpointed."""
    rec: dict = {}
    worker = getattr(engine, "worker", engine)
    layer = worker.checkpointing.layers[0]
    orig = layer.forward
    calls: list = []
    layer.forward = lambda *a, **k: (calls.append(worker.checkpointing.enabled), orig(*a, **k))[1]
    engine.create_adapter("a", SPEC)
    engine.forward("a", random_samples(LONG_LENS, VOCAB, seed=1), "cross_entropy", backward=True)
    engine.optim_step("a", AdamParams(learning_rate=1e-2))
    record_adam(engine, "a", rec, "a", 0, ckpt_dir)
    samples = random_samples(LONG_LENS, VOCAB, seed=2)
    calls.clear()
    out = engine.forward("a", samples, "cross_entropy", backward=True, return_logprobs=True)
    rec["checkpointed"] = list(calls)
    rec["loss"], rec["lp"] = out.loss, [np.asarray(x) for x in out.logprobs]
    fwd = engine.forward("a", samples, "cross_entropy", return_logprobs=True)
    rec["f_loss"], rec["f_lp"] = fwd.loss, [np.asarray(x) for x in fwd.logprobs]
    rec["norm"] = engine.optim_step("a", AdamParams(learning_rate=1e-2)).grad_norm
    record_adam(engine, "a", rec, "a", 1, ckpt_dir)
    rec["worker"] = (worker.chunked_head, worker.checkpointing.mode, worker.logprob_chunk_rows)
    layer.forward = orig
    return rec
