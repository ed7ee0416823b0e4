#!/usr/bin/env bash
# One call on a GPU machine (PyTorch and transformers preinstalled, no network), under 10 minutes:
#   1. make tiermoe importable from this working tree without fetching anything
#      (pip install --no-deps --no-index --no-build-isolation -e ., else PYTHONPATH);
#   2. python -m tiermoe.analysis.gpu_check: on a make-model checkpoint, check and time CUDA hybrid inference
#      at several GPU ratios (exactness against the CPU path, CPU/GPU overlap, pinned asynchronous copies, the
#      `auto` memory budget, layerwise GPU prefill, FP8 GPU-tier experts), calibrate the cost model (a measured GPU profile, and the
#      CPU-only estimate against the measurement), and write OUT_DIR/gpu_check.json (+ gpu_profile.json).
# Without CUDA it runs end to end too: CUDA-only checks say "skipped: no CUDA", the rest uses the CPU device.
#
#   benchmarks/gpu_check.sh [OUT_DIR] [--quick]      # OUT_DIR default: $OUT if set, else benchmarks/results
# Exit status: 0 when no check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
OUT_DIR="${OUT:-benchmarks/results}"
if [[ $# -gt 0 && "$1" != --* ]]; then
  OUT_DIR="$1"
  shift
fi
PYTHON="${PYTHON:-python}"

# tiermoe from this tree: already installed from it (a dev checkout), else installed without any download, else
# put on the path (works as long as torch, transformers, safetensors and tqdm are installed). The check runs
# from / because `python -c` puts the current directory on sys.path, which would always find the tree here.
here="$(cd / && "$PYTHON" -c 'import os, tiermoe; print(os.path.dirname(os.path.dirname(os.path.abspath(tiermoe.__file__))))' 2>/dev/null || true)"
if [[ "$here" != "$REPO" ]]; then
  echo "[gpu-check] installing tiermoe from $REPO (no dependencies, no index)" >&2
  mkdir -p "$OUT_DIR"
  if ! "$PYTHON" -m pip install --no-deps --no-index --no-build-isolation -e "$REPO" >"$OUT_DIR/pip_install.log" 2>&1; then
    echo "[gpu-check] pip could not install it offline (see $OUT_DIR/pip_install.log); using PYTHONPATH=$REPO" >&2
  fi
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
"$PYTHON" -c 'import torch; print(f"[gpu-check] torch {torch.__version__}, CUDA {torch.cuda.is_available()}" + (f", {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ""))' >&2
exec "$PYTHON" -m tiermoe.analysis.gpu_check --out "$OUT_DIR" "$@"
