#!/usr/bin/env bash
# (Re)download the wheels benchmarks/gpu_check.sh carries to the GPU machine (pinned in benchmarks/gpu_wheels.txt)
# into benchmarks/gpu_wheels/ (git-ignored): cp312 / pure-Python wheels for manylinux x86_64, without their
# dependencies (the list names every one the machine's image lacks). Run it where the package registry is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=benchmarks/gpu_wheels
rm -rf "$DIR"
mkdir -p "$DIR"
"${PYTHON:-python3}" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$DIR" -r benchmarks/gpu_wheels.txt
ls -l "$DIR"
du -sh "$DIR"
