"""The engine registries: one entry per generator engine (``--engine``) and per trainer (``--trainer``).

A new backend is its own module under ``engines/`` and one entry here: its name (the flag's
choice) and a builder taking the parsed config. Modules are imported only when chosen (vllm and
deepspeed are optional extras). Nothing else names a backend: the flags' choices are these keys.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TypeAlias

# The builders take config.GeneratorConfig / config.ServeConfig; config imports this module (for the flags'
# choices), so they are named here, not imported (no import circle).
GeneratorConfig: TypeAlias = Any
ServeConfig: TypeAlias = Any


def _torch_generator(model_dir: str, cfg: GeneratorConfig) -> Any:
    from together_train_server.engines.torch_generator import TorchGeneratorEngine

    return TorchGeneratorEngine(model_dir, dtype=cfg.dtype, device=cfg.device, prefix_cache_mb=cfg.prefix_cache_mb)


def _vllm_generator(model_dir: str, cfg: GeneratorConfig) -> Any:
    from together_train_server.engines.vllm_generator import VllmGeneratorEngine, vllm_available

    if not vllm_available():
        raise SystemExit("--engine vllm needs vllm: pip install 'together-train[vllm]' (GPU) "
                         "or bash scripts/setup_vllm.sh (CPU test build); or use --engine torch")
    options: dict[str, Any] = dict(cfg.vllm_options())
    if cfg.prefix_cache_mb <= 0:
        options["enable_prefix_caching"] = False
    return VllmGeneratorEngine(model_dir, dtype=cfg.dtype, device=cfg.device, **options)


# name -> builder(model directory, config) of a `GeneratorEngine`.
GENERATORS: dict[str, Callable[[str, GeneratorConfig], Any]] = {"torch": _torch_generator, "vllm": _vllm_generator}


@dataclass
class TrainerStart:
    """A started trainer: the engine rank 0 serves, and what else the serve loop needs.

    Attributes:
        engine: the `TrainerEngine`.
        guard: watches the other ranks (`RankGuard`), None for one process.
        close: releases the engine's other ranks (None: nothing to release).
    """

    engine: Any
    guard: Any = None
    close: Callable[[], None] | None = None


@dataclass(frozen=True)
class TrainerBackend:
    """One ``--trainer``.

    Attributes:
        check: refuses flags this trainer cannot serve (SystemExit naming the flag), before anything loads.
        start: builds the engine on this process; returns None on a rank that only follows
            (it has served its part when `start` returns).
        engine_class: the engine's class (imported when called), whose declared `capabilities` and
            `backend_name` `capability_refusal` reads before anything loads.
    """

    check: Callable[[ServeConfig], None]
    start: Callable[[str, ServeConfig], TrainerStart | None]
    engine_class: Callable[[], Any]


def _check_torch(cfg: ServeConfig) -> None:
    if cfg.mode == "full":
        raise SystemExit("--mode full needs --trainer deepspeed (the torch trainer trains LoRA adapters only)")
    for flag, value in (("--zero-stage", cfg.zero_stage), ("--deepspeed-config", cfg.deepspeed_config)):
        if value is not None:
            raise SystemExit(f"{flag} applies to --trainer deepspeed only (this is --trainer {cfg.trainer})")


def _start_torch(model_dir: str, cfg: ServeConfig) -> TrainerStart:
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    return TrainerStart(TorchTrainerEngine(model_dir, dtype=cfg.dtype, device=cfg.device,
                                           micro_batch_tokens=cfg.micro_batch_tokens,
                                           activation_checkpointing=cfg.activation_checkpointing))


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




def _start_deepspeed(model_dir: str, cfg: ServeConfig) -> TrainerStart | None:
    """Every rank builds the engine; ranks 1..k-1 follow rank 0 and serve nothing."""
    import signal

    from together_train_server.engines.deepspeed import DeepSpeedTrainerEngine, deepspeed_available

    if not deepspeed_available():
        raise SystemExit("--trainer deepspeed needs deepspeed: pip install 'together-train[deepspeed]'")
    engine = DeepSpeedTrainerEngine(
        model_dir, zero_stage=cfg.zero_stage or 2, mode=cfg.mode, dtype=cfg.dtype, device=cfg.device,
        micro_batch_tokens=cfg.micro_batch_tokens, deepspeed_config=_load_json(cfg.deepspeed_config),
        activation_checkpointing=cfg.activation_checkpointing,
    )  # fmt: skip
    from together_train_server.service.training.rank_guard import RankGuard, exchange_peers

    peers = exchange_peers() if engine.world_size > 1 else []
    if engine.rank != 0:
        # Launchers signal every rank at once on a stop; a follower killed by that would look like a
        # crash to rank 0. Followers end when rank 0 releases them (its close) or is gone.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        engine.follow()
        return None
    # Rank 0: a dead follower fails every later operation at once, naming it.
    return TrainerStart(engine, RankGuard(engine, peers) if peers else None, engine.close)


def capability_refusal(cfg: ServeConfig, engine: Any) -> str | None:
    """Why ``engine`` cannot serve what ``cfg``'s flags ask for (None: it can), from the capabilities it
    declares (`TrainerCapabilities`, on the class: `engine` is the class or an instance): ``--session-memory-mb
    N`` (N > 0) needs paging, ``--batch-window-ms`` > 0 the clock cycle, ``--mode full`` full weights,
    ``--activation-checkpointing on`` long context. The message names the flag, the capability and the engine."""
    asked: dict[str, str] = {}
    if cfg.session_memory_mb:
        asked["paging"] = f"--session-memory-mb {cfg.session_memory_mb:g}"
    if cfg.batch_window_ms > 0:
        asked["clock_cycle"] = f"--batch-window-ms {cfg.batch_window_ms:g}"
    if cfg.mode == "full":
        asked["full_weight"] = "--mode full"
    if cfg.activation_checkpointing == "on":
        asked["long_context"] = "--activation-checkpointing on"
    return engine.capabilities.refusal(f"--trainer {cfg.trainer} ({engine.backend_name})", asked)


def _torch_class() -> Any:
    from together_train_server.engines.torch_trainer import TorchTrainerEngine

    return TorchTrainerEngine


def _deepspeed_class() -> Any:
    from together_train_server.engines.deepspeed import DeepSpeedTrainerEngine  # imports without deepspeed

    return DeepSpeedTrainerEngine


TRAINERS: dict[str, TrainerBackend] = {
    "torch": TrainerBackend(_check_torch, _start_torch, _torch_class),
    "deepspeed": TrainerBackend(lambda cfg: None, _start_deepspeed, _deepspeed_class),
}
