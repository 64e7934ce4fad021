#!/usr/bin/env bash
# Experiment: baseline (.gpu) vs slimmed receive kernels (.gpux), with and without EP_PLAIN.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
X=$(cd "$(dirname "$0")" && pwd); B=$X/../.gpu
L=$OUT/logs; mkdir -p $L
pick() { grep -E "profile batched|batched.*(kernel time|CUPTI kernel)|speed-up|MISMATCH|error|Error" "$1" | grep -v "^path" | cut -c1-230; }
bench() { local n=$1 bin=$2; shift 2; timeout 100 $bin --backend gpu --masked 0 "$@" > $L/$n.log 2>&1; echo "== $n rc=$?"; pick $L/$n.log; }
bench base_ep1 $B/ep-bench --ranks 1 --profile
bench v1_ep1 $X/ep-bench --ranks 1 --profile
EP_EXPERIMENT_DEFINES="#define EP_PLAIN 1" bench v2_ep1 $X/ep-bench --ranks 1 --profile
bench v1_ep8 $X/ep-bench --ranks 8 --profile
EP_EXPERIMENT_DEFINES="#define EP_PLAIN 1" bench v2_ep8 $X/ep-bench --ranks 8 --profile
bench base_ep8 $B/ep-bench --ranks 8 --profile
for f in r1_both virtual_r2_r4_r8 scales_column standard_setting device_api_r1 graph skewed 1000_consecutive error_reaches fp8_cast; do
  timeout 60 $X/gpu $f > $L/t_$f.log 2>&1; echo "t $f rc=$? $(grep -E 'gpu tests:' $L/t_$f.log)"; grep -iE "FAILED|panick|mismatch" $L/t_$f.log | head -3
done
for f in r1_both virtual_r2_r4_r8 standard_setting graph; do
  EP_EXPERIMENT_DEFINES="#define EP_PLAIN 1" timeout 60 $X/gpu $f > $L/tp_$f.log 2>&1; echo "tplain $f rc=$? $(grep -E 'gpu tests:' $L/tp_$f.log)"; grep -iE "FAILED|panick|mismatch" $L/tp_$f.log | head -3
done
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $L
