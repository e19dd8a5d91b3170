"""The catalog of ``together-train cluster`` (``--catalog FILE``, YAML or JSON): which base models may be
served and how each one's resources are built and placed on Ray.

One entry per base model (docs/cluster.md has a full example)::

    models:
      - name: tiny                 # what clients ask for (create_resource(base_model="tiny"))
        model: /models/tiny        # a Hugging Face directory every node reads, or "embedded"
        mode: lora                 # lora (full needs the DeepSpeed trainer: not on the cluster yet)
        trainer: {backend: torch}  # the only backend on the cluster so far
        trainer_resources: {num_cpus: 1, trainer_node: 1}   # per rank; other keys are Ray custom resources
        generator: {engine: torch}
        replica_resources: {num_cpus: 1, memory: 512MiB}    # per replica
        replicas: {min: 1, default: 1, max: 2}
        max_sessions: 16
        inactive_timeout: 3600     # seconds without a call before the resource stops (0 = never)

Resources (`RayResources`): ``num_cpus``, ``num_gpus`` (numbers), ``memory`` (bytes, or a string with a unit:
``512MiB``, ``2GB``); every other key is a custom resource passed to Ray unchanged.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CatalogError", "Catalog", "ModelEntry", "RayResources", "load_catalog", "parse_catalog"]

_TRAINERS = ("torch", "deepspeed")
_ENGINES = ("torch", "vllm")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


class CatalogError(ValueError):
    """A catalog that cannot be used; the message names the file, the entry and the key."""


@dataclass(frozen=True)
class RayResources:
    """What one trainer rank or one replica asks Ray for.

    num_cpus, num_gpus: logical units (fractions allowed); memory: bytes (0 = not asked);
    custom: other resources (e.g. ``{"trainer_node": 1}``), passed to Ray unchanged.
    """

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    memory: int = 0
    custom: dict[str, float] = field(default_factory=dict)

    def bundle(self) -> dict[str, float]:
        """A placement-group bundle: Ray's resource names (CPU, GPU, memory, custom) -> amounts, zeros left out."""
        out: dict[str, float] = {"CPU": self.num_cpus, "GPU": self.num_gpus, "memory": float(self.memory), **self.custom}
        return {k: v for k, v in out.items() if v > 0}

    def actor_options(self) -> dict[str, Any]:
        """Keyword arguments of ``ActorClass.options``."""
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.memory:
            opts["memory"] = self.memory
        if self.custom:
            opts["resources"] = dict(self.custom)
        return opts


@dataclass(frozen=True)
class ModelEntry:
    """One base model of the catalog and how its resources are built (see the module docstring)."""

    name: str
    model: str
    mode: str = "lora"
    trainer: str = "torch"
    ranks: int = 1
    zero_stage: int | None = None
    engine: str = "torch"
    trainer_resources: RayResources = field(default_factory=RayResources)
    replica_resources: RayResources = field(default_factory=RayResources)
    min_replicas: int = 1
    default_replicas: int = 1
    max_replicas: int = 1
    max_sessions: int = 64
    inactive_timeout: float = 0.0


@dataclass(frozen=True)
class Catalog:
    """The models a cluster serves, by name."""

    models: dict[str, ModelEntry]

    def get(self, name: str) -> ModelEntry:
        """The entry of base model `name`.

        Raises:
            CatalogError: not in the catalog (naming the catalog's models).
        """
        try:
            return self.models[name]
        except KeyError:
            raise CatalogError(f"base model {name!r} is not in the catalog; it serves: "
                               f"{', '.join(sorted(self.models)) or '(nothing)'}") from None


def _memory(value: Any, where: str) -> int:
    if isinstance(value, bool):
        raise CatalogError(f"{where}: expected bytes or a size such as '512MiB', got {value!r}")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise CatalogError(f"{where}: expected a size >= 0, got {value!r}")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise CatalogError(f"{where}: expected bytes or a size such as '512MiB' or '2GB', got {value!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _amount(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise CatalogError(f"{where}: expected a number >= 0, got {value!r}")
    return float(value)


def _resources(raw: Any, where: str) -> RayResources:
    if raw is None:
        return RayResources()
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: expected a mapping such as {{num_cpus: 1, num_gpus: 1}}, got {raw!r}")
    custom = {}
    for k, v in raw.items():
        if k in ("num_cpus", "num_gpus", "memory"):
            continue
        if k in ("CPU", "GPU", "cpu", "gpu"):
            raise CatalogError(f"{where}.{k}: write num_cpus / num_gpus")
        custom[str(k)] = _amount(v, f"{where}.{k}")
    return RayResources(num_cpus=_amount(raw.get("num_cpus", 1), f"{where}.num_cpus"),
                        num_gpus=_amount(raw.get("num_gpus", 0), f"{where}.num_gpus"),
                        memory=_memory(raw.get("memory", 0), f"{where}.memory"), custom=custom)


def _int(raw: dict, key: str, default: int, where: str, minimum: int = 0) -> int:
    v = raw.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise CatalogError(f"{where}.{key}: expected an integer >= {minimum}, got {v!r}")
    return v


def _choice(value: Any, choices: tuple[str, ...], where: str) -> str:
    if value not in choices:
        raise CatalogError(f"{where}: expected one of {', '.join(choices)}, got {value!r}")
    return str(value)


_ENTRY_KEYS = {"name", "model", "mode", "trainer", "generator", "trainer_resources", "replica_resources",
               "replicas", "max_sessions", "inactive_timeout"}


def _entry(raw: Any, where: str) -> ModelEntry:
    if not isinstance(raw, dict):
        raise CatalogError(f"{where}: expected a mapping, got {raw!r}")
    name = raw.get("name")
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:-]*", name):
        raise CatalogError(f"{where}.name: expected a name of letters, digits, '.', '_', ':' or '-', got {name!r}")
    where = f"{where} ({name})"
    unknown = sorted(set(raw) - _ENTRY_KEYS)
    if unknown:
        raise CatalogError(f"{where}: unknown key(s) {', '.join(unknown)}; expected {', '.join(sorted(_ENTRY_KEYS))}")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise CatalogError(f"{where}.model: expected a model directory or 'embedded', got {model!r}")
    trainer = raw.get("trainer", {}) or {}
    if isinstance(trainer, str):
        trainer = {"backend": trainer}
    if not isinstance(trainer, dict):
        raise CatalogError(f"{where}.trainer: expected {{backend: torch}} or {{backend: deepspeed, ranks: N, "
                           f"zero_stage: S}}, got {trainer!r}")
    backend = _choice(trainer.get("backend", "torch"), _TRAINERS, f"{where}.trainer.backend")
    ranks = _int(trainer, "ranks", 1, f"{where}.trainer", minimum=1)
    stage = trainer.get("zero_stage")
    if backend == "torch" and (ranks != 1 or stage is not None):
        raise CatalogError(f"{where}.trainer: the torch trainer has one rank and no zero_stage; "
                           "use backend: deepspeed for ranks / zero_stage")
    if backend == "deepspeed":
        if stage not in (1, 2, 3):
            raise CatalogError(f"{where}.trainer.zero_stage: expected 1, 2 or 3, got {stage!r}")
        # The ranks' rendezvous across actors is not built yet (docs/cluster.md, "Not yet").
        raise CatalogError(f"{where}.trainer.backend: the cluster runs the torch trainer only so far; "
                           "DeepSpeed ranks as Ray actors are not built yet")
    generator = raw.get("generator", {}) or {}
    if isinstance(generator, str):
        generator = {"engine": generator}
    if not isinstance(generator, dict):
        raise CatalogError(f"{where}.generator: expected {{engine: torch|vllm}}, got {generator!r}")
    replicas = raw.get("replicas", {}) or {}
    if not isinstance(replicas, dict):
        raise CatalogError(f"{where}.replicas: expected {{min: 1, default: 1, max: 2}}, got {replicas!r}")
    lo = _int(replicas, "min", 1, f"{where}.replicas", minimum=1)
    hi = _int(replicas, "max", max(lo, 1), f"{where}.replicas", minimum=1)
    default = _int(replicas, "default", lo, f"{where}.replicas", minimum=1)
    if not lo <= default <= hi:
        raise CatalogError(f"{where}.replicas: expected min <= default <= max, got min {lo}, default {default}, "
                           f"max {hi}")
    timeout = raw.get("inactive_timeout", 0)
    return ModelEntry(
        name=name, model=model, mode=_choice(raw.get("mode", "lora"), ("lora",), f"{where}.mode"),  # full needs deepspeed
        trainer=backend, ranks=ranks, zero_stage=stage,
        engine=_choice(generator.get("engine", "torch"), _ENGINES, f"{where}.generator.engine"),
        trainer_resources=_resources(raw.get("trainer_resources"), f"{where}.trainer_resources"),
        replica_resources=_resources(raw.get("replica_resources"), f"{where}.replica_resources"),
        min_replicas=lo, default_replicas=default, max_replicas=hi,
        max_sessions=_int(raw, "max_sessions", 64, where, minimum=1),
        inactive_timeout=_amount(timeout, f"{where}.inactive_timeout"),
    )


def parse_catalog(data: Any, source: str = "catalog") -> Catalog:
    """A `Catalog` from parsed YAML/JSON (``{"models": [entry, ...]}``); `source` names it in errors.

    Raises:
        CatalogError: a missing or malformed key, an unknown key, a duplicated name (naming entry and key).
    """
    if not isinstance(data, dict) or not isinstance(data.get("models"), list) or not data["models"]:
        raise CatalogError(f"{source}: expected a mapping with a non-empty list 'models'")
    models: dict[str, ModelEntry] = {}
    for i, raw in enumerate(data["models"]):
        e = _entry(raw, f"{source}: models[{i}]")
        if e.name in models:
            raise CatalogError(f"{source}: models[{i}].name {e.name!r} is already models' entry for that name")
        models[e.name] = e
    return Catalog(models)


def load_catalog(path: str | Path | None) -> Catalog:
    """The catalog in `path` (``.json``, else YAML), or without one a catalog of the embedded model
    (``embedded``: a torch trainer and one torch replica, one CPU each).

    Raises:
        CatalogError: unreadable or invalid (naming the file).
    """
    if path is None:
        return parse_catalog({"models": [{"name": "embedded", "model": "embedded"}]}, "built-in catalog")
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise CatalogError(f"--catalog {p}: cannot read it: {e.strerror or e}") from None
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as e:  # the parser's message, with the file named
        raise CatalogError(f"--catalog {p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: {e}") from None
    return parse_catalog(data, str(p))
