#!/usr/bin/env bash
# Session 7 call 3: is the expansion bound by address translation? EP1 at E = 16..1024 (recv_x
# spans E x T x H bytes: 15 MB .. 940 MB), and T = 128 at H = 7168; base kernels.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
X=$(cd "$(dirname "$0")" && pwd); L=/tmp/c3; mkdir -p $L; S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|batched.*send/recv.*CUPTI|per-expert.*send/recv.*CUPTI|profile batched +(Dispatch|Combine) recv|MISMATCH|rror" "$1" | cut -c1-230; }
for e in 16 32 64 256 1024; do
  ( timeout 60 $X/ep-bench-base --backend gpu --masked 0 --ranks 1 --experts $e --iters 200 --profile > $L/e$e.log 2>&1; echo "== [$(el)] E=$e rc=$?"; pick $L/e$e.log ) >> $S 2>&1
done
echo "[$(el)] done" >> $S
tar czf $OUT/logs.tgz -C $L .
cat $S
