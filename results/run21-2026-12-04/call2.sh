#!/usr/bin/env bash
# Session 7 call 2: tp (a warp without a payload unit loads its first tail at the start) beside
# base: EP1 with block stamps, EP8, T = 1 and 16, the bf16 dispatch too; tp's dispatch GPU tests.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
X=$(cd "$(dirname "$0")" && pwd); L=/tmp/c2; mkdir -p $L; S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|batched.*send/recv.*CUPTI|speed-up|profile batched +Dispatch|MISMATCH|rror" "$1" | cut -c1-260; }
for v in base tp base tp; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 200 --profile --profile-blocks > $L/ep1-$v.log 2>&1; echo "== [$(el)] $v ep1 rc=$?"; pick $L/ep1-$v.log ) >> $S 2>&1
done
for v in base tp; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 8 --iters 100 --profile > $L/ep8-$v.log 2>&1; echo "== [$(el)] $v ep8 rc=$?"; pick $L/ep8-$v.log ) >> $S 2>&1
  ( timeout 90 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 200 --sweep-tokens 1,16 > $L/sw-$v.log 2>&1; echo "== [$(el)] $v sweep rc=$?"; pick $L/sw-$v.log ) >> $S 2>&1
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 200 --dispatch bf16 > $L/bf16-$v.log 2>&1; echo "== [$(el)] $v bf16 rc=$?"; pick $L/bf16-$v.log ) >> $S 2>&1
done
for f in gpu_r1_both gpu_virtual_r2 gpu_scales_column gpu_standard_setting gpu_skewed gpu_device_api_r1 gpu_bad_inputs gpu_virtual_r64_r128; do
  ( timeout 200 $X/gpu-tp $f > $L/gpu-tp-$f.log 2>&1; echo "== [$(el)] tp $f rc=$?"; grep -E "FAILED|panicked|failed;|passed;" $L/gpu-tp-$f.log | tail -3 ) >> $S 2>&1
done
echo "[$(el)] done" >> $S
tar czf $OUT/logs.tgz -C $L .
cat $S
