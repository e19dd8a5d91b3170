"""`together-train status`: a resource's summary in a terminal (model, sessions, replicas).

Reads only what the resource serves over gRPC to this API key: capabilities,
the caller's sessions and the resource's Health (one entry per generator
replica: state, outstanding requests, adapter versions held, restarts).
Imports no torch: it runs wherever the SDK does.
"""

from __future__ import annotations

import json
import time
from typing import Any

from together_train._proto import generator_pb2


def resource_status(client: Any) -> dict[str, Any]:
    """The summary as plain values (what ``--json`` prints).

    Args:
        client: a connected `together_train.ResourceClient`.

    Returns:
        ``{"address", "resource": {model_id, mode, dtype, max_sessions, num_replicas,
        generator_engine, trainer_backend}, "sessions": [{session_id, name, state, step,
        synced_version, next_seq_id, last_active_s_ago, lora_rank}], "replicas":
        [{replica_id, address, state, outstanding, restarts, versions}], "ready"}``.

    Raises:
        together_train.errors.TogetherTrainError: the resource refused or cannot be reached.
    """
    caps = client.get_capabilities(refresh=True)
    sessions = client.list_sessions()
    health = client._call(client._generator.Health, generator_pb2.HealthRequest(), what="Health")
    now = time.time()
    return {
        "address": client.address,
        "resource": {
            "model_id": caps.model_id, "mode": caps.mode, "dtype": getattr(caps, "dtype", ""),
            "max_sessions": caps.max_sessions, "num_replicas": caps.num_replicas,
            "generator_engine": getattr(caps, "generator_engine", ""),
            "trainer_backend": getattr(caps, "trainer_backend", ""),
        },
        "sessions": [
            {
                "session_id": s.session_id, "name": s.name, "state": s.state, "step": s.step,
                "synced_version": s.synced_version, "next_seq_id": s.next_seq_id,
                "last_active_s_ago": round(max(0.0, now - s.last_active_at), 1), "lora_rank": s.lora.rank,
            }
            for s in sessions
        ],
        "ready": health.ready,
        "replicas": [
            {
                "replica_id": r.replica_id, "address": r.address, "state": r.state,
                "outstanding": r.outstanding_requests, "restarts": r.restarts,
                "versions": dict(sorted(r.loaded_versions.items())),
            }
            for r in health.replicas
        ],
    }


def _table(rows: list[list[str]], header: list[str]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    return ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in [header, *rows]]


def format_status(st: dict[str, Any]) -> str:
    """The summary of `resource_status` as aligned text tables."""
    r = st["resource"]
    lines = [
        f"resource {st['address']}: {r['model_id']} ({r['mode']}, {r['dtype'] or '?'}, trainer "
        f"{r['trainer_backend'] or '?'}, generator {r['generator_engine'] or '?'})",
        f"sessions: {sum(1 for s in st['sessions'] if s['state'] == 'active')} active of max {r['max_sessions']}"
        f"; replicas: {sum(1 for x in st['replicas'] if x['state'] == 'healthy')} healthy of {len(st['replicas'])}",
        "",
    ]
    if st["sessions"]:
        lines += _table(
            [[s["session_id"], s["name"] or "-", s["state"], s["step"], s["synced_version"], s["next_seq_id"],
              f"{s['last_active_s_ago']:.0f}s ago", s["lora_rank"]] for s in st["sessions"]],
            ["SESSION", "NAME", "STATE", "STEP", "SYNCED", "NEXT_SEQ", "LAST_ACTIVE", "RANK"],
        )
    else:
        lines.append("no sessions")
    lines.append("")
    if st["replicas"]:
        lines += _table(
            [[x["replica_id"], x["address"] or "-", x["state"], x["outstanding"], x["restarts"],
              ", ".join(f"{k}@v{v}" for k, v in x["versions"].items()) or "-"] for x in st["replicas"]],
            ["REPLICA", "ADDRESS", "STATE", "OUTSTANDING", "RESTARTS", "VERSIONS"],
        )
    else:
        lines.append("no generator replicas")
    return "\n".join(lines)


def main_status(address: str, api_key: str | None = None, as_json: bool = False, tls: bool = False) -> int:
    """`together-train status`: print the summary (text or JSON); 0 on success, 1 when unreachable."""
    from together_train import ResourceClient
    from together_train.errors import TogetherTrainError

    client = ResourceClient(address, api_key=api_key, tls=tls, keepalive_interval_s=None, timeout=10.0)
    try:
        st = resource_status(client)
    except TogetherTrainError as err:
        print(f"together-train status: {address}: {err}", flush=True)
        return 1
    finally:
        client.close()
    print(json.dumps(st, indent=2) if as_json else format_status(st), flush=True)
    return 0
