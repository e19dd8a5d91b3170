"""Shared driver for the DeepSpeed backend tests and benchmark: a fixed training script.

``script(engine, out)`` runs on rank 0 of a DeepSpeedTrainerEngine (LoRA) or on a
TorchTrainerEngine: two adapters, forward_backward x2 + optim_step per step
(LoRA+, weight decay, clipping), a save_state after step 2 and a resume into
a fresh adapter with its optimizer; records losses, logprobs, grad norms and
adapter tensors.
"""

from __future__ import annotations

import os
import socket

import numpy as np
import torch

from together_train_server.engines.testing import random_samples
from together_train_server.engines.types import AdamConfig, LoraSpec

VOCAB = 49152
SPEC = LoraSpec(rank=4, alpha=8.0, seed=3)
STEPS = 3


def batches(step: int):
    return [random_samples([5, 9, 7], VOCAB, seed=100 * step + k) for k in range(2)]


def cfg(step: int) -> AdamConfig:
    return AdamConfig(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=0.5 if step == 1 else 0.0,
                      lora_plus_ratio=4.0)


def train_steps(engine, aid, steps, rec, tag):
    for step in steps:
        for k, b in enumerate(batches(step)):
            out = engine.forward(aid, b, "cross_entropy", backward=True, return_logprobs=True)
            rec[f"{tag}/loss/{step}/{k}"] = out.loss
            rec[f"{tag}/lp/{step}/{k}"] = np.concatenate(out.logprobs)
        o = engine.optim_step(aid, cfg(step))
        rec[f"{tag}/norm/{step}"] = o.grad_norm
        rec[f"{tag}/stepno/{step}"] = o.step


def script(engine, ckpt_dir: str) -> dict:
    rec: dict = {}
    engine.create_adapter("a", SPEC)
    engine.create_adapter("b", LoraSpec(rank=4, alpha=8.0, seed=5))
    train_steps(engine, "a", [0, 1], rec, "a")
    train_steps(engine, "b", [0], rec, "b")
    engine.save_state("a", ckpt_dir)
    train_steps(engine, "a", [2], rec, "a")
    rec["a/weights"] = {k: v.clone() for k, v in engine.adapter_tensors("a").items()}
    engine.create_adapter("c", SPEC)
    rec["c/loaded_step"] = engine.load_state("c", ckpt_dir, with_optimizer=True)
    train_steps(engine, "c", [2], rec, "c")
    rec["c/weights"] = {k: v.clone() for k, v in engine.adapter_tensors("c").items()}
    return rec


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
    for name, p in engine._base.named_parameters():
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

    from together_train_server.engines.deepspeed_trainer import DeepSpeedTrainerEngine

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
