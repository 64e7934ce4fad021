#!/usr/bin/env bash
# Session 6 call 1: three kernel builds side by side (base = d9fab36's kernels, a = one
# atom.acq_rel count-in, ab = a + combine's reduction without the row table), ep-bench EP1 with
# the phase profile, the T sweep and EP8 virtual; then ncu source counters of ab's kernels.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
X=$(cd "$(dirname "$0")" && pwd); L=/tmp/c1; mkdir -p $L; S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|per-expert.*CUPTI kernel time|speed-up|profile batched +(Dispatch|Combine)|MISMATCH|rror|^\[T=" "$1" | grep -v "^path" | cut -c1-240; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv > $S
for v in base a ab; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 200 --profile > $L/ep1-$v.log 2>&1; echo "== [$(el)] $v ep1 rc=$?"; pick $L/ep1-$v.log ) >> $S 2>&1
done
for v in ab base a; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 8 --iters 100 --profile > $L/ep8-$v.log 2>&1; echo "== [$(el)] $v ep8 rc=$?"; pick $L/ep8-$v.log ) >> $S 2>&1
done
for v in ab base; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 100 --sweep-tokens 1,16 > $L/sw-$v.log 2>&1; echo "== [$(el)] $v sweep rc=$?"; pick $L/sw-$v.log ) >> $S 2>&1
done
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1)
echo "== [$(el)] ncu: $NCU" >> $S
if [ -n "$NCU" ]; then
  timeout 200 $NCU -f -o /tmp/ab --section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats \
    --kernel-name regex:ep_batched --launch-count 60 $X/ep-bench-ab --backend gpu --masked 0 --ranks 1 --iters 2 --warmup 1 > $L/ncu-run.log 2>&1
  echo "ncu rc=$? at $(el)" >> $S
  timeout 60 $NCU -i /tmp/ab.ncu-rep --page details --csv > $L/ncu-details.csv 2>&1
  mkdir -p /tmp/sass; timeout 150 python3 $X/ncu_post.py $NCU /tmp/ab.ncu-rep /tmp/sass 60; echo "post rc=$? at $(el)" >> $S
  tar czf $OUT/sass.tgz -C /tmp/sass .
fi
tail -3 $L/ncu-run.log >> $S
echo "[$(el)] done" >> $S
tar czf $OUT/logs.tgz -C $L .
cat $S
