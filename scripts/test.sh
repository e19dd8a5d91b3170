#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the test suite. Extra arguments go to pytest.
#   bash scripts/test.sh          the whole suite, every tier (what CI runs)
#   bash scripts/test.sh --fast   lint, contracts, types, then the unit and engines tiers only (no server process;
#                                 a few minutes on 2 cores): the check before a commit
# Tiers are folders (tests/unit, engines, server, conformance, long) and markers (-m server, -m "not long").
set -euo pipefail
cd "$(dirname "$0")/.."
fast=""
if [ "${1:-}" = "--fast" ]; then
  fast=yes
  shift
fi
bash scripts/setup.sh
# The dashboard's browser tests drive Debian's chromium through playwright (never a downloaded browser); installed
# here when missing and possible, else those tests skip saying why.
if [ -z "$fast" ] && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -q && apt-get install -y -q chromium) >/dev/null 2>&1 \
    || echo "chromium could not be installed: the dashboard browser tests will skip"
fi
. .venv/bin/activate
export HF_HUB_OFFLINE=1
# Lint first (rules in pyproject's [tool.ruff]): a finding fails the run before the slow tests start.
ruff check .
# Import contracts (pyproject's [tool.importlinter]): layers wire -> service -> engines, no cycles.
lint-imports --no-cache
# Types (pyproject's [tool.mypy]: server/ and together_train/).
mypy
if [ -n "$fast" ]; then
  python -m pytest -q --durations=10 tests/unit tests/engines "$@"
else
  # The 25 slowest tests are listed at the end: the suite is kept well under CI's limit.
  python -m pytest -q --durations=25 "$@"
fi
