#!/usr/bin/env bash
# The Python package: builds the abi3 wheel with maturin, installs it into a throwaway
# environment, and runs the pytest suite against the installed wheel (CPU tests; the GPU tests
# report skipped: no torch, no GPU here). Needs only Rust, Python 3.9+ and pip; pip fetches
# maturin, pytest and numpy. Ends with pytest's summary line ("N passed, M skipped in ...").
set -euo pipefail
cd "$(dirname "$0")/.."
root="$(pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
py="${PYTHON:-python3}"
start=$(date +%s)

# A venv where the interpreter has one (Debian needs python3-venv for it); otherwise pip's
# --target into the temp directory (PIP_BREAK_SYSTEM_PACKAGES: Debian's pip refuses to install
# for the system interpreter without it, though --target touches nothing of the system's).
if "$py" -m venv "$tmp/venv" >/dev/null 2>&1 && [ -x "$tmp/venv/bin/pip" ]; then
    run_py=("$tmp/venv/bin/python")
    pip_install() { "$tmp/venv/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
    maturin="$tmp/venv/bin/maturin"
else
    export PIP_BREAK_SYSTEM_PACKAGES=1
    export PYTHONPATH="$tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    run_py=("$py")
    pip_install() { "$py" -m pip install -q --disable-pip-version-check --target "$tmp/site" "$@"; }
    maturin="$tmp/site/bin/maturin"
fi

echo "== python: pip installs maturin, pytest, numpy"
pip_install "maturin>=1.5,<2" pytest numpy

echo "== python: maturin builds the wheel (abi3, release)"
(cd python && "$maturin" build --release --out "$tmp/dist" 2>&1 | tail -n 3)
wheel="$(ls "$tmp"/dist/ep_dispatch-*.whl)"
echo "wheel: $(basename "$wheel")"
pip_install "$wheel"

echo "== python: import check, then pytest on the installed wheel"
# Run from outside the source tree, so `import ep_dispatch` is the installed wheel.
cd "$tmp"
"${run_py[@]}" -c "import ep_dispatch, sys; print('import ep_dispatch:', ep_dispatch.__file__); \
print('DEVICE_API:', ep_dispatch.DEVICE_API)"
"${run_py[@]}" -m pytest -q -rs -p no:cacheprovider "$root/python/tests"
echo "python.sh: $(( $(date +%s) - start )) s"
