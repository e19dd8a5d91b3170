"""Exported adapters serve elsewhere: save_weights adapters load unchanged in peft and score like the
resource's sampler (server/together_train_server/adapter_tools.py, ``together-train check-adapter``);
an lm_head (train_unembed) adapter is refused for vLLM with the reason. Where vLLM is installed, the
exported adapter also loads as a vLLM LoRARequest.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import together_train as tt
from together_train_server.adapter_tools import PROMPTS, export_adapter, parity, tolerance, vllm_refusals

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def served(resource):
    """The suite's shared resource (tests/conftest.py)."""
    return resource


def _trained(client, name: str, **lora) -> str:
    """A session trained 2 steps (so B != 0), saved with save_weights; returns the URI."""
    s = client.create_session(lora=tt.LoraConfig(rank=4, alpha=8.0, seed=0, **lora))
    rng = np.random.default_rng(0)
    for _ in range(2):
        toks = rng.integers(0, 500, size=12)
        s.forward_backward([tt.Sample(model_input=toks[:-1], loss_fn_inputs={
            "target_tokens": toks[1:], "weights": np.ones(11, np.float32)})], "cross_entropy")
        s.optim_step(tt.AdamParams(learning_rate=5e-2)).result(timeout=120)
    return s.save_weights(name).result(timeout=120).uri


def test_exported_adapter_loads_in_peft_and_matches_the_sampler(served, tiny_model_dir, tmp_path):
    uri = _trained(served, "plain", target_modules=ALL)
    out = export_adapter(served, uri, tmp_path / "plain", for_vllm=True)
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    keys = set(load_file(str(out / "adapter_model.safetensors")))
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(out))
    loaded = {k for k, _ in model.named_parameters() if "lora_" in k}
    assert len(loaded) == len(keys) == 2 * len(ALL) * 2  # every saved tensor maps onto a LoRA parameter
    r = parity(served, uri, tiny_model_dir)
    print(f"parity float32: max_abs_delta_logprob={r.max_abs_delta:.3e} tolerance={r.tolerance:.3e} "
          f"tokens={r.tokens}")
    assert r.tokens > 40 and r.ok, r
    assert tolerance("float32", 10.0) == pytest.approx(16 * 2.0 ** -23 * 11)


def test_lm_head_adapter_is_refused_for_vllm_with_the_reason(served, tiny_model_dir, tmp_path):
    uri = _trained(served, "unembed", target_modules=("q_proj", "v_proj"), train_unembed=True)
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'\].*merged=True"):
        export_adapter(served, uri, tmp_path / "v", for_vllm=True)
    assert not (tmp_path / "v").exists()
    export_adapter(served, uri, tmp_path / "p")  # for peft it exports as is, lm_head copy included
    r = parity(served, uri, tiny_model_dir)
    assert r.ok, r
    assert vllm_refusals({"r": 4, "target_modules": ["q_proj"]}) == []
    assert len(vllm_refusals({"r": 1024, "use_dora": True, "bias": "all", "target_modules": ".*proj"})) == 4


def test_cli_check_and_export(served, tiny_model_dir, tmp_path):
    uri = _trained(served, "cli", target_modules=("q_proj",))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    base = [sys.executable, "-m", "together_train_server.cli"]
    out = subprocess.run([*base, "check-adapter", uri, "--address", served.address],  # --model: from the adapter
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in line.split())
    assert fields["verdict"] == "ok" and float(fields["max_abs_delta_logprob"]) <= float(fields["tolerance"]), line
    assert fields["dtype"] == "float32" and int(fields["tokens"]) > 40
    unembed = _trained(served, "cli-unembed", target_modules=("q_proj",), train_unembed=True)
    out = subprocess.run([*base, "export-adapter", unembed, str(tmp_path / "x"), "--for-vllm", "--address",
                          served.address], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "lm_head" in out.stdout and "merged=True" in out.stdout, out
    assert not (tmp_path / "x").exists()


def test_exported_adapter_loads_in_vllm(served, tiny_model_dir, tmp_path):
    """Where vLLM is installed: the exported adapter is a LoRARequest vLLM accepts, and its prompt logprobs
    agree with the resource's sampler within the float32 tolerance. Skipped without vLLM."""
    vllm = pytest.importorskip("vllm")
    from vllm.lora.request import LoRARequest

    uri = _trained(served, "for-vllm", target_modules=ALL)
    out = export_adapter(served, uri, tmp_path / "vllm", for_vllm=True)
    tok = served.get_tokenizer()
    seqs = [tok.encode(p) for p in PROMPTS]
    llm = vllm.LLM(model=str(tiny_model_dir), enable_lora=True, max_lora_rank=8, dtype="float32",
                   enforce_eager=True, max_model_len=256)
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0)
    res = llm.generate([{"prompt_token_ids": s} for s in seqs], params, lora_request=LoRARequest("a", 1, str(out)))
    ours = served.compute_logprobs([np.asarray(s) for s in seqs], checkpoint_uri=uri).result(timeout=300).logprobs
    for r, s, o in zip(res, seqs, ours):
        theirs = np.array([lp[t].logprob for lp, t in zip(r.prompt_logprobs[1:], s[1:])])
        assert np.max(np.abs(theirs - np.asarray(o)[-len(theirs):])) <= tolerance("float32", 30.0)
