#!/usr/bin/env bash
# The failed-rank checks in one device call on one H200: the GPU tests of both
# binaries (every kernel carries the poison path), the Python suite with N = 2 ranks and the
# skipped-call test with N = 4, the ranks sharing the GPU, then the fault trials of faults.py:
# skip one dispatch, skip one combine, SIGSTOP, SIGKILL.
#
#   bash scripts/gpu/failed-rank.sh BIN_DIR      (BIN_DIR from PACK_WHEEL=1 scripts/gpu/pack.sh)
#
# FR_TRIALS (default 20) trials per fault kind, FR_TIMEOUT_S (default 0.5) the wait bound,
# FR_STEPS (default "rust python faults") the steps. Logs under $OUT, one per step.
set -u
BIN=$(cd "${1:?usage: failed-rank.sh BIN_DIR}" && pwd)
OUT=${OUT:-/tmp/ep-failed-rank}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
PY=${PY:-/opt/torch/.venv/bin/python3}
TRIALS=${FR_TRIALS:-20}
BOUND=${FR_TIMEOUT_S:-0.5}
steps=" ${FR_STEPS:-rust python faults} "
t0=$SECONDS
note() { echo "[failed-rank $((SECONDS - t0)) s] $*" | tee -a "$OUT/summary.txt"; }

if [[ $steps == *" rust "* ]]; then
  timeout -k 5 240 "$BIN/gpu" > "$OUT/gpu.log" 2>&1; note "gpu tests rc=$? $(grep -E 'passed|failed' "$OUT/gpu.log" | tail -n 1)"
  timeout -k 5 150 "$BIN/gpu_process" > "$OUT/gpu_process.log" 2>&1; note "gpu_process rc=$? $(grep -E 'passed|failed' "$OUT/gpu_process.log" | tail -n 1)"
fi
if [[ $steps == *" python "* ]]; then
  # N = 2: the whole suite (FR_PYTEST_K2 narrows it); N = 4: the skipped-call test.
  for n in 2 4; do
    k="skips_a_call"
    [ "$n" = 2 ] && k="${FR_PYTEST_K2:-}"
    timeout -k 5 200 env NO_BENCH=1 NPROCS="$n" SHARE_GPU=1 ${k:+PYTEST_K="$k"} \
      bash "$BIN/python/gpu.sh" "$BIN" "$OUT" > "$OUT/python-n$n.log" 2>&1
    note "python N=$n rc=$? $(grep -E 'passed|failed' "$OUT/python-n$n.log" | tail -n 1)"
  done
fi
if [[ $steps == *" faults "* ]]; then
  site=$(mktemp -d)
  "$PY" -m pip install -q --no-deps --no-index --target "$site" "$BIN"/ep_dispatch-*.whl
  for kinds in skip-dispatch,skip-combine stall,kill; do
    left=$(( 560 - (SECONDS - t0) ))
    [ "$left" -lt 30 ] && { note "faults $kinds: not run (time spent)"; continue; }
    log="$OUT/faults-${kinds//,/_}.log"
    (cd "$site" && timeout -k 5 "$left" env PYTHONPATH="$site" "$PY" "$BIN/python/faults.py" \
      --trials "$TRIALS" --timeout-s "$BOUND" --kinds "$kinds") > "$log" 2>&1
    note "faults $kinds rc=$?"
    grep -E "FAIL|HANG" "$log" | head -n 5 | tee -a "$OUT/summary.txt"
    sed -n '/^== Python Buffer fault trials/,$p' "$log" | tee -a "$OUT/summary.txt"
  done
fi
note "done"
