#!/usr/bin/env bash
# Session 7 call 1: the dispatch receive's tails folded into the units (v1: places with chunk 0;
# v2: places per entry, preloaded) beside base (7d3b1dd's kernels): EP1 with block stamps, EP8,
# T = 1 and 16; then the dispatch GPU tests of both variants.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
X=$(cd "$(dirname "$0")" && pwd); L=/tmp/c1; mkdir -p $L; S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|send/recv|speed-up|profile batched +Dispatch|MISMATCH|rror|^\[T=" "$1" | grep -v "^path\|generating\|running both" | cut -c1-260; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv >> $S
for v in base v1 v2; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 200 --profile --profile-blocks > $L/ep1-$v.log 2>&1; echo "== [$(el)] $v ep1 rc=$?"; pick $L/ep1-$v.log ) >> $S 2>&1
done
for v in base v1 v2; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 8 --iters 100 --profile > $L/ep8-$v.log 2>&1; echo "== [$(el)] $v ep8 rc=$?"; pick $L/ep8-$v.log ) >> $S 2>&1
done
for v in base v1 v2; do
  ( timeout 90 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 200 --sweep-tokens 1,16 > $L/sw-$v.log 2>&1; echo "== [$(el)] $v sweep rc=$?"; pick $L/sw-$v.log ) >> $S 2>&1
done
for v in v2 v1; do
  for f in gpu_r1_both gpu_virtual_r2 gpu_scales_column gpu_standard_setting gpu_skewed gpu_device_api_r1 gpu_virtual_r64_r128; do
    ( timeout 200 $X/gpu-$v $f > $L/gpu-$v-$f.log 2>&1; echo "== [$(el)] $v $f rc=$?"; grep -E "test result|FAILED|panicked|failed;|passed;" $L/gpu-$v-$f.log | tail -3 ) >> $S 2>&1
  done
done
echo "[$(el)] done" >> $S
tar czf $OUT/logs.tgz -C $L .
cat $S
