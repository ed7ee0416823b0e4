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
    if [ "$EXTRAS" = kt ]; then
        # kt-kernel's wheel pins torch==2.9.1 (CUDA); keep the torch installed above
        $PIP install -e . gguf typer rich pyyaml httpx packaging
        $PIP install --no-deps "kt-kernel==0.7.2"
    else
        $PIP install -e ".${EXTRAS:+[$EXTRAS]}"
    fi
    touch "$STAMP"
fi
# Build the CPU expert kernels now rather than on the first model load (about 20 s; a warning and the pure-torch
# path where there is no compiler)
.venv/bin/tiermoe version --check | grep "^cpu kernels" >&2
