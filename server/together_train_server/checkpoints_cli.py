"""``together-train checkpoints search|update|usage`` and ``together-train import-adapter DIR``: checkpoint
metadata, search, storage and PEFT adapter import from a shell.

Each command is a client of a running resource (``--address``, ``--api-key-file`` or
``$TOGETHER_TRAIN_API_KEY``, ``--tls``) through the SDK's `ResourceClient`; a refused request prints the
server's message (naming the field) and exits 1.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
from pathlib import Path
from typing import Any


def client_flags(p: argparse.ArgumentParser) -> None:
    """--address, --api-key-file, --tls, --json (shared by the checkpoint client commands)."""
    p.add_argument("--address", default=os.environ.get("TOGETHER_TRAIN_ADDRESS", "127.0.0.1:7470"),
                   help="the resource's host:port (default $TOGETHER_TRAIN_ADDRESS or 127.0.0.1:7470)")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="file whose first line is your API key (default $TOGETHER_TRAIN_API_KEY)")
    p.add_argument("--tls", action="store_true", help="the resource serves TLS")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def connect(args: argparse.Namespace) -> Any:
    """A `ResourceClient` for the client flags."""
    from together_train import ResourceClient

    key = None
    if args.api_key_file is not None:
        lines = [x.strip() for x in Path(args.api_key_file).read_text().splitlines() if x.strip()]
        key = lines[0] if lines else None
    return ResourceClient(args.address, api_key=key, tls=args.tls, keepalive_interval_s=None, timeout=30.0)


def _pairs(items: list[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or ():
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ValueError(f"{flag} {item!r}: expected KEY=VALUE")
        out[k] = v
    return out


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, tz=datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S") if t else "never"


def _info_json(c: Any) -> dict[str, Any]:
    return {"uri": c.uri, "type": c.type, "base_model": c.base_model, "session_id": c.session_id, "step": c.step,
            "size_bytes": c.size_bytes, "created_at": c.created_at, "expires_at": c.expires_at or None,
            "pinned": c.pinned, "user_metadata": c.user_metadata, "owner": c.owner}


def _table(rows: list[Any]) -> str:
    head = f"{'URI':<60} {'TYPE':<8} {'SIZE_BYTES':>12} {'CREATED (UTC)':<19} {'EXPIRES':<19} PIN METADATA"
    lines = [head]
    for c in rows:
        lines.append(f"{c.uri:<60} {c.type:<8} {c.size_bytes:>12} {_when(c.created_at):<19} {_when(c.expires_at):<19} "
                     f"{'yes' if c.pinned else 'no ':<3} {json.dumps(c.user_metadata, sort_keys=True)}")
    return "\n".join(lines)


def _run(args: argparse.Namespace, fn: Any) -> int:
    from together_train.errors import TogetherTrainError

    client = connect(args)
    try:
        out = fn(client)
    except TogetherTrainError as err:
        print(f"together-train {' '.join(filter(None, (args.command, args.action)))}: {err}", flush=True)
        return 1
    finally:
        client.close()
    print(out, flush=True)
    return 0


def cmd_search(args: argparse.Namespace) -> int:
    md = _pairs(args.metadata, "--metadata")

    def go(client: Any) -> str:
        rows, nxt = client.search_checkpoints(user_metadata=md, type=args.type, base_model=args.base_model,
                                              session_id=args.session, owner=args.owner, limit=args.limit,
                                              cursor=args.cursor)
        if args.json:
            return json.dumps({"checkpoints": [_info_json(c) for c in rows], "next_cursor": nxt}, indent=1)
        return _table(rows) + (f"\nnext page: --cursor '{nxt}'" if nxt else "")

    return _run(args, go)


def cmd_update(args: argparse.Namespace) -> int:
    kw: dict[str, Any] = {}
    if args.metadata is not None or args.clear_metadata:
        kw["user_metadata"] = _pairs(args.metadata, "--metadata")
    if args.ttl is not None:
        kw["ttl_seconds"] = args.ttl
    if args.pin or args.unpin:
        kw["pinned"] = bool(args.pin)

    def go(client: Any) -> str:
        c = client.update_checkpoint(args.uri, **kw)
        return json.dumps(_info_json(c), indent=1) if args.json else _table([c])

    return _run(args, go)


def cmd_usage(args: argparse.Namespace) -> int:
    def go(client: Any) -> str:
        usage = client.storage_usage()
        if args.json:
            return json.dumps(usage, indent=1)
        return "\n".join(f"{owner or '(no key)':<34} {b:>14} bytes" for owner, b in sorted(usage.items()))

    return _run(args, go)


def cmd_import_adapter(args: argparse.Namespace) -> int:
    md = _pairs(args.metadata, "--metadata")
    name = args.name or Path(args.dir).resolve().name

    def go(client: Any) -> str:
        c = client.import_adapter(args.dir, name, type=args.type, user_metadata=md, ttl_seconds=args.ttl,
                                  pinned=args.pin)
        return json.dumps(_info_json(c), indent=1) if args.json else c.uri

    return _run(args, go)


def cmd_export_adapter(args: argparse.Namespace) -> int:
    from together_train_server.adapter_tools import export_adapter

    def go(client: Any) -> str:
        return str(export_adapter(client, args.uri, args.dest, for_vllm=args.for_vllm))

    try:
        return _run(args, go)
    except ValueError as err:  # refused for vLLM: one line with the reason, nothing written
        print(f"together-train export-adapter: {err}", flush=True)
        return 1


def cmd_check_adapter(args: argparse.Namespace) -> int:
    from together_train_server.adapter_tools import base_model_dir, parity

    result: list[Any] = []

    def go(client: Any) -> str:
        model = args.model or base_model_dir(client, args.checkpoint)
        r = parity(client, args.checkpoint, model)
        result.append(r)
        return (f"checkpoint={args.checkpoint} dtype={r.dtype} tokens={r.tokens} "
                f"max_abs_delta_logprob={r.max_abs_delta:.3e} tolerance={r.tolerance:.3e} "
                f"verdict={'ok' if r.ok else 'MISMATCH'}")

    rc = _run(args, go)
    return rc if rc or not result else (0 if result[0].ok else 1)


def add_parser(sub: Any) -> None:
    """Register ``checkpoints`` (search | update | usage) on the CLI's subparsers."""
    p = sub.add_parser("checkpoints", help="search checkpoints, edit their metadata / TTL / pin, storage usage")
    acts = p.add_subparsers(dest="action", required=True)
    s = acts.add_parser("search", help="checkpoints matching every filter, newest first (size in bytes)")
    client_flags(s)
    s.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="exact user-metadata match (repeatable)")
    s.add_argument("--type", choices=("training", "sampler", "merged"), default=None)
    s.add_argument("--base-model", default=None)
    s.add_argument("--session", default=None, help="only this session's")
    s.add_argument("--owner", default=None, help="another key's owner tag, or '*' for all (admin keys only)")
    s.add_argument("--limit", type=int, default=50, help="1-200 per page (default 50)")
    s.add_argument("--cursor", default="", help="next_cursor of the previous page")
    s.set_defaults(func=cmd_search)
    u = acts.add_parser("update", help="replace user metadata, set/clear the TTL, pin or unpin one checkpoint")
    client_flags(u)
    u.add_argument("uri", help="together-train://<session>/<kind>/<name>")
    u.add_argument("--metadata", action="append", metavar="KEY=VALUE",
                   help="the new metadata, replacing the old (repeatable)")
    u.add_argument("--clear-metadata", action="store_true", help="remove every metadata pair")
    u.add_argument("--ttl", type=int, default=None, help="seconds from now until deletion (0 = never)")
    g = u.add_mutually_exclusive_group()
    g.add_argument("--pin", action="store_true")
    g.add_argument("--unpin", action="store_true")
    u.set_defaults(func=cmd_update)
    us = acts.add_parser("usage", help="checkpoint bytes of your key (an admin key: every key's)")
    client_flags(us)
    us.set_defaults(func=cmd_usage)
    im = sub.add_parser("import-adapter", help="import a PEFT LoRA adapter directory as a training or sampler "
                                              "checkpoint (prints its URI)")
    client_flags(im)
    im.add_argument("dir", help="directory with adapter_config.json and adapter_model.safetensors")
    im.add_argument("--name", default=None, help="checkpoint name (default: the directory's name)")
    im.add_argument("--type", choices=("training", "sampler"), default="training",
                    help="training: create_session(checkpoint_uri=...) trains on (fresh optimizer); sampler: for "
                         "scoring and OpenAI serving (default training)")
    im.add_argument("--metadata", action="append", metavar="KEY=VALUE", help="user metadata (repeatable)")
    im.add_argument("--ttl", type=int, default=None, help="seconds until the resource deletes it")
    im.add_argument("--pin", action="store_true", help="never removed by TTL or keep-last")
    im.set_defaults(func=cmd_import_adapter, action="")
    ex = sub.add_parser("export-adapter", help="download a save_weights adapter for peft / vLLM (--for-vllm refuses "
                                              "what vLLM --lora-modules cannot load, with the reason)")
    client_flags(ex)
    ex.add_argument("uri", help="together-train://<session>/weights/<name>")
    ex.add_argument("dest", type=Path, help="directory to write (replaced)")
    ex.add_argument("--for-vllm", action="store_true", help="refuse an adapter vLLM cannot serve (lm_head, DoRA, ...)")
    ex.set_defaults(func=cmd_export_adapter, action="")
    ck = sub.add_parser("check-adapter", help="score fixed prompts with the exported adapter in transformers + peft "
                                             "and with the resource's sampler; print max |delta logprob| vs the "
                                             "dtype's tolerance (exit 1 over it)")
    client_flags(ck)
    ck.add_argument("checkpoint", help="together-train://<session>/weights/<name> (an adapter)")
    ck.add_argument("--model", type=Path, default=None,
                    help="the base model directory the resource serves (default: the adapter's "
                         "base_model_name_or_path when that directory exists here)")
    ck.set_defaults(func=cmd_check_adapter, action="")
