#!/usr/bin/env bash
# On a GPU machine with torch: installs a wheel built elsewhere (`cd python && maturin build
# --release --out DIR`; the GPU machine has no cargo) into a temp folder for torch's Python, then
# runs the GPU tests under torchrun with N = 1 and, where there are 2+ GPUs, N = 2, and the
# benchmark at the same sizes. Keeps going after a failure; prints one summary per step.
#
#   bash python/gpu.sh WHEEL_DIR [OUT_DIR]
#
# Environment: PY (torch's interpreter, default /opt/torch/.venv/bin/python3), NVRTC_DIR (added
# to LD_LIBRARY_PATH for the kernels' run-time compilation), BENCH_ARGS (extra bench.py flags),
# PYTEST_K (a pytest -k expression, e.g. 'nccl or two-tier': only those tests), NO_BENCH=1 (the
# tests only), NPROCS (the group sizes, default "1 2"), SHARE_GPU=1 (run N ranks on fewer GPUs:
# processes share a GPU over CUDA IPC; the NCCL tests then skip, NCCL needs one GPU per rank),
# EP_DISPATCH_TORCH_EXT (the Buffer's call path: unset or 1 the C++ torch extension, built at the
# first Buffer, 1 failing where it cannot be; 0 the Python path; run the script once with each).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
wheels="${1:?usage: gpu.sh WHEEL_DIR [OUT_DIR]}"
out="${2:-${OUT:-/tmp}}"
py="${PY:-/opt/torch/.venv/bin/python3}"
nvrtc="${NVRTC_DIR:-/usr/local/cuda-13.0/targets/x86_64-linux/lib}"
export LD_LIBRARY_PATH="$nvrtc${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT

"$py" -m pip install -q --no-deps --no-index --target "$site" "$wheels"/ep_dispatch-*.whl || exit 1
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
gpus="$("$py" -c 'import torch; print(torch.cuda.device_count())')"
echo "gpu.sh: $gpus GPU(s); $("$py" -c 'import ep_dispatch as e; print(e.__file__, e.DEVICE_API)')"
echo "gpu.sh: EP_DISPATCH_TORCH_EXT=${EP_DISPATCH_TORCH_EXT:-(unset)}"

status=0
for n in ${NPROCS:-1 2}; do
    if [ "$n" -gt 1 ] && [ "$gpus" -lt "$n" ] && [ "${SHARE_GPU:-0}" != 1 ]; then
        echo "gpu.sh: N=$n SKIPPED: $gpus GPU(s)"
        continue
    fi
    echo "== pytest, torchrun --nproc-per-node $n"
    (cd "$site" && "$py" -m torch.distributed.run --nproc-per-node "$n" -m pytest -q -rs \
        -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} "$here/tests" 2>&1) \
        | tee "$out/pytest-n$n.log" | tail -n 40
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
    [ "${NO_BENCH:-0}" = 1 ] && continue
    echo "== bench.py, torchrun --nproc-per-node $n (T=128 H=7168 K=8 E=256, FP8 dispatch)"
    for path in batched per_expert; do
        (cd "$site" && "$py" -m torch.distributed.run --nproc-per-node "$n" "$here/bench.py" \
            --experts 256 --path "$path" ${BENCH_ARGS:-} 2>&1) | tee "$out/bench-n$n-$path.log" \
            | grep -E "^(==|\[rank)" || status=1
    done
done
exit "$status"
