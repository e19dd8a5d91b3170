"""`together-train` command line: `serve` (resource + replicas) and `generator` (one replica).

    together-train serve [--model DIR|embedded] [--generators N] [--port P] [--storage DIR] [--api-key-file F]
    torchrun --nproc-per-node K -m together_train_server.cli serve --trainer deepspeed --zero-stage 1|2|3 [--mode lora|full] ...
    together-train generator --model DIR --replica-secret-file F [--port P] [--tls-cert C --tls-key K]
    together-train prepare-model [--model embedded]     # convert the embedded model once, print its path

Processes sharing a CPU machine get a thread budget each (docs/design.md §9): torch
threads via --trainer-threads / --generator-threads and OMP_WAIT_POLICY=PASSIVE,
so an idle process's OpenMP threads sleep instead of spinning on the cores
another process is using.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path

from together_train_server.engines.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_PREFIX_CACHE_MB

# Must be set before torch (and its OpenMP runtime) is imported in this process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from together_train_server.process_lifecycle import wait_for_stop, watch_parent
from together_train_server.run_dirs import make_run_dir, remove_run_dir
from together_train_server.service.tenancy.config import add_flags as add_tenancy_flags
from together_train_server.service.tenancy.config import from_args as tenancy_from_args
from together_train_server.service.sessions.pager import add_paging_flags, paging_from_args, paging_summary

log = logging.getLogger("together_train_server")


def _default_storage() -> Path:
    base = os.environ.get("TOGETHER_TRAIN_CACHE") or os.path.join(Path.home(), ".cache", "together-train")
    return Path(base) / "storage"


def _watch_ranks(guard, health) -> None:
    """Rank 0: once a rank is known dead, log it and mark the server NOT_SERVING (gRPC health).

    The trainer and session services cannot work any more; routed sampling
    (GeneratorService) still can, so it stays SERVING. Runs until then (also
    through a stop's drain window).
    """
    from grpc_health.v1 import health_pb2

    from together_train._proto import resource_pb2, session_pb2

    names = ["", resource_pb2.DESCRIPTOR.services_by_name["ResourceService"].full_name,
             session_pb2.DESCRIPTOR.services_by_name["SessionService"].full_name]
    while True:
        why = guard.failure()
        if why is not None:
            log.error("DeepSpeed trainer: %s; restart every rank and resume from the last checkpoints", why)
            for name in names:
                health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            return
        time.sleep(0.5)


def _drain_after_rank_failure(guard, seconds: float) -> None:
    """Keep answering (UNAVAILABLE, naming the dead rank) for ``seconds`` after a stop caused by a rank death.

    torchrun (and the deepspeed launcher) stop every worker as soon as one
    dies: rank 0 gets SIGTERM at once and SIGKILL 30 s later. Serving a little
    longer lets clients read why instead of a refused connection. A second
    SIGTERM/SIGINT ends the drain at once.
    """
    log.error("rank 0: %s; answering UNAVAILABLE for %.0f s, then exiting", guard.failure(), seconds)
    again = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: again.set())
    again.wait(max(0.0, seconds))


def configure_logging(level: str = "INFO", fmt: str = "text") -> None:
    """Logging of a together-train process (``--log-level``, ``--log-format``).

    `level` applies to together-train's own loggers (``together_train_server.*``);
    other libraries log WARNING and above, everything at DEBUG when `level` is DEBUG.
    ``fmt="json"``: one JSON object per line (python-json-logger) with ``time``,
    ``level``, ``logger``, ``message`` and each event's fields (``event``,
    ``session``, ``kind``, ``status``, ...); ``"text"``: ``time logger LEVEL message``.

    Raises:
        ValueError: unknown level or format (naming the flag).
    """
    name = str(level).upper()
    if not isinstance(logging.getLevelName(name), int):
        raise ValueError(f"--log-level {level!r}: expected debug, info, warning, error or critical")
    if fmt not in ("text", "json"):
        raise ValueError(f"--log-format {fmt!r}: expected text or json")
    handler = logging.StreamHandler()
    if fmt == "json":
        from pythonjsonlogger.json import JsonFormatter

        handler.setFormatter(JsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        ))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if name == "DEBUG" else max(logging.WARNING, logging.getLevelName(name)))
    logging.getLogger("together_train_server").setLevel(name)


def cmd_status(args: argparse.Namespace) -> int:
    from together_train.status import main_status

    key = None
    if args.api_key_file is not None:
        lines = [x.strip() for x in Path(args.api_key_file).read_text().splitlines() if x.strip()]
        key = lines[0] if lines else None
    return main_status(args.address, api_key=key, as_json=args.json, tls=args.tls)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from together_train_server.engines.model_loading import resolve_model_dir

    print(resolve_model_dir(None if args.model in (None, "embedded") else args.model))
    return 0


DEFAULT_MAX_ADAPTERS = 32   # rank 16 on SmolLM2-135M in bf16: ~10 MB each


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """The ``--engine vllm`` settings and ``--max-adapters`` (serve passes them on to the replicas it spawns)."""
    p.add_argument("--max-adapters", type=int, default=DEFAULT_MAX_ADAPTERS,
                   help="adapters a generator replica keeps loaded; past it the least recently used is dropped and "
                        "loaded again from the resource's latest push when a request needs it (0 = no limit; "
                        f"default {DEFAULT_MAX_ADAPTERS})")
    p.add_argument("--vllm-enforce-eager", action="store_true",
                   help="--engine vllm: no CUDA graphs (faster start, slower decode); default: CUDA graphs on a "
                        "GPU, eager on CPU")
    p.add_argument("--vllm-max-loras", type=int, default=4,
                   help="--engine vllm: LoRA adapters usable in one batch (default 4)")
    p.add_argument("--vllm-gpu-memory-utilization", type=float, default=0.85,
                   help="--engine vllm: fraction of GPU memory vLLM may take (weights + KV cache; default 0.85)")


def vllm_engine_options(args: argparse.Namespace) -> dict:
    """``VllmGeneratorEngine`` keyword arguments from the ``--vllm-*`` flags (enforce_eager None = by device)."""
    return {"enforce_eager": True if args.vllm_enforce_eager else None, "max_loras": args.vllm_max_loras,
            "gpu_memory_utilization": args.vllm_gpu_memory_utilization}


def vllm_flag_args(args: argparse.Namespace) -> list[str]:
    """The ``--vllm-*`` flags of ``serve`` as ``generator`` command-line arguments (for spawned replicas)."""
    out = ["--max-adapters", str(args.max_adapters), "--vllm-max-loras", str(args.vllm_max_loras),
           "--vllm-gpu-memory-utilization", repr(float(args.vllm_gpu_memory_utilization))]
    return out + (["--vllm-enforce-eager"] if args.vllm_enforce_eager else [])


def cmd_generator(args: argparse.Namespace) -> int:
    from together_train_server.engines.model_loading import configure_cpu_threads, resolve_model_dir
    from together_train_server.wire.generator_servicer import ReplicaServicer
    from together_train_server.wire.replica_auth import read_secret_file
    from together_train_server.wire.server import bind, build_generator_server
    from together_train_server.wire.tls import is_loopback, server_credentials

    # Credentials first: a bad file fails in a second, not after the model loaded.
    secret = read_secret_file(args.replica_secret_file)
    credentials = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    if credentials is None and not is_loopback(args.host):
        log.warning("generator replica binds %s in plaintext: its secret, prompts and adapters cross the network "
                    "readable; give --tls-cert/--tls-key (and the resource --generator-tls-ca)", args.host)
    if args.threads:
        configure_cpu_threads(args.threads)
    model_dir = resolve_model_dir(None if args.model in (None, "embedded") else args.model)
    if args.engine == "vllm":
        # Imported here: vllm is an optional extra, nothing else needs it.
        from together_train_server.engines.vllm_generator import VllmGeneratorEngine, vllm_available

        if not vllm_available():
            raise SystemExit("--engine vllm needs vllm: pip install 'together-train[vllm]' (GPU) "
                             "or bash scripts/setup_vllm.sh (CPU test build); or use --engine torch")
        engine = VllmGeneratorEngine(model_dir, dtype=args.dtype, device=args.device, **vllm_engine_options(args),
                                     **({} if args.prefix_cache_mb > 0 else {"enable_prefix_caching": False}))
    else:
        from together_train_server.engines.torch_generator import TorchGeneratorEngine

        engine = TorchGeneratorEngine(model_dir, dtype=args.dtype, device=args.device,
                                      prefix_cache_mb=args.prefix_cache_mb)
    servicer = ReplicaServicer(engine, replica_id=args.replica_id, engine_name=args.engine,
                               max_adapters=args.max_adapters)
    server = build_generator_server(servicer, secret)
    port = bind(server, args.host, args.port, args.port_file, credentials)
    server.start()
    log.info("generator replica %s serving %s on %s:%d", args.replica_id, model_dir, args.host, port)
    stop = threading.Event()
    if args.parent_pid:
        threading.Thread(target=watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    wait_for_stop(stop)
    server.stop(grace=2).wait()
    return 0


def _load_json(path: Path | None) -> dict | None:
    """The JSON object in ``path`` (None when no path); SystemExit naming the file when it is not one."""
    if path is None:
        return None
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise SystemExit(f"--deepspeed-config {path}: {err}") from None
    if not isinstance(obj, dict):
        raise SystemExit(f"--deepspeed-config {path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def _serve_credentials(args: argparse.Namespace):
    """The replica secret, the server's TLS credentials and the TLS towards attached replicas of ``serve``.

    Spawned replicas get a fresh random secret unless ``--replica-secret-file`` is given; attached
    replicas (``--generator-address``) must have been started with that same file. Warns when API keys
    or the replica secret would cross the network in plaintext.
    """
    from together_train_server.wire.replica_auth import new_secret, read_secret_file
    from together_train_server.wire.tls import channel_credentials, is_loopback, server_credentials

    if args.generator_address and args.replica_secret_file is None:
        raise SystemExit("--generator-address needs --replica-secret-file: the secret file the attached replicas "
                         "were started with (together-train generator --replica-secret-file F)")
    secret = read_secret_file(args.replica_secret_file) if args.replica_secret_file else new_secret()
    tls = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
    if tls is None and args.api_key_file is not None and not is_loopback(args.host):
        log.warning("API keys are enabled but %s:%s serves plaintext: keys and data cross the network readable; "
                    "give --tls-cert/--tls-key", args.host, args.port)
    replica_tls = None
    if args.generator_tls_ca is not None:
        replica_tls = channel_credentials(args.generator_tls_ca, args.tls_cert, args.tls_key)
    else:
        for address in args.generator_address:
            if not is_loopback(address.rsplit(":", 1)[0]):
                log.warning("attached replica %s is reached in plaintext: the replica secret, prompts and adapters "
                            "cross the network readable; start it with --tls-cert/--tls-key and give "
                            "--generator-tls-ca", address)
    return secret, tls, replica_tls


def _attach_replica(client, timeout: float):
    """Wait for an attached replica and check that it accepts our secret (one Health call)."""
    import grpc

    try:
        client.wait_ready(timeout)
    except grpc.FutureTimeoutError:
        raise SystemExit(f"--generator-address {client.address}: no replica answered within {timeout:.0f} s "
                         "(a TLS replica needs --generator-tls-ca)") from None
    try:
        client.health(timeout=min(timeout, 30.0))
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:
            raise SystemExit(f"--generator-address {client.address} refused this resource's replica secret: start "
                             "the replica and the resource with the same --replica-secret-file") from None
        raise SystemExit(f"--generator-address {client.address}: Health failed: {err.code().name} "
                         f"{err.details()}") from None
    return client


def _memory_budget(args: argparse.Namespace) -> int:
    """--memory-budget-mb in bytes, or the default from the memory available now (after the model loaded)."""
    from together_train_server.service.training.memory_admission import default_budget_bytes

    if args.memory_budget_mb is None:
        budget = default_budget_bytes()
    else:
        if args.memory_budget_mb < 0:
            raise SystemExit(f"--memory-budget-mb must be >= 0, got {args.memory_budget_mb}")
        budget = int(args.memory_budget_mb * (1 << 20))
    log.info("memory admission: per-operation budget %s", f"{budget >> 20} MB" if budget else "off")
    return budget


def _bind_http_early(args: argparse.Namespace):
    """The HTTP port bound before the model loads, answering 503 "starting" (wire/http/starting.py), or None
    (no --http-port, or TLS: the port is then bound when the app starts).

    Raises:
        SystemExit: the port cannot be bound (in use), naming it.
    """
    if args.http_port is None or args.tls_cert:
        return None
    from together_train_server.wire.http.starting import StartingListener

    try:
        return StartingListener(args.host, args.http_port)
    except OSError as e:
        raise SystemExit(f"--http-port {args.http_port}: cannot bind {args.host}:{args.http_port}: {e.strerror or e}") from None


def cmd_serve(args: argparse.Namespace) -> int:
    from together_train_server.engines.memory import set_mmap_threshold
    from together_train_server.engines.model_loading import configure_cpu_threads, resolve_model_dir

    configure_cpu_threads(args.trainer_threads or os.cpu_count() or 1)
    set_mmap_threshold()   # long sequences: freed activations go back to the OS (engines/memory.py)
    stop = threading.Event()
    if getattr(args, "parent_pid", 0):  # launch_local: do not outlive a launcher killed without cleanup
        threading.Thread(target=watch_parent, args=(args.parent_pid, stop), daemon=True).start()
    if args.mode == "full" and args.trainer != "deepspeed":
        raise SystemExit("--mode full needs --trainer deepspeed (the torch trainer trains LoRA adapters only)")
    if args.trainer != "deepspeed":
        for flag, value in (("--zero-stage", args.zero_stage), ("--deepspeed-config", args.deepspeed_config)):
            if value is not None:
                raise SystemExit(f"{flag} applies to --trainer deepspeed only (this is --trainer {args.trainer})")
    secret, tls, replica_tls = _serve_credentials(args)
    model_dir = resolve_model_dir(None if args.model in (None, "embedded") else args.model)
    ds_engine = guard = None
    t_stop = replica_stop = None  # set once a stop signal arrived (the drain, see below)
    if args.trainer == "deepspeed":
        # Every rank builds the engine; ranks 1..k-1 follow rank 0 and serve nothing.
        from together_train_server.engines.deepspeed import DeepSpeedTrainerEngine, deepspeed_available

        if not deepspeed_available():
            raise SystemExit("--trainer deepspeed needs deepspeed: pip install 'together-train[deepspeed]'")
        ds_engine = DeepSpeedTrainerEngine(
            model_dir, zero_stage=args.zero_stage or 2, mode=args.mode, dtype=args.dtype, device=args.device,
            micro_batch_tokens=args.micro_batch_tokens, deepspeed_config=_load_json(args.deepspeed_config),
            activation_checkpointing=args.activation_checkpointing,
        )  # fmt: skip
        from together_train_server.service.training.rank_guard import RankGuard, exchange_peers

        peers = exchange_peers() if ds_engine.world_size > 1 else []
        if ds_engine.rank != 0:
            # Launchers signal every rank at once on a stop; a follower killed by that would look like a
            # crash to rank 0. Followers end when rank 0 releases them (its close) or is gone.
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, signal.SIG_IGN)
            ds_engine.follow()
            return 0
        # Rank 0: a dead follower fails every later operation at once, naming it.
        guard = RankGuard(ds_engine, peers) if peers else None
    starting = _bind_http_early(args)  # rank 0 only: followers serve nothing
    tmp = make_run_dir()  # replica secret and port files; removed on stop (stale ones of a kill -9 at start)
    from together_train_server.replica_processes import ReplicaProcesses

    # Replicas load their model while the trainer loads its own.
    threads = args.generator_threads or max(1, (os.cpu_count() or 1) // max(1, args.generators))
    replicas = ReplicaProcesses(
        args.generators, model_dir, tmp,
        threads=threads, dtype=args.generator_dtype or args.dtype, engine=args.engine, device=args.device,
        secret=secret, generator_args=vllm_flag_args(args) + ["--prefix-cache-mb", repr(float(args.prefix_cache_mb))],
    )  # fmt: skip
    try:
        from together_train_server.engines.torch_trainer import TorchTrainerEngine
        from together_train_server.service.replicas.pool import ReplicaPool, deadlines_from_args
        from together_train_server.service.resource import Resource
        from together_train_server.wire.auth import read_api_keys
        from together_train_server.wire.replica_client import GrpcReplicaClient
        from together_train_server.wire.server import bind, build_resource_server

        engine = ds_engine or TorchTrainerEngine(
            model_dir, dtype=args.dtype, device=args.device, micro_batch_tokens=args.micro_batch_tokens,
            activation_checkpointing=args.activation_checkpointing,
        )
        if guard is not None:  # hooks run around the engine's calls (engines/wrapped.py), the guard innermost
            from together_train_server.engines.wrapped import wrap

            engine = wrap(engine, guard)
        from together_train_server.engines.fault_injection import install_from_env

        engine = install_from_env(engine)  # tests only: TOGETHER_TRAIN_TEST_FAULTS (unset = nothing)
        from together_train_server.engines.memory import install_trim_from_env

        engine = install_trim_from_env(engine)  # TOGETHER_TRAIN_TRIM_AFTER=optim_step,... (unset = nothing)
        from together_train_server.service.sampling import chat_templates

        try:  # the template chats are rendered with: --chat-template, or the embedded model's with tools
            chat_templates.install(engine.tokenizer, args.chat_template)
        except ValueError as e:
            raise SystemExit(str(e)) from None
        clients = replicas.connect_all(args.startup_timeout)
        for address in args.generator_address:
            clients.append(_attach_replica(GrpcReplicaClient(address, address, secret=secret, credentials=replica_tls),
                                           args.startup_timeout))
        pool = ReplicaPool(clients, deadlines=deadlines_from_args(args))
        replicas.supervise(pool, startup_timeout=args.startup_timeout)
        from together_train_server.service.sampling.rollouts import RolloutStore
        from together_train_server.service.validation import Limits

        resource = Resource(
            engine,
            pool,
            args.storage or _default_storage(),
            # These also size gRPC's receive limit (Resource.max_request_bytes).
            limits=Limits(vocab_size=engine.vocab_size, max_seq_len=engine.max_seq_len,
                          max_tokens_per_batch=args.max_tokens_per_batch,
                          max_samples_per_batch=args.max_samples_per_batch),
            max_sessions=args.max_sessions,
            idle_timeout_s=args.idle_timeout,
            generator_engine=args.engine,
            memory_budget_bytes=_memory_budget(args),
            rollouts=RolloutStore(args.max_rollouts, args.max_rollout_mb << 20, args.rollout_ttl),
            client_heartbeat_timeout_s=args.client_heartbeat_timeout_s,
            batching=args.batching == "on",
            batch_window_ms=args.batch_window_ms,
            admin_keys=frozenset(read_api_keys(args.admin_key_file)) if args.admin_key_file else frozenset(),
            checkpoint_sweep_s=args.checkpoint_sweep_s,
            tenancy=tenancy_from_args(args),
            paging=paging_from_args(args),
        )
        keys = read_api_keys(args.api_key_file) if args.api_key_file else None
        server = build_resource_server(resource, keys)
        port = bind(server, args.host, args.port, args.port_file, tls)
        server.start()
        http = None
        if args.http_port is not None:  # the Tinker-compatible HTTP API, over the same Resource
            from together_train_server.wire.http.app import start_http

            http = start_http(resource, keys, args.host, args.http_port, args.http_port_file,
                              tls=(args.tls_cert, args.tls_key, args.tls_client_ca) if args.tls_cert else None,
                              sock=starting.hand_over() if starting is not None else None)
            starting = None
        print(
            f"together-train resource serving {engine.model_id} on {args.host}:{port} "
            f"({len(clients)} generator replica(s), storage {resource.store.root}; {paging_summary(resource.pager)})",
            flush=True,
        )
        if guard is not None:
            threading.Thread(target=_watch_ranks, args=(guard, server.health), name="rank-watch",
                             daemon=True).start()
        wait_for_stop(stop)
        t_stop = time.monotonic()
        log.info("stopping: draining (HTTP, gRPC, the trainer queue, replicas; within 10 s)")
        if guard is not None and guard.failure() is not None:
            _drain_after_rank_failure(guard, args.failure_drain_s)
        if http is not None:
            http.stop()
        log.info("stopping: HTTP closed after %.1f s", time.monotonic() - t_stop)
        server.stop(grace=1).wait()
        log.info("stopping: gRPC closed after %.1f s", time.monotonic() - t_stop)
        # Nothing routes to the replicas any more: they stop while the trainer queue drains.
        replica_stop = threading.Thread(target=replicas.stop, name="replica-stop")
        replica_stop.start()
        resource.close()
        log.info("stopping: trainer queue drained after %.1f s", time.monotonic() - t_stop)
    finally:
        if starting is not None:  # startup failed before the HTTP app took the port
            starting.close()
        if replica_stop is not None:
            replica_stop.join()
        else:
            replicas.stop()
        remove_run_dir(tmp)
        if ds_engine is not None and (guard is None or guard.failure() is None):
            ds_engine.close()  # releases the follower ranks (no broadcast to dead ones)
    rc = 1 if guard is not None and guard.failure() is not None else 0
    if t_stop is not None:
        log.info("stopped %.1f s after the stop signal", time.monotonic() - t_stop)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        # Threads still parked in library pools (gRPC handlers, HTTP long-polls) hold nothing to save
        # (checkpoints are renamed into place when complete): exit now rather than wait for them.
        os._exit(rc)
    return rc


def _megabytes(text: str) -> float:
    """A size flag in MiB: a finite number >= 0, refused while parsing (before any model loads).

    Raises:
        argparse.ArgumentTypeError: not a number, NaN, infinite or negative (``nan > 0`` is False, so a NaN
            would otherwise silently turn a cache off, and ``int(inf)`` fails after the model loaded).
    """
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of MiB, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of MiB >= 0, got {text!r}")
    return v


def _memory_budget_mb(text: str) -> float:
    """--memory-budget-mb: `_megabytes`, and 0 (no check) or at least the fixed part of every estimate.

    Every operation's estimate includes ``memory_estimate.FIXED_BYTES`` (96 MiB), so a smaller budget
    would refuse every forward, forward_backward and scoring request, even of 2 tokens.

    Raises:
        argparse.ArgumentTypeError: as `_megabytes`, or 0 < value < 96.
    """
    from together_train_server.engines.memory_estimate import FIXED_BYTES

    v = _megabytes(text)
    if 0 < v * (1 << 20) < FIXED_BYTES:
        raise argparse.ArgumentTypeError(
            f"{text!r} MiB is below the {FIXED_BYTES >> 20} MiB every operation is estimated to need at least: "
            "it would refuse every training and scoring request; give 0 (no check) or more")
    return v


def _prefix_cache_mb(text: str) -> float:
    """--prefix-cache-mb: `_megabytes`, and 0 (off) or at least 1 MiB.

    A smaller size rounds to 0 bytes inside the engine (not one 16-token block fits), which the
    replica refused at start, after its model loaded, and the resource then failed to start.

    Raises:
        argparse.ArgumentTypeError: as `_megabytes`, or 0 < value < 1.
    """
    v = _megabytes(text)
    if 0 < v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} MiB holds no prefix block: give 0 (off) or at least 1")
    return v


def _milliseconds(text: str) -> float:
    """--batch-window-ms: a finite number of milliseconds >= 0, refused while parsing.

    Raises:
        argparse.ArgumentTypeError: not a number, NaN, infinite or negative.
    """
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds, got {text!r}") from None
    if not math.isfinite(v) or v < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of milliseconds >= 0, got {text!r}")
    return v


def _positive_int(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="together-train", description="Self-hostable LLM post-training service.")
    parser.add_argument("--log-level", default=os.environ.get("TOGETHER_TRAIN_LOG", "INFO"),
                        help="level of together-train's own logs (one INFO line per operation, session, checkpoint, "
                             "replica and weights event); other libraries log WARNING+ unless debug")
    parser.add_argument("--log-format", default=os.environ.get("TOGETHER_TRAIN_LOG_FORMAT", "text"),
                        choices=["text", "json"], help="text lines, or one JSON object per line for log shippers")
    # The `deepspeed` launcher passes --local_rank=N before the subcommand; LOCAL_RANK (env) is what we read.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    def logs(p: argparse.ArgumentParser) -> None:
        # Also accepted after the subcommand (launch_local's extra_args); SUPPRESS keeps the top-level value
        # when not given here.
        p.add_argument("--log-level", default=argparse.SUPPRESS, help="as before the subcommand")
        p.add_argument("--log-format", default=argparse.SUPPRESS, choices=["text", "json"],
                       help="as before the subcommand")

    def common(p: argparse.ArgumentParser) -> None:
        logs(p)
        p.add_argument("--model", default="embedded", help="local Hugging Face model directory, or 'embedded' (SmolLM2-135M-Instruct)")
        p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
        p.add_argument("--port-file", type=Path, help="write the bound port here once serving")
        p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
                       help="model dtype (float64: for tests that need sampling independent of batching)")
        p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
        p.add_argument("--engine", default="torch", choices=["torch", "vllm"], help="generator engine")
        p.add_argument("--prefix-cache-mb", type=_prefix_cache_mb, default=DEFAULT_PREFIX_CACHE_MB,
                       help="--engine torch: MiB of prompt-prefix keys/values kept across requests per replica "
                            f"(blocks of {DEFAULT_BLOCK_SIZE} tokens, LRU; 0 disables; default "
                            f"{DEFAULT_PREFIX_CACHE_MB}). --engine vllm sizes its own prefix cache; 0 turns it off")
        _add_vllm_flags(p)
        p.add_argument("--chat-template", type=Path, default=None,
                       help="Jinja chat template file replacing the model's own for /v1/chat/completions (default: "
                            "the model's; the embedded model's gets Hermes-style tool rendering)")
        p.add_argument("--tls-cert", type=Path, default=None, help="serve TLS only, with this PEM certificate chain")
        p.add_argument("--tls-key", type=Path, default=None, help="PEM private key of --tls-cert")
        p.add_argument("--tls-client-ca", type=Path, default=None,
                       help="mutual TLS: refuse clients without a certificate signed by this PEM CA bundle")

    s = sub.add_parser("serve", help="start a model resource (trainer) and its generator replicas")
    common(s)
    s.add_argument("--port", type=int, default=7470, help="gRPC port (the SDK); 0 = any free port (default 7470)")
    s.add_argument("--http-port", type=int, default=None,
                   help="also serve the HTTP API on this port: Tinker (/api/v1), Together RL (/v1/rl), OpenAI "
                        "(/v1/models, /v1/chat/completions, ...), /metrics, dashboard (/); 0 = any free port "
                        "(default: off)")
    s.add_argument("--http-port-file", type=Path, default=None, help="write the bound HTTP port here once serving")
    s.add_argument("--mode", default="lora", choices=["lora", "full"],
                   help="lora: sessions are LoRA adapters on a frozen base; full: one session training every "
                        "parameter (needs --trainer deepspeed)")
    s.add_argument("--trainer", default="torch", choices=["torch", "deepspeed"],
                   help="trainer backend: torch (one device) or deepspeed (ZeRO across the ranks of a "
                        "`deepspeed` / `torchrun` launch; rank 0 serves)")
    s.add_argument("--zero-stage", type=int, default=None, choices=[1, 2, 3],
                   help="ZeRO stage of --trainer deepspeed: 1 optimizer state, 2 + gradients, 3 + parameters "
                        "(LoRA: the frozen base) partitioned across ranks (default 2)")
    s.add_argument("--deepspeed-config", type=Path, default=None,
                   help="JSON file merged over --trainer deepspeed's DeepSpeed config, e.g. "
                        '\'{"zero_optimization": {"stage3_max_live_parameters": 0}}\' (batch sizes, clipping, '
                        "optimizer and the stage stay the engine's)")
    s.add_argument("--generators", type=int, default=1, help="generator replica processes to start on this host")
    s.add_argument("--generator-address", action="append", default=[], help="attach a replica started elsewhere (host:port)")
    s.add_argument("--generator-dtype", default=None, help="dtype of the replicas (default: --dtype)")
    s.add_argument("--replica-secret-file", type=Path, default=None,
                   help="secret (mode 0600 file) sent to every replica; needed with --generator-address, whose "
                        "replicas are started with the same file (default: a random secret per start)")
    s.add_argument("--generator-tls-ca", type=Path, default=None,
                   help="attached replicas serve TLS: verify them with this PEM CA bundle (their certificate must "
                        "name the host of --generator-address); --tls-cert/--tls-key are the client certificate "
                        "for replicas started with --tls-client-ca")
    s.add_argument("--storage", type=Path, default=None, help="checkpoint directory (default ~/.cache/together-train/storage)")
    s.add_argument("--api-key-file", type=Path, default=None, help="require one of these API keys (one per line)")
    s.add_argument("--admin-key-file", type=Path, default=None,
                   help="API keys (one per line, also in --api-key-file) that may search and change every key's "
                        "checkpoints")
    s.add_argument("--checkpoint-sweep-s", type=float, default=30.0,
                   help="seconds between sweeps deleting checkpoints whose TTL passed (default 30)")
    s.add_argument("--max-sessions", type=int, default=256,
                   help="sessions that may exist at once, resident or paged out (RESOURCE_EXHAUSTED past it)")
    add_tenancy_flags(s)  # --scheduler and the per-key limits (service/tenancy/config.py)
    s.add_argument(
        "--micro-batch-tokens",
        type=int,
        default=8192,
        help="padded tokens per trainer forward; larger requests are split and their gradients accumulated",
    )
    s.add_argument("--activation-checkpointing", default="auto", choices=["auto", "on", "off"],
                   help="recompute decoder-layer activations in backward instead of keeping them: less memory "
                        "for long sequences, ~1/3 more compute; auto = on for micro-batches of >= 2048 padded "
                        "tokens (docs/operating.md)")
    s.add_argument("--batching", default="on", choices=["on", "off"],
                   help="clock cycle: ready forward/forward_backward operations of different sessions run as one "
                        "pass over the base model, each row with its own adapter (docs/operating.md); off = one "
                        "operation at a time")
    s.add_argument("--batch-window-ms", type=_milliseconds, default=0.0,
                   help="with --batching on, how long a cycle waits for a second ready operation (default 0: "
                        "a cycle starts as soon as the trainer is free)")
    s.add_argument("--memory-budget-mb", type=_memory_budget_mb, default=None,
                   help="most memory (MiB) one training/scoring operation may add to the trainer; a request "
                        "estimated above it is refused with RESOURCE_EXHAUSTED before it runs (default: 80%% of "
                        "the memory available at start; 0 = no check; at least 96 otherwise; docs/operating.md)")
    s.add_argument("--max-tokens-per-batch", type=int, default=65_536,
                   help="most model_input tokens of one forward request (and of one compute_logprobs request); "
                        "also raises gRPC's receive limit, which refuses larger messages before parsing them")
    s.add_argument("--max-samples-per-batch", type=int, default=1024,
                   help="most samples of one forward request (also sizes gRPC's receive limit)")
    s.add_argument("--idle-timeout", type=float, default=0.0,
                   help="seconds without a call after which a session is discarded, after a training checkpoint "
                        "(idle-<step>-<time>) its owner can list and resume from is written (default 0: never; "
                        "idle sessions are paged out instead, --page-out-idle)")
    add_paging_flags(s)  # --session-memory-mb, --page-out-idle (service/sessions/pager.py)
    # Rollouts recorded under the OpenAI endpoint's /v1/rollouts/{id} (service/sampling/rollouts.py).
    s.add_argument("--max-rollouts", type=_positive_int, default=10_000,
                   help="rollouts kept in memory; past it the least recently written one is dropped")
    s.add_argument("--max-rollout-mb", type=_positive_int, default=1024,
                   help="megabytes of recorded rollouts kept (8 bytes per token, logprob and version, plus texts)")
    s.add_argument("--rollout-ttl", type=float, default=86400.0,
                   help="seconds a rollout is kept after its last call")
    s.add_argument("--client-heartbeat-timeout-s", type=float, default=120.0,
                   help="HTTP (Tinker) client sessions: release a client's models (checkpoints kept) after this "
                        "long without a heartbeat (the tinker SDK sends one every 10 s; 0 = never)")
    s.add_argument("--trainer-threads", type=int, default=0, help="torch threads of the trainer (0 = all cores)")
    s.add_argument("--generator-threads", type=int, default=0, help="torch threads per replica (0 = cores / replicas)")
    s.add_argument("--startup-timeout", type=float, default=600.0)
    # Replica deadlines and health probes (service/replicas/pool.py Deadlines; README "Failures").
    s.add_argument("--replica-timeout-s", type=float, default=30.0,
                   help="base deadline of every call to a replica; sample/compute_logprobs add "
                        "--replica-timeout-per-token-s per token, a weights push bytes / --replica-push-mb-s")
    s.add_argument("--replica-timeout-per-token-s", type=float, default=0.1,
                   help="seconds per token (prompt + num_samples * max_tokens) added to a sample's deadline")
    s.add_argument("--replica-push-mb-s", type=float, default=10.0,
                   help="slowest push rate allowed (MB/s): a push of B bytes gets base + B / rate seconds")
    s.add_argument("--replica-sync-s", type=float, default=1.0,
                   help="a weights_sync waits this long (+ bytes / 100 MB/s) for a slow replica once another took "
                        "the version; the slow one serves that session again once it holds it")
    s.add_argument("--replica-probe-period-s", type=float, default=2.0, help="seconds between health probes")
    s.add_argument("--replica-probe-timeout-s", type=float, default=5.0, help="deadline of one health probe")
    s.add_argument("--replica-suspect-s", type=float, default=0.5,
                   help="a replica whose health probe is unanswered this long gets no new requests while another "
                        "answers, and its samples in flight are re-issued on another replica, until a probe answers")
    s.add_argument("--replica-probe-misses", type=int, default=2,
                   help="missed probes in a row that take a replica out of routing (and restart a spawned one)")
    s.add_argument("--replica-wait-s", type=float, default=60.0,
                   help="how long a request waits for a replica to come back when none is routable")
    s.add_argument("--parent-pid", type=int, default=0,  # launch_local passes its own pid
                   help=argparse.SUPPRESS)  # shut down when this process is gone; internal, not in --help
    s.add_argument("--failure-drain-s", type=float, default=20.0,
                   help="--trainer deepspeed: after a rank died and the launcher stops rank 0, keep answering "
                        "UNAVAILABLE (naming the rank) this long before exiting (torchrun kills at 30 s)")
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generator", help="start one generator replica")
    common(g)
    g.add_argument("--port", type=int, default=7471)
    g.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    g.add_argument("--replica-id", default=None)
    g.add_argument("--parent-pid", type=int, default=0, help="exit when this process is gone")
    g.add_argument("--replica-secret-file", type=Path, required=True,
                   help="mode 0600 file holding the secret every call must carry (the resource's "
                        "--replica-secret-file); calls without it get UNAUTHENTICATED")
    g.set_defaults(func=cmd_generator)

    st = sub.add_parser("status", help="print a resource's summary: model, sessions, replicas (--json: as JSON)")
    st.add_argument("--address", default=os.environ.get("TOGETHER_TRAIN_ADDRESS", "127.0.0.1:7470"),
                    help="the resource's host:port (default $TOGETHER_TRAIN_ADDRESS or 127.0.0.1:7470)")
    st.add_argument("--api-key-file", type=Path, default=None,
                    help="file whose first line is your API key (default $TOGETHER_TRAIN_API_KEY)")
    st.add_argument("--tls", action="store_true", help="the resource serves TLS")
    st.add_argument("--json", action="store_true", help="print JSON instead of tables")
    st.set_defaults(func=cmd_status)

    from together_train_server.deploy import add_parser as add_deploy

    add_deploy(sub, common)  # together-train deploy CHECKPOINT: OpenAI-compatible serving without a trainer

    from together_train_server.checkpoints_cli import add_parser as add_checkpoints

    add_checkpoints(sub)  # together-train checkpoints search|update|usage (checkpoints_cli.py)

    p = sub.add_parser("prepare-model", help="convert the embedded model once and print its directory")
    p.add_argument("--model", default="embedded")
    p.set_defaults(func=cmd_prepare_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``together-train``; user errors at startup (a missing model directory, a
    launcher environment not set, a refused option) print one line and exit 2."""
    args = build_parser().parse_args(argv)
    try:
        configure_logging(args.log_level, args.log_format)
        # Spawned generator replicas log at the same level and format (their stderr is ours).
        os.environ["TOGETHER_TRAIN_LOG"], os.environ["TOGETHER_TRAIN_LOG_FORMAT"] = args.log_level, args.log_format
    except ValueError as err:
        print(f"together-train: error: {err}", file=sys.stderr, flush=True)
        return 2
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        if args.log_level.upper() == "DEBUG":
            raise
        print(f"together-train {args.command}: error: {err} (--log-level debug shows the traceback)",
              file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
