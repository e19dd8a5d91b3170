"""``together-train deploy CHECKPOINT_OR_DIR``: serve a trained model, without a trainer.

A resource-less inference server: generator replica processes on the base
model (or on a merged model directory) and the HTTP app's OpenAI routes
(``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``) over them.
No sessions, no training, no optimizer memory.

What can be deployed:

- a registered checkpoint URI ``together-train://<session>/weights/<name>`` of
  the ``--storage`` directory (verified against its manifest first);
- a directory: a PEFT adapter (``adapter_config.json`` +
  ``adapter_model.safetensors``, e.g. a downloaded inference checkpoint) on
  ``--model`` (default: the adapter's ``base_model_name_or_path``), or a merged
  model directory (``config.json``: served as the model itself). A
  ``manifest.json`` beside the files (a downloaded checkpoint) is checked:
  a file whose size or sha256 differs stops the deploy.

The adapter is pushed to every replica at startup under the key
``ckpt:<served name>`` (re-pushed to a restarted replica by the pool). The
served model name is ``--served-model-name`` (default: the argument as
given); the base model is also served under its id unless ``--adapter-only``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Deployable:
    """What `resolve` found.

    Attributes:
        base_dir: the model directory the replicas load.
        adapter_dir: the PEFT adapter directory, None for a merged model.
        step: the checkpoint's step (the adapter's version on the replicas; 0 when unknown).
    """

    base_dir: Path
    adapter_dir: Path | None
    step: int = 0


def _check_manifest(path: Path) -> int:
    """Verify ``path/manifest.json`` (when present) against the files; returns its step (0 when absent).

    Raises:
        ValueError: a listed file is missing or its size / sha256 differs.
    """
    from together_train_server.service.checkpoints.store import _sha256

    manifest = path / "manifest.json"
    if not manifest.exists():
        return 0
    meta = json.loads(manifest.read_text())
    for rel, m in (meta.get("files") or {}).items():
        f = path / rel
        if not f.is_file():
            raise ValueError(f"{path}: {rel} is listed in manifest.json but missing")
        if f.stat().st_size != int(m["size"]) or _sha256(f) != m["sha256"]:
            raise ValueError(f"{path}: {rel} does not match manifest.json (size or sha256 differs): corrupted copy")
    return int(meta.get("step", 0) or 0)


def resolve(target: str, *, storage: Path | None, model: str | None) -> Deployable:
    """Find the model and adapter directories of a checkpoint URI or a directory.

    Raises:
        ValueError / FileNotFoundError: naming what is missing or wrong (the CLI prints it and exits 2).
    """
    from together_train_server.engines.model_loading import resolve_model_dir
    from together_train_server.service.errors import ServiceError

    step = 0
    if target.startswith("together-train://"):
        from together_train_server.service.checkpoints.store import CheckpointStore

        if storage is None:
            raise ValueError(f"{target} is a registered checkpoint: give the --storage directory it was saved in")
        from together_train_server.service.checkpoints.registry import FILENAME, Registry

        # A registered checkpoint: looked up through the storage's model registry when it has one.
        registry = Registry(storage) if (Path(storage) / FILENAME).exists() else None
        try:
            ckpt = CheckpointStore(storage, registry=registry).get(target, verify=True)
        except ServiceError as e:
            raise ValueError(f"{target}: {e.message}") from None
        if ckpt.kind != "weights":
            raise ValueError(f"{target} is a training checkpoint (save_state); deploy an inference checkpoint "
                             "(save_weights)")
        path, step = ckpt.path, ckpt.step
    else:
        path = Path(target).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"{target} is neither a checkpoint URI (together-train://...) nor a directory")
        step = _check_manifest(path)
    if (path / "adapter_config.json").exists():
        base = model
        if base is None:
            base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
            if not base or not Path(base).is_dir():
                raise ValueError(f"{path}: the adapter names base model {base!r}, which is not a local directory "
                                 "here; give --model DIR")
        return Deployable(resolve_model_dir(None if base == "embedded" else base), path, step)
    if (path / "config.json").exists():
        if model is not None:
            raise ValueError(f"{path} is a merged model (config.json): it is served as is, without --model")
        return Deployable(path, None, step)
    raise ValueError(f"{path} holds neither a PEFT adapter (adapter_config.json) nor a model (config.json)")


class Deployment:
    """The object the HTTP app serves for ``deploy``: an `InferenceService` over replicas (``.inference``).

    Args:
        deployable: what to serve (`resolve`).
        served_name: the model name clients pass.
        pool: the started `ReplicaPool`.
        adapter_only: do not serve the base model itself.
        chat_template: a Jinja file replacing the model's chat template (`chat_templates.install`).
    """

    def __init__(self, deployable: Deployable, served_name: str, pool: Any, *, adapter_only: bool = False,
                 chat_template: Path | None = None) -> None:
        from transformers import AutoConfig, AutoTokenizer

        from together_train_server.service.sampling import chat_templates

        from together_train_server.service.sampling.inference import FixedCatalog, InferenceService
        from together_train_server.service.sampling.replica_sampler import ReplicaSampler
        from together_train_server.service.sampling.rollouts import RolloutStore
        from together_train_server.service.validation import Limits

        self.pool = pool
        self.rollouts = RolloutStore()  # /v1/rollouts/{id} on a deployment too (default bounds)
        base = deployable.base_dir
        cfg = AutoConfig.from_pretrained(str(base))
        text_cfg = getattr(cfg, "text_config", None) or cfg
        self.limits = Limits(vocab_size=int(text_cfg.vocab_size),
                             max_seq_len=int(getattr(text_cfg, "max_position_embeddings", 0) or 2048))
        tokenizer = AutoTokenizer.from_pretrained(str(base))
        chat_templates.install(tokenizer, chat_template)  # --chat-template, or the embedded model's with tools
        adapters: dict[str, str] = {}
        if deployable.adapter_dir is not None:
            from together_train_server.engines.lora import read_peft_adapter

            spec, tensors = read_peft_adapter(deployable.adapter_dir)
            key = f"ckpt:{served_name}"
            pool.push_all(key, max(1, deployable.step), spec, tensors)
            adapters[served_name] = key
            catalog = FixedCatalog(base.name, adapters, aliases=[str(base)], names_only=adapter_only)
        else:  # a merged model: the replicas' base model is the served model
            catalog = FixedCatalog(served_name, {}, aliases=[base.name, str(base)])
        self.inference = InferenceService(catalog, tokenizer, self.limits, ReplicaSampler(pool, self.limits), self.rollouts)

    def max_request_bytes(self) -> int:
        """The HTTP body limit's base (`app.create_app`): no trainer, no training limits, only chat/completion
        bodies: 8 MiB of protobuf-equivalent."""
        return 8 << 20


def add_parser(sub: Any, common: Any) -> None:
    """Register ``deploy`` on the CLI's subparsers (`common` adds --model, --host, --port-file, --dtype, ...)."""
    d = sub.add_parser("deploy", help="serve a trained checkpoint through OpenAI-compatible endpoints "
                                      "(generator replicas only, no trainer)")
    d.add_argument("checkpoint", help="together-train://<session>/weights/<name> (with --storage), a downloaded "
                                      "adapter directory, or a merged model directory")
    common(d)
    d.set_defaults(model=None)  # --model: the adapter's base (default: its base_model_name_or_path)
    d.add_argument("--port", type=int, default=8000, help="HTTP port of the OpenAI API (0 = any free port)")
    d.add_argument("--http-port", type=int, default=None, help="same as --port (the name serve uses)")
    d.add_argument("--storage", type=Path, default=None, help="storage directory of a together-train:// checkpoint")
    d.add_argument("--served-model-name", default=None, help="the name clients pass as model (default: CHECKPOINT)")
    d.add_argument("--adapter-only", action="store_true", help="do not also serve the base model")
    d.add_argument("--generators", type=int, default=1, help="generator replica processes")
    d.add_argument("--generator-threads", type=int, default=0, help="torch threads per replica (0 = cores / replicas)")
    d.add_argument("--api-key-file", type=Path, default=None, help="require one of these API keys (Bearer)")
    d.add_argument("--startup-timeout", type=float, default=600.0)
    d.add_argument("--parent-pid", type=int, default=0, help=argparse.SUPPRESS)
    d.set_defaults(func=cmd_deploy)


def cmd_deploy(args: argparse.Namespace) -> int:
    """Start the replicas, push the adapter, serve the OpenAI routes until SIGTERM/SIGINT."""
    from together_train_server.process_lifecycle import wait_for_stop, watch_parent
    from together_train_server.run_dirs import make_run_dir, remove_run_dir
    from together_train_server.replica_processes import ReplicaProcesses
    from together_train_server.service.replicas.pool import ReplicaPool
    from together_train_server.wire.auth import read_api_keys
    from together_train_server.wire.http.app import HttpServer, create_app
    from together_train_server.wire.replica_auth import new_secret

    if args.generators < 1:
        raise ValueError("deploy needs at least one generator replica (--generators >= 1)")
    stop = threading.Event()
    if args.parent_pid:
        threading.Thread(target=watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    target = resolve(args.checkpoint, storage=args.storage, model=args.model)
    served = args.served_model_name or args.checkpoint
    threads = args.generator_threads or max(1, (os.cpu_count() or 1) // args.generators)
    run_dir = make_run_dir("together-deploy-")  # removed on stop (stale ones of a kill -9 at start)
    replicas = ReplicaProcesses(args.generators, target.base_dir, run_dir,
                                threads=threads, dtype=args.dtype, engine=args.engine, device=args.device,
                                secret=new_secret())
    try:
        pool = ReplicaPool(replicas.connect_all(args.startup_timeout))
        replicas.supervise(pool, startup_timeout=args.startup_timeout)
        deployment = Deployment(target, served, pool, adapter_only=args.adapter_only,
                                chat_template=getattr(args, "chat_template", None))
        keys = read_api_keys(args.api_key_file) if args.api_key_file else None
        app = create_app(deployment, keys, modules=("together_train_server.wire.http.openai",
                                                             "together_train_server.wire.http.anthropic"))
        tls = (args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None
        http = HttpServer(app, args.host, args.http_port if args.http_port is not None else args.port,
                          **({"tls": tls} if tls else {}))
        port = http.start()
        if args.port_file is not None:
            tmp = Path(f"{args.port_file}.tmp")
            tmp.write_text(str(port))
            tmp.rename(args.port_file)
        print(f"together-train deploy: serving {served!r} (base {target.base_dir}) with {args.generators} replica(s); "
              f"OpenAI API at {getattr(http, 'scheme', 'http')}://{args.host}:{port}/v1", flush=True)
        wait_for_stop(stop)
        http.stop()
        pool.close()
    finally:
        replicas.stop()
        remove_run_dir(run_dir)
    return 0
