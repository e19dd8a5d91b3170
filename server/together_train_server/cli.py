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
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

# Must be set before torch (and its OpenMP runtime) is imported in this process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from together_train.cache import default_storage_dir
from together_train_server.backends import capability_refusal, GENERATORS, TRAINERS, TrainerStart
from together_train_server.config import (ClusterConfig, GeneratorConfig, LogConfig, ProcessConfig, ServeConfig, add_flags,
                                          from_namespace)
from together_train_server.engines.allocator import reexec_with_tcmalloc
from together_train_server.process_lifecycle import wait_for_stop, watch_parent
from together_train_server.run_dirs import make_run_dir, remove_run_dir
from together_train_server.service.sessions.pager import paging_summary

log = logging.getLogger("together_train_server")


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


def cmd_cluster(args: argparse.Namespace) -> int:
    """``cluster``: the Ray control plane (needs the ``cluster`` extra); ``cluster status``: its resources."""
    cfg = from_namespace(ClusterConfig, args)
    try:
        from together_train_server.cluster.main import print_status, run_cluster
    except ImportError as e:
        raise SystemExit(f"together-train cluster needs Ray: pip install 'together-train[cluster]' ({e})") from None
    if args.action == "status":
        return print_status(cfg.address)
    return run_cluster(cfg)


def cmd_prepare_model(args: argparse.Namespace) -> int:
    from together_train_server.engines.model_loading import resolve_model_dir

    print(resolve_model_dir(None if args.model in (None, "embedded") else args.model))
    return 0


def vllm_engine_options(args: argparse.Namespace) -> dict:
    """``VllmGeneratorEngine`` keyword arguments from parsed ``--vllm-*`` flags (`ProcessConfig.vllm_options`)."""
    return from_namespace(ProcessConfig, args).vllm_options()


def vllm_flag_args(args: argparse.Namespace) -> list[str]:
    """The ``--vllm-*`` flags of ``serve`` as ``generator`` arguments (`ProcessConfig.vllm_flag_args`)."""
    return from_namespace(ProcessConfig, args).vllm_flag_args()


def cmd_generator(args: argparse.Namespace) -> int:
    from together_train_server.engines.model_loading import configure_cpu_threads, resolve_model_dir
    from together_train_server.service.replica_host.host import ReplicaHost
    from together_train_server.wire.generator_servicer import ReplicaServicer
    from together_train_server.wire.replica_auth import read_secret_file
    from together_train_server.wire.server import bind, build_generator_server
    from together_train_server.wire.tls import is_loopback, server_credentials

    cfg = from_namespace(GeneratorConfig, args)
    # Credentials first: a bad file fails in a second, not after the model loaded.
    secret = read_secret_file(cfg.replica_secret_file)
    credentials = server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
    if credentials is None and not is_loopback(cfg.host):
        log.warning("generator replica binds %s in plaintext: its secret, prompts and adapters cross the network "
                    "readable; give --tls-cert/--tls-key (and the resource --generator-tls-ca)", cfg.host)
    if cfg.threads:
        configure_cpu_threads(cfg.threads)
    model_dir = resolve_model_dir(None if cfg.model in (None, "embedded") else cfg.model)
    engine = GENERATORS[cfg.engine](str(model_dir), cfg)
    host = ReplicaHost(engine, replica_id=cfg.replica_id, max_adapters=cfg.max_adapters)
    servicer = ReplicaServicer(host, engine_name=cfg.engine)
    server = build_generator_server(servicer, secret)
    port = bind(server, cfg.host, cfg.port, cfg.port_file, credentials)
    server.start()
    log.info("generator replica %s serving %s on %s:%d", cfg.replica_id, model_dir, cfg.host, port)
    stop = threading.Event()
    if cfg.parent_pid:
        threading.Thread(target=watch_parent, args=(cfg.parent_pid, stop), daemon=True).start()
    wait_for_stop(stop)
    server.stop(grace=2).wait()
    return 0


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


def _start_process(cfg: ServeConfig) -> threading.Event:
    """Thread budget and allocator settings of the serve process; the event is set to stop."""
    from together_train_server.engines.memory import set_mmap_threshold
    from together_train_server.engines.model_loading import configure_cpu_threads

    configure_cpu_threads(cfg.trainer_threads or os.cpu_count() or 1)
    set_mmap_threshold()   # long sequences: freed activations go back to the OS (engines/memory.py)
    stop = threading.Event()
    if cfg.parent_pid:  # launch_local: do not outlive a launcher killed without cleanup
        threading.Thread(target=watch_parent, args=(cfg.parent_pid, stop), daemon=True).start()
    return stop


def cmd_serve(args: argparse.Namespace) -> int:
    from together_train_server.engines.model_loading import resolve_model_dir

    cfg = from_namespace(ServeConfig, args)
    stop = _start_process(cfg)
    backend = TRAINERS[cfg.trainer]
    backend.check(cfg)
    # What the engine declares it can do, read from its class: refused on every rank before any model loads.
    refusal = capability_refusal(cfg, backend.engine_class())
    if refusal is not None:
        raise SystemExit(refusal)
    credentials = _serve_credentials(cfg)
    model_dir = resolve_model_dir(None if cfg.model in (None, "embedded") else cfg.model)
    started = backend.start(str(model_dir), cfg)
    if started is None:  # a follower rank: it has served its part
        return 0
    return _serve(cfg, started, model_dir, stop, credentials)


def _serve(cfg: ServeConfig, started: TrainerStart, model_dir: Path, stop: threading.Event,
           credentials: tuple) -> int:
    """Rank 0: spawn the replicas, build the resource, serve until stopped, drain (see `_drain`)."""
    from together_train_server.replica_processes import ReplicaProcesses

    secret, tls, replica_tls = credentials
    guard = started.guard
    starting = _bind_http_early(cfg)  # rank 0 only: followers serve nothing
    tmp = make_run_dir()  # replica secret and port files; removed on stop (stale ones of a kill -9 at start)
    # Replicas load their model while the trainer loads its own.
    threads = cfg.generator_threads or max(1, (os.cpu_count() or 1) // max(1, cfg.generators))
    replicas = ReplicaProcesses(
        cfg.generators, model_dir, tmp,
        threads=threads, dtype=cfg.generator_dtype or cfg.dtype, engine=cfg.engine, device=cfg.device,
        secret=secret, generator_args=cfg.vllm_flag_args() + ["--prefix-cache-mb", repr(float(cfg.prefix_cache_mb)),
                                                "--allocator", cfg.allocator],
    )  # fmt: skip
    t_stop = replica_stop = None  # set once a stop signal arrived (the drain)
    try:
        engine = _wrapped_engine(cfg, started)
        pool = _replica_pool(cfg, replicas, secret, replica_tls)
        resource = build_resource(cfg, engine, pool)
        server, port, http = _start_apis(cfg, resource, tls, starting)
        starting = None
        print(f"together-train resource serving {engine.model_id} on {cfg.host}:{port} "
              f"({len(pool)} generator replica(s), storage {resource.store.root}; {paging_summary(resource.pager)})",
              flush=True)
        if guard is not None:
            threading.Thread(target=_watch_ranks, args=(guard, server.health), name="rank-watch",
                             daemon=True).start()
        wait_for_stop(stop)
        t_stop = time.monotonic()
        replica_stop = _drain(cfg, guard, http, server, replicas, resource, t_stop)
    finally:
        if starting is not None:  # startup failed before the HTTP app took the port
            starting.close()
        if replica_stop is not None:
            replica_stop.join()
        else:
            replicas.stop()
        remove_run_dir(tmp)
        if started.close is not None and (guard is None or guard.failure() is None):
            started.close()  # releases the follower ranks (no broadcast to dead ones)
    return _exit(guard, t_stop)


def _wrapped_engine(cfg: ServeConfig, started: TrainerStart):
    """The trainer engine with its hooks (rank guard innermost, test faults, memory trims) and chat template."""
    from together_train_server.engines.fault_injection import install_from_env
    from together_train_server.engines.memory import install_trim_from_env
    from together_train_server.service.sampling import chat_templates

    engine = started.engine
    if started.guard is not None:  # hooks run around the engine's calls (engines/wrapped.py), the guard innermost
        from together_train_server.engines.wrapped import wrap

        engine = wrap(engine, started.guard)
    engine = install_from_env(engine)  # tests only: TOGETHER_TRAIN_TEST_FAULTS (unset = nothing)
    engine = install_trim_from_env(engine)  # TOGETHER_TRAIN_TRIM_AFTER=optim_step,... (unset = nothing)
    try:  # the template chats are rendered with: --chat-template, or the embedded model's with tools
        chat_templates.install(engine.tokenizer, cfg.chat_template)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return engine


def _replica_pool(cfg: ServeConfig, replicas, secret: str, replica_tls):
    """The `ReplicaPool` of the spawned replicas (supervised) and the attached ones (``--generator-address``)."""
    from together_train_server.service.replicas.pool import ReplicaPool, deadlines_from_args
    from together_train_server.wire.replica_client import GrpcReplicaClient

    clients = replicas.connect_all(cfg.startup_timeout)
    for address in cfg.generator_address:
        clients.append(_attach_replica(GrpcReplicaClient(address, address, secret=secret, credentials=replica_tls),
                                       cfg.startup_timeout))
    pool = ReplicaPool(clients, deadlines=deadlines_from_args(cfg))
    replicas.supervise(pool, startup_timeout=cfg.startup_timeout)
    return pool


def build_resource(cfg: ServeConfig, engine, pool):
    """The composition root: the `Resource` over `engine` and `pool`, wired from the serve config."""
    from together_train_server.service.resource import Resource
    from together_train_server.service.sampling.rollouts import RolloutStore
    from together_train_server.service.validation import Limits
    from together_train_server.wire.auth import read_api_keys

    return Resource(
        engine,
        pool,
        cfg.storage or default_storage_dir(),
        # These also size gRPC's receive limit (Resource.max_request_bytes).
        limits=Limits(vocab_size=engine.vocab_size, max_seq_len=engine.max_seq_len,
                      max_tokens_per_batch=cfg.max_tokens_per_batch,
                      max_samples_per_batch=cfg.max_samples_per_batch),
        max_sessions=cfg.max_sessions,
        idle_timeout_s=cfg.idle_timeout,
        generator_engine=cfg.engine,
        memory_budget_bytes=_memory_budget(cfg),
        rollouts=RolloutStore(cfg.max_rollouts, cfg.max_rollout_mb << 20, cfg.rollout_ttl),
        client_heartbeat_timeout_s=cfg.client_heartbeat_timeout_s,
        batching=cfg.batching == "on",
        batch_window_ms=cfg.batch_window_ms,
        admin_keys=frozenset(read_api_keys(cfg.admin_key_file)) if cfg.admin_key_file else frozenset(),
        checkpoint_sweep_s=cfg.checkpoint_sweep_s,
        tenancy=cfg.tenancy(),
        paging=cfg.paging(),
    )


def _start_apis(cfg: ServeConfig, resource, tls, starting):
    """Start the gRPC server and (``--http-port``) the HTTP app; returns (gRPC server, its port, HTTP server
    or None)."""
    from together_train_server.wire.auth import read_api_keys
    from together_train_server.wire.server import bind, build_resource_server

    keys = read_api_keys(cfg.api_key_file) if cfg.api_key_file else None
    server = build_resource_server(resource, keys)
    port = bind(server, cfg.host, cfg.port, cfg.port_file, tls)
    server.start()
    http = None
    if cfg.http_port is not None:  # the Tinker-compatible HTTP API, over the same Resource
        from together_train_server.wire.http.app import start_http

        http = start_http(resource, keys, cfg.host, cfg.http_port, cfg.http_port_file,
                          tls=(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca) if cfg.tls_cert else None,
                          sock=starting.hand_over() if starting is not None else None)
    return server, port, http


def _drain(cfg: ServeConfig, guard, http, server, replicas, resource, t_stop: float) -> threading.Thread:
    """Stop in order: HTTP, gRPC, then the replicas (a thread, returned) while the trainer queue drains."""
    log.info("stopping: draining (HTTP, gRPC, the trainer queue, replicas; within 10 s)")
    if guard is not None and guard.failure() is not None:
        _drain_after_rank_failure(guard, cfg.failure_drain_s)
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
    return replica_stop


def _exit(guard, t_stop: float | None) -> int:
    """serve's exit status (1 after a rank failure); after a stop signal the process exits at once."""
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="together-train", description="Self-hostable LLM post-training service.")
    add_flags(parser, LogConfig)  # --log-level, --log-format
    # The `deepspeed` launcher passes --local_rank=N before the subcommand; LOCAL_RANK (env) is what we read.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    def logs(p: argparse.ArgumentParser) -> None:
        # Also accepted after the subcommand (launch_local's extra_args); not given here, the top-level value holds.
        add_flags(p, LogConfig, defaults=False)

    def common(p: argparse.ArgumentParser) -> None:  # the flags serve, generator and deploy share
        logs(p)
        add_flags(p, ProcessConfig)

    s = sub.add_parser("serve", help="start a model resource (trainer) and its generator replicas")
    logs(s)
    add_flags(s, ServeConfig)  # one flag per ServeConfig field (config.py), tenancy and paging included
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generator", help="start one generator replica")
    logs(g)
    add_flags(g, GeneratorConfig)
    g.set_defaults(func=cmd_generator)

    st = sub.add_parser("status", help="print a resource's summary: model, sessions, replicas (--json: as JSON)")
    st.add_argument("--address", default=os.environ.get("TOGETHER_TRAIN_ADDRESS", "127.0.0.1:7470"),
                    help="the resource's host:port (default $TOGETHER_TRAIN_ADDRESS or 127.0.0.1:7470)")
    st.add_argument("--api-key-file", type=Path, default=None,
                    help="file whose first line is your API key (default $TOGETHER_TRAIN_API_KEY)")
    st.add_argument("--tls", action="store_true", help="the resource serves TLS")
    st.add_argument("--json", action="store_true", help="print JSON instead of tables")
    st.set_defaults(func=cmd_status)

    c = sub.add_parser("cluster", help="model resources on a Ray cluster, routed from one port (docs/cluster.md); "
                                       "`cluster status`: each resource, its actors and their nodes")
    c.add_argument("action", nargs="?", choices=["run", "status"], default="run",
                   help="run (default): the control plane; status: print the resources of --address")
    logs(c)
    add_flags(c, ClusterConfig)
    c.set_defaults(func=cmd_cluster)

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
        if getattr(args, "allocator", None):   # serve, generator: before any model is loaded (may re-exec)
            log.info("allocator: %s", reexec_with_tcmalloc(args.allocator))
        return args.func(args)
    except (ValueError, FileNotFoundError, NotADirectoryError) as err:
        if args.log_level.upper() == "DEBUG":
            raise
        print(f"together-train {args.command}: error: {err} (--log-level debug shows the traceback)",
              file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
