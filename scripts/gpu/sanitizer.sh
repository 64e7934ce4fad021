#!/usr/bin/env bash
# The GPU kernels under compute-sanitizer, on the GPU machine.
#
#   bash scripts/gpu/sanitizer.sh BIN_DIR [LOG_DIR]     (BIN_DIR holds gpu_fuzz and gpu)
#
# For each tool (memcheck with leak checking, racecheck, synccheck) it runs
#   1. gpu_fuzz on a few small random configs (EP_GPU_FUZZ_SMALL=1: R <= 4, T <= 8, H <= 512;
#      every mode drawn, both paths, dispatch and combine, bitwise against the oracle), with
#      two blocks per rank and the kernels' wait bound raised from 2 s to SAN_TIMEOUT_MS
#      (default 20000 ms): the sanitizers slow kernels down many times, and a wait that ran out
#      would fail the run for the tool's slowness, not for a fault. gpu_fuzz reads
#      EP_GPU_TIMEOUT_MS and EP_GPU_BLOCKS_PER_RANK for this; the `gpu` test binary has no such
#      setting (GpuOptions::default(), 2 s), so only its FP8 encoder test (no waits) runs here;
#   2. `gpu gpu_fp8_cast_is_bit_identical_to_the_cpu` (the encoder kernel on edge rows).
# and saves the tool's log, its summary lines and the harness's verdict.
#
# Environment: SAN_TOOL_LIMIT_S (seconds per tool, both parts, default 27), SAN_TIMEOUT_MS,
# SAN_CASES (fuzz configs per tool, 6), SAN_SEED (fuzz seed, 14).
# Exit status: 0 when every tool reported 0 errors and both harnesses passed; 1 otherwise.

set -u
BIN=${1:-}
if [ -z "$BIN" ] || [ ! -x "$BIN/gpu_fuzz" ]; then
  echo "usage: $0 BIN_DIR [LOG_DIR] (with BIN_DIR/gpu_fuzz and BIN_DIR/gpu)" >&2
  exit 2
fi
BIN=$(cd "$BIN" && pwd)
LOGDIR=${2:-$(mktemp -d /tmp/ep-sanitizer.XXXXXX)}
mkdir -p "$LOGDIR"
LIMIT=${SAN_TOOL_LIMIT_S:-27}
WAIT_MS=${SAN_TIMEOUT_MS:-20000}
CASES=${SAN_CASES:-6}
SEED=${SAN_SEED:-14}
CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$CS" ] || [ ! -x "$CS" ]; then
  echo "SKIPPED: sanitizer: compute-sanitizer not found (PATH, /usr/local/cuda*/bin)"
  exit 0
fi
echo "compute-sanitizer: $CS ($("$CS" --version 2>/dev/null | grep -i version | head -n 1))"
echo "per tool: gpu_fuzz ($CASES small configs, seed $SEED, 1 input each, 2 blocks per rank, wait bound $WAIT_MS ms instead of 2000 ms) and gpu_fp8_cast; $LIMIT s per tool; logs in $LOGDIR"

FUZZ_S=$(( LIMIT * 3 / 4 ))
GPU_S=$(( LIMIT - FUZZ_S ))
fail=0
TABLE=""

# run TOOL PART LIMIT_S CMD...: one harness under one tool; appends a row to TABLE.
run() {
  local tool=$1 part=$2 lim=$3; shift 3
  local extra=() log="$LOGDIR/$tool-$part.log" t0 rc secs errs verdict
  case $tool in
    memcheck) extra=(--leak-check full) ;;
    racecheck) extra=(--racecheck-report all) ;;
  esac
  t0=$EPOCHREALTIME
  timeout -k 3 "$lim" "$CS" --tool "$tool" --error-exitcode 99 --print-limit 20 "${extra[@]}" "$@" > "$log" 2>&1
  rc=$?
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  errs=$(grep -E '(ERROR|RACECHECK|LEAK) SUMMARY' "$log" | sed 's/^=* *//' | paste -sd';' -)
  verdict=$(grep -E 'tests: [0-9]+ passed|^gpu_fuzz: [0-9]+ of' "$log" | sed 's/^/ /' | paste -sd';' -)
  case $rc in
    0) ;;
    124|137) errs="CUT at ${lim} s (step limit); ${errs:-no summary printed}"; fail=1 ;;
    2) errs="${errs:-no summary}; INCOMPLETE (the harness's time budget ran out)" ;;
    *) fail=1 ;;
  esac
  TABLE+=$(printf '%-10s %-9s rc=%-4s %6s s  %s |%s' "$tool" "$part" "$rc" "$secs" "${errs:-no summary}" "${verdict:- no verdict}")$'\n'
  echo "---- $tool / $part: rc=$rc, $secs s (last lines of $log)"
  grep -vE '^\s*$' "$log" | tail -n 12 | sed 's/^/    /'
}

for tool in memcheck racecheck synccheck; do
  run "$tool" fuzz "$FUZZ_S" env EP_GPU_FUZZ_CASES="$CASES" EP_GPU_FUZZ_ROUNDS=1 \
    EP_GPU_FUZZ_SMALL=1 EP_GPU_FUZZ_SEED="$SEED" EP_GPU_FUZZ_MAX_SECS=$(( FUZZ_S - 6 )) \
    EP_GPU_TIMEOUT_MS="$WAIT_MS" EP_GPU_BLOCKS_PER_RANK=2 \
    "$BIN/gpu_fuzz" gpu_fuzz_random
  if [ -x "$BIN/gpu" ]; then
    run "$tool" gpu-fp8 "$GPU_S" "$BIN/gpu" gpu_fp8_cast_is_bit_identical_to_the_cpu
  else
    TABLE+="$tool gpu-fp8 SKIPPED: no $BIN/gpu"$'\n'
  fi
done

echo
echo "== sanitizer summary (tool, harness, exit status, time, the tool's summary | the harness's verdict)"
printf '%s' "$TABLE"
echo "(rc 99: the tool found errors; rc 2: gpu_fuzz's time budget ran out before every config ran, the configs that ran are in its line)"
exit $fail
