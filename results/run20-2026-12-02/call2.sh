#!/usr/bin/env bash
# Session 6 call 2: ab (count_in + combine without the row table) and abd (+ masked_peers out
# of line, the reciprocal without a division call): EP1 with per-block stamps, ncu source
# counters of ab's batched kernels, then ab's GPU tests.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
X=$(cd "$(dirname "$0")" && pwd); L=/tmp/c2; mkdir -p $L; S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|profile batched +(Dispatch|Combine)|MISMATCH|rror|^\[T=" "$1" | grep -v "^path" | cut -c1-240; }
for v in ab abd; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 200 --profile --profile-blocks > $L/ep1-$v.log 2>&1; echo "== [$(el)] $v ep1 rc=$?"; pick $L/ep1-$v.log ) >> $S 2>&1
done
( timeout 60 $X/ep-bench-abd --backend gpu --masked 0 --ranks 8 --iters 100 > $L/ep8-abd.log 2>&1; echo "== [$(el)] abd ep8 rc=$?"; pick $L/ep8-abd.log ) >> $S 2>&1
NCU=/usr/local/cuda/bin/ncu
timeout 200 $NCU -f -o /tmp/ab --section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats \
  --kernel-name-base demangled --kernel-name regex:ep_batched --launch-count 40 $X/ep-bench-ab --backend gpu --masked 0 --ranks 1 --iters 2 --warmup 1 > $L/ncu-run.log 2>&1
echo "ncu rc=$? at $(el)" >> $S; tail -4 $L/ncu-run.log >> $S
timeout 60 $NCU -i /tmp/ab.ncu-rep --page details --csv > $L/ncu-details.csv 2>&1
mkdir -p /tmp/sass; timeout 120 python3 $X/ncu_post.py $NCU /tmp/ab.ncu-rep /tmp/sass 40; echo "post rc=$? at $(el)" >> $S
tar czf $OUT/sass.tgz -C /tmp/sass .
( timeout 300 $X/gpu-ab > $L/gpu.log 2>&1; echo "== [$(el)] gpu tests rc=$?"; grep -E "test result|FAILED|panicked|failed|passed" $L/gpu.log | tail -8 ) >> $S 2>&1
echo "[$(el)] done" >> $S
tar czf $OUT/logs.tgz -C $L .
cat $S
