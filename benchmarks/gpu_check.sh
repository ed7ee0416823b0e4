#!/usr/bin/env bash
# The GPU check of tiermoe: everything the CUDA path must show, in one run of at most 10 minutes on a machine with
# an NVIDIA GPU and no network.
#
#   1. where the package registry is reachable:   benchmarks/gpu_wheels.sh
#      (downloads the cp312 wheels the GPU machine's image lacks into benchmarks/gpu_wheels/, git-ignored, ~14 MiB);
#   2. copy the checkout, benchmarks/gpu_wheels/ included, to the GPU machine and run there:
#        OUT=gpu-results timeout 600 bash benchmarks/gpu_check.sh
#   3. copy back the results folder ($OUT): gpu_check.json (the report), gpu_check.jsonl (a line per check as it
#      ended), gpu_check.log (everything printed, hang stacks included), decode_profile.txt, gpu_profile.json;
#      a few checks again: `benchmarks/gpu_check.sh --only a,b`.
#
# On a machine like the one it was written for (Python 3.12, torch 2.11 cu130, transformers 5.17, no network) it
# prints the
# versions first, installs the carried wheels with `pip install --no-index --no-deps --target` into a folder put
# first on PYTHONPATH (tiermoe itself comes from this tree through PYTHONPATH), then runs the checks of
# tiermoe/analysis/gpu_check/plan.py in the order of their value (environment -> exactness -> syncs/overlap ->
# serving -> memory -> layerwise -> FP8 -> profile), each in its own process within its own time budget (stacks
# dumped to the log when one overruns), every result written as soon as its check ends, all of it under a
# `timeout` of the plan's limit (540 s), well inside the call's 600 s. Without CUDA every check is reported
# "skipped: no CUDA".
#
#   benchmarks/gpu_check.sh --dry-run        # the plan, the wheels it would carry, each check's budget; runs nothing
#   benchmarks/gpu_check.sh [--only a,b] [--quick] [--rehearse]   # --rehearse: no CUDA, GPU tier on the CPU device
# Environment: OUT (results folder; default benchmarks/results), PYTHON (default .venv/bin/python if any, else python3),
# GPU_CHECK_WHEELS (default benchmarks/gpu_wheels). Exit status: 0 when no check failed or timed out.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
# the checkout's own environment when it has one; the image's python3 on a GPU machine without one
if [[ -z "${PYTHON:-}" && -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY="${PYTHON:-python3}"; fi
OUT_DIR="${OUT:-benchmarks/results}"
WHEELS="${GPU_CHECK_WHEELS:-benchmarks/gpu_wheels}"
SITE="${TMPDIR:-/tmp}/tiermoe-gpu-check-site"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error PYTHONUNBUFFERED=1 PIP_ROOT_USER_ACTION=ignore

for arg in "$@"; do
  if [[ "$arg" == --dry-run ]]; then
    exec "$PY" -m tiermoe.analysis.gpu_check --wheels "$WHEELS" "$@"
  fi
done

LIMIT_S="$("$PY" -c 'from tiermoe.analysis.gpu_check.plan import LIMIT_S; print(LIMIT_S)')" || exit 2

versions() {
  "$PY" - "$1" <<'EOF'
import platform, sys
from importlib import metadata

def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "-"

names = ("torch", "transformers", "huggingface_hub", "tokenizers", "safetensors", "gguf", "numpy", "regex")
print(f"[gpu-check] versions ({sys.argv[1]}): python {platform.python_version()}, "
      + ", ".join(f"{n} {version(n)}" for n in names), flush=True)
EOF
}

install_wheels() {
  shopt -s nullglob
  local wheels=("$WHEELS"/*.whl)
  shopt -u nullglob
  if (( ${#wheels[@]} == 0 )); then
    echo "[gpu-check] no wheels in $WHEELS (benchmarks/gpu_wheels.sh downloads them): using this Python's packages"
    return
  fi
  rm -rf "$SITE"
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}"; then
    export PYTHONPATH="$SITE:$PYTHONPATH"
    echo "[gpu-check] installed ${#wheels[@]} wheel(s) into $SITE (first on PYTHONPATH): ${wheels[*]##*/}"
  else
    echo "[gpu-check] the wheels did not install (see above): using this Python's packages"
  fi
}

main() {
  echo "[gpu-check] $(date -u '+%Y-%m-%dT%H:%M:%SZ') on ${HOSTNAME:-?}, limit ${LIMIT_S} s, results in $OUT_DIR"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used \
    --format=csv,noheader | sed 's/^/[gpu-check] nvidia-smi: /'
  versions "this Python's own"
  install_wheels
  versions "in use"
  local left=$((LIMIT_S - SECONDS))
  timeout -k 5 "$left" "$PY" -m tiermoe.analysis.gpu_check --out "$OUT_DIR" --limit $((left - 5)) \
    --setup-seconds "$SECONDS" "$@"
  local code=$?
  if (( code == 124 || code == 137 )); then
    echo "[gpu-check] stopped by the outer timeout after ${SECONDS} s: what ended before is in $OUT_DIR/gpu_check.jsonl"
  fi
  return "$code"
}

mkdir -p "$OUT_DIR"
: >"$OUT_DIR/gpu_check.log"
main "$@" 2>&1 | tee -a "$OUT_DIR/gpu_check.log"
exit "${PIPESTATUS[0]}"
