#!/usr/bin/env bash
# run 14 call 4 (run as .gpu/call3.sh, kept here as call4.sh): the final code's GPU checks and figures in one call (from the repo root).
set -u
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export NCCL_NVLS_ENABLE=0
W=$OUT/w; mkdir -p $W; cd .gpu
T0=$SECONDS; left() { echo $(( 560 - (SECONDS - T0) )); }
S=$OUT/summary.txt; : > $S
(OUT=$W/build BESIDE_STEPS=none bash ../scripts/gpu/beside-deepep.sh . DeepEP > $W/build.txt 2>&1) & BP=$!
( timeout 180 ./gpu > $W/gpu.log 2>&1; echo "gpu rc=$?" > $W/gpu.rc
  EP_GPU_FUZZ_MAX_SECS=40 timeout 60 ./gpu_fuzz > $W/fuzz.log 2>&1; echo "fuzz rc=$?" > $W/fuzz.rc ) &
A=$!
( timeout 150 ./gpu_process > $W/proc.log 2>&1; echo "proc rc=$?" > $W/proc.rc
  NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 timeout 90 bash python/gpu.sh . $W/py > $W/py.txt 2>&1; echo "py rc=$?" > $W/py.rc ) &
B=$!
wait $A $B $BP
echo "[$((SECONDS-T0)) s] tests done" >> $S
cat $W/*.rc >> $S; tail -n 2 $W/gpu.log $W/fuzz.log $W/proc.log >> $S 2>/dev/null
grep -hE ' in [0-9.]+s' $W/py/*.log >> $S 2>/dev/null; cat $W/build.txt >> $S
L=$(left); [ $L -gt 150 ] && L=150
OUT=$W/beside BESIDE_STEPS="test bench" BESIDE_TEST_VARIANTS=plain BESIDE_BENCH_ARGS="--host-profile 300" \
  timeout $L bash ../scripts/gpu/beside-deepep.sh . DeepEP > $W/beside.txt 2>&1
echo "[$((SECONDS-T0)) s] beside rc=$?" >> $S; cat $W/beside/beside-summary.txt >> $S 2>/dev/null
for rl in 16:2 16:4 32:2 32:4 64:2 64:4; do
  r=${rl%:*}; l=${rl#*:}; L=$(left); [ $L -lt 20 ] && break; [ $L -gt 40 ] && L=40
  echo "== R=$r L=$l" >> $W/scale-bench.log
  timeout $L ./ep-bench --backend gpu --ranks $r --experts $((r*l)) --masked 0 --iters 30 >> $W/scale-bench.log 2>&1
  echo "rc=$?" >> $W/scale-bench.log
done
grep -E '^== R=|^rc=|kernel time|^per-expert  |^batched  |speed-up \(|msgs' $W/scale-bench.log >> $S
L=$(left); [ $L -gt 60 ] && L=60
[ $L -gt 15 ] && timeout $L ./ep-scale setup --tokens 16 --local 2 --ranks 8,16,32,64,128,256 > $W/scale-setup.log 2>&1
echo "ep-scale rc=$?" >> $S; tail -n 12 $W/scale-setup.log >> $S 2>/dev/null
L=$(left)
if [ $L -gt 40 ]; then
  FAULT_TRANSPORTS=ipc FAULT_TRIALS=4 FAULT_BUDGET_S=$((L-10)) FAULT_LOGDIR=$W/faults timeout $L bash ../scripts/gpu/faults.sh . > $W/faults.log 2>&1
  echo "faults rc=$?" >> $S; grep -A6 'fault summary' $W/faults.log >> $S
fi
echo "[$((SECONDS-T0)) s] end" >> $S
tar -czf $OUT/logs.tgz -C $W . ; cat $S
