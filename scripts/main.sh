#!/usr/bin/env bash
# Set up, then run the main job: a local resource on the embedded SmolLM2-135M-Instruct,
# the SFT recipe on a generated arithmetic task, accuracy before and after, a loss plot.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python -m together_train_cookbook.recipes.sft "$@"
