#!/usr/bin/env bash
# Session 7 call 4 (main 7c33c33 + issue 30's native receive hook): the one-entry IoTable build
# (1io) beside base's 32-entry one at EP1; launch_cost.py; 1io's GPU tests where one rank runs on
# the GPU; the Python suite N=1 on the extension path; bench.py ours alone (host enqueue).
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
X=$(cd "$(dirname "$0")" && pwd); B=$(cd $X/.. && pwd); L=/tmp/c4; mkdir -p $L; S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|batched.*send/recv|empty kernel|MISMATCH|rror" "$1" | cut -c1-230; }
PY=/opt/torch/.venv/bin/python3; export TORCH_EXTENSIONS_DIR=/tmp/ep-ext
for v in base 1io base 1io; do
  ( timeout 60 $X/ep-bench-$v --backend gpu --masked 0 --ranks 1 --iters 300 --profile > $L/ep1-$v.log 2>&1; echo "== [$(el)] $v ep1 rc=$?"; pick $L/ep1-$v.log ) >> $S 2>&1
done
for f in gpu_r1_both gpu_standard_setting gpu_device_api_r1 gpu_graph gpu_error_reaches gpu_1000_consecutive gpu_logfmt_r1 gpu_rank_ep_process; do
  ( timeout 100 $X/gpu-1io $f > $L/gpu-1io-$f.log 2>&1; echo "== [$(el)] 1io $f rc=$?"; grep -E "FAILED|panicked|failed;|passed;" $L/gpu-1io-$f.log | tail -3 ) >> $S 2>&1
done
( timeout 150 $PY python/launch_cost.py > $L/launch_cost.log 2>&1; echo "== [$(el)] launch_cost rc=$?"; tail -14 $L/launch_cost.log ) >> $S 2>&1
( timeout 170 env OUT=$L NO_BENCH=1 NPROCS=1 EP_DISPATCH_TORCH_EXT=1 bash $B/python/gpu.sh $B $L > $L/pytest.log 2>&1; echo "== [$(el)] python N=1 ext rc=$?"; grep -E " passed| failed|^FAILED|^ERROR" $L/pytest.log | tail -6 ) >> $S 2>&1
SITE=/tmp/site4; $PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
( PYTHONPATH=$SITE timeout 120 $PY $B/python/bench.py --experts 256 --masked 0 > $L/bench.log 2>&1; echo "== [$(el)] bench.py ours rc=$?"; grep -E '^\[rank|^==|call path' $L/bench.log | grep -v Guessing | tail -8 ) >> $S 2>&1
echo "[$(el)] done" >> $S
tar czf $OUT/logs.tgz -C $L --exclude='*.so' .
cat $S
