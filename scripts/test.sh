#!/usr/bin/env bash
# Set up (first run only) and run the test suite. Extra arguments go to pytest (e.g. -m slow, -k engine).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
exec .venv/bin/python -m pytest "$@"
