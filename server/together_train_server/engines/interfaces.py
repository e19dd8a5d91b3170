"""The engine interfaces the service layer calls: `TrainerEngine` (and `GeneratorEngine`).

These are `typing.Protocol` classes: an engine satisfies one by having the
attributes and methods below (no base class to inherit). They hold exactly
what the service and wire layers call, so an IDE or a type checker can follow
``runtime.forward(...)`` (service/core/runtime.py) to its contract. Implementations:
`TorchTrainerEngine` (engines/torch_trainer.py), `DeepSpeedTrainerEngine`
(engines/deepspeed/, multi-rank ZeRO) and `WrappedTrainerEngine` (engines/wrapped.py:
hooks around another trainer's calls); `GeneratorEngine` (what a generator replica,
`service.replica_host.ReplicaHost`, calls): `TorchGeneratorEngine` and
`VllmGeneratorEngine` (common part: `generator_base.GeneratorEngineBase`).

Conventions: an adapter id is the session id (one adapter per session; in
full mode the "adapter" is the whole model). Engines are not thread-safe: only
the service's `TrainerRuntime` (service/core/runtime.py) calls a trainer engine,
one call at a time on its thread (pure calls, e.g. ``memory_estimate``, on the caller's). Errors are
plain Python exceptions; one with a ``grpc_code`` attribute (e.g.
``"FAILED_PRECONDITION"``, ``"UNAVAILABLE"``) names the status the service
reports, any other is INTERNAL unless the method documents it. Nothing here
imports torch at run time (the service imports this module).
"""

from __future__ import annotations

import os
from pathlib import Path
from concurrent.futures import Future
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

from .types import AdamParams, ForwardOutput, GenOutput, LoraConfig, OptimOutput, Sample, SamplingParams

if TYPE_CHECKING:  # pragma: no cover
    from .cross_session import ForwardItem
    from .memory_estimate import MicroBatchEstimate
    import numpy as np
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = ["GeneratorEngine", "PageableTrainer", "TrainerCapabilities", "TrainerEngine", "TRAINER_METHODS"]

# The methods of `TrainerEngine` (what a wrapper forwards and may hook).
TRAINER_METHODS = ("create_adapter", "drop_adapter", "step", "forward", "optim_step", "adapter_tensors",
                   "save_adapter", "save_merged", "save_state", "load_state", "read_state_meta",
                   "spec_from_meta", "state_differences")


@dataclass(frozen=True)
class TrainerCapabilities:
    """What a trainer engine can do beyond `TrainerEngine`, declared once by the engine (``capabilities``).

    The service reads these when the resource is built (service/core/runtime.py) and never probes an
    engine's methods at call time; serve refuses a flag asking for one the engine lacks, naming the
    engine (`refusal`). GetCapabilities lists the true ones (``trainer_capabilities``).

    Attributes:
        paging: sessions can be written out and read back bit-exactly (`PageableTrainer`:
            ``save_session`` / ``load_session``; service/sessions/pager.py).
        clock_cycle: several sessions' forwards run as one fused pass (`CycleTrainer.forward_many`;
            service/training/cycle.py).
        full_weight: a session can train every weight of the base (``mode == "full"``).
        long_context: long sequences are trained within memory (layer recomputation, the head in chunks:
            ``--activation-checkpointing``).
    """

    paging: bool = False
    clock_cycle: bool = False
    full_weight: bool = False
    long_context: bool = False

    def names(self) -> list[str]:
        """The capabilities this engine has, by field name (what GetCapabilities lists)."""
        return [f.name for f in fields(self) if getattr(self, f.name)]

    def refusal(self, engine_name: str, asked: dict[str, str]) -> str | None:
        """Why a configuration cannot run on this engine (None: it can).

        Args:
            engine_name: the engine as the message names it (``backend_name``).
            asked: capability name -> the flag that asks for it (e.g. ``{"paging": "--session-memory-mb 512"}``).

        Returns:
            ``"<flag> needs <capability>, which <engine_name> does not have (it has: ...)"``, for the first
            capability missing; None when the engine has every one.
        """
        for name, flag in asked.items():
            if not getattr(self, name):
                has = ", ".join(self.names()) or "none of them"
                return f"{flag} needs {name.replace('_', ' ')}, which {engine_name} does not have (it has: {has})"
        return None


@runtime_checkable
class TrainerEngine(Protocol):
    """A trainer: one frozen base model and many sessions (LoRA adapters, or one full-weight session).

    Attributes:
        model_id: the base model's name (its directory name), as capabilities report it.
        model_dir: the local Hugging Face directory the base was loaded from.
        tokenizer: the base model's ``transformers`` tokenizer.
        vocab_size: rows of the unembedding; valid token ids are ``[0, vocab_size)``.
        max_seq_len: the longest ``model_input`` of one sample (tokens).
        dtype: the base weights' dtype name (``"float32"``, ``"bfloat16"``, ...).
        mode: ``"lora"`` (sessions are adapters; `adapter_tensors` serves them to the
            replicas) or ``"full"`` (one session trains every weight; no adapter to push).
        lora_target_modules: the module names a LoRA config may target (and the default).
        backend_name: the engine's name in capabilities (``trainer_backend``), e.g.
            ``"TorchTrainerEngine"``.
        capabilities: what it can do beyond these methods (`TrainerCapabilities`), fixed for its life.
        micro_batch_tokens: padded tokens of one model forward (a clock cycle's token budget).
    """

    # Read-only for the service (properties, so a wrapper may forward them; a plain attribute satisfies each).
    @property
    def model_id(self) -> str: ...
    @property
    def model_dir(self) -> Path: ...
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def mode(self) -> str: ...
    @property
    def lora_target_modules(self) -> Sequence[str]: ...
    @property
    def backend_name(self) -> str: ...
    @property
    def capabilities(self) -> TrainerCapabilities: ...
    @property
    def micro_batch_tokens(self) -> int: ...

    # ----- sessions
    def create_adapter(self, adapter_id: str, spec: LoraConfig) -> int:
        """Create the session's adapter (weights, AdamW state, step 0); returns its trainable parameter count.

        A's initialisation is seeded by ``spec.seed``; B starts at zero (the adapter equals the base).

        Raises:
            ValueError: the id exists, or the spec is invalid for this model (a ``FullModeError`` with
                ``grpc_code`` FAILED_PRECONDITION where the mode refuses it, e.g. a second full-mode session).
        """
        ...

    def drop_adapter(self, adapter_id: str) -> None:
        """Free the adapter, its optimizer state and gradients. Raises KeyError for an unknown id."""
        ...

    def step(self, adapter_id: str) -> int:
        """Optimizer steps the adapter has taken (= its policy version). Raises KeyError for an unknown id."""
        ...

    # ----- training
    def forward(
        self,
        adapter_id: str,
        samples: Sequence[Sample],
        loss_fn: str,
        loss_params: Mapping[str, Any] | None = None,
        *,
        backward: bool = False,
        return_logprobs: bool = False,
        return_elementwise: bool = False,
    ) -> ForwardOutput:
        """Score ``samples`` with the adapter; with ``backward`` add the loss's gradient to its accumulated one.

        Args:
            samples: validated samples: ``model_input`` int64 ``[n_i]``, ``inputs`` the loss's
                ``loss_fn_inputs`` (each ``[n_i]``; ``target_tokens`` int64, the rest float32;
                ``gradients`` for ``loss_fn="custom"``: the client's ``dL/dp`` per token).
            loss_fn: a name in ``loss_specs.LOSS_SPECS``; loss_params: its parameters.

        Returns:
            ForwardOutput: ``loss`` the sum over samples and tokens (float), ``logprobs`` /
            ``elementwise_loss`` per sample float32 ``[n_i]`` when asked, ``metrics``.

        Raises:
            KeyError (unknown adapter or loss), NotImplementedError (loss not served),
            ValueError (malformed sample or parameter), FloatingPointError (non-finite loss or
            gradient). On any error the accumulated gradient is as before the call.
        """
        ...

    def memory_estimate(self, lens: Sequence[int], backward: bool, adapter_id: str | None = None) -> MicroBatchEstimate:
        """Estimated peak bytes a forward (``backward``: forward_backward) of samples of ``lens`` adds to
        the trainer: ``memory_estimate.MicroBatchEstimate`` of its largest micro-batch (``.bytes``,
        ``.longest_index``, ``.longest_len``, ``.samples``, ``.checkpointed``). Pure: no state changes."""
        ...

    def model_dims(self) -> Any:
        """The base model's sizes and the engine's dtype (``memory_estimate.ModelDims``): what a replica's
        scoring memory is estimated from. Pure."""
        ...

    def optim_step(self, adapter_id: str, cfg: AdamParams) -> OptimOutput:
        """One AdamW step on the accumulated gradient, then drop it; the step counter increments.

        Returns:
            OptimOutput: the new step, the pre-clip global L2 gradient norm, the learning rate.

        Raises:
            KeyError: unknown adapter. ValueError: a hyper-parameter out of range.
            FloatingPointError: non-finite gradient norm (step skipped, gradients dropped).
        """
        ...

    # ----- weights out
    def adapter_tensors(self, adapter_id: str, dtype: str = "float32") -> Mapping[str, torch.Tensor]:
        """A copy of the adapter's weights, CPU tensors in `dtype` by PEFT state-dict key (what replicas load).

        `dtype` ("float32", "bfloat16", "float16"): a weights push snapshots in the replicas' dtype, once.
        A read-only `lora.FlatTensors`: views of one flat buffer, back to back in key order, which a push
        sends as one piece.

        Raises:
            KeyError: unknown adapter. ValueError: unknown `dtype`. ``FullModeError`` (``grpc_code``
            FAILED_PRECONDITION) in full mode.
        """
        ...

    def save_adapter(self, adapter_id: str, out_dir: str | os.PathLike) -> object:
        """Write a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``); the
        return value is not used."""
        ...

    def save_merged(self, adapter_id: str, out_dir: str | os.PathLike) -> object:
        """Write a Hugging Face model directory with the session's weights merged into the base (return
        value not used)."""
        ...

    # ----- training checkpoints
    def save_state(self, adapter_id: str, out_dir: str | os.PathLike) -> object:
        """Write a training checkpoint (weights, AdamW moments, step, RNG state, LoRA config, base fingerprint;
        return value not used)."""
        ...

    def load_state(self, adapter_id: str, state_dir: str | os.PathLike, with_optimizer: bool) -> int:
        """Load a `save_state` checkpoint into the adapter; returns its step (the adapter's new step).

        Raises:
            KeyError: unknown adapter. FileNotFoundError / ValueError: not a training checkpoint,
            or one that does not fit (the message names the difference). Nothing changes on error.
        """
        ...

    def base_fingerprint(self) -> dict[str, Any]:
        """What identifies the frozen base model in a training checkpoint (``trainer_state.base_fingerprint``
        plus ``dtype``); an imported adapter's checkpoint records it (engines/peft_import.py)."""
        ...

    def read_state_meta(self, state_dir: str | os.PathLike) -> dict[str, Any]:
        """The JSON metadata of a training checkpoint directory.

        Raises:
            FileNotFoundError: not a training checkpoint. ValueError: another or a newer format.
        """
        ...

    def spec_from_meta(self, meta: Mapping[str, Any]) -> LoraConfig:
        """The LoraConfig a checkpoint's metadata (`read_state_meta`) records."""
        ...

    def state_differences(self, meta: Mapping[str, Any], spec: LoraConfig | None = None) -> list[str]:
        """Why a checkpoint cannot load here (base model, LoRA shape, mode, ...); empty when it fits.

        ``spec`` None checks the base model only. Each entry is human-readable, e.g.
        ``"LoRA rank: checkpoint 4, session 8"``.
        """
        ...


@runtime_checkable
class CycleTrainer(Protocol):
    """A trainer that runs the forwards of several sessions as one clock cycle (service/training/cycle.py):
    `TorchTrainerEngine`, and a wrapper over it (engines/wrapped.py)."""

    def forward_many(self, items: Sequence[ForwardItem]) -> list[ForwardOutput | BaseException]:
        """Each item's forward (``backward``: and backward) in shared model forwards; per item, in order, its
        `ForwardOutput` or the exception its own work raised (the others' results stand)."""
        ...


@runtime_checkable
class PageableTrainer(Protocol):
    """A trainer that can write one session's full state out and take it back (paging, service/sessions/pager.py).

    `TorchTrainerEngine` implements it (format: engines/session_pages.py). A resource whose engine
    does not (the DeepSpeed engines) keeps every session resident.
    """

    def save_session(self, adapter_id: str, path: str | os.PathLike) -> int:
        """Write the adapter's parameters, gradients, optimizer state, RNG stream and step to ``path``.

        Crash-safe (write-then-rename, fsync) and checksummed; the adapter stays loaded. Returns bytes written.

        Raises:
            KeyError: unknown adapter. OSError: the write failed (e.g. disk full); the previous file
                at ``path``, if any, is untouched.
        """
        ...

    def load_session(self, adapter_id: str, spec: LoraConfig, path: str | os.PathLike) -> int:
        """Create adapter ``adapter_id`` from a `save_session` file, bit-exactly; returns its step.

        Raises:
            ValueError: the id exists; or (``grpc_code`` DATA_LOSS) the file is unreadable, of
                another session, or fails its checksum; then nothing is created.
        """
        ...


@runtime_checkable
class GeneratorEngine(Protocol):
    """Sampling and scoring over a frozen base model with named, versioned LoRA adapters.

    Sampling semantics (both engines): logprobs of sampled tokens are of the
    temperature-scaled distribution ``log_softmax(logits / T)`` (T = 1 when
    greedy), in nats; prompt logprobs and `compute_logprobs` are untempered.
    Stream i of a seeded request draws from its own generator seeded with
    ``generator_base.stream_seed(seed, i)``: the same seed gives the same
    tokens whatever else is batched. Stop tokens, EOS and the token that
    completed a stop string are included in the returned tokens.

    Unlike a trainer, a generator engine is thread-safe: the replica's gRPC
    threads call it concurrently and concurrent requests share decode steps.

    Attributes:
        model_id: the base model's name (its directory name).
        model_dir: the local model directory (``pathlib.Path``).
        vocab_size: rows of the output embedding (token ids are in ``[0, vocab_size)``).
        max_seq_len: prompt + completion tokens at most.
        dtype: ``"float32"`` | ``"bfloat16"`` | ``"float16"``: the weights' dtype, also the
            dtype pushed adapters are sent in.
        eos_token_ids: ids that end a stream unless ``ignore_eos`` (the model's generation config).
        tokenizer: the base model's transformers tokenizer.
        lora_target_modules: module names an adapter without ``target_modules`` adapts.
        stats: counters for logs and benchmarks (engine-specific keys; ints). ``sampled_tokens``, where
            present, counts every token sampled (cancelled requests' too): the replica's Health reports it.
    """

    model_id: str
    model_dir: Path
    vocab_size: int
    max_seq_len: int
    dtype: str
    eos_token_ids: tuple[int, ...]
    tokenizer: PreTrainedTokenizerBase
    lora_target_modules: list[str]
    stats: dict[str, int]

    def submit(
        self,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int = 1,
        adapter: str | None = None,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
        on_token: Callable[[int, int, float], Any] | None = None,
    ) -> Future:
        """Queue a sampling request; returns a ``concurrent.futures.Future[GenOutput]``.

        Args:
            prompt: token ids, ``1 <= len(prompt) < max_seq_len``, each in ``[0, vocab_size)``.
            params: max_tokens, temperature, top_k, top_p, seed, stop strings, stop token ids, ignore_eos.
            num_samples: streams (>= 1).
            adapter: adapter key, or None for the base model; the version current now serves
                every token of the request (``GenOutput.adapter_version`` names it).
            prompt_logprobs: also ``log p(prompt[i+1] | prompt[:i+1])``, ``len(prompt) - 1`` floats.
            top_k_prompt_logprobs: also the k most likely (ids, logprobs) per prompt position.
            on_token: ``on_token(stream, token_id, logprob)``, called on the engine's thread for
                every sampled token, in order per stream, before the future resolves; it must not
                block, and one that raises is not called again (the request goes on). The torch
                engine calls it as each token is sampled; the vLLM engine when the stream ends.

        Cancelling the future (``future.cancel()``) drops the request: not started if still
        queued, its streams leave the batch soon after.

        Raises:
            ValueError: bad prompt or parameters. KeyError: unknown adapter (both here, not
                through the future). The future fails with RuntimeError once the engine is closed.
        """
        ...

    def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        num_samples: int = 1,
        adapter: str | None = None,
        prompt_logprobs: bool = False,
        top_k_prompt_logprobs: int = 0,
    ) -> GenOutput:
        """``submit(...).result()``: blocks until every stream ended (batched with concurrent calls).

        Stops a stream at (first match wins, checked after each token): a
        stop token id or EOS (unless ``ignore_eos``) → ``"stop"``; a stop
        string in the decoded completion → ``"stop"``; ``max_tokens`` new
        tokens or the model's context (``len(prompt) + len(tokens) ==
        max_seq_len``) → ``"length"``. Stream i is seeded with ``stream_seed(seed, i)``.

        Returns:
            GenOutput with one GenSequence per stream (logprobs in nats) and
            ``adapter_version`` = the serving adapter's version tag (None for
            the base model or an untagged adapter).

        Raises:
            KeyError: unknown adapter. ValueError: bad prompt or parameters.
            RuntimeError: the engine was closed.
        """
        ...

    def compute_logprobs(self, sequences: list[list[int]], adapter: str | None = None) -> list[np.ndarray]:
        """Untempered ``log p(tokens[i+1] | tokens[:i+1])`` per sequence: float32 arrays of ``len - 1`` (nats).

        Raises:
            ValueError: empty batch or sequence, token out of range, a sequence too long.
            KeyError: unknown adapter.
        """
        ...

    @property
    def adapter_keys(self) -> list[str]:
        """Keys of the loaded adapters."""
        ...

    def adapter_version(self, key: str) -> int | None:
        """Version tag of the adapter ``key`` now (None if untagged). Raises KeyError if unknown."""
        ...

    def load_adapter(self, key: str, spec: LoraConfig, tensors: Mapping[str, torch.Tensor], version: int | None = None) -> None:
        """Serve ``key`` with these adapter weights from now on, tagged ``version``.

        ``tensors``: ``peft.get_peft_model_state_dict`` keys -> torch tensors (any float dtype,
        CPU): ``lora_A`` ``[rank, in]``, ``lora_B`` ``[out, rank]``. Requests already submitted
        finish on the weights they started with. The engine copies what it keeps: the caller
        reuses the tensors' memory for the next push once this returns (or raises).

        Raises:
            ValueError: invalid spec, missing/unexpected keys, shape mismatch, non-finite values
                (or what the engine cannot serve); the previous version under ``key`` is kept.
        """
        ...

    def drop_adapter(self, key: str) -> None:
        """Forget the adapter ``key`` (its running requests finish). Raises KeyError if unknown."""
        ...

    def close(self) -> None:
        """Stop the engine; queued and running requests fail with RuntimeError."""
        ...

