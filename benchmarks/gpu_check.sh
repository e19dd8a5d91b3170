#!/usr/bin/env bash
# GPU check: bf16 LoRA training throughput + MFU, torch generator vs model.generate,
# trainer/generator bf16 logprob parity, 1-GPU ZeRO-2 step. Prints key=value lines; see benchmarks/gpu_check.py.
#   bash benchmarks/gpu_check.sh                 # on a CUDA machine (H200 class: ~3-5 minutes)
#   bash benchmarks/gpu_check.sh --cpu-smoke     # tiny sizes on CPU, tests the script
#   bash benchmarks/gpu_check.sh --peak-tflops 989.4 --part train
# Needs torch, transformers, peft, grpcio; no internet. The whole run is capped at 8 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/server:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY="${PYTHON:-python}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
exec timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" benchmarks/gpu_check.py "$@"
