"""Service values -> JSON for the Together RL API: times, forward results, samples, checkpoint summaries.

Shapes are the ``together`` SDK's (3.1.1, ``together/types/post_training``); times are RFC 3339.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any

import numpy as np

from together_train_server.engines.types import ForwardOutput
from together_train_server.service.interfaces import Checkpoint, CheckpointRow, PromptSamples
from together_train_server.wire.http.together.ids import ckpt_id


def rfc3339(t: float | None) -> str | None:
    """Unix seconds -> RFC 3339 UTC ("2026-01-02T03:04:05.678Z"); None stays None."""
    if t is None:
        return None
    return _dt.datetime.fromtimestamp(t, _dt.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _floats(a: Any) -> list[float]:
    return [float(x) for x in np.asarray(a, dtype=np.float32).reshape(-1)]


def excluded(inputs: dict[str, np.ndarray]) -> np.ndarray | None:
    """Positions a sample's loss excludes (its weight or mask is 0), as a bool array; None when it has neither."""
    sel = inputs.get("weights")
    sel = sel if sel is not None else inputs.get("mask")
    return None if sel is None else np.asarray(sel) == 0


def forward_result(out: ForwardOutput, masks: list[np.ndarray | None] | None, with_outputs: bool) -> dict[str, Any]:
    """A ForwardOutput -> ForwardBackwardResult ``{loss, metrics, loss_fn_outputs?}``.

    ``loss_fn_outputs[i].tensors.logprobs`` is float32 ``[n_i]``; as Together
    documents, positions the loss excludes (``masks[i]``, see `excluded`) are 0 there.
    """
    res: dict[str, Any] = {"loss": float(out.loss),
                           "metrics": {k: float(v) for k, v in (out.metrics or {}).items() if math.isfinite(v)}}
    if with_outputs and out.logprobs is not None:
        outs = []
        for i, lp in enumerate(out.logprobs):
            lp = np.asarray(lp, dtype=np.float32).copy()
            sel = masks[i] if masks else None
            if sel is not None and len(sel) == len(lp):
                lp[sel] = 0.0
            outs.append({"tensors": {"logprobs": {"data": _floats(lp), "dtype": "float32", "shape": [int(lp.size)]}}})
        res["loss_fn_outputs"] = outs
    return res


_STOP = {"stop": "STOP_REASON_STOP", "length": "STOP_REASON_LENGTH"}


def sample_result(ps: PromptSamples, prompt_len: int, prompt_logprobs: bool, topk: int) -> dict[str, Any]:
    """One prompt's `PromptSamples` -> SampleResult (policy segment: the version that served it)."""
    resp = ps.response
    seqs = [{"tokens": [int(t) for t in q.tokens], "logprobs": [float(x) for x in q.logprobs],
             "stop_reason": _STOP.get(q.stop_reason, "STOP_REASON_STOP"),
             "prompt_cache_hit_tokens": int(resp.prompt_cache_hit_tokens)}
            for q in resp.sequences]
    out: dict[str, Any] = {"sequences": seqs, "policy_segments": [{"start_token": 0, "version": ps.policy_version}]}
    if prompt_logprobs:
        lps = [float(x) for x in resp.prompt_logprobs]
        # Together: full prompt length, entry 0 a 0.0 placeholder (the first token has no context).
        out["prompt_logprobs"] = ([0.0] + lps if len(lps) == prompt_len - 1 else lps)[:prompt_len]
    if topk:
        rows = [{"token_ids": [int(t) for t in ids], "logprobs": [float(x) for x in lps]}
                for ids, lps in resp.top_k_prompt_logprobs]
        out["topk_prompt_logprobs"] = ([{"token_ids": [], "logprobs": []}] + rows
                                       if len(rows) == prompt_len - 1 else rows)[:prompt_len]
    return out


def ckpt_short(c: Checkpoint | CheckpointRow) -> dict[str, Any]:
    """A checkpoint as a session's and an operation's output list it: id, created_at, step."""
    return {"id": ckpt_id(c), "created_at": rfc3339(c.created_at), "step": int(c.step)}
