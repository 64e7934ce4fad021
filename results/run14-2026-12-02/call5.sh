#!/usr/bin/env bash
set -u
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
cd .gpu; T0=$SECONDS; S=$OUT/summary.txt; : > $S
left() { echo $(( 185 - (SECONDS - T0) )); }
timeout 40 ./ep-scale setup --tokens 8 --local 1 --ranks 256 > $OUT/scale-setup-r256.log 2>&1; echo "ep-scale rc=$?" >> $S
tail -n 4 $OUT/scale-setup-r256.log >> $S
for rl in 64:2 64:4 32:4; do
  r=${rl%:*}; l=${rl#*:}; L=$(left); [ $L -lt 25 ] && break; [ $L -gt 75 ] && L=75
  echo "== R=$r L=$l ($((SECONDS-T0)) s)" >> $OUT/ep-bench.log
  timeout $L ./ep-bench --backend gpu --ranks $r --experts $((r*l)) --masked 0 --iters 10 >> $OUT/ep-bench.log 2>&1
  echo "rc=$? ($((SECONDS-T0)) s)" >> $OUT/ep-bench.log
done
grep -E '^== R=|^rc=|^\[T|kernel time|^per-expert  |^batched  |speed-up \(' $OUT/ep-bench.log >> $S
cat $S
