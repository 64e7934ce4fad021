#!/usr/bin/env bash
# Session 6 call 3: v3 (count_in, combine without the row table, tails spread over every block,
# masked_peers out of line, the send half without an exit count): EP1 with per-block stamps,
# EP8, the T sweep, then the GPU tests.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
X=$(cd "$(dirname "$0")" && pwd); L=/tmp/c3; mkdir -p $L; S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|profile batched +(Dispatch|Combine)|MISMATCH|rror|^\[T=" "$1" | grep -v "^path" | cut -c1-240; }
( timeout 60 $X/ep-bench-v3 --backend gpu --masked 0 --ranks 1 --iters 200 --profile --profile-blocks > $L/ep1.log 2>&1; echo "== [$(el)] v3 ep1 rc=$?"; pick $L/ep1.log ) >> $S 2>&1
( timeout 60 $X/ep-bench-v3 --backend gpu --masked 0 --ranks 8 --iters 100 --profile > $L/ep8.log 2>&1; echo "== [$(el)] v3 ep8 rc=$?"; pick $L/ep8.log ) >> $S 2>&1
( timeout 60 $X/ep-bench-v3 --backend gpu --masked 0 --ranks 1 --iters 100 --sweep-tokens 1,16,512 > $L/sw.log 2>&1; echo "== [$(el)] v3 sweep rc=$?"; pick $L/sw.log ) >> $S 2>&1
( timeout 320 $X/gpu-v3 > $L/gpu.log 2>&1; echo "== [$(el)] gpu tests rc=$?"; grep -E "FAILED|panicked|failed|passed" $L/gpu.log | tail -8 ) >> $S 2>&1
echo "[$(el)] done" >> $S
tar czf $OUT/logs.tgz -C $L .
cat $S
