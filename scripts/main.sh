#!/usr/bin/env bash
# Set up, then run the main job: a local resource on the embedded SmolLM2-135M-Instruct,
# SFT then RL (recipes.main) on a generated arithmetic task on that one resource; prints the
# held-out accuracy at start, after SFT and after RL, and the plot paths.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export HF_HUB_OFFLINE=1
python -m together_train_cookbook.recipes.main "$@"
