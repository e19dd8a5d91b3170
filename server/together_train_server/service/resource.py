"""The model resource: sessions, their operation queues, weight versions and checkpoints.

`Resource` is the service layer the gRPC servicers call with plain Python
values. It validates every request before queuing it (a malformed request
becomes a FAILED operation that never touches state), runs operations on
one trainer worker in each session's `seq_id` order, publishes adapter
versions to the generator replicas and writes checkpoints.
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from together_train_server.engines.losses import LOSS_SPECS
from together_train_server.engines.interfaces import TrainerEngine
from together_train_server.engines.types import AdamParams, LoraConfig, Sample
from together_train_server.service import validation
from together_train_server.service.checkpoints import Checkpoint, CheckpointStore, owner_tag, validate_name
from together_train_server.service.errors import ServiceError, internal_error, invalid, unimplemented
from together_train_server.service.operations import (
    OperationBook,
    OperationRecord,
    SessionQueue,
    TrainerWorker,
)
from together_train_server.service.replicas import ReplicaPool
from together_train_server.service.telemetry import Telemetry
from together_train_server.service.tokenizer_files import TokenizerFiles, read_tokenizer_files

log = logging.getLogger(__name__)
PROTOCOL_VERSION = "1"
ACTIVE, STOPPED, EXPIRED = "ACTIVE", "STOPPED", "EXPIRED"
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
)


@dataclass
class SessionRecord:
    """One LoRA adapter with its optimizer, step counter and operation queue."""

    session_id: str
    name: str
    lora: LoraConfig
    queue: SessionQueue
    num_trainable_params: int
    owner: str = ""
    state: str = ACTIVE
    created_at: float = field(default_factory=time.time)
    last_active_at: float = field(default_factory=time.time)
    # Policy version the replicas serve for this session. Version 0 is the
    # freshly initialised adapter (B = 0), identical to the base model.
    synced_version: int = 0
    step: int = 0
    # The session's last weights publish (push to the replicas), run off the trainer worker;
    # the next one starts after it, so a session's pushes reach the replicas in order.
    publish_tail: concurrent.futures.Future | None = None


def _num_tokens(samples: Sequence[tuple[Any, Any]]) -> int:
    """model_input tokens of a request (0 when it is malformed: validation reports that)."""
    try:
        return sum(len(mi) for mi, _ in samples)
    except (TypeError, ValueError):
        return 0


@dataclass
class LoadOutcome:
    """Result of load_state: the session's step (= policy version) after loading."""

    step: int
    with_optimizer: bool


@dataclass
class WeightsSyncOutcome:
    """Result of a weights_sync: the version published and what it cost."""

    policy_version: int
    num_replicas: int
    num_bytes: int
    seconds: float


class Resource:
    """Sessions and operations over one trainer engine and a replica pool.

    Args:
        engine: the trainer engine (engines/interfaces.py), e.g. TorchTrainerEngine; its
            ``lora_target_modules`` are the LoRA targets capabilities list and sessions may name.
        pool: generator replicas (may be empty: a trainer-only resource).
        storage_dir: where checkpoints are written.
        limits: request limits; vocab size and context length come from the engine.
        max_sessions: concurrent ACTIVE sessions allowed (RESOURCE_EXHAUSTED past it).
        idle_timeout_s: a session with no call for this long expires (docs/design.md §6).
        generator_engine: name reported in capabilities.
    """

    def __init__(
        self,
        engine: TrainerEngine,
        pool: ReplicaPool,
        storage_dir: Path,
        *,
        limits: validation.Limits | None = None,
        max_sessions: int = 8,
        idle_timeout_s: float = 3600.0,
        generator_engine: str = "torch",
    ) -> None:
        self.engine = engine
        self.pool = pool
        # The model registry (SQLite under the storage directory) indexes sessions and checkpoints; an
        # existing storage directory without one is imported, disagreements are reported (registry_report).
        from together_train_server.service.registry import Registry, base_model_of

        self.registry = Registry(Path(storage_dir))
        self.store = CheckpointStore(Path(storage_dir), registry=self.registry,
                                     base_model=str(engine.model_id))
        self.registry.close_stale_sessions()
        self.registry_report = self.registry.reconcile(self.store, base_model_of)
        self.limits = limits or validation.Limits(vocab_size=engine.vocab_size, max_seq_len=engine.max_seq_len)
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.generator_engine = generator_engine
        # From the loaded model (peft's all-linear: the linear layers inside the blocks, e.g.
        # Phi-3 qkv_proj, GPT-2 c_attn), never a fixed list of Llama names.
        self.lora_target_modules: tuple[str, ...] = tuple(engine.lora_target_modules)
        self.book = OperationBook()
        # Logs, metrics and curves (service/telemetry.py); the replica pool is read at scrape time.
        self.telemetry = Telemetry(sessions=self.list_sessions_all,
                                   replicas=getattr(pool, "snapshot", lambda: []))
        self.book.on_end = self.telemetry.operation_ended
        self.worker = TrainerWorker(self.book)
        # The engine is not thread-safe: the worker holds this lock while an
        # operation runs; session create/drop take it too.
        self.engine_lock = threading.RLock()
        self._sessions: dict[str, SessionRecord] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # checkpoint uri -> (replica adapter key, step) loaded for compute_logprobs(source=CHECKPOINT)
        self._scoring_ckpts: dict[str, tuple[str, int]] = {}
        self._scoring_lock = threading.Lock()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="session-expiry", daemon=True)
        self._sweeper.start()

    # ----- capabilities -------------------------------------------------------------------
    def capabilities(self) -> dict[str, Any]:
        """Everything GetCapabilities reports, as plain values."""
        return {
            "protocol_version": PROTOCOL_VERSION,
            "model_id": self.engine.model_id,
            "vocab_size": self.limits.vocab_size,
            "max_seq_len": self.limits.max_seq_len,
            "mode": self.engine.mode,
            "operations": list(OPERATIONS),
            "max_lora_rank": self.limits.max_lora_rank,
            "lora_target_modules": list(self.lora_target_modules),
            "max_sessions": self.max_sessions,
            "losses": list(LOSS_SPECS.values()),
            "limits": self.limits,
            "num_replicas": len(self.pool),
            "adam_defaults": dict(validation.ADAM_DEFAULTS),
            "generator_engine": self.generator_engine,
            "trainer_backend": self.engine.backend_name,
            "dtype": str(self.engine.dtype),
            "tokenizer_sha256": self._tokenizer_sha256(),
        }

    @functools.cached_property
    def _tokenizer(self) -> TokenizerFiles | ServiceError:
        try:
            return read_tokenizer_files(self.engine.model_dir, str(self.engine.model_id))
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

    def max_request_bytes(self) -> int:
        """gRPC's receive limit for this resource: the largest request its limits allow (bytes).

        See ``validation.Limits.max_request_bytes``; a sample may carry every input of
        the loss with the most inputs plus a gradients array (custom_forward_backward).
        """
        return self.limits.max_request_bytes(max(len(s.inputs) for s in LOSS_SPECS.values()) + 1)

    # ----- sessions ------------------------------------------------------------------------
    def create_session(
        self,
        lora: LoraConfig | None,
        *,
        name: str = "",
        owner: str = "",
        checkpoint_uri: str = "",
        with_optimizer: bool = False,
    ) -> SessionRecord:
        """Create a LoRA session (adapter + AdamW + step counter).

        With `checkpoint_uri` (a training checkpoint from `save_state`, of this
        or an earlier session, also from before a restart of the resource) the
        session starts from its weights, and with `with_optimizer` also from
        its AdamW moments and RNG stream (see `submit_load_state`). `lora`
        None takes the checkpoint's LoRA config (or the defaults without a
        checkpoint); a given `lora` must have the checkpoint's shape. The step
        (= policy version) starts at the checkpoint's step; when that is > 0
        the adapter is pushed to the replicas before the session is returned,
        so its samples are served by the loaded weights (version 0 is the base
        model).

        Raises:
            ServiceError: INVALID_ARGUMENT for a bad LoRA config, `with_optimizer`
                without a checkpoint, or a URI that is malformed or names an
                inference checkpoint; NOT_FOUND for an
                unknown checkpoint; DATA_LOSS for a corrupted one;
                FAILED_PRECONDITION when its base model or LoRA shape differs
                (the message names what); RESOURCE_EXHAUSTED past max_sessions.
        """
        ckpt = meta = None
        if with_optimizer and not checkpoint_uri:
            raise invalid(
                "with_optimizer restores a checkpoint's optimizer: it needs checkpoint_uri", key="with_optimizer"
            )
        if checkpoint_uri:
            ckpt, meta = self._state_checkpoint(checkpoint_uri, owner)
            self._check_fits(meta, None, checkpoint_uri)
            if lora is None:
                lora = self.engine.spec_from_meta(meta)
            else:
                self._check_fits(meta, lora, checkpoint_uri)
        lora = lora or LoraConfig()
        validation.validate_lora(
            lora.rank, lora.alpha, lora.dropout, lora.target_modules, self.lora_target_modules, self.limits
        )
        with self._lock:
            active = sum(1 for s in self._sessions.values() if s.state == ACTIVE)
            if active >= self.max_sessions:
                raise ServiceError(
                    "RESOURCE_EXHAUSTED",
                    f"this resource already has {active} active sessions (max_sessions={self.max_sessions}); "
                    "stop one first",
                    retryable=True,
                )
            session_id = f"s-{uuid.uuid4().hex[:12]}"
            queue = SessionQueue(session_id, self.book, self.worker)
            # Reserve the slot before the slow adapter creation.
            placeholder = SessionRecord(session_id, name, lora, queue, 0, owner=owner)
            self._sessions[session_id] = placeholder
        created = False
        try:
            with self.engine_lock:
                n_params = self.engine.create_adapter(session_id, lora)
                created = True
                if ckpt is not None:
                    placeholder.step = self._engine_load(session_id, ckpt, with_optimizer)
                    tensors = self._loaded_snapshot(placeholder)
            placeholder.num_trainable_params = int(n_params)
            if ckpt is not None:
                self._publish_loaded(placeholder, placeholder.step, tensors)
        except Exception as err:
            with self._lock:
                del self._sessions[session_id]
            if created:
                with self.engine_lock:
                    self.engine.drop_adapter(session_id)
                self.pool.drop_all(session_id)
            if not isinstance(err, ServiceError) and hasattr(err, "grpc_code"):
                # An engine refusal that names its status (e.g. full mode: one session at a time).
                raise ServiceError(err.grpc_code, str(err)) from err
            raise
        self._register_session(placeholder)
        self.telemetry.session_event("created", placeholder)
        return placeholder

    def _register_session(self, s: SessionRecord) -> None:
        """The session's registry row (a registry failure is logged, never fails the session)."""
        import dataclasses

        try:
            self.registry.record_session(s.session_id, owner=owner_tag(s.owner),
                                         base_model=str(self.engine.model_id),
                                         lora=dataclasses.asdict(s.lora), status=s.state, step=s.step,
                                         created_at=s.created_at, display_name=s.name)
        except Exception:
            log.exception("could not register session %s in the model registry", s.session_id)

    def get_session(self, session_id: str, owner: str = "") -> SessionRecord:
        """Raises ServiceError NOT_FOUND for an unknown id (or one owned by another key)."""
        with self._lock:
            s = self._sessions.get(session_id)
        if s is None or (s.owner and s.owner != owner):
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}", key="session_id")
        return s

    def active_session(self, session_id: str, owner: str = "") -> SessionRecord:
        """The session if ACTIVE, touching its idle timer.

        Raises:
            ServiceError: NOT_FOUND for an unknown id; FAILED_PRECONDITION for
                a stopped or expired session.
        """
        s = self.get_session(session_id, owner)
        if s.state != ACTIVE:
            raise ServiceError(
                "FAILED_PRECONDITION",
                f"session {session_id} is {s.state.lower()}; create a new session"
                + (" (it expired after an idle timeout; call keep_alive to prevent that)" if s.state == EXPIRED else ""),
                key="session_id",
            )
        s.last_active_at = time.time()
        return s

    def list_sessions(self, owner: str = "") -> list[SessionRecord]:
        with self._lock:
            return [s for s in self._sessions.values() if not s.owner or s.owner == owner]

    def stop_session(self, session_id: str, owner: str = "", *, state: str = STOPPED) -> SessionRecord:
        """Cancel queued operations, drop the adapter everywhere, free the slot."""
        s = self.get_session(session_id, owner)
        if s.state != ACTIVE:
            return s
        s.state = state
        s.queue.cancel_all(f"session {session_id} was {state.lower()}")
        with self.engine_lock:  # waits for a running operation to finish
            self.engine.drop_adapter(session_id)
        self.pool.drop_all(session_id)
        try:
            self.registry.update_session(session_id, status=state, step=s.step, stopped=True)
        except Exception:
            log.exception("could not record the stop of session %s in the model registry", session_id)
        self.telemetry.session_event(state.lower(), s)
        return s

    def keep_alive(self, session_id: str, owner: str = "") -> SessionRecord:
        return self.active_session(session_id, owner)

    def expires_at(self, s: SessionRecord) -> float:
        return s.last_active_at + self.idle_timeout_s

    def _sweep_loop(self) -> None:
        while not self._closed.wait(min(10.0, self.idle_timeout_s / 4)):
            now = time.time()
            for s in self.list_sessions_all():
                if s.state == ACTIVE and now > self.expires_at(s) and not s.queue.pending():
                    self.stop_session(s.session_id, s.owner, state=EXPIRED)

    def list_sessions_all(self) -> list[SessionRecord]:
        with self._lock:
            return list(self._sessions.values())

    def replica_view(self, owner: str | None) -> list[dict[str, Any]]:
        """The replica pool's `snapshot()`, with adapter versions limited to what `owner` may see.

        A replica's ``versions`` keys are adapter keys (session ids, ``ckpt:<uri>``,
        ``snap:<id>``); a key is kept when it names one of `owner`'s sessions (every
        session without API keys); `owner` None (an anonymous scrape with keys on)
        sees none. ``hidden`` counts the keys left out.
        """
        visible = {s.session_id for s in self.list_sessions(owner)} if owner is not None else set()
        out = []
        for r in self.pool.snapshot() if hasattr(self.pool, "snapshot") else []:
            shown = {k: v for k, v in r["versions"].items() if any(sid in k for sid in visible)}
            out.append({**r, "versions": shown, "hidden": len(r["versions"]) - len(shown)})
        return out

    # ----- checkpoints ----------------------------------------------------------------------
    def get_checkpoint(self, uri: str, owner: str = "", *, verify: bool = False) -> Checkpoint:
        """A checkpoint visible to `owner` (written with the same API key).

        Raises:
            ServiceError: INVALID_ARGUMENT for a malformed URI, NOT_FOUND for an
                unknown one (or another key's), DATA_LOSS with `verify` when a
                file's size or sha256 differs from the manifest.
        """
        ckpt = self.store.get(uri, verify=False)
        if ckpt.owner != owner_tag(owner):
            raise ServiceError("NOT_FOUND", f"no checkpoint {uri}", key="uri")
        return self.store.get(uri, verify=True) if verify else ckpt

    def list_checkpoints(self, session_id: str = "", owner: str = "") -> list[Checkpoint]:
        """Complete checkpoints of `owner`, oldest first; of one session id when given.

        Checkpoints outlive their session (and a restart of the resource), so
        a session id that is no longer (or never was) live is not an error.

        Raises:
            ServiceError: INVALID_ARGUMENT for a malformed session id.
        """
        tag = owner_tag(owner)
        return [c for c in self.store.list(session_id or None) if c.owner == tag]

    def page_checkpoints(self, owner: str = "", *, session_id: str = "", kind: str = "", variant: str = "",
                         base_model: str = "", limit: int = 0, cursor: str = "") -> tuple[list[Checkpoint], str]:
        """Checkpoints of `owner` from the model registry, filtered; returns (checkpoints, next cursor or "").

        Filters ("" = any): session id, kind ("weights" | "state"), variant ("adapter" |
        "merged"), base model id. `limit` 0: every match, oldest first (as `list_checkpoints`);
        `limit` > 0: one page, newest first, with the cursor of the next page. A registered
        checkpoint whose files are gone is skipped (and logged).

        Raises:
            ServiceError: INVALID_ARGUMENT naming a malformed kind, variant, cursor or a negative limit.
        """
        from together_train_server.service.checkpoints import _NAME_RE

        if limit < 0:
            raise invalid(f"limit must be >= 0 (0 = all), got {limit}", key="limit")
        if session_id and not _NAME_RE.match(session_id):
            raise invalid(f"invalid session id {session_id!r}", key="session_id")
        rows, nxt = self.registry.list_checkpoints(owner_tag(owner), session_id=session_id, kind=kind,
                                                   variant=variant, base_model=base_model, limit=limit, cursor=cursor)
        out = []
        for r in rows:
            try:
                out.append(self.store.get(r.uri, verify=False))
            except ServiceError:
                log.warning("checkpoint %s is registered but its files are gone; not listed", r.uri)
        return (out if limit else out[::-1]), nxt

    def delete_checkpoint(self, uri: str, owner: str = "") -> None:
        """Delete a checkpoint. Raises ServiceError NOT_FOUND when unknown (or another key's)."""
        self.get_checkpoint(uri, owner)
        self.store.delete(uri)
        self.telemetry.checkpoint_deleted(uri)

    def checkpoint_files(self, uri: str, owner: str = "") -> tuple[Checkpoint, list[tuple[str, Path, int, str]]]:
        """A verified checkpoint and its files for download: (relative path, path, size, sha256).

        Includes `manifest.json` (last), so a download is a complete copy.

        Raises:
            ServiceError: NOT_FOUND, DATA_LOSS (corrupted: nothing is sent).
        """
        from together_train_server.service.checkpoints import _sha256

        ckpt = self.get_checkpoint(uri, owner, verify=True)
        files = [(rel, ckpt.path / rel, int(m["size"]), str(m["sha256"])) for rel, m in sorted((ckpt.files or {}).items())]
        manifest = ckpt.path / "manifest.json"
        files.append(("manifest.json", manifest, manifest.stat().st_size, _sha256(manifest)))
        return ckpt, files

    def _state_checkpoint(self, uri: str, owner: str) -> tuple[Checkpoint, dict[str, Any]]:
        """A verified training checkpoint and its metadata (see engine `read_state_meta`)."""
        ckpt = self.get_checkpoint(uri, owner, verify=True)
        if ckpt.kind != "state":
            raise invalid(
                f"{uri} is an inference checkpoint (save_weights); loading needs a training checkpoint "
                "from save_state (together-train://<session>/state/<name>)",
                key="uri",
            )
        try:
            meta = self.engine.read_state_meta(ckpt.path)
        except (OSError, ValueError) as e:
            raise ServiceError("DATA_LOSS", f"checkpoint {uri} is not a readable training checkpoint: {e}", key="uri") from e
        return ckpt, meta

    def _check_fits(self, meta: Mapping[str, Any], lora: LoraConfig | None, uri: str) -> None:
        """FAILED_PRECONDITION naming every base-model or LoRA-shape difference."""
        diffs = self.engine.state_differences(meta, lora)
        if diffs:
            raise ServiceError(
                "FAILED_PRECONDITION", f"checkpoint {uri} does not fit: " + "; ".join(diffs), key="uri"
            )

    def _engine_load(self, session_id: str, ckpt: Checkpoint, with_optimizer: bool) -> int:
        """engine.load_state (caller holds engine_lock); engine refusals become FAILED_PRECONDITION."""
        try:
            return int(self.engine.load_state(session_id, ckpt.path, with_optimizer))
        except (ValueError, OSError) as e:
            raise ServiceError("FAILED_PRECONDITION", f"cannot load checkpoint {ckpt.uri}: {e}", key="uri") from e

    def _loaded_snapshot(self, s: SessionRecord) -> dict[str, Any] | None:
        """The adapter tensors `_publish_loaded` pushes (caller holds engine_lock); None when nothing is."""
        if self.engine.mode == "full" or len(self.pool) == 0 or s.step <= 0:
            return None
        return self.engine.adapter_tensors(s.session_id)

    def _publish_loaded(self, s: SessionRecord, step: int, tensors: dict[str, Any] | None) -> None:
        """After a load: make the replicas serve the loaded weights (`tensors`) under `step`.

        The step may go down (loading an older checkpoint), and replicas never
        replace a version by an older one, so the session's adapter is dropped
        from every replica first. Step 0 is the base model (B = 0): nothing is
        pushed. Without replicas only the bookkeeping changes.
        """
        if self.engine.mode == "full":
            return  # full-weight sessions have no adapter to push; replicas keep serving the base model
        if len(self.pool) > 0:
            self.pool.drop_all(s.session_id)
            if step > 0 and tensors is not None:
                self.pool.push_all(s.session_id, step, s.lora, tensors)
        s.synced_version = step

    def _publish_async(self, s: SessionRecord, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn` (a push to the replicas) on its own thread, after the session's previous one.

        The trainer worker never waits on a replica: an operation returns this
        future and stays RUNNING until it resolves. Chaining on the session's
        previous publish keeps its pushes in submission order (a load_state's
        drop + push and a weights_sync never overtake each other). Errors other
        than ServiceError become INTERNAL (logged with the traceback).
        """
        out: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            prev, s.publish_tail = s.publish_tail, out

        def body() -> None:
            if prev is not None:
                concurrent.futures.wait([prev])
            try:
                out.set_result(fn())
            except ServiceError as err:
                out.set_exception(err)
            except Exception as err:
                out.set_exception(internal_error(err, what="weights push", session_id=s.session_id))

        threading.Thread(target=body, name=f"publish-{s.session_id}", daemon=True).start()
        return out

    # ----- operations -----------------------------------------------------------------------
    def _submit(
        self,
        session_id: str,
        owner: str,
        seq_id: int,
        idempotency_key: str,
        kind: str,
        prepare: Callable[[], Callable[[], Any]],
        tokens: int = 0,
    ) -> OperationRecord:
        """Queue an operation. `prepare` validates and returns the function to run.

        A validation error becomes a FAILED operation occupying its seq_id, so
        the session's order is kept and no state is touched. `tokens`: the
        request's model_input tokens (telemetry counts them when it succeeds).
        """
        s = self.active_session(session_id, owner)
        try:
            run = prepare()
            error = None
        except ServiceError as err:
            run, error = None, err
        return s.queue.submit(seq_id, idempotency_key, kind, self._locked(run) if run else None, error,
                              tokens=tokens)

    def _locked(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        def run() -> Any:
            with self.engine_lock:
                return fn()

        return run

    def _check_batch(
        self, loss_fn: str, loss_params: Mapping[str, Any], samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]]
    ) -> tuple[dict[str, Any], list[Sample]]:
        params = validation.validate_loss_params(loss_fn, loss_params, LOSS_SPECS)
        inputs, why = validation.effective_inputs(LOSS_SPECS[loss_fn], params)
        checked = validation.validate_samples(samples, inputs, self.limits, required_because=why)
        validation.validate_loss_inputs(LOSS_SPECS[loss_fn], params, checked)
        return params, [Sample(model_input=mi, inputs=inp) for mi, inp in checked]

    def _run_forward(self, session_id: str, batch: list[Sample], loss_fn: str, params: Mapping[str, Any],
                     backward: bool, return_logprobs: bool, return_elementwise: bool) -> Any:
        """Run engine.forward; a non-finite loss/gradient becomes INVALID_ARGUMENT (state untouched)."""
        try:
            return self.engine.forward(
                session_id,
                batch,
                loss_fn,
                params,
                backward=backward,
                return_logprobs=return_logprobs,
                return_elementwise=return_elementwise,
            )
        except FloatingPointError as err:
            raise invalid(str(err)) from None

    def submit_forward(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        *,
        samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]],
        loss_fn: str,
        loss_params: Mapping[str, Any],
        backward: bool,
        return_logprobs: bool,
        return_elementwise: bool,
        owner: str = "",
    ) -> OperationRecord:
        """Queue `forward` (backward=False) or `forward_backward`; result is a ForwardOutput."""

        def prepare() -> Callable[[], Any]:
            params, batch = self._check_batch(loss_fn, loss_params, samples)
            return lambda: self._run_forward(
                session_id, batch, loss_fn, params, backward, return_logprobs, return_elementwise
            )

        kind = "forward_backward" if backward else "forward"
        return self._submit(session_id, owner, seq_id, idempotency_key, kind, prepare, _num_tokens(samples))

    def submit_custom_forward_backward(
        self,
        session_id: str,
        seq_id: int,
        idempotency_key: str,
        *,
        samples: Sequence[tuple[np.ndarray, Mapping[str, np.ndarray]]],
        gradients: Sequence[np.ndarray],
        return_logprobs: bool = True,
        return_elementwise: bool = False,
        owner: str = "",
    ) -> OperationRecord:
        """Queue custom_forward_backward: backpropagate client gradients ``g = dL/dp``.

        The engine runs the ``custom`` loss, ``l_t = g_t * p_t``: the gradient
        reaching each target-token logprob ``p_t`` is exactly ``g_t``, and the
        reported loss is ``sum g·p`` (a sum, not the client's own loss value).

        Validation (before queuing, state untouched): each sample's
        ``loss_fn_inputs`` holds ``target_tokens`` only; ``gradients`` has one
        float 1-D array per sample, as long as the sample, finite (errors name
        the sample index and the key ``gradients``).
        """

        def prepare() -> Callable[[], Any]:
            checked = validation.validate_samples(
                samples, LOSS_SPECS["custom"].inputs[:1], self.limits, extra_per_sample=gradients
            )
            batch = [
                Sample(model_input=mi, inputs={**inp, "gradients": np.asarray(g, dtype=np.float32)})
                for (mi, inp), g in zip(checked, gradients)
            ]
            return lambda: self._run_forward(
                session_id, batch, "custom", {}, True, return_logprobs, return_elementwise
            )

        return self._submit(session_id, owner, seq_id, idempotency_key, "custom_forward_backward", prepare,
                            _num_tokens(samples))

    def submit_optim_step(
        self, session_id: str, seq_id: int, idempotency_key: str, adam: Mapping[str, float | None], owner: str = ""
    ) -> OperationRecord:
        """Queue an AdamW step; result is an OptimOutput (step = new policy version)."""
        s = self.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            cfg = AdamParams(**validation.validate_adam(adam))

            def run() -> Any:
                out = self.engine.optim_step(session_id, cfg)
                s.step = out.step
                return out

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "optim_step", prepare)

    def submit_weights_sync(
        self, session_id: str, seq_id: int, idempotency_key: str, background: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue a weights_sync: publish the session's current adapter to every replica.

        The trainer worker only snapshots the adapter tensors; the push runs on
        its own thread (`_publish_async`), so other sessions keep training
        while it waits. Synchronous mode completes when every replica in
        routing serves the new version: a replica that misses the push
        deadline (`Deadlines.for_bytes`) or is found hung by the probes is taken
        out of routing until it has been re-pushed, and the result's
        ``num_replicas`` counts the replicas that took the version; UNAVAILABLE
        naming each replica when none did. Background mode completes once the
        tensors are snapshotted and the push is under way (samples report
        which version served them).
        """
        s = self.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            if len(self.pool) == 0:
                raise ServiceError(
                    "FAILED_PRECONDITION",
                    "this resource has no generator replicas; weights_sync needs at least one (--generators N)",
                )

            def run() -> WeightsSyncOutcome | concurrent.futures.Future:
                # On the trainer worker only the snapshot (a copy: training goes on during the push).
                t0 = time.perf_counter()
                version = self.engine.step(session_id)
                tensors = self.engine.adapter_tensors(session_id)

                def push() -> WeightsSyncOutcome:
                    if s.state != ACTIVE:
                        raise ServiceError("CANCELLED", f"session {session_id} was {s.state.lower()} before its push")
                    nbytes, replicas = self.pool.publish(session_id, version, s.lora, tensors)
                    s.synced_version = max(s.synced_version, version)
                    if s.state != ACTIVE:  # stopped while pushing: its drop_all may have run before the push
                        self.pool.drop_all(session_id)
                    seconds = time.perf_counter() - t0
                    self.telemetry.weights_pushed(session_id, version, nbytes, replicas, seconds)
                    return WeightsSyncOutcome(version, replicas, nbytes, seconds)

                done = self._publish_async(s, push)
                if not background:
                    # Succeeds once every replica still in routing serves `version` (laggards are
                    # taken out of routing until re-pushed); UNAVAILABLE when none took it.
                    return done
                done.add_done_callback(
                    lambda f: f.exception() and log.warning("background weights_sync of %s v%d failed: %s",
                                                            session_id, version, f.exception())
                )
                nbytes = sum(int(t.numel()) * 4 for t in tensors.values())
                return WeightsSyncOutcome(version, len(self.pool), nbytes, time.perf_counter() - t0)

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "weights_sync", prepare)

    def submit_save_weights(
        self, session_id: str, seq_id: int, idempotency_key: str, name: str, merged: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue save_weights: an inference checkpoint in the store (kind "weights").

        Unmerged: a PEFT adapter directory (`adapter_config.json`,
        `adapter_model.safetensors`) for peft / vLLM. Merged: a standard Hugging
        Face model directory (engine `save_merged`: base + scaling * B @ A on a
        fresh copy of the base, config, generation config, tokenizer, chat
        template). Result: the Checkpoint. ALREADY_EXISTS when the name is taken.
        """

        def prepare() -> Callable[[], Any]:
            validate_name(name)

            def run() -> Any:
                step = self.engine.step(session_id)
                with self.store.writer(session_id, "weights", name, step=step, merged=merged, owner=owner) as tmp:
                    if merged:
                        self.engine.save_merged(session_id, tmp)
                    else:
                        self.engine.save_adapter(session_id, tmp)
                ckpt = self.store.get(self.store.uri(session_id, "weights", name), verify=False)
                self.telemetry.checkpoint_written(ckpt)
                return ckpt

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "save_weights", prepare)

    def submit_save_state(
        self, session_id: str, seq_id: int, idempotency_key: str, name: str, owner: str = ""
    ) -> OperationRecord:
        """Queue save_state: a training checkpoint (kind "state") of the session.

        Holds the adapter tensors, AdamW moments and per-parameter steps, the
        step counter, the session's dropout RNG state, the LoRA config and the
        base model's fingerprint (engine `save_state`). Gradients accumulated
        since the last optim_step are not saved. Result: the Checkpoint.

        Errors: INVALID_ARGUMENT for a bad name (at submission, as a FAILED
        operation); ALREADY_EXISTS when the name is taken.
        """

        def prepare() -> Callable[[], Any]:
            validate_name(name)

            def run() -> Any:
                step = self.engine.step(session_id)
                with self.store.writer(session_id, "state", name, step=step, owner=owner) as tmp:
                    self.engine.save_state(session_id, tmp)
                ckpt = self.store.get(self.store.uri(session_id, "state", name), verify=False)
                self.telemetry.checkpoint_written(ckpt)
                return ckpt

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "save_state", prepare)

    def submit_load_state(
        self, session_id: str, seq_id: int, idempotency_key: str, uri: str, with_optimizer: bool, owner: str = ""
    ) -> OperationRecord:
        """Queue load_state / load_state_with_optimizer; result is a LoadOutcome.

        The checkpoint is verified against its manifest first (a corrupted
        file is DATA_LOSS and nothing is loaded). Weights always; with
        `with_optimizer` also the AdamW moments and the dropout RNG stream, so
        training continues bit-for-bit; without, a fresh AdamW. The step
        counter (= policy version) becomes the checkpoint's step either way,
        accumulated gradients are dropped, and the replicas are updated to
        serve the loaded weights (`_publish_loaded`) before it succeeds.

        Errors: INVALID_ARGUMENT (malformed URI, an inference checkpoint),
        NOT_FOUND, DATA_LOSS, FAILED_PRECONDITION (different base model or
        LoRA shape, naming what differs).
        """
        s = self.get_session(session_id, owner)

        def prepare() -> Callable[[], Any]:
            self.store.parse_uri(uri)

            def run() -> concurrent.futures.Future:
                ckpt, meta = self._state_checkpoint(uri, owner)
                self._check_fits(meta, s.lora, uri)
                step = s.step = self._engine_load(session_id, ckpt, with_optimizer)
                tensors = self._loaded_snapshot(s)

                def publish() -> LoadOutcome:  # off the trainer worker
                    self._publish_loaded(s, step, tensors)
                    return LoadOutcome(step, with_optimizer)

                return self._publish_async(s, publish)

            return run

        return self._submit(session_id, owner, seq_id, idempotency_key, "load_state", prepare)

    def submit_unimplemented(
        self, session_id: str, seq_id: int, idempotency_key: str, kind: str, feature: str, owner: str = ""
    ) -> OperationRecord:
        """Queue an operation of a later release: it FAILS with UNIMPLEMENTED, keeping seq order."""

        def prepare() -> Callable[[], Any]:
            raise unimplemented(feature)

        return self._submit(session_id, owner, seq_id, idempotency_key, kind, prepare)

    def get_operation(self, operation_id: str, owner: str = "") -> OperationRecord:
        """Raises ServiceError NOT_FOUND for an unknown id, or one of another API key's session."""
        rec = self.book.get(operation_id)
        with self._lock:
            s = self._sessions.get(rec.session_id)
        if s is not None and s.owner and s.owner != owner:
            raise ServiceError("NOT_FOUND", f"unknown operation {operation_id!r}", key="operation_id")
        return rec

    def wait_operation(self, operation_id: str, timeout_s: float, owner: str = "") -> OperationRecord:
        self.get_operation(operation_id, owner)
        return self.book.wait(operation_id, min(max(timeout_s, 0.0) or 30.0, 60.0))

    def cancel_operation(self, operation_id: str, owner: str = "") -> OperationRecord:
        rec = self.get_operation(operation_id, owner)
        with self._lock:
            s = self._sessions.get(rec.session_id)
        if s is not None:
            s.queue.cancel(rec)
        return rec

    # ----- sampling --------------------------------------------------------------------------
    MAX_SCORING_CHECKPOINTS = 4

    def checkpoint_scoring_key(self, uri: str, owner: str = "") -> tuple[str, int]:
        """Make a saved checkpoint's adapter servable for compute_logprobs; returns (replica key, step).

        The PEFT adapter directory of a `save_weights` (unmerged) or
        `save_state` checkpoint is read and pushed to every replica under the
        synthetic key ``"ckpt:<uri>"`` with the checkpoint's step as its
        version (re-pushed to restarted replicas like a session's adapter).
        The `MAX_SCORING_CHECKPOINTS` most recently used stay loaded; older
        ones are dropped from the replicas.

        Raises:
            ServiceError: INVALID_ARGUMENT (malformed URI, merged checkpoint),
                NOT_FOUND (unknown or another key's), DATA_LOSS (corrupted or
                unreadable), FAILED_PRECONDITION (no replicas, or the adapter
                does not fit this model).
        """
        from together_train_server.engines.lora import read_peft_adapter

        ckpt = self.get_checkpoint(uri, owner)
        if ckpt.merged:
            raise invalid(f"{uri} is a merged model; compute_logprobs scores unmerged adapter checkpoints", key="uri")
        if len(self.pool) == 0:
            raise ServiceError("FAILED_PRECONDITION", "this resource has no generator replicas to score with")
        with self._scoring_lock:
            hit = self._scoring_ckpts.pop(uri, None)
            if hit is not None:
                self._scoring_ckpts[uri] = hit  # most recently used last
                return hit
            ckpt = self.get_checkpoint(uri, owner, verify=True)
            try:
                spec, tensors = read_peft_adapter(ckpt.path)
            except (OSError, ValueError, KeyError) as e:
                raise ServiceError("DATA_LOSS", f"checkpoint {uri} has no readable adapter: {e}", key="uri") from e
            key = f"ckpt:{uri}"
            try:
                self.pool.push_all(key, ckpt.step, spec, tensors)
            except ServiceError as e:
                if e.code == "INTERNAL":  # the replica refused the tensors
                    raise ServiceError("FAILED_PRECONDITION", f"checkpoint {uri} does not fit this model: {e.message}",
                                       key="uri") from e
                raise
            self._scoring_ckpts[uri] = (key, ckpt.step)
            while len(self._scoring_ckpts) > self.MAX_SCORING_CHECKPOINTS:
                old = next(iter(self._scoring_ckpts))
                old_key, _ = self._scoring_ckpts.pop(old)
                self.pool.drop_all(old_key)
            return key, ckpt.step

    def check_sample_session(self, session_id: str, owner: str = "") -> int:
        """Version a sample for this session will be served with (-1 = base model)."""
        if not session_id:
            return -1
        return self.active_session(session_id, owner).synced_version

    def close(self) -> None:
        self._closed.set()
        self.worker.close()
        self.pool.close()
