#!/usr/bin/env bash
# Validation of 932b27a on one H200: ep-bench figures, Python suite N=1/N=2, GPU tests, process tests.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$(dirname "$0")" && pwd)
cat $B/BUILD-INFO
L=$OUT/logs; mkdir -p $L
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|profile batched +(Dispatch|Combine) recv|MISMATCH|rror" "$1" | grep -v "^path" | cut -c1-200; }
bench() { local n=$1; shift; timeout 40 $B/ep-bench --backend gpu --masked 0 "$@" > $L/$n.log 2>&1; echo "== $n rc=$?"; pick $L/$n.log; }
bench ep1 --ranks 1 --profile
bench ep1_t16 --ranks 1 --tokens 16
bench ep1_t1 --ranks 1 --tokens 1
bench ep8 --ranks 8 --profile
( timeout 150 env OUT=$L NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 bash $B/python/gpu.sh $B $L > $L/python.log 2>&1; echo "python rc=$?"; grep -E "passed|failed|rror" $L/python.log | tail -8 )
( timeout 250 $B/gpu > $L/gpu.log 2>&1; echo "gpu rc=$?"; grep -E "gpu tests:" $L/gpu.log | tail -1; grep -E "FAILED|panicked" $L/gpu.log | head -8; grep -E "^test .* ok" $L/gpu.log | wc -l )
( timeout 70 $B/gpu_process > $L/gpu_process.log 2>&1; echo "gpu_process rc=$?"; tail -1 $L/gpu_process.log; grep -E "FAILED|panicked" $L/gpu_process.log | head -5 )
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
