"""The typed settings of ``together-train serve`` and ``generator``: each field is one flag.

`ServeConfig` and `GeneratorConfig` share `ProcessConfig` (model, bind address, dtype, device,
generator engine, TLS). Their flags are generated from the fields (`together_train.config_flags`,
as the cookbook's recipes build theirs): the field's metadata ``help`` is the flag's help, its
default the flag's default. Every flag of ``serve`` is a `ServeConfig` field, the scheduler, per-key
limits and paging too: `ServeConfig.tenancy` and `ServeConfig.paging` turn those into the service's
`TenancyConfig` and `PagingConfig`. Numeric flags are checked while parsing by `number`.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from together_train.config_flags import add_flags, from_namespace
from together_train_server.backends import GENERATORS, TRAINERS
from together_train_server.engines.allocator import ALLOCATORS
from together_train_server.engines.prefix_cache import DEFAULT_BLOCK_SIZE, DEFAULT_PREFIX_CACHE_MB
from together_train_server.service.core.scheduler import SCHEDULERS
from together_train_server.service.sessions.pager import PagingConfig
from together_train_server.service.tenancy.config import TenancyConfig

__all__ = ["ClusterConfig", "GeneratorConfig", "LogConfig", "ProcessConfig", "ServeConfig", "add_flags", "from_namespace", "number"]


DEFAULT_MAX_ADAPTERS = 32   # rank 16 on SmolLM2-135M in bf16: ~10 MB each


def number(unit: str = "", *, integer: bool = False, minimum: float = 0) -> Callable[[str], Any]:
    """An argparse ``type``: a finite number (an int with ``integer``) >= ``minimum``, in ``unit``.

    Refused while parsing, before any model loads, with argparse naming the flag: ``float("nan") < 0``
    is False (a NaN would silently turn a cache off) and ``int(inf * 2**20)`` raises OverflowError after
    the model loaded, so neither may pass. Messages: ``must be a number of MiB, got 'lots'``,
    ``must be a finite number of MiB >= 0, got '-1'``, ``must be an integer >= 1, got '0'``.

    Raises (from the returned parser):
        argparse.ArgumentTypeError: not a number (not an integer), NaN, infinite or below ``minimum``.
    """
    of = f" of {unit}" if unit else ""
    bound = f"{'an integer' if integer else 'a finite number'}{of} >= {minimum:g}"

    def parse(text: str) -> Any:
        try:
            v = int(text) if integer else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {'an integer' if integer else 'a number'}{of}, "
                                             f"got {text!r}") from None
        if not math.isfinite(v) or v < minimum:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return v

    parse.__name__ = "integer" if integer else "number"   # argparse names the type in some messages
    return parse


_megabytes = number("MiB")


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


def opt(default: Any, help: str = "", **meta: Any) -> Any:
    """A config field: its default and its flag's help (and `together_train.config_flags` metadata).

    A help that does not mention its default gets ``(default X)`` appended when the default is a
    number or a non-empty string, so ``serve --help`` shows every value a newcomer would otherwise
    look up in this file.
    """
    if help and "default" not in help and not isinstance(default, bool) and (
            isinstance(default, (int, float)) or (isinstance(default, str) and default)):
        help = f"{help} (default {default:g})" if isinstance(default, float) else f"{help} (default {default})"
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class LogConfig:
    """Logging of every together-train process (`cli.configure_logging`): given before the subcommand or
    after it (launch_local's extra_args); the environment sets the defaults (replicas inherit them)."""

    log_level: str = opt(os.environ.get("TOGETHER_TRAIN_LOG", "INFO"),
                         "level of together-train's own logs (one INFO line per operation, session, checkpoint, "
                         "replica and weights event); other libraries log WARNING+ unless debug (default "
                         "$TOGETHER_TRAIN_LOG or INFO)")
    log_format: str = opt(os.environ.get("TOGETHER_TRAIN_LOG_FORMAT", "text"),
                          "text lines, or one JSON object per line for log shippers (default "
                          "$TOGETHER_TRAIN_LOG_FORMAT or text)", choices=["text", "json"])


@dataclass
class ProcessConfig:
    """What serve and generator share: the model, where they listen, the generator engine, TLS."""

    model: str = opt("embedded", "local Hugging Face model directory, or 'embedded' (SmolLM2-135M-Instruct)")
    host: str = opt("127.0.0.1", "bind address (default loopback only)")
    port_file: Path | None = opt(None, "write the bound port here once serving")
    dtype: str = opt("float32", "model dtype (float64: for tests that need sampling independent of batching)",
                     choices=["float32", "bfloat16", "float16", "float64"])
    device: str = opt("cpu", "cpu, cuda or cuda:N")
    allocator: str = opt("auto", "C allocator of this process and the replicas it spawns: auto (tcmalloc when "
                         "libtcmalloc_minimal is installed, else glibc), tcmalloc (required), glibc; tcmalloc takes "
                         "long steps off glibc's page-fault tax (engines/allocator.py)", choices=list(ALLOCATORS))
    engine: str = opt("torch", "generator engine", choices=list(GENERATORS))
    prefix_cache_mb: float = opt(
        DEFAULT_PREFIX_CACHE_MB, "--engine torch: MiB of prompt-prefix keys/values kept across requests per replica "
        f"(blocks of {DEFAULT_BLOCK_SIZE} tokens, LRU; 0 disables; default {DEFAULT_PREFIX_CACHE_MB}). --engine vllm "
        "sizes its own prefix cache; 0 turns it off", type=_prefix_cache_mb)
    max_adapters: int = opt(DEFAULT_MAX_ADAPTERS, "adapters a generator replica keeps loaded; past it the least "
                            "recently used is dropped and loaded again from the resource's latest push when a "
                            f"request needs it (0 = no limit; default {DEFAULT_MAX_ADAPTERS})", type=number(integer=True))
    vllm_enforce_eager: bool = opt(False, "--engine vllm: no CUDA graphs (faster start, slower decode); default: CUDA "
                                   "graphs on a GPU, eager on CPU", action="store_true")
    vllm_max_loras: int = opt(4, "--engine vllm: LoRA adapters usable in one batch (default 4)")
    vllm_gpu_memory_utilization: float = opt(
        0.85, "--engine vllm: fraction of GPU memory vLLM may take (weights + KV cache; default 0.85)")
    chat_template: Path | None = opt(None, "Jinja chat template file replacing the model's own for "
                                     "/v1/chat/completions (default: the model's; the embedded model's gets "
                                     "Hermes-style tool rendering)")
    tls_cert: Path | None = opt(None, "serve TLS only, with this PEM certificate chain")
    tls_key: Path | None = opt(None, "PEM private key of --tls-cert")
    tls_client_ca: Path | None = opt(None, "mutual TLS: refuse clients without a certificate signed by this PEM "
                                     "CA bundle")

    def vllm_options(self) -> dict[str, Any]:
        """``VllmGeneratorEngine`` keyword arguments from the ``--vllm-*`` flags (enforce_eager None = by device)."""
        return {"enforce_eager": True if self.vllm_enforce_eager else None, "max_loras": self.vllm_max_loras,
                "gpu_memory_utilization": self.vllm_gpu_memory_utilization}

    def vllm_flag_args(self) -> list[str]:
        """``--max-adapters`` and the ``--vllm-*`` flags as ``generator`` command-line arguments (for the
        replicas serve spawns)."""
        out = ["--max-adapters", str(self.max_adapters), "--vllm-max-loras", str(self.vllm_max_loras),
               "--vllm-gpu-memory-utilization", repr(float(self.vllm_gpu_memory_utilization))]
        return out + (["--vllm-enforce-eager"] if self.vllm_enforce_eager else [])


@dataclass
class GeneratorConfig(ProcessConfig):
    """``together-train generator``: one generator replica."""

    port: int = opt(7471, "gRPC port of the replica")
    threads: int = opt(0, "torch threads (0 = torch default)")
    replica_id: str | None = opt(None, "name in logs and errors (default: the address)")
    parent_pid: int = opt(0, "exit when this process is gone")
    replica_secret_file: Path | None = opt(
        None, "mode 0600 file holding the secret every call must carry (the resource's --replica-secret-file); "
        "calls without it get UNAUTHENTICATED", required=True)


@dataclass
class ServeConfig(ProcessConfig):
    """``together-train serve``: a model resource (trainer), its generator replicas and its APIs."""

    port: int = opt(7470, "gRPC port (the SDK); 0 = any free port (default 7470)")
    http_port: int | None = opt(None, "also serve the HTTP API on this port: Tinker (/api/v1), Together RL (/v1/rl), "
                                "OpenAI (/v1/models, /v1/chat/completions, ...), /metrics, dashboard (/); 0 = any free "
                                "port (default: off)")
    http_port_file: Path | None = opt(None, "write the bound HTTP port here once serving")
    mode: str = opt("lora", "lora: sessions are LoRA adapters on a frozen base; full: one session training every "
                    "parameter (needs --trainer deepspeed)", choices=["lora", "full"])
    trainer: str = opt("torch", "trainer backend: torch (one device) or deepspeed (ZeRO across the ranks of a "
                       "`deepspeed` / `torchrun` launch; rank 0 serves)", choices=list(TRAINERS))
    zero_stage: int | None = opt(None, "ZeRO stage of --trainer deepspeed: 1 optimizer state, 2 + gradients, 3 + "
                                 "parameters (LoRA: the frozen base) partitioned across ranks (default 2)",
                                 choices=[1, 2, 3])
    deepspeed_config: Path | None = opt(
        None, "JSON file merged over --trainer deepspeed's DeepSpeed config, e.g. "
        '\'{"zero_optimization": {"stage3_max_live_parameters": 0}}\' (batch sizes, clipping, optimizer and the '
        "stage stay the engine's)")
    generators: int = opt(1, "generator replica processes to start on this host", type=number(integer=True))
    generator_address: list[str] = field(default_factory=list, metadata={
        "help": "attach a replica started elsewhere (host:port)", "action": "append"})
    generator_dtype: str | None = opt(None, "dtype of the replicas (default: --dtype)")
    replica_secret_file: Path | None = opt(
        None, "secret (mode 0600 file) sent to every replica; needed with --generator-address, whose replicas are "
        "started with the same file (default: a random secret per start)")
    generator_tls_ca: Path | None = opt(
        None, "attached replicas serve TLS: verify them with this PEM CA bundle (their certificate must name the "
        "host of --generator-address); --tls-cert/--tls-key are the client certificate for replicas started with "
        "--tls-client-ca")
    storage: Path | None = opt(None, "checkpoint directory (default ~/.cache/together-train/storage)")
    api_key_file: Path | None = opt(None, "require one of these API keys (one per line)")
    admin_key_file: Path | None = opt(None, "API keys (one per line, also in --api-key-file) that may search and "
                                      "change every key's checkpoints")
    checkpoint_sweep_s: float = opt(30.0, "seconds between sweeps deleting checkpoints whose TTL passed (default 30)")
    max_sessions: int = opt(256, "sessions that may exist at once, resident or paged out (RESOURCE_EXHAUSTED past it; "
                            "at least 1)", type=number(integer=True, minimum=1))
    # Sharing the trainer among API keys (`TenancyConfig`, service/tenancy/; 0 = no limit).
    scheduler: str = opt("fair", "order of ready trainer operations: fair = deficit round-robin across API keys, "
                         "then a key's sessions, charged by tokens; fifo = one queue in arrival order (default "
                         "fair; docs/operating.md)", choices=list(SCHEDULERS))
    max_sessions_per_key: int = opt(0, "most active sessions one API key may hold (default 0 = no per-key limit; "
                                    "--max-sessions still holds)", type=number(integer=True))
    max_queued_per_key: int = opt(0, "most trainer operations one API key may have queued or running at once "
                                  "(default 0 = no limit; a pipelined loop keeps forward_backward and optim_step in "
                                  "flight per session, so allow at least 2 per session; the SDK does not retry)",
                                  type=number(integer=True))
    max_tokens_per_key: int = opt(0, "most model_input tokens one API key may train on and score in this "
                                  "resource's lifetime, counted from the usage meter (survives restarts; default 0 "
                                  "= no limit)", type=number(integer=True))
    # Session paging (`PagingConfig`, service/sessions/pager.py).
    session_memory_mb: float | None = opt(
        None, "memory (MiB) the trainer keeps resident sessions in (weights, gradients, AdamW: ~16 bytes per LoRA "
        "parameter, 78 MB for rank 16 on SmolLM2-135M); past it the least recently used idle session is paged out "
        "to the storage directory and paged back in on its next call (default: a quarter of the memory available "
        "at start, within 256 MiB..2 GiB; 0 = never page; docs/operating.md)", type=number("MiB"))
    page_out_idle: float = opt(600.0, "seconds without an operation after which a session is paged out even within "
                               "the budget; heartbeats (KeepAlive) do not count (default 600; 0 = only when room is "
                               "needed)", type=number("seconds"))
    micro_batch_tokens: int = opt(8192, "padded tokens per trainer forward; larger requests are split and their "
                                  "gradients accumulated", type=number("tokens", integer=True, minimum=1))
    activation_checkpointing: str = opt(
        "auto", "recompute decoder-layer activations in backward instead of keeping them: less memory for long "
        "sequences, ~1/3 more compute; auto = on for micro-batches of >= 2048 padded tokens (docs/operating.md)",
        choices=["auto", "on", "off"])
    # Off by default: a fused pass sums a row's float32 products in an order that depends on its companions, so a
    # step redone after a restart is not bit-identical to the one first acknowledged (issue 42: batch-invariant
    # passes); off keeps that promise, on trades it for throughput with many small sessions.
    batching: str = opt("off", "clock cycle: ready forward/forward_backward operations of different sessions run as "
                        "one pass over the base model, each row with its own adapter (docs/operating.md; faster "
                        "with many small sessions, but a replayed step then equals its first run only within "
                        "float32 summation error); off = one operation at a time, bit-exact replays",
                        choices=["on", "off"])
    batch_window_ms: float = opt(0.0, "with --batching on, how long a cycle waits for a second ready operation "
                                 "while another session is active (default 0: a cycle starts as soon as the "
                                 "trainer is free)", type=number("milliseconds"))
    memory_budget_mb: float | None = opt(
        None, "most memory (MiB) one training/scoring operation may add to the trainer; a request estimated above "
        "it is refused with RESOURCE_EXHAUSTED before it runs (default: 80%% of the memory available at start; 0 = "
        "no check; at least 96 otherwise; docs/operating.md)", type=_memory_budget_mb)
    max_tokens_per_batch: int = opt(65_536, "most model_input tokens of one forward request (and of one "
                                    "compute_logprobs request); also raises gRPC's receive limit, which refuses "
                                    "larger messages before parsing them", type=number("tokens", integer=True, minimum=1))
    max_samples_per_batch: int = opt(1024, "most samples of one forward request (also sizes gRPC's receive limit)",
                                     type=number("samples", integer=True, minimum=1))
    idle_timeout: float = opt(0.0, "seconds without a call after which a session is discarded, after a training "
                              "checkpoint (idle-<step>-<time>) its owner can list and resume from is written "
                              "(default 0: never; idle sessions are paged out instead, --page-out-idle)")
    # Rollouts recorded under the OpenAI endpoint's /v1/rollouts/{id} (service/sampling/rollouts.py).
    max_rollouts: int = opt(10_000, "rollouts kept in memory; past it the least recently written one is dropped",
                            type=number(integer=True, minimum=1))
    max_rollout_mb: int = opt(1024, "megabytes of recorded rollouts kept (8 bytes per token, logprob and version, "
                              "plus texts)", type=number(integer=True, minimum=1))
    rollout_ttl: float = opt(86400.0, "seconds a rollout is kept after its last call")
    client_heartbeat_timeout_s: float = opt(
        120.0, "HTTP (Tinker) client sessions: release a client's models (checkpoints kept) after this long without "
        "a heartbeat (the tinker SDK sends one every 10 s; 0 = never)")
    trainer_threads: int = opt(0, "torch threads of the trainer (0 = all cores)")
    generator_threads: int = opt(0, "torch threads per replica (0 = cores / replicas)")
    startup_timeout: float = opt(600.0, "seconds the replicas (spawned or attached) may take to answer at start")
    # Replica deadlines and health probes (service/replicas/pool.py Deadlines; README "Failures").
    replica_timeout_s: float = opt(30.0, "base deadline of every call to a replica; sample/compute_logprobs add "
                                   "--replica-timeout-per-token-s per token, a weights push bytes / "
                                   "--replica-push-mb-s")
    replica_timeout_per_token_s: float = opt(0.1, "seconds per token (prompt + num_samples * max_tokens) added to "
                                             "a sample's deadline")
    replica_push_mb_s: float = opt(10.0, "slowest push rate allowed (MB/s): a push of B bytes gets base + B / rate "
                                   "seconds")
    replica_sync_s: float = opt(1.0, "a weights_sync waits this long (+ bytes / 100 MB/s) for a slow replica once "
                                "another took the version; the slow one serves that session again once it holds it")
    replica_probe_period_s: float = opt(2.0, "seconds between health probes")
    replica_probe_timeout_s: float = opt(5.0, "deadline of one health probe")
    replica_suspect_s: float = opt(0.5, "a replica whose health probe is unanswered this long gets no new requests "
                                   "while another answers, and its samples in flight are re-issued on another "
                                   "replica, until a probe answers")
    replica_probe_misses: int = opt(2, "missed probes in a row that take a replica out of routing (and restart a "
                                    "spawned one)")
    replica_wait_s: float = opt(60.0, "how long a request waits for a replica to come back when none is routable")
    # launch_local passes its own pid: shut down when this process is gone (internal, not in --help).
    parent_pid: int = opt(0, hidden=True)
    failure_drain_s: float = opt(20.0, "--trainer deepspeed: after a rank died and the launcher stops rank 0, keep "
                                 "answering UNAVAILABLE (naming the rank) this long before exiting (torchrun kills "
                                 "at 30 s)")

    def tenancy(self) -> TenancyConfig:
        """The scheduler and per-key limits (``--scheduler``, ``--max-*-per-key``) as the service takes them."""
        return TenancyConfig(scheduler=self.scheduler, max_sessions_per_key=self.max_sessions_per_key,
                             max_queued_per_key=self.max_queued_per_key, max_tokens_per_key=self.max_tokens_per_key)

    def paging(self) -> PagingConfig:
        """``--session-memory-mb`` (in bytes; None = the default budget) and ``--page-out-idle``."""
        mb = self.session_memory_mb
        return PagingConfig(None if mb is None else int(mb * (1 << 20)), float(self.page_out_idle))


@dataclass
class ClusterConfig:
    """``together-train cluster``: the control plane of model resources on Ray (cluster/, docs/cluster.md)."""

    catalog: Path | None = opt(None, "YAML or JSON file of the base models this cluster serves and how their resources "
                               "are placed (docs/cluster.md); default: the embedded model, one CPU per actor")
    ray_address: str | None = opt(None, "join this Ray cluster: 'auto' (the one `ray start` runs on this host) or "
                                  "HOST:PORT; default: start a local Ray instance")
    host: str = opt("127.0.0.1", "bind address of the control plane's gRPC port")
    port: int = opt(7460, "gRPC port: the Cluster API and every resource's services, routed; 0 = any free port")
    port_file: Path | None = opt(None, "write the bound port here once serving")
    storage: Path | None = opt(None, "checkpoint root every node reads (a shared path); each resource writes under "
                               "STORAGE/<resource_id> (default ~/.cache/together-train/storage)")
    num_cpus: int | None = opt(None, "local Ray only: CPUs it offers (default: all)")
    object_store_mb: int = opt(256, "local Ray only: object store size in MiB (the control plane sends little "
                               "through it)", type=number("MiB", integer=True, minimum=64))
    startup_timeout: float = opt(600.0, "seconds a placed resource's processes may take to serve")
    placement_timeout: float = opt(0.0, "seconds a resource may wait PENDING for Ray before it FAILS (0 = forever)")
    address: str = opt("127.0.0.1:7460", "`cluster status`: the control plane's host:port")
    parent_pid: int = opt(0, hidden=True)
