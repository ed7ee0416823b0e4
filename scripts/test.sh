#!/usr/bin/env bash
# Set up (first run only) and run the test suite. Extra arguments go to pytest (e.g. -m slow, -k engine).
# Without arguments (CI: .ci/run) it tests both ends of the transformers range pyproject.toml declares: the whole
# suite on the release .venv has (the newest below the cap), then the exactness tests (`-m exactness`) on the
# floor, in a second virtualenv (scripts/floor_env.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
if [ $# -gt 0 ]; then
    exec .venv/bin/python -m pytest "$@"
fi
TIERMOE_FLOOR_PYTHON=$(scripts/floor_env.sh)
export TIERMOE_FLOOR_PYTHON  # tests/test_versions.py checks the floor release is the one installed there
# one worker per core (pytest-xdist): the suite's models are tiny, so its cases are bound by Python, not memory
.venv/bin/python -m pytest -n auto
echo "test: every MoE architecture of the installed transformers (tests/test_arch_zoo.py, its own invocation)" >&2
.venv/bin/python -m pytest -q -m zoo
echo "test: the exactness tests on the floor of the transformers range" >&2
exec "$TIERMOE_FLOOR_PYTHON" -m pytest -q -m "exactness and not slow and not gpu"
