"""The SDK imports and works without torch, and never imports the server."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import together_train

SDK_DIR = pathlib.Path(together_train.__file__).parent
FORBIDDEN = ("torch", "together_train_server", "together_train_cookbook", "transformers", "peft", "vllm", "deepspeed")
# get_tokenizer's optional dependency: imported inside the function only (never at import time, checked above).
LAZY_ALLOWED = {("tokenizer.py", "transformers")}


def test_import_without_torch_in_subprocess():
    code = (
        "import sys\n"
        "for name in ('torch', 'transformers', 'peft', 'together_train_server'):\n"
        "    sys.modules[name] = None  # any import of these now raises ImportError\n"
        "import together_train as tt\n"
        "from together_train import errors, futures, launcher, resource_client, retry, session, types\n"
        "s = tt.Sample.for_cross_entropy([1, 2, 3])\n"
        "s.to_proto(0)\n"
        "c = tt.ResourceClient('127.0.0.1:1')\n"
        "c.close()\n"
        "loaded = sorted(m for m in sys.modules if sys.modules[m] is not None and m.split('.')[0] in "
        + repr(FORBIDDEN)
        + ")\n"
        "assert not loaded, loaded\n"
        "print('ok', tt.__version__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok ")


def test_sdk_sources_never_import_heavy_or_server_modules():
    offenders = []
    for path in SDK_DIR.rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                if (path.name, n.split(".")[0]) in LAZY_ALLOWED and node.col_offset > 0:
                    continue
                if n.split(".")[0] in FORBIDDEN:
                    offenders.append(f"{path.relative_to(SDK_DIR)}:{node.lineno} imports {n}")
    assert not offenders, offenders


def test_public_api_exports():
    for name in together_train.__all__:
        assert hasattr(together_train, name), name
    for name in ("ResourceClient", "Session", "OperationFuture", "launch_local", "Sample", "LoraConfig",
                 "AdamParams", "SamplingParams", "ForwardResult", "TogetherTrainError", "InvalidArgumentError"):
        assert name in together_train.__all__
        assert getattr(together_train, name).__doc__, name


def test_version_matches_pyproject():
    import re

    text = (SDK_DIR.parent / "pyproject.toml").read_text()
    assert re.search(r'^version = "([^"]+)"', text, re.M).group(1) == together_train.__version__
