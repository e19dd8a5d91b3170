#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The dashboard's browser tests drive Debian's chromium through playwright (never a downloaded
# browser); installed here when missing and possible, else those tests skip saying why.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -q && apt-get install -y -q chromium) >/dev/null 2>&1 \
    || echo "chromium could not be installed: the dashboard browser tests will skip"
fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1
# Lint first (rules in pyproject's [tool.ruff]): a finding fails the run before the slow tests start.
ruff check .
# Import contracts (pyproject's [tool.importlinter]): layers wire -> service -> engines, no cycles.
lint-imports --no-cache
# Types at the seams (pyproject's [tool.mypy]: server/ and together_train/).
mypy
# The 25 slowest tests are listed at the end: the suite is kept well under CI's limit.
python -m pytest -q --durations=25 "$@"
