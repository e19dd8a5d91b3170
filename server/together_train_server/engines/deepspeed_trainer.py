"""DeepSpeed ZeRO trainer engine: the TorchTrainerEngine interface across ranks.

Launch one process per rank (``deepspeed`` launcher or ``torchrun``; env
``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
Every rank builds a ``DeepSpeedTrainerEngine``. Rank 0 is the one the
service calls: each state-changing operation (create/drop adapter, forward,
optim_step, save/load state) is first broadcast to the other ranks as a small
pickled description (``torch.distributed.broadcast_object_list``; samples
travel as numpy arrays inside it), then every rank executes it; results come
from rank 0. Ranks 1..k-1 sit in ``follow()`` (no gRPC here).

Three layouts (``_kind``), chosen by ``mode`` and ``zero_stage``:

- LoRA, ZeRO-1/2 (``"lora12"``): one frozen base copy per rank, one DeepSpeed
  engine (with a plain ``torch.optim.AdamW`` that ZeRO partitions) per adapter
  over the shared peft model.
- LoRA, ZeRO-3 (``"lora3"``): the frozen base is partitioned once, before peft
  wraps it, by a DeepSpeed engine without optimizer (``DeepSpeedZeRoOffload``):
  each rank stores ~1/k of every base tensor and ZeRO-3's module hooks gather a
  layer's weights for its forward and backward. peft's LoRA modules are added
  afterwards, so every adapter's A/B (small) stay ordinary replicated tensors
  outside ZeRO, and adapters come and go without touching DeepSpeed (two
  DeepSpeed engines over one model do not train under stage 3). Each rank
  backpropagates its chunk's *sum* loss; ``optim_step`` all-reduces (SUM) the
  adapter's gradients, which is exactly the gradient of the request's sum loss,
  then clips and steps the adapter's own ``torch.optim.AdamW`` identically on
  every rank (the TorchTrainerEngine code path). Checkpoints are the
  single-device format, written by rank 0. ``train_unembed`` is refused (peft
  would copy a partitioned ``lm_head``). The model is loaded already
  partitioned (same for full mode; ``_load_model``): built under
  ``deepspeed.zero.Init`` by transformers' DeepSpeed integration
  (``HfDeepSpeedConfig``), then the safetensors tensors are copied in one
  module at a time (``GatheredParameters``, rank 0 reads the file), so no
  rank holds the whole model, on the host or on the device.
- Full-weight (``"full"``, ZeRO-1/2/3): one DeepSpeed engine over the whole
  model with one ``torch.optim.AdamW`` group over every parameter (lr,
  betas, eps, weight decay on all of them; ``lora_plus_ratio`` is ignored);
  ZeRO partitions optimizer state (1), gradients (2) and parameters (3). One
  session at a time; a session created after a dropped one starts again from
  the base weights (re-read from ``model_dir``). The forward goes through the
  DeepSpeed engine. Checkpoints are DeepSpeed's own sharded format
  (``save_checkpoint``: every rank writes its optimizer shard) plus
  ``trainer_state.json``; they resume exactly on the same world size and
  stage. ``save_merged`` gathers the full weights
  (``safe_get_full_fp32_param``, one tensor at a time) and writes the same
  Hugging Face directory as the single-device merged export;
  ``adapter_tensors`` / ``save_adapter`` (LoRA only) raise ``FullModeError``.

Data parallel: the samples of a request are split into contiguous chunks, one
per rank (``numpy.array_split`` order); each rank runs its chunk in
micro-batches (``micro_batch_tokens``) and every rank runs the same number of
forwards (a rank with fewer pads with zero-loss one-token forwards), so
collectives line up. lora12 / full: DeepSpeed averages gradients over ranks;
the loss is multiplied by the world size before ``engine.backward`` so the
reduced gradient is the gradient of the request's *sum* loss, as on one
device (lora3 sums instead, see above). Loss sums,
metric sums, per-sample logprobs and elementwise losses are gathered
(``all_gather_object``) and returned in request order.

Gradient accumulation (docs/design.md §9; lora12 and full): every
``forward(backward=True)`` marks its backward as not a boundary; ``optim_step`` marks the boundary with a
zero-loss backward, then sets the AdamW hyper-parameters on the ZeRO param
groups (A: lr, B: lr * lora_plus_ratio, betas, eps, weight_decay), sets
ZeRO's own clipping (``optimizer.clip_grad``; same formula as
``torch.nn.utils.clip_grad_norm_``: scale by ``max / (norm + 1e-6)`` when
above) and calls ``engine.step()``; the returned ``grad_norm`` is ZeRO's
pre-clip global L2 norm. DeepSpeed's config ``gradient_clipping`` is 0.
``zero_grad`` also drops the buffers ZeRO-1/2 reduce non-boundary gradients
into (``optimizer.zero_grad`` alone leaves them).

Dtypes: LoRA A/B and their AdamW state are float32 (as TorchTrainerEngine);
full mode keeps the model dtype (float32, or bfloat16 with DeepSpeed's bf16
mode: fp32 master weights and moments in the ZeRO partitions); logprobs are
float32 numpy arrays ``[n_i]`` per sample.

Checkpoints (lora12): ``save_state`` gathers the full (unpartitioned) AdamW moments
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

import contextlib
import dataclasses
import json
import logging
import math
import os
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from . import losses as _losses
from . import trainer_state
from .merged_export import write_model_dir
from .trainer_batching import check_forward, micro_batches
from .torch_trainer import TorchTrainerEngine, _Adapter
from .types import AdamParams, ForwardOutput, LoraConfig, OptimOutput, Sample

__all__ = ["DeepSpeedTrainerEngine", "FullModeError", "RankFailure", "deepspeed_available", "init_distributed",
           "merge_config"]

log = logging.getLogger(__name__)


class RankFailure(RuntimeError):
    """A rank died or a collective timed out; the resource must be restarted.

    ``grpc_code`` tells the service layer which status to report (engines do
    not import gRPC).
    """

    grpc_code = "UNAVAILABLE"
    retryable = False


class FullModeError(ValueError):
    """An operation that a ``--mode full`` resource (or a ZeRO-3 LoRA one) cannot serve.

    ``grpc_code`` is FAILED_PRECONDITION: the request is valid, this
    resource's mode does not offer it.
    """

    grpc_code = "FAILED_PRECONDITION"
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
                   "save_state", "load_state", "full_weights", "save_merged", "shutdown")
_FULL_TAG = "zero"
# Keys that the engine derives from its own semantics (sum-loss gradients, per-step clipping).
_ENGINE_OWNED_KEYS = frozenset({"train_batch_size", "train_micro_batch_size_per_gpu",
                                "gradient_accumulation_steps", "gradient_clipping", "optimizer", "scheduler"})


def merge_config(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` merged in recursively (dicts merge, other values replace).

    Returns a new dict; neither argument is modified.
    """
    out = dict(base)
    for key, val in overrides.items():
        if isinstance(val, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = merge_config(out[key], val)
        else:
            out[key] = val
    return out        # DeepSpeed checkpoint tag of a full-mode training checkpoint


class DeepSpeedTrainerEngine(TorchTrainerEngine):
    """Trainer over DeepSpeed ZeRO across ranks (same interface as TorchTrainerEngine).

    Args:
        model_dir, dtype, micro_batch_tokens: as ``TorchTrainerEngine``.
        zero_stage: 1, 2 (optimizer-state / gradient partitioning) or 3 (also
            parameters: the frozen base in LoRA mode, every weight in full mode).
        mode: ``"lora"`` (sessions are LoRA adapters on the frozen base) or
            ``"full"`` (one session training every parameter; ``dtype``
            float32 or bfloat16).
        device: ``"cpu"`` or ``"cuda"`` (each rank uses ``cuda:LOCAL_RANK``).
        collective_timeout_s: timeout of every collective (process group).
        heartbeat_s / heartbeat_timeout_s: follower heartbeat period and the
            age after which rank 0 declares a follower dead.
        deepspeed_config: entries merged (recursively) over the engine's own
            DeepSpeed config, e.g. ``{"zero_optimization":
            {"stage3_max_live_parameters": 0}}``. DeepSpeed's stage-3 defaults
            keep up to 1e9 gathered parameters live and prefetch 5e7, so a
            model below ~1B parameters keeps every gathered layer for the whole
            step; lower them to trade speed for memory. Batch-size and
            clipping keys are the engine's own and cannot be overridden.

    Attributes:
        mode, zero_stage, rank, world_size: as given / from the launcher.

    Raises:
        ValueError: bad stage or mode, float16 in full mode, launcher env
        missing. ImportError: no deepspeed.
    """

    backend_name = "DeepSpeedTrainerEngine"

    def __init__(self, model_dir, *, zero_stage: int = 2, mode: str = "lora", dtype: str = "float32",
                 device: str = "cpu", micro_batch_tokens: int = 8192, collective_timeout_s: float = 300.0,
                 heartbeat_s: float = 1.0, heartbeat_timeout_s: float = 10.0,
                 deepspeed_config: Mapping[str, Any] | None = None) -> None:
        if zero_stage not in (1, 2, 3):
            raise ValueError(f"zero_stage must be 1, 2 or 3, got {zero_stage}")
        if mode not in ("lora", "full"):
            raise ValueError(f"mode must be 'lora' or 'full', got {mode!r}")
        if mode == "full" and dtype in ("float16", "fp16"):
            raise ValueError("--mode full trains in float32 or bfloat16 (float16 would need loss scaling)")
        fixed = _ENGINE_OWNED_KEYS & set(deepspeed_config or {})
        if fixed or "stage" in dict((deepspeed_config or {}).get("zero_optimization") or {}):
            raise ValueError(f"deepspeed_config may not set {sorted(fixed) or ['zero_optimization.stage']}: "
                             "the engine owns them (set the stage with --zero-stage / zero_stage)")
        self._ds_overrides = dict(deepspeed_config or {})
        self.rank, self.world_size = init_distributed(timeout_s=collective_timeout_s)
        if device.startswith("cuda"):
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
            torch.cuda.set_device(torch.device(device))
        self.zero_stage = int(zero_stage)
        self.mode = mode
        self._kind = "full" if mode == "full" else ("lora3" if zero_stage == 3 else "lora12")
        self.dtype = dtype
        # ZeRO-3: _load_model builds and loads the model already partitioned.
        super().__init__(model_dir, dtype=dtype, device=device, micro_batch_tokens=micro_batch_tokens)
        self.device = torch.device(device)
        self._ds: dict[str, Any] = {}        # adapter_id -> DeepSpeedEngine (lora12)
        self._cur = None                      # DeepSpeed engine of the running operation
        self._base_eng = None                 # lora3: the engine that partitions the base; full: the model's
        self._full_dirty = False              # full: weights changed since loaded from model_dir
        self._failed: str | None = None
        self._hb_s, self._hb_timeout = float(heartbeat_s), float(heartbeat_timeout_s)
        self._store = dist.distributed_c10d._get_default_store()
        self._stop = threading.Event()
        self._beat()
        if self.world_size > 1:
            target = self._heartbeat_loop if self.rank else self._monitor_loop
            self._hb_thread = threading.Thread(target=target, name="ds-heartbeat", daemon=True)
            self._hb_thread.start()
        if self._kind != "lora12":
            self._init_zero3_or_full()

    def _load_model(self, path: Path, dtype: str, device: str):
        """The base model and tokenizer; under ZeRO-3 loaded already partitioned (no rank holds it whole).

        ZeRO-3: the model is built by transformers' DeepSpeed integration
        (``from_config`` while an ``HfDeepSpeedConfig`` of stage 3 is alive:
        constructed under ``deepspeed.zero.Init``, each parameter partitioned
        onto this rank's device as it is created; weight initialisation
        skipped), then the safetensors checkpoint is copied in one module at a
        time: ``GatheredParameters(modifier_rank=0)`` gathers the module's
        parameters, rank 0 reads their tensors (one at a time) from the files
        and copies them in, and leaving the context partitions them again.
        Peak memory per rank: its partition plus one gathered module and one
        checkpoint tensor. Tied weights are tied at construction (the tied
        ``lm_head`` is the embedding's parameter, loaded once); buffers (RoPE
        frequencies) are computed at construction, and a buffer the
        checkpoint holds is read by every rank. When a parameter has no
        tensor of its name in ``*.safetensors`` (renamed keys, other formats)
        it falls back to transformers' own ZeRO-3 ``from_pretrained``, which
        handles them but reads the whole checkpoint into rank 0's host memory.
        """
        if self.zero_stage != 3:
            return TorchTrainerEngine._load_model(self, path, dtype, device)
        from safetensors import safe_open
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        from transformers.initialization import no_init_weights

        from .model_loading import load_causal_lm, torch_dtype

        where: dict[str, Path] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for f in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    where[k], shapes[k] = f, tuple(h.get_slice(k).get_shape())
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with self._zero3_loading():
            with no_init_weights():   # every weight comes from the checkpoint below
                model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype(dtype))
            params = dict(model.named_parameters())   # a tied weight once
            if any(n not in where for n in params):
                del model
                log.info("ZeRO-3: %s has parameter names outside its safetensors; loading through "
                         "transformers' from_pretrained (rank 0 reads the whole checkpoint)", path)
                return load_causal_lm(path, dtype=dtype, device=device)
        # Checked on every rank before any collective (a raise inside one would leave the others waiting).
        bad = [f"{n}: checkpoint {shapes[n]}, model {tuple(p.ds_shape)}" for n, p in params.items()
               if shapes[n] != tuple(p.ds_shape)]
        if bad:
            raise ValueError(f"{path}: checkpoint shapes do not fit the model: {'; '.join(bad[:3])}")
        self._load_partitioned(model, where)
        with contextlib.suppress(OSError, ValueError):
            model.generation_config = GenerationConfig.from_pretrained(str(path), local_files_only=True)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        return model, AutoTokenizer.from_pretrained(str(path), local_files_only=True)

    def _load_partitioned(self, model: torch.nn.Module, where: Mapping[str, Path]) -> None:
        """Copy checkpoint tensors into a ZeRO-3 model, one module's parameters gathered at a time."""
        import deepspeed
        from safetensors import safe_open

        def copy(dst: torch.Tensor, name: str) -> None:
            # safetensors maps the file and get_tensor is a view of it: the pages copied from stay
            # in this process's RSS while the file is open, so it is opened per tensor.
            with safe_open(str(where[name]), framework="pt") as h:
                dst.copy_(h.get_tensor(name))

        seen: set[int] = set()
        with torch.no_grad():
            for prefix, mod in model.named_modules():   # the same order on every rank
                pre = prefix + "." if prefix else ""
                own = [(pre + n, p) for n, p in mod.named_parameters(recurse=False) if id(p) not in seen]
                seen.update(id(p) for _, p in own)
                if own:
                    with deepspeed.zero.GatheredParameters([p for _, p in own], modifier_rank=0):
                        if self.rank == 0:
                            for name, p in own:
                                copy(p.data, name)
                for n, buf in mod.named_buffers(recurse=False):
                    if buf is not None and pre + n in where:
                        copy(buf, pre + n)

    @contextlib.contextmanager
    def _zero3_loading(self):
        """Context: transformers' ``from_config`` / ``from_pretrained`` inside it build the model partitioned.

        transformers' DeepSpeed integration: while an ``HfDeepSpeedConfig`` with
        stage 3 is alive, they construct the model under
        ``deepspeed.zero.Init`` (every parameter is partitioned as it is
        created, on this rank's device) and tie weights afterwards;
        ``from_pretrained`` then loads its checkpoint module by module
        (``GatheredParameters``, modifier rank 0) after reading the whole
        checkpoint on rank 0 (the fallback of ``_load_model``).
        The zero.Init dtype follows the model dtype (``bf16``/``fp16``
        ``enabled`` in the loading config only): it would otherwise cast a
        bfloat16 base to float32 in LoRA mode. The config object is dropped on
        exit, so later transformers/peft calls see no DeepSpeed config, as
        before.
        """
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

        from .model_loading import torch_dtype

        td = torch_dtype(self.dtype)
        cfg = self._ds_config()
        cfg["bf16"] = {"enabled": td == torch.bfloat16}
        cfg["fp16"] = {"enabled": td == torch.float16}
        hf_cfg = HfDeepSpeedConfig(cfg)   # referenced (weakly) by transformers while alive
        try:
            yield hf_cfg
        finally:
            unset_hf_deepspeed_config()
            del hf_cfg

    def _init_zero3_or_full(self) -> None:
        """Build the one DeepSpeed engine of lora3 (base partitioning) or full mode (the whole model)."""
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import is_zero_param

        params = list(self._base.parameters())      # tied weights appear once
        for p in params:
            p.requires_grad_(self._kind == "full")
        if self.zero_stage == 3:
            # Loaded partitioned (_zero3_loading): every parameter is a ZeRO-3 one already.
            loose = [n for n, p in self._base.named_parameters() if not is_zero_param(p)]
            if loose:
                raise RuntimeError(f"ZeRO-3 loading left parameters unpartitioned: {loose[:5]}")
        if self._kind == "lora3":
            # No optimizer: DeepSpeed only partitions (DeepSpeedZeRoOffload) and gathers in the hooks.
            self._base_eng, _, _, _ = deepspeed.initialize(model=self._base, config=self._ds_config())
            return
        opt = torch.optim.AdamW([{"params": params, "name": "A"}], lr=0.0, foreach=False)
        self._base_eng, _, _, _ = deepspeed.initialize(model=self._base, optimizer=opt, config=self._ds_config())
        self._base_eng.eval()

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
    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        """Create a session; returns its trainable parameter count. Collective.

        LoRA: as TorchTrainerEngine (lora12: plus a DeepSpeed engine over the
        adapter's AdamW). Full mode: the session trains every parameter
        (count = the model's parameters); ``spec`` must be ``LoraConfig()``'s
        defaults apart from ``seed``.

        Raises:
            ValueError: as TorchTrainerEngine; ``FullModeError`` (a ValueError)
            for a second full-mode session, LoRA fields in full mode, or
            ``train_unembed`` under ZeRO-3.
        """
        return self._call("create_adapter", adapter_id, spec)

    def drop_adapter(self, adapter_id: str) -> None:
        """As TorchTrainerEngine (lora12: its DeepSpeed engine is released; full: the optimizer
        state is cleared and the next session starts from the base weights). Collective."""
        return self._call("drop_adapter", adapter_id)

    def forward(self, adapter_id: str, samples: Sequence[Sample], loss_fn: str,
                loss_params: Mapping[str, Any] | None = None, *, backward: bool = False,
                return_logprobs: bool = False, return_elementwise: bool = False) -> ForwardOutput:
        """As TorchTrainerEngine.forward, the batch split across ranks. Collective.

        Differences: on a non-finite loss the error is raised before that
        micro-batch's backward on every rank, but gradients of *earlier*
        micro-batches of the same request (requests above
        ``micro_batch_tokens``) stay accumulated. LoRA dropout draws differ
        from the single-device backend (each rank has its own stream). Full
        mode always runs the model in eval mode.
        """
        samples = [Sample(np.asarray(s.model_input), {k: np.asarray(v) for k, v in s.inputs.items()})
                   for s in samples]
        return self._call("forward", adapter_id, samples, loss_fn, dict(loss_params or {}), backward=backward,
                          return_logprobs=return_logprobs, return_elementwise=return_elementwise)

    def optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        """As TorchTrainerEngine.optim_step. Collective.

        lora12 / full: ZeRO-partitioned AdamW; without any accumulated
        gradient the step still runs (zero gradients: Adam moments decay and
        weight decay applies), unlike the torch backend which skips parameters
        without a gradient. Full mode: one group, ``lora_plus_ratio`` unused.
        lora3: gradients are all-reduced (sum), then the torch backend's step.
        """
        return self._call("optim_step", adapter_id, cfg)

    def zero_grad(self, adapter_id: str) -> None:
        """Drop the adapter's accumulated gradients on every rank. Collective."""
        return self._call("zero_grad", adapter_id)

    def save_state(self, adapter_id: str, out_dir) -> Any:
        """Training checkpoint. Collective; ``out_dir`` must be reachable by every rank.

        LoRA: the single-device format (rank 0 writes; it resumes on either
        backend). Full mode: DeepSpeed's checkpoint (``zero/``: model states
        and one optimizer shard per rank, written by each rank) plus
        ``trainer_state.json`` (``mode: "full"``, step, ``zero_stage``,
        ``world_size``, base fingerprint).
        """
        return self._call("save_state", adapter_id, str(out_dir))

    def load_state(self, adapter_id: str, state_dir, with_optimizer: bool) -> int:
        """As TorchTrainerEngine.load_state on every rank (``state_dir`` readable by all). Collective.

        Full mode: a full-mode checkpoint of the same model, world size and
        ZeRO stage (else ValueError naming the difference); without
        ``with_optimizer`` the AdamW state starts fresh.
        """
        return self._call("load_state", adapter_id, str(state_dir), bool(with_optimizer))

    def save_merged(self, adapter_id: str, out_dir) -> Any:
        """Hugging Face model directory of the session's weights (the single-device merged format).

        LoRA: as TorchTrainerEngine (rank 0 only, nothing partitioned is
        read). Full mode: collective; the full weights are gathered one tensor
        at a time and rank 0 writes ``config.json``, ``model.safetensors``,
        tokenizer files (and ``chat_template.jinja``).
        """
        if self._kind != "full":
            return TorchTrainerEngine.save_merged(self, adapter_id, out_dir)
        return self._call("save_merged", adapter_id, str(out_dir))

    def full_weights(self, adapter_id: str) -> dict[str, torch.Tensor] | None:
        """Full mode: every parameter by name (model dtype, CPU) on rank 0, None elsewhere. Collective.

        Raises:
            FullModeError: not a full-mode resource. KeyError: unknown session.
        """
        if self._kind != "full":
            raise FullModeError("full_weights is for --mode full; LoRA sessions have adapter_tensors")
        return self._call("full_weights", adapter_id)

    def adapter_tensors(self, adapter_id: str) -> dict[str, torch.Tensor]:
        """As TorchTrainerEngine.adapter_tensors (LoRA). Raises FullModeError in full mode."""
        if self._kind == "full":
            self._get(adapter_id)
            raise FullModeError(
                "a --mode full session has no adapter: weights_sync and unmerged save_weights are LoRA "
                "operations; save_weights(merged=True) writes the full Hugging Face model directory"
            )
        return TorchTrainerEngine.adapter_tensors(self, adapter_id)

    def save_adapter(self, adapter_id: str, out_dir) -> Any:
        """As TorchTrainerEngine.save_adapter (LoRA). Raises FullModeError in full mode."""
        self.adapter_tensors(adapter_id) if self._kind == "full" else None
        return TorchTrainerEngine.save_adapter(self, adapter_id, out_dir)

    def state_differences(self, meta: Mapping[str, Any], spec: LoraConfig | None = None) -> list[str]:
        """As TorchTrainerEngine.state_differences, plus mode (and, full mode, world size and stage)."""
        diffs = TorchTrainerEngine.state_differences(self, meta, spec)
        theirs = meta.get("mode", "lora")
        if theirs != self.mode:
            diffs.append(f"training mode: checkpoint {theirs!r}, this resource {self.mode!r}")
        elif self.mode == "full":
            for key, mine in (("world_size", self.world_size), ("zero_stage", self.zero_stage)):
                if meta.get(key) != mine:
                    diffs.append(f"DeepSpeed {key}: checkpoint {meta.get(key)!r}, this resource {mine!r} "
                                 "(full-mode checkpoints resume on the same layout)")
        return diffs

    def grad_norm(self, adapter_id: str) -> float:  # pragma: no cover - not meaningful under ZeRO-2
        """Not available: gradients are partitioned (ZeRO) or per rank (lora3) until ``optim_step``.

        Raises:
            NotImplementedError: always; ``optim_step`` returns the pre-clip norm.
        """
        raise NotImplementedError("grad_norm before optim_step is not available on the DeepSpeed backend")

    # ------------------------------------------------------------------ op implementations
    def _ds_config(self) -> dict[str, Any]:
        return merge_config(self._base_ds_config(), self._ds_overrides)

    def _base_ds_config(self) -> dict[str, Any]:
        return {
            "train_batch_size": self.world_size,
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "gradient_clipping": 0.0,           # ours, set per step on the ZeRO optimizer
            "zero_optimization": {"stage": self.zero_stage},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 1 << 30,
            "wall_clock_breakdown": False,
            "bf16": {"enabled": self._kind == "full" and self.dtype in ("bfloat16", "bf16")},
        }

    # ------------------------------------------------------------------ sessions
    def _op_create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        if self._kind == "full":
            return self._create_full_session(adapter_id, spec)
        if self._kind == "lora3":
            if spec.train_unembed:
                raise FullModeError("train_unembed is not available with --zero-stage 3 (the lm_head copy "
                                    "would be a partitioned tensor); use --zero-stage 1 or 2")
            n = TorchTrainerEngine.create_adapter(self, adapter_id, spec)
            for p in self._get(adapter_id).params:   # peft follows the base's (empty) partition device
                if p.device != self.device:
                    p.data = p.data.to(self.device)
            return n
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

    def _create_full_session(self, adapter_id: str, spec: LoraConfig) -> int:
        if adapter_id in self._adapters:
            raise ValueError(f"adapter {adapter_id!r} already exists")
        if dataclasses.replace(spec, seed=0) != LoraConfig():
            raise FullModeError("this resource runs --mode full (every parameter trains): create the session "
                                "without a LoRA config")
        if self._adapters:
            raise FullModeError(f"this --mode full resource trains one session at a time "
                                f"({next(iter(self._adapters))!r} is live); stop it first")
        if self._full_dirty:
            self._reload_base_weights()
        eng = self._base_eng
        params = list(self._base.parameters())
        names = [n for n, _ in self._base.named_parameters()]
        st = _Adapter(adapter_id, "full", spec, params, [], eng.optimizer.optimizer, 0, names)
        self._adapters[adapter_id] = st
        self._full_dirty = True
        return int(sum(getattr(p, "ds_numel", p.numel()) for p in params))

    def _reload_base_weights(self) -> None:
        """Full mode: every weight back to ``model_dir``'s, fresh AdamW state (one tensor at a time)."""
        import deepspeed
        from deepspeed.utils import safe_set_full_fp32_param
        from safetensors import safe_open

        files = sorted(Path(self.model_dir).glob("*.safetensors"))
        if not files:
            raise FullModeError(f"{self.model_dir} has no *.safetensors to restore the base weights from; "
                                "restart the resource to start a new full-mode session")
        where = {}
        for f in files:
            with safe_open(str(f), framework="pt") as h:
                where.update({k: f for k in h.keys()})
        for name, p in self._base.named_parameters():
            if name not in where:
                raise FullModeError(f"{name} is not in {self.model_dir}'s safetensors; restart the resource "
                                    "to start a new full-mode session")
            with safe_open(str(where[name]), framework="pt") as h:
                t = h.get_tensor(name).to(self.device)
            # ZeRO keeps an fp32 master copy apart from the model's weights: set both.
            if hasattr(p, "ds_id"):
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if self.rank == 0:
                        p.data.copy_(t)
            else:
                with torch.no_grad():
                    p.data.copy_(t)
            safe_set_full_fp32_param(p, t.to(torch.float32))
        self._reset_full_optimizer()
        self._full_dirty = False

    def _op_drop_adapter(self, adapter_id: str) -> None:
        if self._kind == "full":
            self._get(adapter_id)
            del self._adapters[adapter_id]
            self._full_zero_grad()
            self._reset_full_optimizer()
            return
        TorchTrainerEngine.drop_adapter(self, adapter_id)
        eng = self._ds.pop(adapter_id, None)
        if eng is not None:
            try:
                eng.optimizer.zero_grad(set_to_none=True)
            except Exception:
                pass
            eng.destroy() if hasattr(eng, "destroy") else None

    def _activate(self, st: _Adapter) -> None:
        if self._kind != "full":  # full mode has no peft model
            TorchTrainerEngine._activate(self, st)

    def _set_train(self, flag: bool) -> None:
        if self._kind == "full":
            self._base_eng.eval()   # deterministic: full mode never enables dropout
        else:
            self._peft.train(flag)

    def _engine_of(self, adapter_id: str):
        """The DeepSpeed engine a forward of this adapter runs through (None: plain peft forward, lora3)."""
        if self._kind == "lora12":
            return self._ds[adapter_id]
        return self._base_eng if self._kind == "full" else None

    # ------------------------------------------------------------------ forward / backward
    def _model_logits(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self._cur is None:   # lora3: ZeRO-3's hooks on the base modules gather each layer's weights
            return self._peft(input_ids=ids, attention_mask=mask, use_cache=False).logits
        return self._cur(input_ids=ids, attention_mask=mask, use_cache=False).logits

    def _backward_group(self, total: torch.Tensor, value: float) -> None:
        ok = torch.tensor([1.0 if math.isfinite(value) else 0.0])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() < 1.0:
            raise FloatingPointError(
                "the loss of this batch is not finite on at least one rank; this micro-batch was not "
                "accumulated (check advantages and sampler logprobs: r = exp(p - q) may overflow)"
            )
        if self._cur is None:
            total.backward()    # lora3: summed over ranks at optim_step
            return
        self._cur.set_gradient_accumulation_boundary(False)
        # DeepSpeed averages over ranks; x world gives the gradient of the request's sum loss.
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
        params, lens = check_forward(samples, loss_fn, loss_params, self.max_seq_len)
        self._activate(st)
        self._cur = self._engine_of(adapter_id)
        batch = _losses.batch_stats([s.inputs for s in samples])
        mine = [int(i) for i in np.array_split(np.arange(len(samples)), self.world_size)[self.rank]]
        groups = micro_batches([lens[i] for i in mine], self.micro_batch_tokens)
        n_groups = torch.tensor([len(groups)], dtype=torch.long)
        dist.all_reduce(n_groups, op=dist.ReduceOp.MAX)
        train_mode = backward and st.spec.dropout > 0 and self._kind != "full"
        self._set_train(train_mode)
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
            self._set_train(False)
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
        st = self._get(adapter_id)
        eng = self._engine_of(adapter_id)
        if eng is not None:
            self._drop_zero_grads(eng.optimizer)
        for p in st.params:
            p.grad = None

    def _full_zero_grad(self) -> None:
        self._drop_zero_grads(self._base_eng.optimizer)

    def _drop_zero_grads(self, zopt) -> None:
        """Discard the gradients a DeepSpeed ZeRO optimizer accumulated since its last step."""
        zopt.zero_grad(set_to_none=True)
        if self.zero_stage < 3:
            # ZeRO-1/2 keep gradients reduced by earlier (non-boundary) backwards in buffers that
            # zero_grad leaves alone (measured: they came back at the next step); drop them as
            # DeepSpeed's own overflow path does.
            if hasattr(zopt, "_release_preflattened_grad_buffers"):
                zopt._release_preflattened_grad_buffers()
            for attr in ("averaged_gradients", "all_grad_tensors"):
                held = getattr(zopt, attr, None) or {}
                for k in list(held):
                    held[k] = None

    # ------------------------------------------------------------------ optimizer
    def _op_optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        st = self._get(adapter_id)
        lr = self._check_cfg(cfg)
        if self._kind == "lora3":
            return self._lora3_step(st, cfg, lr)
        eng = self._cur = self._engine_of(adapter_id)
        self._activate(st)
        self._set_train(False)
        # The boundary: a zero-loss backward marked as the accumulation boundary
        # makes ZeRO reduce the accumulated gradients (docs/design.md §9).
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

    def _lora3_step(self, st: _Adapter, cfg: AdamParams, lr: float) -> OptimOutput:
        """All-reduce (sum) the adapter's gradients, then TorchTrainerEngine's clip + AdamW step on every rank."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

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
            # Checked here (same verdict on every rank): the torch path would call the collective zero_grad.
            if not bool(torch.isfinite(flat).all()):
                TorchTrainerEngine.zero_grad(self, st.adapter_id)
                raise FloatingPointError("non-finite gradient norm (nan or inf gradient); step skipped, "
                                         "gradients dropped")
        del lr
        return TorchTrainerEngine.optim_step(self, st.adapter_id, cfg)

    # ------------------------------------------------------------------ checkpoints (LoRA)
    def _group_of(self, st: _Adapter) -> list[int]:
        return [0] * len(st.params_a) + [1] * len(st.params_b)

    def _optimizer_state_dict(self, st: _Adapter) -> dict[str, Any]:
        """Full AdamW state per parameter (lora12: gathered from the ZeRO partitions; collective)."""
        from deepspeed.utils import safe_get_full_optimizer_state

        if self._kind != "lora12":
            return TorchTrainerEngine._optimizer_state_dict(self, st)
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

        if self._kind != "lora12":
            return TorchTrainerEngine._load_optimizer_state_dict(self, st, sd)
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

        if self._kind != "lora12":
            return TorchTrainerEngine._reset_optimizer(self, st)
        eng = self._ds[st.adapter_id]
        for p in st.params:
            safe_set_full_fp32_param(p, p.detach())
        eng.optimizer.optimizer.state.clear()
        eng.optimizer._hp_optimizer_states_linked = False   # relinked at the next step

    def _op_save_state(self, adapter_id: str, out_dir: str) -> Any:
        if self._kind == "full":
            return self._save_full_state(self._get(adapter_id), out_dir)
        if self.rank == 0:
            return TorchTrainerEngine.save_state(self, adapter_id, out_dir)
        self._optimizer_state_dict(self._get(adapter_id))  # lora12: the collective part
        return None

    def _op_load_state(self, adapter_id: str, state_dir: str, with_optimizer: bool) -> int:
        if self._kind == "full":
            return self._load_full_state(self._get(adapter_id), state_dir, with_optimizer)
        eng = self._ds.get(adapter_id)
        if eng is not None:
            self._drop_zero_grads(eng.optimizer)
        return TorchTrainerEngine.load_state(self, adapter_id, state_dir, with_optimizer)

    # ------------------------------------------------------------------ full mode: checkpoints and export
    def _save_full_state(self, st: _Adapter, out_dir: str) -> Path:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        # DeepSpeed's own sharded format: every rank writes its optimizer partition; bit-exact resume.
        self._base_eng.save_checkpoint(str(out), tag=_FULL_TAG, save_latest=False)
        if self.rank == 0:
            spec = dataclasses.asdict(st.spec)
            spec["target_modules"] = list(st.spec.target_modules)
            groups = [{"name": g.get("name"), "lr": float(g["lr"]), "betas": [float(b) for b in g["betas"]],
                       "eps": float(g["eps"]), "weight_decay": float(g["weight_decay"])}
                      for g in self._base_eng.optimizer.param_groups]
            meta = {"format": trainer_state.STATE_FORMAT, "format_version": trainer_state.STATE_FORMAT_VERSION,
                    "mode": "full",
                    "step": int(st.step), "lora": spec, "base": self.base_fingerprint(),
                    "zero_stage": self.zero_stage, "world_size": self.world_size, "param_groups": groups,
                    "params": list(st.param_names)}
            (out / trainer_state.STATE_META).write_text(json.dumps(meta, indent=1))
        dist.barrier()
        return out

    def _load_full_state(self, st: _Adapter, state_dir: str, with_optimizer: bool) -> int:
        d = Path(state_dir)
        meta = self.read_state_meta(d)
        diffs = self.state_differences(meta, st.spec)
        if diffs:
            raise ValueError("checkpoint does not fit this session: " + "; ".join(diffs))
        if not (d / _FULL_TAG).is_dir():
            raise ValueError(f"{state_dir} has no DeepSpeed checkpoint ({_FULL_TAG}/)")
        eng = self._base_eng
        self._full_zero_grad()
        # Always with optimizer states: under ZeRO the fp32 master weights live there.
        path, _ = eng.load_checkpoint(str(d), tag=_FULL_TAG, load_optimizer_states=True,
                                      load_lr_scheduler_states=False)
        if path is None:
            raise ValueError(f"DeepSpeed could not load the checkpoint in {state_dir}")
        if not with_optimizer:
            self._reset_full_optimizer()
        self._full_dirty = True
        st.step = int(meta["step"])
        return st.step

    def _reset_full_optimizer(self) -> None:
        """Fresh AdamW moments (the fp32 master weights are kept)."""
        zopt = self._base_eng.optimizer
        zopt.optimizer.state.clear()
        if hasattr(zopt, "_hp_optimizer_states_linked"):
            zopt._hp_optimizer_states_linked = False   # relinked at the next step

    def _op_full_weights(self, adapter_id: str) -> dict[str, torch.Tensor] | None:
        from deepspeed.utils import safe_get_full_fp32_param

        self._get(adapter_id)
        td = next(p.dtype for p in self._base.parameters())
        out: dict[str, torch.Tensor] | None = {} if self.rank == 0 else None
        for name, p in self._base.named_parameters():   # one gathered tensor at a time
            t = safe_get_full_fp32_param(p)
            if out is not None:
                out[name] = t.detach().to("cpu", td).clone()
        return out

    def _op_save_merged(self, adapter_id: str, out_dir: str) -> Path | None:
        sd = self._op_full_weights(adapter_id)
        if self.rank != 0:
            return None
        return write_model_dir(self._base, self.tokenizer, Path(out_dir), state_dict=sd)
