#!/usr/bin/env bash
# CI check for ep-kernels on a machine without a GPU (fresh Debian with Rust, Python 3 and pip):
# installs NVRTC from PyPI (the CUDA 13 wheel), compiles every kernel for sm_90 and prints
# ptxas's register/spill report, and runs the on-disk kernel cache's compile/store/load path with
# that NVRTC; then runs the crate's tests, whose GPU tests print SKIPPED.
set -euo pipefail
cd "$(dirname "$0")/.."

NVRTC_DIR="${NVRTC_DIR:-${TMPDIR:-/tmp}/ep-kernels-nvrtc}"
if ! ls "$NVRTC_DIR"/nvidia/cu13/lib/libnvrtc.so.* >/dev/null 2>&1; then
    # PIP_BREAK_SYSTEM_PACKAGES: Debian's pip refuses installs outside a venv otherwise; with
    # --target nothing of the system's Python is touched.
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --quiet --disable-pip-version-check \
        --target "$NVRTC_DIR" 'nvidia-cuda-nvrtc>=13,<14'
fi
LIB="$(dirname "$(find "$NVRTC_DIR" -name 'libnvrtc.so.*' -not -name '*builtins*' | head -n1)")"
if [ -z "$LIB" ] || [ "$LIB" = "." ]; then
    echo "kernels.sh: libnvrtc not found under $NVRTC_DIR" >&2
    exit 1
fi
export LD_LIBRARY_PATH="$LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "kernels.sh: NVRTC from $LIB"

out="$(mktemp)"
cargo test --release -p ep-kernels --test compile 2>&1 | tee "$out"
if grep -q SKIPPED "$out"; then
    echo "kernels.sh: the compile check was skipped although NVRTC was installed" >&2
    exit 1
fi
grep -q "compiled 3 modules for sm_90" "$out"
# The on-disk kernel cache's whole path with the real compiler (same test binary).
grep -q "^disk cache: 3 modules compiled and stored" "$out"
rm -f "$out"

# The crate's other tests (the GPU tests print SKIPPED here) run in .ci/run's workspace test.
