"""Test-only model helpers: tiny random causal LMs and random training samples.

Not shipped with the server: tests import this as ``_models`` (pytest puts tests/ on ``sys.path``);
a benchmark that wants a tiny model adds tests/ to its path. The tokenizer and chat template come
from the embedded SmolLM2 GGUF (tokenizer only, no weight conversion).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from together_train_server.engines.model_loading import embedded_tokenizer_dir
from together_train_server.engines.types import Sample

__all__ = ["build_tiny_model", "tiny_model", "random_samples"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tiny_config(arch: str, vocab_size: int, bos: int | None, eos: int | None, pad: int | None,
                 max_positions: int = 256) -> Any:
    from transformers import LlamaConfig, Qwen2Config

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,  # as SmolLM2 and small Qwen2
        bos_token_id=bos,
        eos_token_id=eos,
        pad_token_id=pad,
        rms_norm_eps=1e-5,
    )
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common, use_sliding_window=False)
    if arch == "qwen3":
        from transformers import Qwen3Config

        return Qwen3Config(**common, head_dim=16, use_sliding_window=False)
    if arch == "phi3":  # fused qkv_proj and gate_up_proj
        from transformers import Phi3Config

        common.pop("rms_norm_eps")
        return Phi3Config(**common, rms_norm_eps=1e-5)
    if arch == "gpt2":  # fused c_attn, transformers Conv1D layers instead of nn.Linear
        from transformers import GPT2Config

        return GPT2Config(
            vocab_size=vocab_size, n_embd=64, n_inner=128, n_layer=2, n_head=4, n_positions=max_positions,
            tie_word_embeddings=True, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
        )
    raise ValueError(f"unknown tiny arch {arch!r}; expected 'llama', 'qwen2', 'qwen3', 'phi3' or 'gpt2'")


def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    arch: str = "llama",
    seed: int = 0,
    tokenizer_dir: str | os.PathLike | None = None,
    max_positions: int = 256,
) -> Path:
    """Write a tiny random causal LM (for tests) as a Hugging Face directory.

    Config: hidden 64, intermediate 128, 2 layers, 4 attention heads, 2 KV
    heads, ``max_position_embeddings=256`` (so "too long" tests are cheap),
    tied embeddings, vocabulary = the tokenizer's size (49152 for SmolLM2).
    Weights are fp32 safetensors drawn with ``torch.manual_seed(seed)``. The
    tokenizer and chat template come from ``tokenizer_dir`` or, by default,
    from the embedded SmolLM2 GGUF (tokenizer only, no weight conversion).

    Args:
        out_dir: directory to create (may exist; files are overwritten).
        arch: ``"llama"``, ``"qwen2"``, ``"qwen3"``, ``"phi3"`` (fused ``qkv_proj`` /
            ``gate_up_proj``) or ``"gpt2"`` (fused ``c_attn``, Conv1D layers; GPT-2 sizes:
            hidden 64, inner 128, 2 layers, 4 heads, 256 positions).
        seed: torch seed of the random initialisation.
        tokenizer_dir: a local directory holding a tokenizer.
        max_positions: ``max_position_embeddings`` (long-context tests build one with more).

    Returns:
        ``Path(out_dir)``.

    Raises:
        ValueError: unknown arch. FileNotFoundError: no tokenizer source.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_src = Path(tokenizer_dir) if tokenizer_dir is not None else embedded_tokenizer_dir()
    tok = AutoTokenizer.from_pretrained(str(tok_src), local_files_only=True)
    eos_ids: list[int] = []
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tok.get_vocab() else None
    if im_end is not None:
        eos_ids.append(im_end)
    if tok.eos_token_id is not None and tok.eos_token_id not in eos_ids:
        eos_ids.append(tok.eos_token_id)
    eos = eos_ids[0] if eos_ids else None
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    config = _tiny_config(arch, len(tok), tok.bos_token_id, eos, pad, max_positions)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=eos_ids if len(eos_ids) > 1 else eos,
        pad_token_id=pad,
    )
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    if getattr(tok, "chat_template", None):
        (out / "chat_template.jinja").write_text(tok.chat_template)
    return out


def tiny_model(out_dir: str | os.PathLike, arch: str = "llama", seed: int = 0, max_positions: int = 256) -> Path:
    """Build (or reuse) a tiny random model in ``out_dir`` (see ``build_tiny_model``)."""
    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    return build_tiny_model(out, arch=arch, seed=seed, max_positions=max_positions)


def random_samples(lengths, vocab_size: int, seed: int = 0, weights: str = "random") -> list[Sample]:
    """Cross-entropy samples with random tokens, one per entry of ``lengths``.

    Args:
        lengths: ``model_input`` lengths.
        vocab_size: token ids are drawn from ``[0, vocab_size)``.
        seed: numpy seed.
        weights: ``"random"`` (uniform in [-0.5, 1.5), negative values included),
            ``"ones"``.
    """
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        full = rng.integers(0, vocab_size, n + 1).astype(np.int64)
        w = (rng.random(n) * 2 - 0.5) if weights == "random" else np.ones(n)
        out.append(Sample(full[:-1].copy(), {
            "target_tokens": full[1:].copy(), "weights": w.astype(np.float32)}))
    return out


def vllm_tiny_model(out_dir: str | os.PathLike) -> Path:
    """``build_tiny_model``'s Llama (tokenizer, generation config) re-initialised as 2 heads x 32, 2 KV heads.

    vLLM's CPU attention supports head sizes 32, 64, 80, ... but not the default tiny model's 16;
    the torch engines serve it too (the generator contract tests run both engines on it).
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    out = build_tiny_model(out_dir, arch="llama", seed=0)
    cfg = AutoConfig.from_pretrained(str(out))
    assert cfg.hidden_size == 64
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 2, 32
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(str(out))
    return out


CHATML = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def build_char_model(out: str | os.PathLike, chars: str, chat_template: str = CHATML, *,
                     tokenizer_config: dict[str, Any] | None = None, embed_scale: float = 3.0, seed: int = 0) -> Path:
    """A tiny random Llama (hidden 64, 2 layers, context 256) over one token per character of `chars`
    plus the ChatML specials (``<|endoftext|>`` pad, ``<|im_start|>``, ``<|im_end|>`` = EOS, ``<unk>``).

    Over a few dozen tokens LoRA can make chosen tokens most of the mass in a few steps (over
    SmolLM2's 49152 a tiny random model cannot: see tests/server/test_cookbook_rl_multiturn.py); the tied
    embeddings are scaled by `embed_scale` (std 0.02 * 3 = 0.06) for the same reason.

    Args:
        chars: the characters of the vocabulary (duplicates ignored).
        chat_template: the tokenizer's chat template (default ChatML).
        tokenizer_config: more keys merged into ``tokenizer_config.json`` (e.g. ``response_template``).
    """
    import json

    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = Path(out)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + sorted(set(chars)))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one piece per character
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<unk>", additional_special_tokens=["<|im_start|>"])
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    if tokenizer_config:
        cfg_path = out / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg.update(tokenizer_config)
        cfg_path.write_text(json.dumps(cfg))
    eos = vocab["<|im_end|>"]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, bos_token_id=None,
        eos_token_id=eos, pad_token_id=vocab["<|endoftext|>"]))
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=vocab["<|endoftext|>"])
    model.save_pretrained(out, safe_serialization=True)
    return out
