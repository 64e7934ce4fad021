#!/usr/bin/env bash
# Issue 13's run in ONE device call on a 4- or 8-GPU machine (nvidia-h200-x4 / -x8): EP4 and
# EP8 with one process per GPU, both paths, bit for bit first, then timed; over CUDA IPC and
# NCCL; the fault runs at the largest N; the Python benchmark at EP8 where the wheel was packed.
#
#   here:        PACK_WHEEL=1 bash scripts/gpu/pack.sh .gpu
#   device tool: kind nvidia-h200-x8, carry [".gpu"], timeout_s 600,
#                command `bash scripts/gpu/ep8.sh .gpu`
#
# Every step has a time limit; the script keeps going after a failure, writes one tarball of logs
# and summary.txt to $OUT, and prints the summary last (the tool returns the output's tail).
set -u
BIN=$(cd "${1:?usage: ep8.sh BIN_DIR}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-/tmp/ep8-out}
mkdir -p "$OUT"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
LOGS=$(mktemp -d /tmp/ep8.XXXXXX)
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
T0=$EPOCHREALTIME
elapsed() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
DEADLINE=${EP8_DEADLINE_S:-555}
step() {
  local name=$1 limit=$2; shift 2
  local left=$(( DEADLINE - $(elapsed) ))
  [ "$limit" -gt "$left" ] && limit=$left
  if [ "$limit" -lt 10 ]; then echo "$name: NOT RUN (time spent)" >> "$SUMMARY"; return; fi
  local t0=$EPOCHREALTIME rc
  timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
  rc=$?
  printf '%-28s rc=%-4s %4s s\n' "$name" "$rc" \
    "$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.0f", b - a }')" >> "$SUMMARY"
}

G=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
nvidia-smi topo -m > "$LOGS/topo.txt" 2>&1
echo "== ep8.sh: $G GPU(s); $(head -n 1 "$BIN/BUILD-INFO" 2>/dev/null)" >> "$SUMMARY"
[ "$G" -ge 4 ] || { echo "ep8.sh: needs 4 or 8 GPUs, found $G" | tee -a "$SUMMARY"; exit 2; }

# Correctness in every mode at each N (ep-bench --nprocs checks both paths bit for bit against
# the oracle before timing; --iters 5 keeps these short).
for n in 4 8; do
  [ "$n" -le "$G" ] || continue
  for mode in "--dispatch bf16" "--dispatch fp8" "--dispatch fp8 --round-scale" \
              "--dispatch fp8 --round-scale --ue8m0"; do
    tag=$(echo "$mode" | tr -d ' -' )
    step "check-ep$n-$tag" 40 "$BIN/ep-bench" --nprocs "$n" --gpus "$n" $mode --iters 5
  done
done

# Figures: the standard setting, IPC and NCCL, both paths.
for n in 4 8; do
  [ "$n" -le "$G" ] || continue
  step "bench-ep$n-ipc" 45 "$BIN/ep-bench" --nprocs "$n" --gpus "$n" --masked 0 --iters 200
  step "bench-ep$n-nccl" 60 "$BIN/ep-bench" --nprocs "$n" --gpus "$n" --masked 0 --iters 200 \
    --transport nccl
done

# The Python Buffer at the largest N (DeepEP's lines from torch.profiler kernel times).
if ls "$BIN"/ep_dispatch-*.whl > /dev/null 2>&1; then
  py=/opt/torch/.venv/bin/python3
  site=$(mktemp -d)
  "$py" -m pip install -q --no-deps --no-index --target "$site" "$BIN"/ep_dispatch-*.whl
  for path in batched per_expert; do
    step "python-bench-ep$G-$path" 60 env PYTHONPATH="$site" "$py" -m torch.distributed.run \
      --nproc-per-node "$G" "$BIN/python/bench.py" --experts 256 --path "$path"
  done
fi

# Faults: kill -9 and stall of one rank of two, each pair on its own GPUs (faults.sh's design).
left=$(( DEADLINE - $(elapsed) ))
[ "$left" -gt 40 ] && step faults "$left" env FAULT_BUDGET_S=$(( left - 8 )) \
  FAULT_LOGDIR="$LOGS/faults" bash "$HERE/faults.sh" "$BIN"

for f in "$LOGS"/bench-*.log "$LOGS"/python-*.log; do
  [ -f "$f" ] && { echo "-- $(basename "$f")"; grep -aE 'rank 0\]|succeeded|error' "$f" | tail -n 8; } >> "$SUMMARY"
done
grep -ahE 'bit-identical|differ|error' "$LOGS"/check-*.log 2>/dev/null | sort | uniq -c | head -n 20 >> "$SUMMARY"
grep -aA6 'transport fault' "$LOGS/faults.log" >> "$SUMMARY" 2>/dev/null
tar -czf "$OUT/ep8-logs.tar.gz" -C "$LOGS" . 2>/dev/null
cat "$SUMMARY"
