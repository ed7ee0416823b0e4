#!/usr/bin/env bash
# Create .venv and install tiermoe into it (idempotent). Used by quickstart.sh and scripts/test.sh.
# torch is installed first and pinned, so pip never swaps in a multi-GB CUDA build on a CPU machine;
# set TIERMOE_TORCH (e.g. TIERMOE_TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128")
# to choose another build.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip --disable-pip-version-check -q"
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "setup: installing torch (${TIERMOE_TORCH:-torch==2.13.0})" >&2
    # shellcheck disable=SC2086
    $PIP install ${TIERMOE_TORCH:-torch==2.13.0}
fi
STAMP=".venv/.tiermoe-installed${EXTRAS:+-$EXTRAS}"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
    echo "setup: installing tiermoe${EXTRAS:+[$EXTRAS]} into .venv" >&2
    $PIP install -e ".${EXTRAS:+[$EXTRAS]}"
    touch "$STAMP"
fi
