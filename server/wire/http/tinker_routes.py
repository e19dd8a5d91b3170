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

from together_train_server.engines.types import LoraSpec
from together_train_server.service.errors import ServiceError, invalid
from together_train_server.service.operations import CANCELLED, FAILED, SUCCEEDED
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

    def model_of(self, ours: str) -> str | None:
        with self._lock:
            for model_id, (_, sid) in self.models.items():
                if sid == ours:
                    return model_id
        return None


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


def _submit(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
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
def _lora_from_tinker(cfg: dict[str, Any]) -> LoraSpec:
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
    return LoraSpec(rank=int(rank), alpha=LORA_ALPHA, target_modules=modules, train_unembed=bool(train_unembed),
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

    def create() -> dict[str, Any]:
        if model_id not in cs.models:  # a re-sent create finds the model made by the first
            s = resource.create_session(spec, name=model_id, owner=owner)
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
        "model_data": {"arch": arch, "model_name": str(engine.model_id), "tokenizer_id": str(model_dir or "")},
        "model_id": model_id,
        "is_lora": True,
        "lora_rank": int(s.lora.rank),
        "model_name": str(engine.model_id),
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
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError
        raise invalid(f"the body is not a ForwardBackwardRequest: {e}") from None
    ours = ids.ours(msg.model_id, owner)
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
    ours = ids.ours(model_id, owner)
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
    if isinstance(res, dict):  # results of this API's detached operations are already in tinker's shape
        return JSONResponse(res)
    raise ServiceError("INTERNAL", f"operation kind {rec.kind!r} has no tinker result shape")


@router.post("/retrieve_future")
async def retrieve_future(request: Request) -> Response:
    """Long-poll an operation: its result, 200 {error, category} when it failed, or 408 after ~40 s."""
    resource, ids, owner = _ctx(request)
    body = await _json(request)
    op_id = _get(body, "request_id", str)
    rec = await asyncio.to_thread(resource.get_operation, op_id, owner)
    deadline = time.monotonic() + LONG_POLL_S
    delay = 0.002
    while not rec.terminal:
        if time.monotonic() >= deadline:
            return JSONResponse({"type": "try_again", "request_id": op_id, "queue_state": "active"},
                                status_code=408)
        await asyncio.sleep(delay)
        delay = min(delay * 1.5, 0.05)
    if rec.status in (FAILED, CANCELLED):
        return JSONResponse({"error": str(rec.error), "category": _category(rec.error)})
    assert rec.status == SUCCEEDED
    return _result(rec, ids, PROTO in request.headers.get("accept", ""))
