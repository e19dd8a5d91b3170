"""The model resource: sessions, their operation queues, weight versions and checkpoints.

`Resource` is the service layer the gRPC servicers call with plain Python
values. It validates every request before queuing it (a malformed request
becomes a FAILED operation that never touches state), runs operations on
the trainer runtime in each session's `seq_id` order, publishes adapter
versions to the generator replicas and writes checkpoints.

`Resource` is the composition root: `__init__` builds its parts, each handed its dependencies (in this
order, none reaching into another's private members). The wire reaches them through the typed faces of
service/interfaces.py (`ResourceApi`: one Protocol per part), e.g. ``resource.sessions.create_session``;
`Resource`'s own methods are those that compose two parts (``submit_save_weights``: a checkpoint
prepared, an operation queued) and what the resource reports (capabilities, tokenizer files, metrics):

- ``runtime`` `core.runtime.TrainerRuntime`: the trainer engine's one owner and only caller (its
  thread runs every operation in the scheduler's order; paging and the clock cycle set up from the
  engine's declared capabilities);
- ``publisher`` `weights.publishing.WeightsPublisher`: weights_sync's push, pushes after a load, the
  per-session publish chain;
- ``checkpoints`` `checkpoints.ops.Checkpoints`: lookup/listing/deletion/files, save_weights /
  save_state / load_state, checkpoint adapters for scoring;
- ``session_table`` `sessions.table.SessionTable`: the live sessions, owner checks, keep-alive;
  ``sessions`` `sessions.manager.SessionLifecycle`: create (optionally from a checkpoint), stop;
  ``sweeper`` `sessions.sweeper.SessionSweeper`: page-out and expiry; ``session_rows``
  `sessions.rows.SessionRows`: the registry's listings;
- ``submissions`` `training.submissions.Submissions`: `submit` (every operation's queueing),
  forward / forward_backward / custom / optim_step, operation lookup;
- ``snapshots`` `sampling.snapshots.SnapshotStore`: fixed weights to sample from;
- ``sampling`` `sampling.ops.Sampling`: the one sampling road of every API, OpenAI inference;
- ``lifecycle`` `checkpoints.lifecycle.CheckpointLifecycle`: checkpoint metadata, search, TTL sweeps,
  keep-last-K; ``quotas`` `tenancy.quotas.Quotas`: per-API-key limits.

This module keeps construction, capabilities and the tokenizer files.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from together_train_server.engines.loss_specs import LOSS_SPECS
from together_train_server.engines.interfaces import TrainerEngine
from together_train_server.engines.types import SamplingParams
from together_train_server.service import validation
from together_train_server.service.checkpoints.adapter_import import AdapterImporter
from together_train_server.service.checkpoints.lifecycle import CheckpointLifecycle
from together_train_server.service.checkpoints.ops import Checkpoints, LoadOutcome
from together_train_server.service.checkpoints.registry import Registry, base_model_of
from together_train_server.service.checkpoints.store import CheckpointStore
from together_train_server.service.core.operations import OperationBook, OperationRecord
from together_train_server.service.core.runtime import TrainerRuntime
from together_train_server.service.core.session_record import ACTIVE, EXPIRED, STOPPED, SessionRecord
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.training.cycle import ClockCycle
from together_train_server.service.replicas.pool import ReplicaPool
from together_train_server.service.sampling.inference import InferenceService
from together_train_server.service.sampling.model_catalog import ResourceCatalog
from together_train_server.service.sampling.ops import Sampling
from together_train_server.service.sampling.rollouts import RolloutStore
from together_train_server.service.sampling.session_ops import submit_sample
from together_train_server.service.sampling.snapshots import SnapshotStore
from together_train_server.service.sessions.heartbeats import DEFAULT_TIMEOUT_S as DEFAULT_HEARTBEAT_TIMEOUT_S
from together_train_server.service.sessions.manager import SessionLifecycle
from together_train_server.service.sessions.pager import PagingConfig, make_pager
from together_train_server.service.sessions.rows import SessionRows
from together_train_server.service.sessions.sweeper import SessionSweeper
from together_train_server.service.sessions.table import SessionTable
from together_train_server.service.telemetry import Telemetry
from together_train_server.service.tenancy.config import TenancyConfig
from together_train_server.service.tenancy.quotas import Quotas
from together_train_server.service.checkpoints.store import owner_tag
from together_train_server.service.usage.access import read_usage
from together_train_server.service.usage.meter import UsageMeter, UsageTotals
from together_train_server.service.usage.store import UsageStore
from together_train_server.service.tokenizer_files import TokenizerFiles, read_tokenizer_files
from together_train_server.service.training.memory_admission import MemoryAdmission
from together_train_server.service.training.submissions import Submissions
from together_train_server.service.weights.publishing import WeightsPublisher, WeightsSyncOutcome

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


PROTOCOL_VERSION = "1"
OPERATIONS = (
    "forward",
    "forward_backward",
    "custom_forward_backward",
    "optim_step",
    "weights_sync",
    "save_weights",
    "save_state",
    "load_state",
    "sample",
    "compute_logprobs",
    "snapshot",
)


class Resource:
    """Sessions and operations over one trainer engine and a replica pool.

    Args:
        engine: the trainer engine (engines/interfaces.py), e.g. TorchTrainerEngine; its
            ``lora_target_modules`` are the LoRA targets capabilities list and sessions may name.
        pool: generator replicas (may be empty: a trainer-only resource).
        storage_dir: where checkpoints are written.
        limits: request limits; vocab size and context length come from the engine.
        max_sessions: ACTIVE sessions allowed, resident or paged out (RESOURCE_EXHAUSTED past it).
        max_sessions: sessions that may exist at once (resident or paged out).
        idle_timeout_s: a session with no call for this long is checkpointed and discarded (0, the
            default: never; docs/design.md §6).
        generator_engine: name reported in capabilities.
        memory_budget_bytes: per-operation memory budget of the trainer (service/training/memory_admission.py;
            None/0: no admission check).
        batching: run ready forwards of several sessions as one clock cycle (service/training/cycle.py)
            when the engine declares ``clock_cycle`` (`TrainerCapabilities`); False: one operation at a time.
        batch_window_ms: how long a cycle waits for a second ready operation (0: no wait).
        admin_keys: API keys that may search and change every key's checkpoints and read every key's usage.
        checkpoint_sweep_s: seconds between checkpoint TTL sweeps.
        tenancy: the scheduler and per-API-key limits (service/tenancy/config.py; default: fair, no limits).
        paging: the resident sessions' memory budget (service/sessions/pager.py; default: derived from the
            memory available).
    """

    def __init__(
        self,
        engine: TrainerEngine,
        pool: ReplicaPool,
        storage_dir: Path,
        *,
        limits: validation.Limits | None = None,
        max_sessions: int = 8,
        idle_timeout_s: float = 0.0,
        generator_engine: str = "torch",
        memory_budget_bytes: int | None = None,
        rollouts: RolloutStore | None = None,
        client_heartbeat_timeout_s: float = DEFAULT_HEARTBEAT_TIMEOUT_S,
        batching: bool = True,
        batch_window_ms: float = 0.0,
        admin_keys: frozenset[str] = frozenset(),
        checkpoint_sweep_s: float = 30.0,
        tenancy: TenancyConfig | None = None,
        paging: PagingConfig | None = None,
    ) -> None:
        self.paging = paging or PagingConfig()
        # Scheduler and per-API-key limits (service/tenancy/).
        self.tenancy = tenancy or TenancyConfig()
        self.quotas = Quotas(self.tenancy)
        self.book = OperationBook()
        # The engine's one owner and only caller (service/core/runtime.py): every engine call runs on its
        # thread in the scheduler's order. Sessions past the resident budget are paged out to storage
        # (service/sessions/pager.py) when the engine declares paging.
        self.runtime = runtime = TrainerRuntime(engine, self.book, self.tenancy.scheduler)
        self.pager = runtime.use_pager(make_pager(storage_dir, self.paging,
                                                  lambda session_id: self.session_table.is_idle(session_id)))
        # Calls recorded under /v1/rollouts/{id} (service/sampling/rollouts.py), bounded by serve's flags.
        self.rollouts = rollouts if rollouts is not None else RolloutStore()
        # HTTP client APIs release a client session silent this long (service/sessions/heartbeats.py); 0 = never.
        self.client_heartbeat_timeout_s = float(client_heartbeat_timeout_s)
        self.pool = pool
        # The model registry (SQLite under the storage directory) indexes sessions and checkpoints; an
        # existing storage directory without one is imported, disagreements are logged (Registry.reconcile).
        self.registry = Registry(Path(storage_dir))
        self.store = CheckpointStore(Path(storage_dir), registry=self.registry, base_model=str(runtime.model_id))
        self.registry.close_stale_sessions()
        self.registry.reconcile(self.store, base_model_of)
        self.limits = limits or validation.Limits(vocab_size=runtime.vocab_size, max_seq_len=runtime.max_seq_len)
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.generator_engine = generator_engine
        self.admission = MemoryAdmission(runtime, memory_budget_bytes)
        # From the loaded model (peft's all-linear: the linear layers inside the blocks, e.g.
        # Phi-3 qkv_proj, GPT-2 c_attn), never a fixed list of Llama names.
        self.lora_target_modules: tuple[str, ...] = tuple(runtime.lora_target_modules)
        # Logs, metrics and curves (service/telemetry.py); sessions and the replica pool are read at scrape time.
        self.telemetry = Telemetry(sessions=lambda: self.session_table.list_sessions_all(), replicas=pool.snapshot)
        # Usage per session and API key (service/usage/), in the registry's file: survives a restart.
        self.usage_meter = UsageMeter(UsageStore(self.registry.path), self._owner_tag_of, owner_tag)
        self.telemetry.usage_sink = self.usage_meter.add
        self.book.on_end = self.telemetry.operation_ended
        self.book.before_end = self._operation_ending  # metered before a waiter can see the end
        # Keys that see and change every key's checkpoints and read every key's usage.
        self.admin_keys = frozenset(admin_keys)
        # Checkpoint metadata, search, TTL sweeps, keep-last-K (service/checkpoints/lifecycle.py).
        self.lifecycle = CheckpointLifecycle(self.store, self.registry, on_deleted=self.telemetry.checkpoint_deleted,
                                             admin_keys=frozenset(admin_keys), sweep_interval_s=checkpoint_sweep_s)
        self.lifecycle.start()
        # PEFT adapters trained elsewhere, imported as checkpoints (service/checkpoints/adapter_import.py).
        self.importer = AdapterImporter(self.store, self.lifecycle, runtime, self.limits.max_lora_rank,
                                        on_written=self.telemetry.checkpoint_written)
        if batching:   # the clock cycle (training/cycle.py), when the engine declares it
            runtime.use_cycle(lambda rt: ClockCycle(rt, self.admission, batch_window_ms / 1000.0,
                                                    budget_tokens=rt.micro_batch_tokens))
        self._compose()

    def _compose(self) -> None:
        """Build the parts, each given what it uses (module docstring), after the shared pieces above."""
        pool, runtime = self.pool, self.runtime
        self.publisher = WeightsPublisher(runtime, pool, self.telemetry)
        self.checkpoints = Checkpoints(self.store, self.registry, runtime, self.telemetry, self.publisher,
                                       self.lifecycle)
        self.session_table = SessionTable(self.max_sessions, self.quotas, self.idle_timeout_s)
        self.sessions = SessionLifecycle(self.session_table, runtime, pool, self.registry, self.telemetry,
                                         self.checkpoints, self.publisher, limits=self.limits)
        self.session_rows = SessionRows(self.registry, self.session_table, pool)
        self.sweeper = SessionSweeper(self.session_table, self.sessions, runtime, self.store, self.paging)
        self.sweeper.start()
        self.submissions = Submissions(self.session_table, runtime, self.book, self.limits,
                                       self.admission, self.quotas, self.usage_meter)
        # Fixed weights to sample from (Tinker's save_weights_for_sampler), most recently used kept.
        self.snapshots = SnapshotStore(self.submissions, pool)
        # Every API samples through this one object (service/sampling/ops.py).
        self.sampling = Sampling(pool, self.limits, self.telemetry, self.admission, lambda: ResourceCatalog(self),
                                 lambda: runtime.tokenizer, self.rollouts)

    def _operation_ending(self, rec: OperationRecord, status: str) -> None:
        try:
            self.usage_meter.operation_ended(rec, status)
        except Exception:  # metering never fails an operation
            log.exception("usage metering of operation %s failed", rec.operation_id)

    def _owner_tag_of(self, session_id: str) -> str | None:
        """A session's owner tag (live, else the registry's row); None for an unknown session."""
        s = self.session_table.find(session_id)
        if s is not None:
            return owner_tag(s.owner)
        row = self.registry.session(session_id)
        return None if row is None else row.owner

    def usage(self, owner: str = "", session_id: str = "") -> tuple[list[UsageTotals], list[UsageTotals]]:
        """(per-key, per-session) usage `owner` may see: an admin key (``--admin-key-file``) every key's,
        any other key its own (service/usage/access.py; `session_id` narrows to one session).

        Raises:
            ServiceError: NOT_FOUND for an unknown session or another key's (non-admin).
        """
        return read_usage(self.usage_meter, self.registry, owner, admin=owner in self.admin_keys,
                          session_id=session_id)

    # ----- sampling (`Sampling`) ----------------------------------------------------------
    @property
    def inference(self) -> InferenceService:
        """The OpenAI-style inference service (`Sampling.inference`)."""
        return self.sampling.inference

    def submit_sample(self, session_id: str, seq_id: int, idempotency_key: str, *, prompts: Sequence[Sequence[int]],
                      params: SamplingParams, num_samples: int, prompt_logprobs: bool = False,
                      top_k_prompt_logprobs: int = 0, owner: str = "") -> OperationRecord:
        """Queue a sample in the session's operation order (the Together API's ``sample``;
        see `session_ops.submit_sample`)."""
        return submit_sample(self, session_id, seq_id, idempotency_key, prompts=prompts, params=params,
                             num_samples=num_samples, prompt_logprobs=prompt_logprobs,
                             top_k_prompt_logprobs=top_k_prompt_logprobs, owner=owner)

    # ----- operations composing two parts (`Submissions` with `Checkpoints` / `WeightsPublisher`) -----
    def submit_save_weights(self, session_id: str, seq_id: int, idempotency_key: str, name: str, merged: bool,
                            owner: str = "", options: Mapping[str, Any] | None = None) -> OperationRecord:
        """Queue save_weights: an inference checkpoint (kind "weights"); see `Checkpoints.prepare_save`."""
        return self.submissions.submit(session_id, owner, seq_id, idempotency_key, "save_weights",
                                       self.checkpoints.prepare_save(session_id, "weights", name, merged=merged,
                                                                     owner=owner, options=options))

    def submit_save_state(self, session_id: str, seq_id: int, idempotency_key: str, name: str,
                          owner: str = "", options: Mapping[str, Any] | None = None) -> OperationRecord:
        """Queue save_state: a training checkpoint (kind "state"); see `Checkpoints.prepare_save`."""
        return self.submissions.submit(session_id, owner, seq_id, idempotency_key, "save_state",
                                       self.checkpoints.prepare_save(session_id, "state", name, owner=owner,
                                                                     options=options))

    def submit_load_state(self, session_id: str, seq_id: int, idempotency_key: str, uri: str, with_optimizer: bool,
                          owner: str = "") -> OperationRecord:
        """Queue load_state / load_state_with_optimizer; result a LoadOutcome (see `Checkpoints.prepare_load`)."""
        s = self.session_table.get_session(session_id, owner)
        return self.submissions.submit(session_id, owner, seq_id, idempotency_key, "load_state",
                                       self.checkpoints.prepare_load(s, uri, with_optimizer, owner))

    def submit_weights_sync(self, session_id: str, seq_id: int, idempotency_key: str, background: bool,
                            owner: str = "") -> OperationRecord:
        """Queue a weights_sync: publish the session's current adapter to every replica; result a
        WeightsSyncOutcome (see `WeightsPublisher.prepare_sync`)."""
        s = self.session_table.get_session(session_id, owner)
        return self.submissions.submit(session_id, owner, seq_id, idempotency_key, "weights_sync",
                                       self.publisher.prepare_sync(s, background))

    # ----- capabilities -------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        """Everything GetCapabilities reports, as plain values."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            "model_id": self.runtime.model_id,
            "vocab_size": self.limits.vocab_size,
            "max_seq_len": self.limits.max_seq_len,
            "mode": self.runtime.mode,
            "operations": list(OPERATIONS),
            "max_lora_rank": self.limits.max_lora_rank,
            "lora_target_modules": list(self.lora_target_modules),
            "max_sessions": self.max_sessions,
            "losses": list(LOSS_SPECS.values()),
            "limits": self.limits,
            "num_replicas": len(self.pool),
            "adam_defaults": dict(validation.ADAM_DEFAULTS),
            "generator_engine": self.generator_engine,
            "trainer_backend": self.runtime.backend_name,
            "trainer_capabilities": self.runtime.capabilities.names(),
            "dtype": str(self.runtime.dtype),
            "tokenizer_sha256": self._tokenizer_sha256(),
        }

    @functools.cached_property
    def _tokenizer(self) -> TokenizerFiles | ServiceError:
        try:
            return read_tokenizer_files(self.runtime.model_dir, str(self.runtime.model_id))
        except ServiceError as err:
            return err

    def tokenizer_files(self) -> TokenizerFiles:
        """The base model's tokenizer files (read once; see service/tokenizer_files.py).

        Raises:
            ServiceError: NOT_FOUND when the model directory holds none.
        """
        if isinstance(self._tokenizer, ServiceError):
            raise self._tokenizer
        return self._tokenizer

    def _tokenizer_sha256(self) -> str:
        return "" if isinstance(self._tokenizer, ServiceError) else self._tokenizer.sha256

    # ----- what the HTTP APIs report and check ---------------------------------------------
    def base_model_name(self) -> str:
        """The base model as the HTTP APIs name it: its local directory when it has one, else its model id."""
        return str(self.runtime.model_dir or self.runtime.model_id)

    def check_base_model(self, base_model: str | None) -> None:
        """Accept a client's base model name when it is the one this resource serves ("" / None: any).

        The model id, the model directory and any path resolving to that directory match.

        Raises:
            ServiceError: INVALID_ARGUMENT (key "base_model") naming the model served here.
        """
        if not base_model:
            return
        names = {str(self.runtime.model_id)}
        model_dir = self.runtime.model_dir
        if model_dir is not None:
            names.add(str(model_dir))
            try:
                if Path(base_model).expanduser().resolve() == Path(model_dir).resolve():
                    return
            except OSError:
                pass
        if base_model not in names:
            raise invalid(
                f"base_model {base_model!r} is not served here; this resource serves {self.runtime.model_id!r} "
                f"(pass {self.base_model_name()!r})",
                key="base_model",
            )

    def trains_lora(self) -> bool:
        """True when sessions train LoRA adapters (False: full weights, ``serve --full-weights``)."""
        return self.runtime.mode == "lora"

    def num_replicas(self) -> int:
        """Generator replicas in the pool (0: a trainer-only resource)."""
        return len(self.pool)

    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The base model's ``transformers`` tokenizer (the trainer engine's)."""
        return self.runtime.tokenizer

    def scratch_dir(self, name: str) -> Path:
        """``<storage>/.<name>``: a directory for an API's own files beside the checkpoints (not created here)."""
        return Path(self.store.root) / f".{name}"

    def metrics_text(self, visible: Callable[[str], bool] | None, viewer: str | None = None) -> bytes:
        """The Prometheus text exposition; per-session series only of sessions whose owner tag `visible` accepts
        (None: none). See `Telemetry.scrape`. Usage series per key (service/usage/prometheus.py): `viewer` None
        (an anonymous scrape with API keys on) none; an admin key every key's; any other key ("" without
        keys) its own."""
        from together_train_server.service.usage.prometheus import usage_families

        if viewer is None:
            see = None
        elif viewer in self.admin_keys:
            see = lambda tag: True  # noqa: E731
        else:
            mine = owner_tag(viewer)
            see = lambda tag: tag == mine  # noqa: E731
        from together_train_server.service.sessions.pager import paging_families

        return self.telemetry.scrape(visible, [*usage_families(self.usage_meter, see), *paging_families(self.pager)])

    def dashboard_state(self, owner: str | None) -> dict[str, Any]:
        """What the web dashboard shows, limited to what `owner` may see (see `telemetry.dashboard_state`)."""
        from together_train_server.service.telemetry import dashboard_state

        return dashboard_state(self, owner)

    def model_architecture(self) -> str | None:
        """The base model's class name (``architectures[0]`` of its config.json); None when unknown."""
        import json

        try:
            cfg = json.loads((Path(self.runtime.model_dir) / "config.json").read_text())
        except (OSError, TypeError, ValueError):
            return None
        return (cfg.get("architectures") or [None])[0]

    def max_request_bytes(self) -> int:
        """gRPC's receive limit for this resource: the largest request its limits allow (bytes).

        See ``validation.Limits.max_request_bytes``; a sample may carry every input of
        the loss with the most inputs plus a gradients array (custom_forward_backward).
        """
        return self.limits.max_request_bytes(max(len(s.inputs) for s in LOSS_SPECS.values()) + 1)

    def close(self) -> None:
        """Shut down within a few seconds (serve's SIGTERM): the running operation finishes, queued ones
        fail with a retryable UNAVAILABLE (`TrainerRuntime.close`), waiters return, replicas are released."""
        self.sweeper.close()
        self.lifecycle.close()
        self.runtime.close()
        self.usage_meter.close()
        self.book.close()
        self.pool.close()


__all__ = ["ACTIVE", "EXPIRED", "OPERATIONS", "PROTOCOL_VERSION", "STOPPED", "LoadOutcome", "Resource",
           "SessionRecord", "WeightsSyncOutcome"]


if TYPE_CHECKING:  # mypy: Resource is the wire's face (service/interfaces.py), part by part
    from together_train_server.service.interfaces import ResourceApi

    def _implements_face(r: Resource) -> ResourceApi:
        return r
