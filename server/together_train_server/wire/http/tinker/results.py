"""Writing Tinker answers: futures, failure categories and operation results in the SDK's shapes."""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi.responses import JSONResponse, Response

from together_train_server.engines.types import ForwardOutput
from together_train_server.service.interfaces import OperationRecord, SampleOutput
from together_train_server.service.errors import ServiceError
from together_train_server.wire.http import tinker_wire as tw
from together_train_server.wire.http.app import error_response
from together_train_server.wire.http.tinker.base import PROTO
from together_train_server.wire.http.tinker.ids import TinkerIds, to_tinker_path

# tinker/types/topk_logprobs.py MASK_LOGPROB: a top-k slot (token 0, this logprob) that holds nothing.
TOPK_MASK_LOGPROB = -99999.0


# Metric reductions the SDK folds across chunks (tinker/lib/chunked_fwdbwd_helpers.py); any
# other key would be dropped by it or break its "name:reduction" split.
_REDUCTIONS = ("mean", "sum", "min", "max", "slack", "hash2", "unique")

# Service error codes that mean "the request was wrong" (category user) vs the resource failed.
_USER_CODES = frozenset({"INVALID_ARGUMENT", "FAILED_PRECONDITION", "NOT_FOUND", "ALREADY_EXISTS", "OUT_OF_RANGE",
                         "UNIMPLEMENTED", "CANCELLED", "PERMISSION_DENIED", "UNAUTHENTICATED", "RESOURCE_EXHAUSTED"})

_SERVER_CODES = frozenset({"INTERNAL", "UNAVAILABLE", "DATA_LOSS", "DEADLINE_EXCEEDED", "ABORTED"})

_FORWARD_KINDS = frozenset({"forward", "forward_backward", "custom_forward_backward"})


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


def _future(rec: OperationRecord, model_id: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"request_id": rec.operation_id}
    if model_id is not None:
        out["model_id"] = model_id
    return out


def _category(err: ServiceError | None) -> str:
    code = err.code if err is not None else ""
    return "user" if code in _USER_CODES else "server" if code in _SERVER_CODES else "unknown"


def _forward_output_proto(out: ForwardOutput) -> bytes:
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


def _forward_output_json(out: ForwardOutput) -> dict[str, Any]:
    def td(a: np.ndarray) -> dict[str, Any]:
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


def _result(rec: OperationRecord, ids: TinkerIds, want_proto: bool) -> Response:
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


def _sample_response_proto(resp: SampleOutput, prompt_len: int, last_n: int | None) -> bytes:
    """A replica's `SampleOutput` -> tinker's SampleResponse; prompt logprobs get Tinker's shape (len(prompt), first None)."""
    out = tw.SampleResponse(prompt_cache_hit_tokens=int(resp.prompt_cache_hit_tokens))
    for seq in resp.sequences:
        q = out.sequences.add()
        q.stop_reason = tw.STOP_REASON_LENGTH if seq.stop_reason == "length" else tw.STOP_REASON_STOP
        q.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        q.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
    if len(resp.prompt_logprobs) or len(resp.top_k_prompt_logprobs):
        lp = np.full(prompt_len, np.nan, np.float32)  # NaN reads as None in the SDK
        lp[1:] = np.asarray(resp.prompt_logprobs, dtype=np.float32)
        if last_n is not None:
            lp[: prompt_len - last_n] = np.nan
        out.prompt_logprobs = lp.tobytes()
        if len(resp.top_k_prompt_logprobs):
            # Rows not computed (position 0, those before prompt_logprobs_last_n) and padding hold the
            # SDK's sentinel (token 0, logprob TOPK_MASK_LOGPROB), which it reads as None / drops.
            k = max(len(ids) for ids, _ in resp.top_k_prompt_logprobs)
            ids_ = np.zeros((prompt_len, k), np.int32)
            lps = np.full((prompt_len, k), TOPK_MASK_LOGPROB, np.float32)
            first = 1 if last_n is None else prompt_len - last_n
            for i, (t_ids, t_lps) in enumerate(resp.top_k_prompt_logprobs, start=1):
                if i < first:
                    continue
                ids_[i, : len(t_ids)] = t_ids
                lps[i, : len(t_lps)] = t_lps
            out.topk_prompt_logprobs.token_ids = ids_.tobytes()
            out.topk_prompt_logprobs.logprobs = lps.tobytes()
            out.topk_prompt_logprobs.k = k
            out.topk_prompt_logprobs.length = prompt_len
    return out.SerializeToString()
