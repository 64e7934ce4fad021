#!/usr/bin/env bash
# Validation of unvalidated commits: gpu tests, gpu_process, Python N=1/N=2, ep-bench EP1 profile.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$(dirname "$0")" && pwd)
cat $B/BUILD-INFO
L=$OUT/logs; mkdir -p $L
( timeout 150 $B/gpu > $L/gpu.log 2>&1; echo "gpu rc=$?"; tail -2 $L/gpu.log; grep -iE "FAIL|panick" $L/gpu.log | head -5 )
( timeout 90 $B/gpu_process > $L/gpu_process.log 2>&1; echo "gpu_process rc=$?"; tail -2 $L/gpu_process.log; grep -iE "FAIL|panick" $L/gpu_process.log | head -5 )
( timeout 40 $B/ep-bench --backend gpu --ranks 1 --masked 0 --iters 200 --profile > $L/ep1.log 2>&1; echo "ep1 rc=$?"; grep -E "profile batched|empty kernel, CUPTI|batched.*(kernel time|CUPTI kernel)|speed-up" $L/ep1.log )
( timeout 170 env OUT=$L NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 bash $B/python/gpu.sh $B $L > $L/python.log 2>&1; echo "python rc=$?"; grep -E "passed|failed|error" $L/python.log | tail -6 )
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
