#!/usr/bin/env bash
# Set up (first run only) and generate with the bundled demo model. Extra arguments go to `tiermoe generate`.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- --prompt "Hello! What can you tell me about the ocean?"
fi
exec .venv/bin/tiermoe generate "$@"
