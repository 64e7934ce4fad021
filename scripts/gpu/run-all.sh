#!/usr/bin/env bash
# Every GPU verification harness in ONE device call:
#
#   bash scripts/gpu/run-all.sh .gpu        (on the GPU machine, from the repository root)
#
# $1 holds the stripped binaries that scripts/gpu/pack.sh copied there: gpu, gpu_fuzz, gpu_soak,
# gpu_process (test binaries), ep-bench, moe_layer, BUILD-INFO. Steps, each under `timeout` and
# each with its own time budget a little inside that limit (so it stops itself and reports what
# ran, instead of being killed):
#
#   step       limit  what
#   env          10 s nvidia-smi, tool versions, BUILD-INFO
#   fuzz        145 s gpu_fuzz: 1000 random configs x 2 inputs, both paths, bitwise vs the oracle
#   soak        155 s gpu_soak: 10^5 calls per path, conservation + combine every call
#   faults      120 s faults.sh: kill -9 / SIGSTOP of a rank, IPC (and NCCL with 2 GPUs)
#   sanitizer    85 s sanitizer.sh: memcheck, racecheck, synccheck
#
# 515 s of nominal limits; a step also gets the time the steps before it left unused (a quick
# fuzz leaves more to the soak), and is shortened so that the whole never passes
# RUN_ALL_TOTAL_S (default 530 s; with the 5 s kill grace, 9 minutes). It continues after a
# failure; the summary says which step failed and which was cut by its limit.
#
# Output ($OUT, at most 8 files): summary.txt, env.txt, fuzz.log, soak.log, faults.log,
# sanitizer.log, faults-ranks.tar.gz (every fault trial's rank logs), sanitizer-logs.tar.gz.
# Set RUN_ALL_STEPS="fuzz soak" (for example) to run only some steps.

set -u
if [ $# -lt 1 ] || [ ! -d "$1" ]; then
  echo "usage: $0 BIN_DIR (the folder scripts/gpu/pack.sh filled)" >&2
  exit 2
fi
BIN=$(cd "$1" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/ep-gpu-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
TOTAL=${RUN_ALL_TOTAL_S:-530}
STEPS=${RUN_ALL_STEPS:-env fuzz soak faults sanitizer}
WORK=$(mktemp -d /tmp/ep-run-all.XXXXXX)
T0=$EPOCHREALTIME
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"

elapsed() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
say() { echo "$*" | tee -a "$SUMMARY"; }

declare -A RC=() SECS=() NOTE=()
ORDER=()
PLANNED=0     # the sum of the nominal limits of the steps so far
LIM=0         # the limit of the next step (set by plan)

# plan NOMINAL_S: sets LIM, the next step's limit: its nominal limit, plus the time the steps
# before it left unused (a quick fuzz gives the soak more), never past the total.
plan() {
  local carry
  PLANNED=$(( PLANNED + $1 ))
  carry=$(( PLANNED - $1 - $(elapsed) ))
  [ "$carry" -lt 0 ] && carry=0
  LIM=$(( $1 + carry ))
  local left=$(( TOTAL - $(elapsed) - 5 ))
  [ "$LIM" -gt "$left" ] && LIM=$left
  [ "$LIM" -lt 0 ] && LIM=0
  return 0
}

# step NAME LIMIT_S LOG CMD...: runs CMD under `timeout`, output to LOG; records the outcome.
step() {
  local name=$1 limit=$2 log=$3; shift 3
  ORDER+=("$name")
  case " $STEPS " in *" $name "*) ;; *) RC[$name]=-; SECS[$name]=0; NOTE[$name]="not selected"; return ;; esac
  if [ "$limit" -lt 10 ]; then
    RC[$name]=-; SECS[$name]=0; NOTE[$name]="NOT RUN: the 9-minute total is spent"
    say "[run-all $(elapsed) s] $name: not run (total time spent)"
    return
  fi
  local note=""
  say "[run-all $(elapsed) s] $name: start (limit $limit s): $*"
  local t0=$EPOCHREALTIME rc
  timeout -k 5 "$limit" "$@" > "$log" 2>&1
  rc=$?
  SECS[$name]=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')
  RC[$name]=$rc
  case $rc in
    0) note+="ok" ;;
    124|137) note+="CUT: killed at its $limit s limit" ;;
    2) note+="INCOMPLETE or SKIPPED (exit 2; see its log)" ;;
    *) note+="FAILED (exit $rc)" ;;
  esac
  local skips
  skips=$(grep -c '^SKIPPED' "$log")
  [ "$skips" -gt 0 ] && note+="; $skips SKIPPED (nothing of those ran: see the log)"
  NOTE[$name]=$note
  say "[run-all $(elapsed) s] $name: rc=$rc, ${SECS[$name]} s: $note"
  # The lines that carry the figures, on stdout too (the device tool returns the output's tail).
  grep -E "$GREP" "$log" | tail -n 40 | sed "s/^/  [$name] /"
}
GREP='^(gpu_fuzz|gpu_soak|config [0-9]|test |SKIPPED|FAIL|TIME BUDGET|CUT|  bitwise|    [a-z0-9+_]+ +(per-expert|batched)|  configs passed|  inputs passed|  calls per routing|== |transport|ipc |nccl |\(|memcheck|racecheck|synccheck|compute-sanitizer|per tool|\[faults)'

env_info() {
  echo "date: $(date -u)"
  echo "host: $(uname -a)"
  nvidia-smi -L 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  nvidia-smi topo -m 2>&1 | head -n 8
  echo "compute-sanitizer: $(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -n 1)"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "binaries:"
  ls -l "$BIN"
  echo "BUILD-INFO: $(cat "$BIN/BUILD-INFO" 2>/dev/null || echo missing)"
}
export -f env_info
export BIN

for need in gpu_fuzz gpu_soak ep-bench gpu; do
  [ -x "$BIN/$need" ] || say "WARNING: $BIN/$need missing: its step will fail"
done

# Each harness's own budget is its limit less a margin, so it stops itself and reports.
plan 10
step env "$LIM" "$OUT/env.txt" bash -c env_info
plan 145
step fuzz "$LIM" "$OUT/fuzz.log" env EP_GPU_FUZZ_MAX_SECS=$(( LIM - 10 )) "$BIN/gpu_fuzz"
plan 155
step soak "$LIM" "$OUT/soak.log" env EP_SOAK_MAX_SECS=$(( LIM - 10 )) "$BIN/gpu_soak"
plan 120
step faults "$LIM" "$OUT/faults.log" env FAULT_BUDGET_S=$(( LIM - 8 )) FAULT_LOGDIR="$WORK/faults" \
  bash "$HERE/faults.sh" "$BIN"
plan 85
step sanitizer "$LIM" "$OUT/sanitizer.log" env SAN_TOOL_LIMIT_S=$(( (LIM - 4) / 3 )) \
  bash "$HERE/sanitizer.sh" "$BIN" "$WORK/sanitizer"

[ -d "$WORK/faults" ] && tar -czf "$OUT/faults-ranks.tar.gz" -C "$WORK" faults 2>/dev/null
[ -d "$WORK/sanitizer" ] && tar -czf "$OUT/sanitizer-logs.tar.gz" -C "$WORK" sanitizer 2>/dev/null

say ""
say "== run-all summary ($(elapsed) s of the $TOTAL s allowed; binaries: $(cat "$BIN/BUILD-INFO" 2>/dev/null || echo 'no BUILD-INFO'))"
bad=0
for name in "${ORDER[@]}"; do
  say "$(printf '%-10s rc=%-4s %5s s  %s' "$name" "${RC[$name]}" "${SECS[$name]}" "${NOTE[$name]}")"
  case ${RC[$name]} in 0|-) ;; *) bad=1 ;; esac
done
say "files in \$OUT: $(cd "$OUT" && ls | paste -sd' ' -)"
exit $bad
