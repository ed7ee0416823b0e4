#!/usr/bin/env bash
# A second virtualenv, .venv-floor, for the floor of the transformers range pyproject.toml declares: .venv's
# packages (scripts/setup.sh test) with the floor release of transformers in front of them, installed without its
# dependencies (from pip's cache after the first run), then `pip check` that .venv's packages satisfy it.
# scripts/test.sh runs the exactness tests in it. Prints the interpreter's path.
set -euo pipefail
cd "$(dirname "$0")/.."
FLOOR=$(.venv/bin/python -c "from tiermoe.arch.transformers_version import range_ends, declared_range
print(range_ends(declared_range())[0])")
PY=.venv-floor/bin/python
if ! "$PY" -c "import transformers; from packaging.version import Version as V
assert V(transformers.__version__) == V('$FLOOR')" 2>/dev/null; then
    echo "setup: .venv-floor with transformers==$FLOOR over .venv's packages" >&2
    rm -rf .venv-floor
    .venv/bin/python -m venv --without-pip .venv-floor
    SITE=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    BASE=$(.venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # .venv's site-packages after the floor's own (its .pth files too: the editable tiermoe)
    echo "import site; site.addsitedir('$BASE')" > "$SITE/_tiermoe_base_venv.pth"
    .venv/bin/python -m pip --disable-pip-version-check -q --python "$PY" install --no-deps "transformers==$FLOOR"
fi
.venv/bin/python -m pip --disable-pip-version-check -q --python "$PY" check >&2
echo "$PY"
