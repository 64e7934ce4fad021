#!/usr/bin/env bash
# The memory test and the Python suite after 4998c33's fixes, then ours beside DeepEP (its test, bench.py).
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$(dirname "$0")" && pwd)
REPO=$(pwd)
W=$(mktemp -d /tmp/final.XXXX)
cat "$B/BUILD-INFO" | tee "$W/summary.txt"
( timeout 60 $B/gpu memory_of > $W/memory.log 2>&1; echo "memory rc=$?"; grep -E "^memory:|gpu tests:|panicked" $W/memory.log ) | tee -a "$W/summary.txt"
( timeout 90 env OUT=$W NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 bash $B/python/gpu.sh $B $W > $W/python.log 2>&1; echo "python rc=$?"; grep -E " passed| failed" $W/python.log | tail -4 ) | tee -a "$W/summary.txt"
OUT=$W BESIDE_STEPS="test bench" BESIDE_TEST_VARIANTS=plain timeout 330 bash "$REPO/scripts/gpu/beside-deepep.sh" "$B" "$B/deepep" > "$W/beside.out" 2>&1
echo "beside rc=$?" >> "$W/summary.txt"
cat "$W/beside-summary.txt" >> "$W/summary.txt"
tar -czf "$OUT/final-logs.tgz" -C "$W" .
cp "$W/summary.txt" "$OUT/summary.txt"
cat "$OUT/summary.txt"
