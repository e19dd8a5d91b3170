"""`WrappedTrainerEngine`: a `TrainerEngine` that runs hooks around the calls of another one.

Behaviour added around an engine's methods without touching the engine: rank
0's guard over dead DeepSpeed ranks (`service.rank_guard.RankGuard`), test-only
fault injection (`engines.fault_injection.FaultInjection`) and allocator
trimming (`engines.memory.TrimAllocator`). Each is an `EngineHook`; `wrap`
composes them into one wrapper object whose methods are written out, so an IDE
follows ``engine.forward(...)`` through the wrapper to the engine.

Only calls made through the wrapper are hooked (the service's); an engine's
calls to its own methods are not.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, TypeVar

from .interfaces import TRAINER_METHODS, TrainerCapabilities, TrainerEngine
from .types import AdamParams, ForwardOutput, LoraConfig, OptimOutput, Sample

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["EngineHook", "WrappedTrainerEngine", "wrap", "check_method_names"]

T = TypeVar("T")


class EngineHook(Protocol):
    """Behaviour around engine calls."""

    def around(self, method: str, call: Callable[[], T]) -> T:
        """Run ``call()`` (the engine's ``method`` with its arguments bound) and return its result.

        A hook may refuse (raise instead of calling), change the error, or act after the
        call; for a ``method`` it does not concern it returns ``call()``.
        """
        ...


def check_method_names(names: Sequence[str], engine: Any, what: str) -> None:
    """Raise ValueError ``"<what>: engine <type> has no method <name>"`` for a name the wrapper cannot hook."""
    inner = engine.inner if isinstance(engine, WrappedTrainerEngine) else engine
    for name in names:
        if name not in TRAINER_METHODS or not callable(getattr(inner, name, None)):
            raise ValueError(f"{what}: engine {type(inner).__name__} has no method {name!r}")


class WrappedTrainerEngine:
    """``inner`` with ``hooks`` run around each `TrainerEngine` method (the first hook innermost).

    Attributes are ``inner``'s (read through). Use `wrap` to add a hook: it returns one
    wrapper holding every hook rather than a wrapper of a wrapper.
    """

    def __init__(self, inner: TrainerEngine, hooks: Sequence[EngineHook] = ()) -> None:
        self.inner = inner
        self.hooks = tuple(hooks)

    def _run(self, method: str, call: Callable[[], T]) -> T:
        for hook in self.hooks:
            call = functools.partial(hook.around, method, call)
        return call()

    # ----- attributes (read through)
    @property
    def model_id(self) -> str:
        return self.inner.model_id

    @property
    def model_dir(self) -> Path:
        return self.inner.model_dir

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.inner.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.inner.max_seq_len

    @property
    def dtype(self) -> str:
        return self.inner.dtype

    @property
    def mode(self) -> str:
        return self.inner.mode

    @property
    def lora_target_modules(self) -> Sequence[str]:
        return self.inner.lora_target_modules

    @property
    def backend_name(self) -> str:
        return self.inner.backend_name

    @property
    def capabilities(self) -> TrainerCapabilities:
        return self.inner.capabilities

    @property
    def micro_batch_tokens(self) -> int:
        return self.inner.micro_batch_tokens

    # ----- methods (see TrainerEngine for each contract)
    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        return self._run("create_adapter", lambda: self.inner.create_adapter(adapter_id, spec))

    def drop_adapter(self, adapter_id: str) -> None:
        return self._run("drop_adapter", lambda: self.inner.drop_adapter(adapter_id))

    def step(self, adapter_id: str) -> int:
        return self._run("step", lambda: self.inner.step(adapter_id))

    def forward(self, adapter_id: str, samples: Sequence[Sample], loss_fn: str,
                loss_params: Mapping[str, Any] | None = None, *, backward: bool = False,
                return_logprobs: bool = False, return_elementwise: bool = False) -> ForwardOutput:
        return self._run("forward", lambda: self.inner.forward(
            adapter_id, samples, loss_fn, loss_params, backward=backward, return_logprobs=return_logprobs,
            return_elementwise=return_elementwise))

    def forward_many(self, items: Sequence[Any]) -> list[Any]:
        """The inner engine's clock cycle (`CycleTrainer.forward_many`), run through the hooks as "forward_many".

        Called only when the inner engine declares ``capabilities.clock_cycle`` (service/core/runtime.py).
        """
        many = self.inner.forward_many  # type: ignore[attr-defined]   # declared by capabilities.clock_cycle
        return self._run("forward_many", lambda: many(items))

    def memory_estimate(self, lens: Sequence[int], backward: bool, adapter_id: str | None = None) -> Any:
        return self.inner.memory_estimate(lens, backward, adapter_id)   # a pure estimate: no hooks

    def model_dims(self) -> Any:
        return self.inner.model_dims()   # pure: no hooks

    def base_fingerprint(self) -> dict[str, Any]:
        return self.inner.base_fingerprint()   # pure: no hooks

    def optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        return self._run("optim_step", lambda: self.inner.optim_step(adapter_id, cfg))

    def adapter_tensors(self, adapter_id: str, dtype: str = "float32") -> Mapping[str, torch.Tensor]:
        return self._run("adapter_tensors", lambda: self.inner.adapter_tensors(adapter_id, dtype))

    def save_adapter(self, adapter_id: str, out_dir: str | os.PathLike) -> Any:
        return self._run("save_adapter", lambda: self.inner.save_adapter(adapter_id, out_dir))

    def save_merged(self, adapter_id: str, out_dir: str | os.PathLike) -> Any:
        return self._run("save_merged", lambda: self.inner.save_merged(adapter_id, out_dir))

    def save_state(self, adapter_id: str, out_dir: str | os.PathLike) -> Any:
        return self._run("save_state", lambda: self.inner.save_state(adapter_id, out_dir))

    def load_state(self, adapter_id: str, state_dir: str | os.PathLike, with_optimizer: bool) -> int:
        return self._run("load_state", lambda: self.inner.load_state(adapter_id, state_dir, with_optimizer))

    def read_state_meta(self, state_dir: str | os.PathLike) -> dict[str, Any]:
        return self._run("read_state_meta", lambda: self.inner.read_state_meta(state_dir))

    def spec_from_meta(self, meta: Mapping[str, Any]) -> LoraConfig:
        return self._run("spec_from_meta", lambda: self.inner.spec_from_meta(meta))

    def state_differences(self, meta: Mapping[str, Any], spec: LoraConfig | None = None) -> list[str]:
        return self._run("state_differences", lambda: self.inner.state_differences(meta, spec))


def wrap(engine: TrainerEngine, hook: EngineHook) -> WrappedTrainerEngine:
    """``engine`` with ``hook`` run around its calls, outside the hooks it already has (one wrapper)."""
    if isinstance(engine, WrappedTrainerEngine):
        return WrappedTrainerEngine(engine.inner, engine.hooks + (hook,))
    return WrappedTrainerEngine(engine, (hook,))
