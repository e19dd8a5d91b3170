"""The Tinker API (``/api/v1/...``) over the resource's service layer.

The official ``tinker`` SDK (0.38) runs unchanged against this router: a
user changes ``base_url`` and nothing else. The contract is the SDK's
sources (``tinker/resources/*.py``, ``tinker/lib/*``); what each route maps to:

- a tinker *client session* (``create_session``, heartbeats every 10 s,
  ``sessions/{id}/finish``) is only a name space here: it owns the training
  models created in it, its heartbeat keeps them alive (`Resource.keep_alive`)
  and finishing it stops them.
- a tinker *training model* is one of our sessions (a LoRA adapter with its
  optimizer). Its id is ``"{client_session}:train:{model_seq_id}"`` (the SDK
  derives that id itself when it creates a model by loading a checkpoint).
  The only state kept here is that id's translation to our session id.
- every call that does work answers a future ``{request_id, model_id}``; the
  request id is our operation id and ``retrieve_future`` long-polls it
  (about 40 s, then 408: the SDK gives up on a poll after 45 s and retries).
  A failed operation is a 200 ``{"error", "category"}`` (category "user" for
  a request the resource refused, "server" for its own failure).
- ordering: the SDK numbers a model's requests ``seq_id = 1, 2, ...``; ours
  start at 0, so ``seq = seq_id - 1``, and the session queue holds early ones
  back. A re-submission (the SDK retries with a new idempotency key) of the
  same seq_id and the same body returns the first operation; the same seq_id
  with another body is a 409.

LoRA: Tinker takes no alpha; we use ``LORA_ALPHA = 32`` for every rank (so the
adapter's scale is ``32 / rank``). ``train_attn`` trains q/k/v/o projections,
``train_mlp`` gate/up/down, ``train_unembed`` a copy of ``lm_head``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from together_train_server.engines.types import LoraConfig
from together_train_server.service.checkpoints import owner_tag
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.operations import CANCELLED, FAILED, SUCCEEDED
from together_train_server.service.sampling import SnapshotStore, tinker_sampling_params
from together_train_server.wire.http import tinker_wire as tw
from together_train_server.wire.http.app import error_response

router = APIRouter(prefix="/api/v1")

LORA_ALPHA = 32.0
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LONG_POLL_S = 40.0
PROTO = "application/x-protobuf"
# Metric reductions the SDK folds across chunks (tinker/lib/chunked_fwdbwd_helpers.py); any
# other key would be dropped by it or break its "name:reduction" split.
_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")
# Service error codes that mean "the request was wrong" (category user) vs the resource failed.
_USER_CODES = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "OUT_OF_RANGE",
                         "UNIMPLEMENTED", "CANCELLED", "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED"})
_SERVER_CODES = frozenset({"INTERNAL", "UNAVAILABLE", "DATA_LOSS", "DEADLINE_EXCEEDED", "ABORTED"})
_FORWARD_KINDS = frozenset({"forward", "forward_backward", "custom_forward_backward"})


# ----- id translation ------------------------------------------------------------------------
@dataclass
class ClientSession:
    """A tinker client session: the training models (our session ids) created in it."""

    session_id: str
    owner: str
    models: dict[str, str] = field(default_factory=dict)  # tinker model id -> our session id
    finished: bool = False
    last_heartbeat: float = field(default_factory=time.time)


class TinkerIds:
    """Tinker client sessions and model ids <-> our session ids (the only state of this API)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.sessions: dict[str, ClientSession] = {}
        self.models: dict[str, tuple[str, str]] = {}  # model id -> (client session id, our session id)
        self.samplers: dict[str, Sampler] = {}
        # Fields a tinker result needs that our operation's result lacks (by operation id).
        self.op_extra: dict[str, dict[str, Any]] = {}
        self._snapshots: Any = None

    def new_session(self, owner: str) -> ClientSession:
        cs = ClientSession(f"ts-{uuid.uuid4().hex[:16]}", owner)
        with self._lock:
            self.sessions[cs.session_id] = cs
        return cs

    def session(self, session_id: str, owner: str) -> ClientSession:
        """Raises ServiceError NOT_FOUND for an unknown id (or another key's)."""
        with self._lock:
            cs = self.sessions.get(session_id)
        if cs is None or cs.owner != owner:
            raise ServiceError("NOT_FOUND", f"unknown session {session_id!r}; create one with create_session",
                               key="session_id")
        return cs

    def live_session(self, session_id: str, owner: str) -> ClientSession:
        cs = self.session(session_id, owner)
        if cs.finished:
            raise ServiceError("FAILED_PRECONDITION", f"session {session_id} has finished", key="session_id")
        return cs

    def add_model(self, cs: ClientSession, model_id: str, ours: str) -> None:
        with self._lock:
            cs.models[model_id] = ours
            self.models[model_id] = (cs.session_id, ours)

    def ours(self, model_id: str, owner: str) -> str:
        """Our session id for a tinker model id. Raises ServiceError NOT_FOUND."""
        with self._lock:
            hit = self.models.get(model_id)
            cs = self.sessions.get(hit[0]) if hit else None
        if hit is None or cs is None or cs.owner != owner:
            raise ServiceError("NOT_FOUND", f"unknown model_id {model_id!r}", key="model_id")
        return hit[1]

    def usable(self, resource: Any, model_id: str, owner: str) -> str:
        """`ours` for a model the caller may train now: ACTIVE, else FAILED_PRECONDITION (checked before
        any payload, so the answer about a model never depends on the body). Raises ServiceError."""
        ours = self.ours(model_id, owner)
        resource.active_session(ours, owner)
        return ours

    def add_sampler(self, sampler: Sampler) -> None:
        with self._lock:
            self.samplers[sampler.sampler_id] = sampler
            if sampler.source_op:
                self.op_extra[sampler.source_op] = {"type": "save_weights_for_sampler",
                                                    "sampling_session_id": sampler.sampler_id}

    def sampler(self, sampler_id: str, owner: str) -> Sampler:
        """Raises ServiceError NOT_FOUND for an unknown id (or another key's)."""
        with self._lock:
            s = self.samplers.get(sampler_id)
        if s is None or s.owner != owner:
            raise ServiceError("NOT_FOUND", f"unknown sampling_session_id {sampler_id!r}", key="sampling_session_id")
        return s

    def snapshots(self, resource: Any) -> SnapshotStore:
        with self._lock:
            if self._snapshots is None:
                self._snapshots = SnapshotStore(resource)
            return self._snapshots


def install(app: FastAPI, resource: Any) -> None:
    """Attach this API's id tables to the app."""
    app.state.tinker = TinkerIds()


def _ctx(request: Request) -> tuple[Any, TinkerIds, str]:
    return request.app.state.resource, request.app.state.tinker, request.state.owner


# ----- request helpers ---------------------------------------------------------------------
async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError as e:
        raise invalid(f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    return body


def _get(body: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = ..., where: str = "") -> Any:
    """body[name] checked against `kind`; INVALID_ARGUMENT naming the field when missing or mistyped."""
    value = body.get(name, default)
    if value is ...:
        raise invalid(f"{where}{name} is required", key=name)
    if value is not None and value is not default and not isinstance(value, kind):
        raise invalid(f"{where}{name} must be {getattr(kind, '__name__', kind)}, got {value!r}", key=name)
    if isinstance(value, bool) and kind in (int, float, (int, float)):
        raise invalid(f"{where}{name} must be a number, got {value!r}", key=name)
    return value


def _seq(seq_id: Any) -> int:
    """Our 0-based queue position for the SDK's 1-based seq_id."""
    if not isinstance(seq_id, int) or isinstance(seq_id, bool) or seq_id < 1:
        raise invalid(f"seq_id must be an integer >= 1 (the SDK sends request_id + 1), got {seq_id!r}", key="seq_id")
    return seq_id - 1


def _dedupe_key(seq_id: int, payload: bytes) -> str:
    """Idempotency key of a submission: re-sent with the same seq_id and body, it finds the first operation."""
    return f"tinker:{seq_id}:{hashlib.sha256(payload).hexdigest()[:32]}"


def _submit(fn, *args, **kwargs):
    """Call a Resource.submit_*; a seq_id already used by another body is 409 (the SDK's contract)."""
    try:
        return fn(*args, **kwargs)
    except ServiceError as err:
        if err.code == "FAILED_PRECONDITION" and err.key == "seq_id":
            return error_response(
                ServiceError("ABORTED", f"{err.message} (a different request was already sent with this seq_id)",
                             key="seq_id"),
                409,
            )
        raise


def _future(rec: Any, model_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": rec.operation_id}
    if model_id is not None:
        out["model_id"] = model_id
    return out


def _check_base_model(resource: Any, base_model: str | None) -> None:
    """The SDK names a base model in create_model / sampling; this resource serves one."""
    if not base_model:
        return
    engine = resource.engine
    names = {str(engine.model_id)}
    model_dir = getattr(engine, "model_dir", None)
    if model_dir is not None:
        names.add(str(model_dir))
        try:
            if Path(base_model).expanduser().resolve() == Path(model_dir).resolve():
                return
        except OSError:
            pass
    if base_model not in names:
        raise invalid(
            f"base_model {base_model!r} is not served here; this resource serves {engine.model_id!r} "
            f"(pass {str(model_dir or engine.model_id)!r})",
            key="base_model",
        )


# ----- service routes ----------------------------------------------------------------------
@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config")
def client_config() -> dict[str, Any]:
    """Feature flags: what this server implements of the SDK's optional protocol features."""
    return {
        "pjwt_auth_enabled": False,  # API keys only, no JWT exchange
        "credential_default_source": "api_key",
        "parallel_fwdbwd_chunks": True,  # chunks may arrive out of order: the session queue holds them back
        "proto_compress_fwdbwd": False,  # loopback/LAN: compressing costs more CPU than it saves
        "use_pyqwest_transport": False,
        "sample_use_retrieve_futures": False,
        "custom_loss_server_side": False,  # forward_backward_custom runs the loss in the client
        "sample_join_sampling_session": False,
    }


@router.post("/client/dynamic_config")
def client_dynamic_config() -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/telemetry")
def telemetry() -> dict[str, str]:
    """The SDK reports client telemetry here; accepted and dropped."""
    return {"status": "accepted"}


@router.post("/create_session")
def create_session(request: Request) -> dict[str, Any]:
    _, ids, owner = _ctx(request)
    cs = ids.new_session(owner)
    return {"type": "create_session", "session_id": cs.session_id}


@router.post("/session_heartbeat")
async def session_heartbeat(request: Request) -> Any:
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    cs = ids.session(_get(body, "session_id", str), owner)
    if cs.finished:
        # 410 ends the SDK's heartbeat loop.
        return JSONResponse({"detail": f"session {cs.session_id} has finished"}, status_code=410)
    cs.last_heartbeat = time.time()
    for ours in list(cs.models.values()):
        try:
            resource.keep_alive(ours, owner)
        except ServiceError:
            pass  # a stopped model stays stopped; its calls say so
    return {"type": "session_heartbeat"}


@router.post("/sessions/{session_id}/finish")
def finish_session(session_id: str, request: Request) -> dict[str, Any]:
    """End a client session: its training models are stopped (their checkpoints stay)."""
    resource, ids, owner = _ctx(request)
    cs = ids.session(session_id, owner)
    cs.finished = True
    for ours in list(cs.models.values()):
        try:
            resource.stop_session(ours, owner)
        except ServiceError:
            pass
        ids.snapshots(resource).release_session(ours)
    return {}


@router.get("/get_server_capabilities")
def get_server_capabilities(request: Request) -> dict[str, Any]:
    resource, _, _ = _ctx(request)
    caps = resource.capabilities()
    model_dir = getattr(resource.engine, "model_dir", None)
    return {
        "supported_models": [
            {
                # The name to pass as base_model (the model directory; its basename is accepted too).
                "model_name": str(model_dir or caps["model_id"]),
                "max_context_length": int(caps["max_seq_len"]),
                "trainable": True,
                "sampleable": int(caps["num_replicas"]) > 0,
            }
        ]
    }


# ----- models -----------------------------------------------------------------------------
def _lora_from_tinker(cfg: dict[str, Any]) -> LoraConfig:
    """Tinker's LoraConfig -> ours (alpha LORA_ALPHA; train_attn/train_mlp -> target modules)."""
    rank = _get(cfg, "rank", int, where="lora_config.")
    seed = _get(cfg, "seed", int, None, where="lora_config.")
    train_mlp = _get(cfg, "train_mlp", bool, True, where="lora_config.")
    train_attn = _get(cfg, "train_attn", bool, True, where="lora_config.")
    train_unembed = _get(cfg, "train_unembed", bool, True, where="lora_config.")
    modules = (ATTN_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ())
    if not modules:
        # Ours reads an empty list as "all linear layers"; Tinker's unembed-only has no equivalent here.
        raise invalid("train_mlp and train_attn are both false: this resource trains LoRA on attention and/or "
                      "MLP layers (an lm_head-only adapter is not supported)", key="train_mlp")
    return LoraConfig(rank=int(rank), alpha=LORA_ALPHA, target_modules=modules, train_unembed=bool(train_unembed),
                    seed=int(seed or 0))


@router.post("/create_model")
async def create_model(request: Request) -> dict[str, Any]:
    """A LoRA training model = one of our sessions; future -> {model_id}."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    cs = ids.live_session(_get(body, "session_id", str), owner)
    model_seq_id = _get(body, "model_seq_id", int)
    _check_base_model(resource, _get(body, "base_model", str, None))
    opt = body.get("optimizer_config") or {}
    if isinstance(opt, dict) and opt.get("type", "adamw") != "adamw":
        raise invalid(f"optimizer {opt.get('type')!r} is not supported; this resource trains with AdamW",
                      key="optimizer_config")
    lora_cfg = _get(body, "lora_config", dict, None)
    if lora_cfg is None:
        raise invalid("lora_config is required: this resource trains LoRA adapters", key="lora_config")
    spec = _lora_from_tinker(lora_cfg)
    model_id = f"{cs.session_id}:train:{model_seq_id}"
    meta = _get(body, "user_metadata", dict, None) or {}

    def create() -> dict[str, Any]:
        if model_id not in cs.models:  # a re-sent create finds the model made by the first
            s = resource.create_session(spec, name=model_id, owner=owner)
            if meta:  # the run's user_metadata, kept in the model registry
                resource.registry.update_session(s.session_id, metadata=meta)
            ids.add_model(cs, model_id, s.session_id)
        return {"type": "create_model", "model_id": model_id}

    return _future(resource.book.run_detached("", "tinker_create_model", create), model_id)


@router.post("/get_info")
async def get_info(request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    model_id = _get(body, "model_id", str)
    s = resource.get_session(ids.ours(model_id, owner), owner)
    engine = resource.engine
    model_dir = getattr(engine, "model_dir", None)
    arch = None
    if model_dir is not None:
        try:
            arch = (json.loads((Path(model_dir) / "config.json").read_text()).get("architectures") or [None])[0]
        except (OSError, ValueError):
            pass
    return {
        "type": "get_info",
        # tokenizer_id goes to AutoTokenizer.from_pretrained in the SDK: the model directory loads offline.
        # model_name is what the SDK's sampling clients pass to AutoTokenizer: the directory too.
        "model_data": {"arch": arch, "model_name": str(model_dir or engine.model_id),
                       "tokenizer_id": str(model_dir or engine.model_id)},
        "model_id": model_id,
        "is_lora": True,
        "lora_rank": int(s.lora.rank),
        "model_name": str(model_dir or engine.model_id),
    }


# ----- training -----------------------------------------------------------------------------
_NP_DTYPES = {tw.DTYPE_FLOAT32: np.float32, tw.DTYPE_INT64: np.int64, tw.DTYPE_INT32: np.int32}


def _tensor(t: Any, sample: int, key: str) -> np.ndarray:
    """A tinker proto Tensor as a 1-D numpy array (int64 or float32)."""
    if t.WhichOneof("encoding") == "sparse_csr":
        raise invalid("sparse loss_fn_inputs are not supported; send dense arrays", sample_index=sample, key=key)
    if t.dtype == tw.DTYPE_BFLOAT16:
        raw = np.frombuffer(t.dense, dtype=np.uint16)
        arr = (raw.astype(np.uint32) << 16).view(np.float32)
    elif t.dtype in _NP_DTYPES:
        dtype = np.dtype(_NP_DTYPES[t.dtype])
        if len(t.dense) % dtype.itemsize:
            raise invalid(f"{len(t.dense)} bytes are not a whole number of {dtype} values", sample_index=sample,
                          key=key)
        arr = np.frombuffer(t.dense, dtype=dtype)
    else:
        raise invalid(f"unsupported tensor dtype {t.dtype}", sample_index=sample, key=key)
    if len(t.shape) > 1:
        raise invalid(f"loss_fn_inputs must be 1-D (one value per position), got shape {list(t.shape)}",
                      sample_index=sample, key=key)
    if t.shape and int(t.shape[0]) != arr.size:
        raise invalid(f"shape {list(t.shape)} does not match its {arr.size} values", sample_index=sample, key=key)
    return arr.astype(np.int64) if arr.dtype.kind in "iu" else arr.astype(np.float32)


def _samples(msg: Any) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
    """Datums -> (model_input int64 [n], loss_fn_inputs) pairs; the service validates lengths and ids."""
    out = []
    for i, datum in enumerate(msg.data):
        parts = []
        for chunk in datum.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise invalid(f"model_input chunk of type {kind!r} is not supported (text tokens only)",
                              sample_index=i, key="model_input")
            if len(chunk.encoded_text.tokens) % 4:
                raise invalid("encoded_text tokens are not int32 values", sample_index=i, key="model_input")
            parts.append(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32))
        tokens = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        inputs = {name: _tensor(t, i, name) for name, t in datum.loss_fn_inputs.items()}
        out.append((tokens, inputs))
    return out


def _loss_params(msg: Any) -> dict[str, Any]:
    """loss_fn_config: the v2 map (numbers and strings) when sent, else the legacy float map."""
    if msg.loss_fn_config_v2:
        return {k: (v.text if v.WhichOneof("value") == "text" else v.number) for k, v in msg.loss_fn_config_v2.items()}
    return dict(msg.loss_fn_config)


async def _body_bytes(request: Request) -> bytes:
    raw = await request.body()
    if request.headers.get("content-encoding", "").lower() == "zstd":
        import zstandard

        try:
            raw = zstandard.ZstdDecompressor().decompressobj().decompress(raw)
        except zstandard.ZstdError as e:
            raise invalid(f"the zstd body does not decompress: {e}") from None
    return raw


@router.post("/forward_backward")
async def forward_backward(request: Request) -> Any:
    """Protobuf ForwardBackwardRequest -> future; ``forward_only`` runs a plain forward (no gradient)."""
    resource, ids, owner = _ctx(request)
    if PROTO not in request.headers.get("content-type", ""):
        raise invalid(f"forward_backward takes a protobuf body (Content-Type: {PROTO})")
    raw = await _body_bytes(request)
    msg = tw.ForwardBackwardRequest()
    try:
        msg.ParseFromString(raw)
    except Exception as e:
        raise invalid(f"the body is not a ForwardBackwardRequest: {e}") from None
    ours = ids.usable(resource, msg.model_id, owner)
    seq = _seq(msg.seq_id)
    samples = _samples(msg)
    rec = await asyncio.to_thread(
        _submit, resource.submit_forward, ours, seq, _dedupe_key(msg.seq_id, raw),
        samples=samples, loss_fn=msg.loss_fn, loss_params=_loss_params(msg), backward=not msg.forward_only,
        return_logprobs=True, return_elementwise=True, owner=owner,
    )
    return rec if isinstance(rec, Response) else _future(rec, msg.model_id)


_ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")


@router.post("/optim_step")
async def optim_step(request: Request) -> Any:
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    model_id = _get(body, "model_id", str)
    ours = ids.usable(resource, model_id, owner)
    if "optimizer_params" in body:
        kind = (body["optimizer_params"] or {}).get("type") if isinstance(body["optimizer_params"], dict) else None
        raise invalid(f"optimizer {kind!r} is not supported; this resource steps AdamW (adam_params)",
                      key="optimizer_params")
    adam = _get(body, "adam_params", dict)
    unknown = sorted(set(adam) - set(_ADAM_KEYS) - {"type"})
    if unknown:
        raise invalid(f"unknown adam_params {unknown}; known: {list(_ADAM_KEYS)}", key=unknown[0])
    seq_id = body.get("seq_id")
    rec = await asyncio.to_thread(
        _submit, resource.submit_optim_step, ours, _seq(seq_id),
        _dedupe_key(seq_id, json.dumps(body, sort_keys=True).encode()),
        {k: adam.get(k) for k in _ADAM_KEYS}, owner=owner,
    )
    return rec if isinstance(rec, Response) else _future(rec, model_id)


# ----- futures -----------------------------------------------------------------------------
def _category(err: ServiceError | None) -> str:
    code = err.code if err is not None else ""
    return "user" if code in _USER_CODES else "server" if code in _SERVER_CODES else "unknown"


def _forward_output_proto(out: Any) -> bytes:
    """Our ForwardOutput -> tinker ForwardBackwardOutput (one ArrayRecord holding every datum)."""
    msg = tw.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in (out.metrics or {}).items():
        if k.count(":") == 1 and k.split(":")[1] in _REDUCTIONS:
            msg.metrics[k] = float(v)
    per_field = {"logprobs": out.logprobs, "elementwise_loss": out.elementwise_loss}
    n = len(next((a for a in per_field.values() if a is not None), []))
    record = msg.loss_fn_outputs.add(num_datums=n)
    for name, arrays in per_field.items():
        if arrays is None:
            continue
        parts = [np.asarray(a, dtype=np.float32).reshape(-1) for a in arrays]
        bt = record.fields[name]
        bt.dtype = tw.DTYPE_FLOAT32
        bt.data = b"".join(p.tobytes() for p in parts)
        bt.offsets = np.concatenate([[0], np.cumsum([p.nbytes for p in parts])]).astype(np.int64).tobytes()
    return msg.SerializeToString()


def _forward_output_json(out: Any) -> dict[str, Any]:
    def td(a: Any) -> dict[str, Any]:
        a = np.asarray(a, dtype=np.float32).reshape(-1)
        return {"data": a.tolist(), "dtype": "float32", "shape": [int(a.size)]}

    outputs = []
    for i in range(len(out.logprobs or out.elementwise_loss or [])):
        d = {}
        if out.logprobs is not None:
            d["logprobs"] = td(out.logprobs[i])
        if out.elementwise_loss is not None:
            d["elementwise_loss"] = td(out.elementwise_loss[i])
        outputs.append(d)
    metrics = {k: float(v) for k, v in (out.metrics or {}).items()
               if k.count(":") == 1 and k.split(":")[1] in _REDUCTIONS}
    return {"loss_fn_output_type": "ArrayRecord", "loss_fn_outputs": outputs, "metrics": metrics}


def _result(rec: Any, ids: TinkerIds, want_proto: bool) -> Response:
    """A SUCCEEDED operation's result in the shape its tinker request type expects."""
    res = rec.result
    if rec.kind in _FORWARD_KINDS:
        if want_proto:
            return Response(_forward_output_proto(res), media_type=PROTO)
        return JSONResponse(_forward_output_json(res))
    if rec.kind == "optim_step":
        return JSONResponse({"metrics": {"step:max": float(res.step), "grad_norm:mean": float(res.grad_norm),
                                         "learning_rate:mean": float(res.learning_rate)}})
    if isinstance(res, bytes):  # sampling: a serialized tinker SampleResponse
        return Response(res, media_type=PROTO)
    extra = ids.op_extra.get(rec.operation_id)
    if extra is not None:  # e.g. {sampling_session_id} of a snapshot, {path, model_id} of a load
        return JSONResponse(extra)
    if rec.kind in ("save_state", "save_weights"):
        kind = "save_weights" if rec.kind == "save_state" else "save_weights_for_sampler"
        return JSONResponse({"type": kind, "path": to_tinker_path(res.uri)})
    if isinstance(res, dict):  # results of this API's detached operations are already in tinker's shape
        return JSONResponse(res)
    raise ServiceError("INTERNAL", f"operation kind {rec.kind!r} has no tinker result shape")


_WAIT_POOL: Any = None
_WAIT_POOL_LOCK = threading.Lock()


def _wait_pool() -> Any:
    """Threads for long-polls (sized like the gRPC server's pool; the default executor has a handful)."""
    global _WAIT_POOL
    with _WAIT_POOL_LOCK:
        if _WAIT_POOL is None:
            from concurrent.futures import ThreadPoolExecutor

            _WAIT_POOL = ThreadPoolExecutor(max_workers=256, thread_name_prefix="http-wait")
        return _WAIT_POOL


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    """Long-poll an operation: its result, 200 {error, category} when it failed, or 408 after ~40 s."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    op_id = _get(body, "request_id", str)
    rec = await asyncio.to_thread(resource.get_operation, op_id, owner)
    if not rec.terminal:
        # Blocked on the operation book's condition in a thread of its own (no polling: the trainer keeps
        # the CPU); one thread per waiting request, as gRPC's WaitOperation.
        await asyncio.get_running_loop().run_in_executor(_wait_pool(), resource.book.wait, op_id, LONG_POLL_S)
    if not rec.terminal:
        return JSONResponse({"type": "try_again", "request_id": op_id, "queue_state": "active"}, status_code=408)
    if rec.status in (FAILED, CANCELLED):
        return JSONResponse({"error": str(rec.error), "category": _category(rec.error)})
    assert rec.status == SUCCEEDED
    return _result(rec, ids, PROTO in request.headers.get("accept", ""))


# ----- checkpoints: tinker:// paths <-> ours ----------------------------------------------------
# tinker://<our session>/weights/<name>          = together-train://<our session>/state/<name>   (save_state)
# tinker://<our session>/sampler_weights/<name>  = together-train://<our session>/weights/<name> (save_weights)
_TO_OURS = {"weights": "state", "sampler_weights": "weights"}
_TO_TINKER = {v: k for k, v in _TO_OURS.items()}


def to_tinker_path(uri: str) -> str:
    """Our checkpoint URI -> the tinker:// path naming it."""
    rest = uri.split("://", 1)[1]
    session, kind, name = rest.split("/", 2)
    return f"tinker://{session}/{_TO_TINKER[kind]}/{name}"


def to_our_uri(path: str, key: str = "path") -> str:
    """A tinker:// path (or one of our URIs) -> our checkpoint URI. INVALID_ARGUMENT naming `key` otherwise."""
    if path.startswith("together-train://"):
        return path
    parts = path[len("tinker://"):].split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in _TO_OURS or not parts[0] or not parts[2]:
        raise invalid(f"{key} {path!r} is not a checkpoint path: expected tinker://<run>/weights/<name> or "
                      "tinker://<run>/sampler_weights/<name>", key=key)
    return f"together-train://{parts[0]}/{_TO_OURS[parts[1]]}/{parts[2]}"


@router.post("/save_weights")
async def save_weights(request: Request) -> Any:
    """save_state: a training checkpoint (weights + optimizer) -> future {path: tinker://.../weights/<name>}."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    model_id = _get(body, "model_id", str)
    ours = ids.usable(resource, model_id, owner)
    name = _get(body, "path", str, None) or f"step-{uuid.uuid4().hex[:8]}"
    seq_id = body.get("seq_id")
    rec = await asyncio.to_thread(_submit, resource.submit_save_state, ours, _seq(seq_id),
                                  _dedupe_key(seq_id, json.dumps(body, sort_keys=True).encode()), name, owner=owner)
    return rec if isinstance(rec, Response) else _future(rec, model_id)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(request: Request) -> Any:
    """Named: a sampler checkpoint (PEFT adapter) -> {path}. Ephemeral (sampling_session_seq_id): a sampling
    session on a snapshot of the weights (kind "snapshot") or on the session's live weights ("inflight")
    -> {sampling_session_id}."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    model_id = _get(body, "model_id", str)
    ours = ids.usable(resource, model_id, owner)
    seq_id = body.get("seq_id")
    # The SDK draws a new sampling_session_seq_id on every attempt of an ephemeral save (its retry after a
    # timeout re-sends the same seq_id with the next counter value), so it is not part of the request's identity.
    ident = {k: v for k, v in body.items() if k != "sampling_session_seq_id"}
    seq, key = _seq(seq_id), _dedupe_key(seq_id, json.dumps(ident, sort_keys=True).encode())
    name = _get(body, "path", str, None)
    if name:
        rec = await asyncio.to_thread(_submit, resource.submit_save_weights, ours, seq, key, name, False, owner=owner)
        return rec if isinstance(rec, Response) else _future(rec, model_id)
    ss_seq = _get(body, "sampling_session_seq_id", int, None)
    if ss_seq is None:
        raise invalid("save_weights_for_sampler needs a path (a named checkpoint) or sampling_session_seq_id",
                      key="path")
    kind = _get(body, "kind", str, "snapshot")
    if kind == "snapshot":
        rec = await asyncio.to_thread(_submit, ids.snapshots(resource).submit_snapshot, ours, seq, key, owner)
    elif kind == "inflight":
        # The session's own replica adapter, updated by every later inflight save (weights_sync). Synchronous:
        # once the save completes every replica serves these weights or newer (the inflight contract's floor).
        rec = await asyncio.to_thread(_submit, resource.submit_weights_sync, ours, seq, key, False, owner=owner)
    else:
        raise invalid(f"kind must be 'snapshot' or 'inflight', got {kind!r}", key="kind")
    if isinstance(rec, Response):
        return rec
    if rec.operation_id in ids.op_extra:  # a re-submission: the first attempt's sampling session stands
        return _future(rec, model_id)
    client_session = ids.models[model_id][0]
    ids.add_sampler(Sampler(f"{client_session}:sample:{ss_seq}", owner, source_op=rec.operation_id,
                            session_id=ours, inflight=kind == "inflight"))
    return _future(rec, model_id)


@router.post("/load_weights")
async def load_weights(request: Request) -> Any:
    """Create-via-load ({session_id, model_seq_id, path, optimizer}: a new model from a training checkpoint,
    id "{session_id}:train:{model_seq_id}") or a load into an existing model ({model_id, seq_id})."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    # The session or model first, then the payload.
    if body.get("session_id") is not None:
        cs = ids.live_session(_get(body, "session_id", str), owner)
    else:
        model_id = _get(body, "model_id", str)
        ours = ids.usable(resource, model_id, owner)
    uri = to_our_uri(_get(body, "path", str))
    with_optimizer = _get(body, "optimizer", bool, False)
    if body.get("session_id") is not None:
        model_id = f"{cs.session_id}:train:{_get(body, 'model_seq_id', int)}"
        _check_base_model(resource, _get(body, "base_model", str, None))

        def create() -> dict[str, Any]:
            if model_id not in cs.models:
                s = resource.create_session(None, name=model_id, owner=owner, checkpoint_uri=uri,
                                            with_optimizer=with_optimizer)
                ids.add_model(cs, model_id, s.session_id)
            return {"type": "load_weights", "path": to_tinker_path(uri), "model_id": model_id}

        return _future(resource.book.run_detached("", "tinker_load_weights", create), model_id)
    seq_id = body.get("seq_id")
    rec = await asyncio.to_thread(_submit, resource.submit_load_state, ours, _seq(seq_id),
                                  _dedupe_key(seq_id, json.dumps(body, sort_keys=True).encode()), uri, with_optimizer,
                                  owner=owner)
    if isinstance(rec, Response):
        return rec
    ids.op_extra[rec.operation_id] = {"type": "load_weights", "path": to_tinker_path(uri), "model_id": model_id}
    return _future(rec, model_id)


# ----- sampling -----------------------------------------------------------------------------
@dataclass
class Sampler:
    """A tinker sampling session: which weights it samples from.

    Exactly one source: `source_op` (a snapshot / inflight save of session
    `session_id`, resolved once that operation succeeds), `checkpoint_uri`
    (a saved adapter) or neither (the base model).
    """

    sampler_id: str
    owner: str
    source_op: str = ""
    session_id: str = ""
    inflight: bool = False
    checkpoint_uri: str = ""
    model_path: str | None = None
    # seq_id -> (body hash, operation id, num_samples) of recent asample requests (re-sends find them)
    seqs: dict[int, tuple[str, str, int]] = field(default_factory=dict)


@router.post("/create_sampling_session")
async def create_sampling_session(request: Request) -> dict[str, Any]:
    """A sampling session on a saved checkpoint (model_path) or on the base model."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    cs = ids.live_session(_get(body, "session_id", str), owner)
    seq = _get(body, "sampling_session_seq_id", int)
    model_path = _get(body, "model_path", str, None)
    uri = ""
    if model_path:
        uri = to_our_uri(model_path, "model_path")
        await asyncio.to_thread(resource.get_checkpoint, uri, owner)  # NOT_FOUND now, not at the first sample
    else:
        _check_base_model(resource, _get(body, "base_model", str, None))
    sampler = Sampler(f"{cs.session_id}:sample:{seq}", owner, checkpoint_uri=uri, model_path=model_path)
    ids.add_sampler(sampler)
    return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}


@router.get("/samplers/{sampler_id}")
def get_sampler(sampler_id: str, request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    s = ids.sampler(sampler_id, owner)
    model_dir = getattr(resource.engine, "model_dir", None)
    return {"sampler_id": s.sampler_id, "base_model": str(model_dir or resource.engine.model_id),
            "model_path": s.model_path}


def _sampler_weights(resource: Any, ids: TinkerIds, s: Sampler, owner: str) -> tuple[str, int, str]:
    """(replica adapter key, version, our session id for scoping) a sampler samples with; "" key = base model."""
    if s.checkpoint_uri:
        key, version = resource.checkpoint_scoring_key(s.checkpoint_uri, owner)
        return key, version, ""
    if not s.source_op:
        return "", -1, ""
    rec = resource.book.wait(s.source_op, 600.0)
    if rec.status != SUCCEEDED:
        raise ServiceError("FAILED_PRECONDITION", f"the weights save of this sampling client failed: {rec.error}",
                           key="sampling_session_id")
    if s.inflight:
        version = resource.check_sample_session(s.session_id, owner)
        return (s.session_id if version > 0 else ""), version, s.session_id
    snap = rec.result
    ids.snapshots(resource).check(snap)
    return snap.key, snap.version, s.session_id


def _check_sampler_usable(resource: Any, ids: TinkerIds, s: Sampler, owner: str) -> None:
    """A sampler on live weights needs its model ACTIVE; one on a snapshot needs the snapshot kept.
    Raises ServiceError FAILED_PRECONDITION (nothing is waited for: a queued save is checked later)."""
    if s.inflight:
        resource.active_session(s.session_id, owner)
    elif s.source_op:
        rec = resource.book.get(s.source_op)
        if rec.status == SUCCEEDED:
            ids.snapshots(resource).check(rec.result)


def _sample_response_proto(resp: Any, prompt_len: int, last_n: int | None) -> bytes:
    """Our generator SampleResponse -> tinker's; prompt logprobs get Tinker's shape (len(prompt), first None)."""
    out = tw.SampleResponse()
    for seq in resp.sequences:
        q = out.sequences.add()
        q.stop_reason = tw.STOP_REASON_LENGTH if seq.stop_reason == 2 else tw.STOP_REASON_STOP
        q.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        q.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if len(resp.prompt_logprobs) or len(resp.top_k_prompt_logprobs):
        lp = np.full(prompt_len, np.nan, np.float32)  # NaN reads as None in the SDK
        lp[1:] = np.asarray(resp.prompt_logprobs, dtype=np.float32)
        if last_n is not None:
            lp[: prompt_len - last_n] = np.nan
        out.prompt_logprobs = lp.tobytes()
        if len(resp.top_k_prompt_logprobs):
            k = max(len(t.token_ids) for t in resp.top_k_prompt_logprobs)
            ids_ = np.zeros((prompt_len, k), np.int32)
            lps = np.full((prompt_len, k), np.nan, np.float32)
            for i, t in enumerate(resp.top_k_prompt_logprobs, start=1):
                ids_[i, : len(t.token_ids)] = t.token_ids
                lps[i, : len(t.logprobs)] = t.logprobs
            out.topk_prompt_logprobs.token_ids = ids_.tobytes()
            out.topk_prompt_logprobs.logprobs = lps.tobytes()
            out.topk_prompt_logprobs.k = k
            out.topk_prompt_logprobs.length = prompt_len
    return out.SerializeToString()


def _prompt_tokens(prompt: Any) -> list[int]:
    if not isinstance(prompt, dict) or not isinstance(prompt.get("chunks"), list):
        raise invalid("prompt must be a ModelInput {chunks: [...]}", key="prompt")
    tokens: list[int] = []
    for chunk in prompt["chunks"]:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
            raise invalid(f"prompt chunk of type {kind!r} is not supported (text tokens only)", key="prompt")
        toks = chunk.get("tokens")
        if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise invalid("prompt chunk tokens must be a list of integers", key="prompt")
        tokens.extend(toks)
    return tokens


# Request fields of the 0.38 SDK this resource does not serve (refused when set, naming the field).
_UNSUPPORTED_SAMPLE = {"topk_sample_logprobs": 0, "prompt_alt_tokens_k": 0, "target_prompt_logprobs": None,
                       "record_stability_info": False}


@router.post("/asample")
async def asample(request: Request) -> Any:
    """Sample (or score the prompt: compute_logprobs is max_tokens=1 with prompt logprobs) -> future with
    one sequence id per sample. A re-sent (sampling_session_id, seq_id) with the same body returns the
    first request's future; with another body it is a 409."""
    from together_train._proto import common_pb2, generator_pb2
    from together_train_server.service import validation

    resource, ids, owner = _ctx(request)
    body = await _json(request)
    if body.get("sampling_session_id") is None:
        # One-shot form (model_path / base_model): a sampling session of its own.
        model_path = _get(body, "model_path", str, None)
        uri = to_our_uri(model_path, "model_path") if model_path else ""
        if not uri:
            _check_base_model(resource, _get(body, "base_model", str, None))
        s = Sampler(f"oneshot:{uuid.uuid4().hex[:12]}", owner, checkpoint_uri=uri, model_path=model_path)
    else:
        s = ids.sampler(_get(body, "sampling_session_id", str), owner)
        _check_sampler_usable(resource, ids, s, owner)  # before the payload
    for name, off in _UNSUPPORTED_SAMPLE.items():
        if body.get(name, off) not in (off, None):
            raise invalid(f"{name} is not supported by this resource", key=name)
    seq_id = _get(body, "seq_id", int, None)
    fingerprint = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    if seq_id is not None and seq_id in s.seqs:
        first_hash, op_id, n = s.seqs[seq_id]
        if first_hash != fingerprint:
            return error_response(ServiceError("ABORTED", f"seq_id {seq_id} of sampling session {s.sampler_id} was "
                                               "already used by a different request", key="seq_id"), 409)
        return {"request_id": op_id, "sample_sequence_ids": [f"{op_id}:{i}" for i in range(n)]}
    prompt = _prompt_tokens(body.get("prompt"))
    num_samples = _get(body, "num_samples", int, 1)
    want_prompt_lp = bool(_get(body, "prompt_logprobs", bool, False))
    topk_prompt = int(_get(body, "topk_prompt_logprobs", int, 0) or 0)
    last_n = _get(body, "prompt_logprobs_last_n", int, None)
    if last_n is not None and not (want_prompt_lp and 1 <= last_n <= len(prompt) - 1):
        raise invalid(f"prompt_logprobs_last_n must be in [1, len(prompt) - 1] with prompt_logprobs, got {last_n}",
                      key="prompt_logprobs_last_n")
    params = _get(body, "sampling_params", dict)
    kw = tinker_sampling_params(params, len(prompt), resource.limits)
    validation.validate_sampling(prompt, num_samples=num_samples, top_k_prompt_logprobs=topk_prompt,
                                 limits=resource.limits, **kw)
    sp = common_pb2.SamplingParams(
        max_tokens=kw["max_tokens"], temperature=kw["temperature"], top_k=kw["top_k"], top_p=kw["top_p"],
        stop=kw["stop"], stop_token_ids=kw["stop_token_ids"], ignore_eos=kw["ignore_eos"],
    )
    if kw["seed"] is not None:
        sp.seed = kw["seed"]
    # Which weights: resolved now for a loaded sampler (a released snapshot fails the call here).
    source_done = not s.source_op or resource.book.get(s.source_op).terminal
    key = version = scope = None
    if source_done:
        key, version, scope = await asyncio.to_thread(_sampler_weights, resource, ids, s, owner)

    def run() -> bytes:
        k = key
        if k is None:  # the weights save is still queued: wait for it (the SDK returns the client before)
            k, _, _ = _sampler_weights(resource, ids, s, owner)
        req = generator_pb2.SampleRequest(session_id=k, prompt=prompt, params=sp, num_samples=num_samples,
                                          prompt_logprobs=want_prompt_lp or topk_prompt > 0,
                                          top_k_prompt_logprobs=topk_prompt)
        try:
            resp = _route(resource, req)
        except ServiceError:
            raise
        except Exception as e:
            code = getattr(e, "code", None)
            name = code().name if callable(code) else "INTERNAL"
            details = e.details() if callable(getattr(e, "details", None)) else str(e)
            raise ServiceError(name, f"sampling failed on a replica: {details}") from None
        # Metrics: together_train_tokens_sampled_total (the operation itself ends as kind tinker_sample).
        resource.telemetry.count_sampled(scope or "", sum(len(q.tokens) for q in resp.sequences))
        return _sample_response_proto(resp, len(prompt), last_n)

    rec = resource.book.run_detached(scope or "", "tinker_sample", run)
    if seq_id is not None:
        s.seqs[seq_id] = (fingerprint, rec.operation_id, num_samples)
        if len(s.seqs) > 4096:  # the SDK re-sends recent seq_ids only
            for old in list(s.seqs)[:2048]:
                del s.seqs[old]
    return {"request_id": rec.operation_id, "sample_sequence_ids": [f"{rec.operation_id}:{i}" for i in range(num_samples)]}


def _route(resource: Any, req: Any) -> Any:
    """Send a SampleRequest to a replica (least outstanding); re-pushes a lost adapter where the pool can."""
    import inspect

    if "key" in inspect.signature(resource.pool.route).parameters:
        return resource.pool.route(lambda c: c.sample(req), key=req.session_id)
    return resource.pool.route(lambda c: c.sample(req))


# ----- RestClient: training runs and checkpoints ---------------------------------------------------
def _iso(t: float) -> str:
    from datetime import datetime, timezone

    return datetime.fromtimestamp(t, tz=timezone.utc).isoformat()


def _checkpoint_json(c: Any) -> dict[str, Any]:
    path = to_tinker_path(c.uri)
    return {"checkpoint_id": path.split("/", 3)[3], "checkpoint_type": "training" if c.kind == "state" else "sampler",
            "time": _iso(c.created_at), "tinker_path": path, "size_bytes": int(c.size_bytes), "public": False}


def _run_id(ids: TinkerIds, run_id: str, owner: str) -> str:
    """A training run id is our session id (the first part of its tinker:// paths); a tinker model id works too."""
    return ids.ours(run_id, owner) if ":train:" in run_id else run_id


def _training_run(resource: Any, row: Any, owner: str) -> dict[str, Any]:
    """A Tinker TrainingRun of a session's model-registry `row` (a live session adds its last request time)."""
    try:
        live = resource.get_session(row.session_id, owner)
    except ServiceError:
        live = None  # a session of an earlier run of this server
    ckpts = resource.list_checkpoints(row.session_id, owner)
    last = {kind: next((c for c in reversed(ckpts) if c.kind == kind), None) for kind in ("state", "weights")}
    model_dir = getattr(resource.engine, "model_dir", None)
    meta = {k: str(v) for k, v in row.metadata.items()}  # Tinker's user_metadata is str -> str
    return {
        "training_run_id": row.session_id,
        "base_model": str(model_dir or resource.engine.model_id),
        "model_owner": "",
        "is_lora": True,
        "lora_rank": int(row.lora.get("rank") or 0) or None,
        "last_request_time": _iso(live.last_active_at if live is not None else (row.stopped_at or row.created_at)),
        "last_checkpoint": _checkpoint_json(last["state"]) if last["state"] else None,
        "last_sampler_checkpoint": _checkpoint_json(last["weights"]) if last["weights"] else None,
        "user_metadata": meta or None,
    }


def _offset_page(limit: int, offset: int) -> None:
    if limit < 1 or offset < 0:
        raise invalid(f"limit must be >= 1 and offset >= 0, got limit={limit} offset={offset}", key="limit")


@router.get("/training_runs")
def list_training_runs(request: Request, limit: int = 20, offset: int = 0) -> dict[str, Any]:
    """Every session this storage holds (earlier runs' too), newest first, paged by offset from the model registry."""
    resource, _, owner = _ctx(request)
    _offset_page(limit, offset)
    tag = owner_tag(owner)
    rows, _ = resource.registry.list_sessions(tag, limit=limit, offset=offset)
    return {"training_runs": [_training_run(resource, r, owner) for r in rows],
            "cursor": {"offset": offset, "limit": limit, "total_count": resource.registry.count("sessions", tag)}}


@router.get("/training_runs/{run_id}")
def get_training_run(run_id: str, request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    sid = _run_id(ids, run_id, owner)
    row = resource.registry.session(sid)
    if row is None or row.owner != owner_tag(owner):
        raise ServiceError("NOT_FOUND", f"unknown training run {run_id!r}", key="run_id")
    return _training_run(resource, row, owner)


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(run_id: str, request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    ckpts = [_checkpoint_json(c) for c in resource.list_checkpoints(_run_id(ids, run_id, owner), owner)]
    return {"checkpoints": ckpts}


@router.get("/checkpoints")
def list_user_checkpoints(request: Request, limit: int = 100, offset: int = 0) -> dict[str, Any]:
    """The caller's checkpoints, newest first, paged by offset from the model registry."""
    resource, _, owner = _ctx(request)
    _offset_page(limit, offset)
    tag = owner_tag(owner)
    rows, _ = resource.registry.list_checkpoints(tag, limit=limit, offset=offset)
    ckpts = []
    for r in rows:
        try:
            ckpts.append(resource.store.get(r.uri, verify=False))
        except ServiceError:
            pass  # files gone: reported by the registry at startup, not listed
    return {"checkpoints": [_checkpoint_json(c) for c in ckpts],
            "cursor": {"offset": offset, "limit": limit, "total_count": resource.registry.count("checkpoints", tag)}}


@router.delete("/training_runs/{run_id}/checkpoints/{checkpoint_id:path}")
def delete_checkpoint(run_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
    resource, ids, owner = _ctx(request)
    uri = to_our_uri(f"tinker://{_run_id(ids, run_id, owner)}/{checkpoint_id}", "checkpoint_id")
    resource.delete_checkpoint(uri, owner)
    return {}


@router.post("/weights_info")
async def weights_info(request: Request) -> dict[str, Any]:
    """The LoRA shape of a checkpoint (from its training state, or its PEFT adapter config)."""
    resource, _, owner = _ctx(request)
    body = await _json(request)
    uri = to_our_uri(_get(body, "tinker_path", str), "tinker_path")
    ckpt = await asyncio.to_thread(resource.get_checkpoint, uri, owner)
    cfg: dict[str, Any] = {}
    try:
        cfg = json.loads((Path(ckpt.path) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        pass
    targets = set(cfg.get("target_modules") or ())
    model_dir = getattr(resource.engine, "model_dir", None)
    return {
        "base_model": str(model_dir or resource.engine.model_id),
        "is_lora": True,
        "lora_rank": cfg.get("r"),
        "train_unembed": bool(cfg.get("modules_to_save")),
        "train_mlp": bool(targets & set(MLP_MODULES)) if targets else None,
        "train_attn": bool(targets & set(ATTN_MODULES)) if targets else None,
    }
