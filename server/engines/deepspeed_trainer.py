"""DeepSpeed ZeRO trainer engine: the TorchTrainerEngine interface across ranks.

Launch one process per rank (``deepspeed`` launcher or ``torchrun``; env
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
Every rank builds a ``DeepSpeedTrainerEngine``. Rank 0 is the one the
service calls: each state-changing operation (create/drop adapter, forward,
optim_step, save/load state) is first broadcast to the other ranks as a small
pickled description (``torch.distributed.broadcast_object_list``; samples
travel as numpy arrays inside it), then every rank executes it; results come
from rank 0. Ranks 1..k-1 sit in ``follow()`` (no gRPC here).

LoRA mode (the only mode of this release): one frozen base copy per rank,
one DeepSpeed engine (ZeRO stage 1 or 2, with a plain ``torch.optim.AdamW``
that ZeRO partitions) per adapter over the shared peft model.

Data parallel: the samples of a request are split into contiguous chunks, one
per rank (``numpy.array_split`` order); each rank runs its chunk in
micro-batches (``micro_batch_tokens``) and every rank runs the same number of
forwards (a rank with fewer pads with zero-loss one-token forwards), so
collectives line up. DeepSpeed averages gradients over ranks; the loss is
multiplied by the world size before ``engine.backward`` so the reduced gradient
is the gradient of the request's *sum* loss, as on one device. Loss sums,
metric sums, per-sample logprobs and elementwise losses are gathered
(``all_gather_object``) and returned in request order.

Gradient accumulation (DESIGN §9): every ``forward(backward=True)`` marks its
backward as not a boundary; ``optim_step`` marks the boundary with a
zero-loss backward, then sets the AdamW hyper-parameters on the ZeRO param
groups (A: lr, B: lr * lora_plus_ratio, betas, eps, weight_decay), sets
ZeRO's own clipping (``optimizer.clip_grad``; same formula as
``torch.nn.utils.clip_grad_norm_``: scale by ``max / (norm + 1e-6)`` when
above) and calls ``engine.step()``; the returned ``grad_norm`` is ZeRO's
pre-clip global L2 norm. DeepSpeed's config ``gradient_clipping`` is 0.

Checkpoints: ``save_state`` gathers the full (unpartitioned) AdamW moments
with ``deepspeed.utils.safe_get_full_optimizer_state`` (a collective on every
rank) and rank 0 writes exactly the single-device format
(``TorchTrainerEngine.save_state``), so a checkpoint resumes on either
backend. ``load_state`` runs on every rank and reads the directory, which
must be reachable from every rank (same host, or shared storage).

Failure: collectives carry a timeout (``collective_timeout_s``) and every
follower writes a heartbeat into the c10d store; when a collective fails or
a heartbeat is older than ``heartbeat_timeout_s`` the engine turns *broken*:
every later call raises ``RankFailure`` (``grpc_code = "UNAVAILABLE"``)
naming the ranks that stopped. Restart all ranks and create the session from
the last training checkpoint (``load_state_with_optimizer``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from datetime import timedelta
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import losses as _losses
from .torch_trainer import TorchTrainerEngine, _Adapter
from .types import AdamConfig, ForwardOutput, LoraSpec, OptimOutput, TrainSample

__all__ = ["DeepSpeedTrainerEngine", "RankFailure", "init_distributed", "deepspeed_available"]

log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A rank died or a collective timed out; the resource must be restarted.

    ``grpc_code`` tells the service layer which status to report (engines do
    not import gRPC).
    """

    grpc_code = "UNAVAILABLE"
    retryable = False


def deepspeed_available() -> bool:
    """True when ``import deepspeed`` works (the ``deepspeed`` extra)."""
    try:
        import deepspeed  # noqa: F401
    except Exception:
        return False
    return True


def init_distributed(backend: str | None = None, timeout_s: float = 300.0) -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed from the launcher's env; returns (rank, world).

    ``backend`` defaults to ``"nccl"`` when CUDA is available, else ``"gloo"``.
    The shared-memory CPU collective op (a 25-40 s JIT C++ build) is disabled:
    gloo is used as is.

    Raises:
        ImportError: deepspeed missing. ValueError: env not set (``RANK`` etc.).
    """
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
        if key not in os.environ:
            raise ValueError(f"{key} is not set: launch with `deepspeed` or `torchrun` (see README)")
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s), verbose=False)
    return dist.get_rank(), dist.get_world_size()


_COLLECTIVE_OPS = ("create_adapter", "drop_adapter", "forward", "optim_step", "zero_grad",
                   "save_state", "load_state", "shutdown")


class DeepSpeedTrainerEngine(TorchTrainerEngine):
    """LoRA trainer over DeepSpeed ZeRO across ranks (same interface as TorchTrainerEngine).

    Args:
        model_dir, dtype, micro_batch_tokens: as ``TorchTrainerEngine``.
        zero_stage: 1 or 2 (ZeRO optimizer-state / gradient partitioning).
        mode: ``"lora"`` (one DeepSpeed engine per adapter over the shared base).
        device: ``"cpu"`` or ``"cuda"`` (each rank uses ``cuda:LOCAL_RANK``).
        collective_timeout_s: timeout of every collective (process group).
        heartbeat_s / heartbeat_timeout_s: follower heartbeat period and the
            age after which rank 0 declares a follower dead.

    Raises:
        NotImplementedError: ``zero_stage=3`` or ``mode="full"`` (not in this release).
        ValueError: bad stage / launcher env missing. ImportError: no deepspeed.
    """

    def __init__(self, model_dir, *, zero_stage: int = 2, mode: str = "lora", dtype: str = "float32",
                 device: str = "cpu", micro_batch_tokens: int = 8192, collective_timeout_s: float = 300.0,
                 heartbeat_s: float = 1.0, heartbeat_timeout_s: float = 10.0) -> None:
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        if zero_stage == 3 or mode != "lora":
            raise NotImplementedError(
                "this release of the DeepSpeed backend supports --mode lora with --zero-stage 1 or 2; "
                "ZeRO-3 and --mode full are not implemented yet"
            )
        self.rank, self.world_size = init_distributed(timeout_s=collective_timeout_s)
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(torch.device(device))
        super().__init__(model_dir, dtype=dtype, device=device, micro_batch_tokens=micro_batch_tokens)
        self.zero_stage = int(zero_stage)
        self.mode = mode
        self._ds: dict[str, Any] = {}        # adapter_id -> DeepSpeedEngine
        self._cur = None                      # DeepSpeed engine of the running operation
        self._failed: str | None = None
        self._hb_s, self._hb_timeout = float(heartbeat_s), float(heartbeat_timeout_s)
        self._store = dist.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._beat()
        if self.world_size > 1:
            target = self._heartbeat_loop if self.rank else self._monitor_loop
            self._hb_thread = threading.Thread(target=target, name="ds-heartbeat", daemon=True)
            self._hb_thread.start()

    # ------------------------------------------------------------------ liveness
    def _beat(self) -> None:
        self._store.set(f"together_train/hb/{self.rank}", repr(time.time()))

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._hb_s):
            try:
                self._beat()
            except Exception:  # rank 0 (the store's host) is gone
                log.error("rank %d: lost the rendezvous store (rank 0 gone?); exiting", self.rank)
                os._exit(3)

    def dead_ranks(self) -> list[int]:
        """Followers whose heartbeat is older than ``heartbeat_timeout_s`` (rank 0 view)."""
        now, dead = time.time(), []
        for r in range(1, self.world_size):
            try:
                ts = float(self._store.get(f"together_train/hb/{r}").decode())
            except Exception:
                ts = 0.0
            if now - ts > self._hb_timeout:
                dead.append(r)
        return dead

    def _monitor_loop(self) -> None:
        while not self._stop.wait(self._hb_s) and self._failed is None:
            dead = self.dead_ranks()
            if dead:
                self._failed = f"rank(s) {dead} stopped sending heartbeats"
                log.error("DeepSpeed trainer: %s", self._failed)

    def _broken(self, err: BaseException | None = None) -> RankFailure:
        if self._failed is None:
            dead = self.dead_ranks() if self.rank == 0 else []
            who = f"rank(s) {dead} died" if dead else "a collective failed or timed out"
            self._failed = f"{who}: {type(err).__name__}: {err}" if err else who
        return RankFailure(
            f"the DeepSpeed trainer is unavailable ({self._failed}); restart every rank and resume the "
            "session from its last training checkpoint"
        )

    @property
    def failed(self) -> str | None:
        """Why the engine is broken (None while every rank is alive)."""
        return self._failed

    # ------------------------------------------------------------------ op broadcast
    def _call(self, op: str, *args: Any, **kwargs: Any) -> Any:
        """Rank 0: broadcast ``(op, args, kwargs)`` then run it here too; the result is this rank's."""
        if self._failed is not None:
            raise self._broken()
        if self.world_size > 1:
            try:
                dist.broadcast_object_list([(op, args, kwargs)], src=0)
            except Exception as err:
                raise self._broken(err) from None
        return self._run(op, args, kwargs)

    def _run(self, op: str, args: tuple, kwargs: dict) -> Any:
        try:
            return getattr(self, "_op_" + op)(*args, **kwargs)
        except (RuntimeError, dist.DistBackendError) as err:
            if isinstance(err, RankFailure) or "gloo" in str(err).lower() or "nccl" in str(err).lower() \
                    or isinstance(err, dist.DistBackendError) or "timed out" in str(err).lower():
                raise self._broken(err) from None
            raise

    def follow(self) -> None:
        """Ranks 1..k-1: execute rank 0's operations until ``close()`` (or rank 0 dies).

        Errors raised by an operation are logged and swallowed (rank 0 raises
        the same error and reports it); a failed broadcast ends the loop.
        """
        if self.rank == 0:
            raise RuntimeError("follow() runs on ranks 1..k-1 only")
        while True:
            box: list[Any] = [None]
            try:
                dist.broadcast_object_list(box, src=0)
            except Exception as err:
                log.error("rank %d: lost rank 0 (%s); exiting follower loop", self.rank, err)
                return
            op, args, kwargs = box[0]
            if op == "shutdown":
                self._stop.set()
                self._join_heartbeat()
                return
            try:
                self._run(op, args, kwargs)
            except RankFailure as err:
                log.error("rank %d: %s", self.rank, err)
                return
            except Exception as err:  # the same error is raised on rank 0
                log.info("rank %d: %s failed: %s", self.rank, op, err)

    def close(self) -> None:
        """Rank 0: release the followers (they return from ``follow``)."""
        if self.rank == 0 and self.world_size > 1 and self._failed is None:
            try:
                self._call("shutdown")
            except Exception:
                pass
        self._stop.set()
        self._join_heartbeat()

    def _join_heartbeat(self) -> None:
        t = getattr(self, "_hb_thread", None)
        if t is not None and t.is_alive():
            t.join(timeout=5)

    def _op_shutdown(self) -> None:
        return None

    # ------------------------------------------------------------------ public (collective) API
    def create_adapter(self, adapter_id: str, spec: LoraSpec) -> int:
        """As TorchTrainerEngine, plus a DeepSpeed engine (ZeRO) over the adapter's AdamW. Collective."""
        return self._call("create_adapter", adapter_id, spec)

    def drop_adapter(self, adapter_id: str) -> None:
        """As TorchTrainerEngine (its DeepSpeed engine is released). Collective."""
        return self._call("drop_adapter", adapter_id)

    def forward(self, adapter_id: str, samples: Sequence[TrainSample], loss_fn: str,
                loss_params: Mapping[str, Any] | None = None, *, backward: bool = False,
                return_logprobs: bool = False, return_elementwise: bool = False) -> ForwardOutput:
        """As TorchTrainerEngine.forward, the batch split across ranks. Collective.

        Differences: on a non-finite loss the error is raised before that
        micro-batch's backward on every rank, but gradients of *earlier*
        micro-batches of the same request (requests above
        ``micro_batch_tokens``) stay accumulated. LoRA dropout draws differ
        from the single-device backend (each rank has its own stream).
        """
        samples = [TrainSample(np.asarray(s.model_input), {k: np.asarray(v) for k, v in s.inputs.items()})
                   for s in samples]
        return self._call("forward", adapter_id, samples, loss_fn, dict(loss_params or {}), backward=backward,
                          return_logprobs=return_logprobs, return_elementwise=return_elementwise)

    def optim_step(self, adapter_id: str, cfg: AdamConfig) -> OptimOutput:
        """As TorchTrainerEngine.optim_step (ZeRO partitioned AdamW). Collective.

        Without any accumulated gradient the step still runs (zero gradients:
        Adam moments decay and weight decay applies), unlike the torch backend
        which skips parameters without a gradient.
        """
        return self._call("optim_step", adapter_id, cfg)

    def zero_grad(self, adapter_id: str) -> None:
        """Drop the adapter's accumulated gradients on every rank. Collective."""
        return self._call("zero_grad", adapter_id)

    def save_state(self, adapter_id: str, out_dir) -> Any:
        """Training checkpoint in the single-device format (rank 0 writes). Collective."""
        return self._call("save_state", adapter_id, str(out_dir))

    def load_state(self, adapter_id: str, state_dir, with_optimizer: bool) -> int:
        """As TorchTrainerEngine.load_state on every rank (``state_dir`` readable by all). Collective."""
        return self._call("load_state", adapter_id, str(state_dir), bool(with_optimizer))

    def grad_norm(self, adapter_id: str) -> float:  # pragma: no cover - not meaningful under ZeRO-2
        raise NotImplementedError("grad_norm before optim_step is not available on the DeepSpeed backend")

    # ------------------------------------------------------------------ op implementations
    def _ds_config(self) -> dict[str, Any]:
        return {
            "train_batch_size": self.world_size,
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,           # ours, set per step on the ZeRO optimizer
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
        }

    def _op_create_adapter(self, adapter_id: str, spec: LoraSpec) -> int:
        import deepspeed

        n = TorchTrainerEngine.create_adapter(self, adapter_id, spec)
        st = self._get(adapter_id)
        self._activate(st)
        try:
            eng, _, _, _ = deepspeed.initialize(model=self._peft, optimizer=st.optimizer, config=self._ds_config())
        except Exception:
            TorchTrainerEngine.drop_adapter(self, adapter_id)
            raise
        self._ds[adapter_id] = eng
        return n

    def _op_drop_adapter(self, adapter_id: str) -> None:
        TorchTrainerEngine.drop_adapter(self, adapter_id)
        eng = self._ds.pop(adapter_id, None)
        if eng is not None:
            try:
                eng.optimizer.zero_grad(set_to_none=True)
            except Exception:
                pass
            eng.destroy() if hasattr(eng, "destroy") else None

    def _model_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self._cur(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def _backward_group(self, total: torch.Tensor, value: float) -> None:
        ok = torch.tensor([1.0 if math.isfinite(value) else 0.0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1.0:
            raise FloatingPointError(
                "the loss of this batch is not finite on at least one rank; this micro-batch was not "
                "accumulated (check advantages and sampler logprobs: r = exp(p - q) may overflow)"
            )
        self._cur.set_gradient_accumulation_boundary(False)
        self._cur.backward(total * float(self.world_size))

    def _pad_forward(self, backward: bool) -> None:
        """A zero-loss one-token forward (and backward), so every rank runs as many as the others."""
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        with torch.set_grad_enabled(backward):
            total = self._model_logits(ids, torch.ones_like(ids)).float().sum() * 0.0
            if backward:
                self._backward_group(total, 0.0)

    def _op_forward(self, adapter_id, samples, loss_fn, loss_params, *, backward, return_logprobs,
                    return_elementwise) -> ForwardOutput:
        st = self._get(adapter_id)
        params, lens = self._check_forward(samples, loss_fn, loss_params)
        self._activate(st)
        self._cur = self._ds[adapter_id]
        batch = _losses.batch_stats([s.inputs for s in samples])
        mine = [int(i) for i in np.array_split(np.arange(len(samples)), self.world_size)[self.rank]]
        groups = self._micro_batches([lens[i] for i in mine])
        n_groups = torch.tensor([len(groups)], dtype=torch.long)
        dist.all_reduce(n_groups, op=dist.ReduceOp.MAX)
        train_mode = backward and st.spec.dropout > 0
        self._peft.train(train_mode)
        rng_outer = self._rng_enter(st, train_mode)
        total, acc, lp_out, el_out = 0.0, {}, [], []
        try:
            for g in range(int(n_groups.item())):
                if g < len(groups):
                    idx = [mine[j] for j in groups[g]]
                    total += self._forward_group(
                        [samples[i] for i in idx], [lens[i] for i in idx], loss_fn, params, batch,
                        backward, return_logprobs, return_elementwise, acc, lp_out, el_out,
                    )
                else:
                    self._pad_forward(backward)
        finally:
            self._peft.eval()
            self._rng_exit(st, rng_outer)
        parts: list[Any] = [None] * self.world_size
        dist.all_gather_object(parts, (total, acc, lp_out, el_out))
        total, acc, lp_out, el_out = 0.0, {}, [], []
        for t, a, lp, el in parts:
            total += t
            for k, v in a.items():
                acc[k] = acc.get(k, 0.0) + v
            lp_out += lp
            el_out += el
        if not math.isfinite(total):
            raise FloatingPointError(f"the {loss_fn} loss of this batch is not finite ({total})")
        metrics = _losses.finalize_metrics(acc)
        metrics["loss:sum"] = total
        return ForwardOutput(loss=total, logprobs=lp_out if return_logprobs else None,
                             elementwise_loss=el_out if return_elementwise else None, metrics=metrics)

    def _op_zero_grad(self, adapter_id: str) -> None:
        self._ds[adapter_id].optimizer.zero_grad(set_to_none=True)
        for p in self._get(adapter_id).params:
            p.grad = None

    def _op_optim_step(self, adapter_id: str, cfg: AdamConfig) -> OptimOutput:
        st = self._get(adapter_id)
        lr = float(cfg.learning_rate)
        if not (math.isfinite(lr) and lr >= 0):
            raise ValueError(f"learning_rate must be finite and >= 0, got {cfg.learning_rate}")
        if not (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
            raise ValueError(f"betas must be in [0, 1), got {cfg.beta1}, {cfg.beta2}")
        if not cfg.eps > 0 or cfg.weight_decay < 0 or cfg.grad_clip_norm < 0 or cfg.lora_plus_ratio <= 0:
            raise ValueError("eps and lora_plus_ratio must be > 0; weight_decay, grad_clip_norm >= 0")
        eng = self._cur = self._ds[adapter_id]
        self._activate(st)
        self._peft.eval()
        # The boundary: a zero-loss backward marked as the accumulation boundary
        # makes ZeRO-1/2 reduce the accumulated gradients (DESIGN §9).
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)
        zero = self._model_logits(ids, torch.ones_like(ids)).float().sum() * 0.0
        eng.set_gradient_accumulation_boundary(True)
        eng.backward(zero)
        for g in eng.optimizer.param_groups:
            g["lr"] = lr * (float(cfg.lora_plus_ratio) if g.get("name") == "B" else 1.0)
            g["betas"] = (float(cfg.beta1), float(cfg.beta2))
            g["eps"] = float(cfg.eps)
            g["weight_decay"] = float(cfg.weight_decay)
        eng.optimizer.clip_grad = float(cfg.grad_clip_norm)
        eng.step()
        norm = eng.get_global_grad_norm()
        norm = float(norm) if norm is not None else 0.0
        if not math.isfinite(norm):
            raise FloatingPointError(f"non-finite gradient norm ({norm}); step skipped, gradients dropped")
        st.step += 1
        return OptimOutput(step=st.step, grad_norm=norm, learning_rate=lr)

    # ------------------------------------------------------------------ checkpoints
    def _group_of(self, st: _Adapter) -> list[int]:
        return [0] * len(st.params_a) + [1] * len(st.params_b)

    def _optimizer_state_dict(self, st: _Adapter) -> dict[str, Any]:
        """Full AdamW state per parameter (gathered from the ZeRO partitions; collective)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        eng = self._ds[st.adapter_id]
        inner = eng.optimizer.optimizer
        if inner.state:   # (re)link the per-parameter fragments to the live AdamW state
            eng.optimizer._hp_optimizer_states_linked = False
            eng.optimizer._lazy_init_hp_params_optimizer_state()
        steps = []
        for g in inner.param_groups:
            s = inner.state.get(g["params"][0], {}) if g["params"] else {}
            steps.append(s.get("step"))
        state: dict[int, dict[str, torch.Tensor]] = {}
        for idx, (p, gi) in enumerate(zip(st.params, self._group_of(st))):
            if steps[gi] is None:
                continue
            entry = {"step": torch.as_tensor(steps[gi]).detach().clone().float().reshape(())}
            for key in ("exp_avg", "exp_avg_sq"):
                entry[key] = safe_get_full_optimizer_state(p, key).detach().to("cpu").clone()
            state[idx] = entry
        groups = [{k: v for k, v in g.items() if k != "params"} for g in eng.optimizer.param_groups]
        return {"state": state, "param_groups": groups}

    def _load_optimizer_state_dict(self, st: _Adapter, sd: dict[str, Any]) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        eng = self._ds[st.adapter_id]
        inner = eng.optimizer.optimizer
        for p in st.params:
            safe_set_full_fp32_param(p, p.detach())
        # Fresh AdamW state tensors on the flat fp32 partitions, linked to the
        # per-parameter fragments, then filled from the full tensors.
        inner.state.clear()
        for g in inner.param_groups:
            for fp in g["params"]:
                inner.state[fp] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(fp),
                                   "exp_avg_sq": torch.zeros_like(fp)}
        eng.optimizer._hp_optimizer_states_linked = False
        eng.optimizer._lazy_init_hp_params_optimizer_state()
        groups = self._group_of(st)
        steps: dict[int, torch.Tensor] = {}
        for idx, p in enumerate(st.params):
            entry = sd["state"].get(idx)
            if not entry:
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                safe_set_full_optimizer_state(p, entry[key].to(p.device, torch.float32), key)
            steps[groups[idx]] = entry["step"]
        for gi, g in enumerate(inner.param_groups):
            if gi in steps:
                for fp in g["params"]:
                    inner.state[fp]["step"] = steps[gi].clone()
            g.update({k: v for k, v in sd["param_groups"][gi].items() if k in ("lr", "betas", "eps", "weight_decay")})

    def _reset_optimizer(self, st: _Adapter) -> None:
        from deepspeed.utils import safe_set_full_fp32_param

        eng = self._ds[st.adapter_id]
        for p in st.params:
            safe_set_full_fp32_param(p, p.detach())
        eng.optimizer.optimizer.state.clear()
        eng.optimizer._hp_optimizer_states_linked = False   # relinked at the next step

    def _op_save_state(self, adapter_id: str, out_dir: str) -> Any:
        if self.rank == 0:
            return TorchTrainerEngine.save_state(self, adapter_id, out_dir)
        self._optimizer_state_dict(self._get(adapter_id))  # the collective part
        return None

    def _op_load_state(self, adapter_id: str, state_dir: str, with_optimizer: bool) -> int:
        eng = self._ds[adapter_id]
        eng.optimizer.zero_grad(set_to_none=True)
        return TorchTrainerEngine.load_state(self, adapter_id, state_dir, with_optimizer)
