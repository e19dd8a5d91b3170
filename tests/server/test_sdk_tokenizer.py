"""ResourceClient.get_tokenizer against a real resource, in a process where torch cannot be imported:
the tokenizer equals the model directory's (encode, chat template), and a second process with the
same cache loads it without calling GetTokenizer."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import json, sys
    for name in ("torch", "together_train_server", "together_train_cookbook", "peft"):
        sys.modules[name] = None  # any import of these now raises ImportError
    import together_train as tt

    client = tt.ResourceClient(sys.argv[1])
    real = client._resource.GetTokenizer
    calls = []

    def counted(*args, **kwargs):  # a spy: the real RPC still runs
        calls.append(1)
        return real(*args, **kwargs)

    client._resource.GetTokenizer = counted
    tok = client.get_tokenizer()
    assert client.get_tokenizer() is tok  # loaded once per client
    texts, messages = json.loads(sys.argv[2]), json.loads(sys.argv[3])
    out = {
        "calls": len(calls),
        "encode": [tok.encode(t) for t in texts],
        "chat_text": tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
        "chat_ids": list(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"]),
        "sha": client.get_capabilities().tokenizer_sha256,
        "torch_loaded": sys.modules.get("torch") is not None,
    }
    client.close()
    print(json.dumps(out))
    """
)

TEXTS = ["Hello, world!", "  two  spaces and ünïcödé 123", "<|im_start|>user\\nhi<|im_end|>"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5"}, {"role": "user", "content": "And 4 * 4?"}]


def _run(address: str, cache) -> dict:
    env = {**os.environ, "TOGETHER_TRAIN_CACHE": str(cache)}
    out = subprocess.run([sys.executable, "-c", SCRIPT, address, json.dumps(TEXTS), json.dumps(MESSAGES)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _model_dir_sha(model_dir) -> tuple[str, dict[str, bytes]]:
    """The hash of resource.proto's GetTokenizerResponse.sha256, computed here from the model directory."""
    from together_train_server.service.tokenizer_files import TOKENIZER_FILE_NAMES

    files = {n: (model_dir / n).read_bytes() for n in TOKENIZER_FILE_NAMES if (model_dir / n).is_file()}
    h = hashlib.sha256()
    for name in sorted(files):
        h.update(name.encode() + b"\0" + str(len(files[name])).encode() + b"\0" + files[name])
    return h.hexdigest(), files


@pytest.mark.timeout(900)
def test_get_tokenizer_without_torch_equals_the_model_dirs_and_is_cached(resource, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    assert ref.chat_template, "the tiny model must carry a chat template for this test"
    want = {
        "encode": [ref.encode(t) for t in TEXTS],
        "chat_text": ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True),
        "chat_ids": list(ref.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                                 return_dict=True)["input_ids"]),
    }
    sha, files = _model_dir_sha(tiny_model_dir)
    cache = tmp_path / "cache"

    first = _run(resource.address, cache)
    assert first["calls"] == 1 and not first["torch_loaded"], first
    for key, value in want.items():
        assert first[key] == value, (key, first[key], value)
    assert first["sha"] == sha

    cached = cache / "tokenizers" / resource.get_capabilities().model_id / sha
    assert {p.name for p in cached.iterdir()} == set(files) | {".complete"}
    for name, data in files.items():
        assert (cached / name).read_bytes() == data, name

    second = _run(resource.address, cache)  # a new process, same cache: no GetTokenizer
    assert second["calls"] == 0, second
    for key, value in want.items():
        assert second[key] == value, (key, second[key], value)


def test_partial_cache_folder_is_refetched(resource, tmp_path, monkeypatch):
    """A folder without its completion marker (a killed writer) is not trusted: the files are fetched again."""
    from together_train.tokenizer import cached_tokenizer_dir, fetch_tokenizer_dir

    monkeypatch.setenv("TOGETHER_TRAIN_CACHE", str(tmp_path))
    caps = resource.get_capabilities()
    partial = cached_tokenizer_dir(caps.model_id, caps.tokenizer_sha256)
    partial.mkdir(parents=True)
    (partial / "tokenizer.json").write_text("{truncated")
    folder = fetch_tokenizer_dir(resource)
    assert folder == partial and (folder / ".complete").is_file()
    assert (folder / "tokenizer.json").read_bytes() != b"{truncated"


ONE_ROOT_SCRIPT = textwrap.dedent(
    """
    import sys
    import together_train as tt

    with tt.launch_local(model=sys.argv[1], generators=0, extra_args=["--trainer-threads", "1"]) as client:
        client.get_tokenizer()
        print(client.get_capabilities().model_id)
    """
)


def test_storage_and_tokenizers_share_one_cache_root(tiny_model_dir, tmp_path):
    """Without $TOGETHER_TRAIN_CACHE, serve's default storage and the SDK's tokenizer cache both live under
    ~/.cache/together-train (the tokenizers went to ~/.cache/together_train): a real serve with a fresh HOME."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TOGETHER_TRAIN_CACHE"}
    env["HOME"] = str(home)
    out = subprocess.run([sys.executable, "-c", ONE_ROOT_SCRIPT, str(tiny_model_dir)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    model_id = out.stdout.strip().splitlines()[-1]
    root = home / ".cache" / "together-train"
    sha, _ = _model_dir_sha(tiny_model_dir)
    assert (root / "tokenizers" / model_id / sha / ".complete").is_file(), sorted(map(str, home.rglob("*")))[:40]
    assert (root / "storage").is_dir(), sorted(map(str, home.rglob("*")))[:40]
    assert not (home / ".cache" / "together_train").exists(), sorted(map(str, home.rglob("*")))[:40]
