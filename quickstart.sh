#!/usr/bin/env bash
# Set up (first run only) and generate with the bundled demo model. Extra arguments go to `tiermoe generate`;
# without --prompt a default prompt is used.
set -euo pipefail
cd "$(dirname "$0")"
scripts/setup.sh
case " $* " in
    *" --prompt "* | *" --prompt="*) ;;
    *) set -- --prompt "Hello! What can you tell me about the ocean?" "$@" ;;
esac
exec .venv/bin/tiermoe generate "$@"
