#!/usr/bin/env bash
# Validation of `next` (main + one kernel per batched op + combine area T x K) on one H200:
# ep-bench EP1/EP8 (CUPTI), DeepEP's test on ours (hooks), the GPU tests, then the Python suite
# beside the fuzz and the process tests.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$(dirname "$0")" && pwd)
L=$(mktemp -d /tmp/next.XXXX); S=$L/summary.txt
cat $B/BUILD-INFO > $S
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|profile batched +(Dispatch|Combine) (send|recv)|MISMATCH|rror" "$1" | grep -v "^path" | cut -c1-200; }
bench() { local n=$1; shift; timeout 35 $B/ep-bench --backend gpu --masked 0 "$@" > $L/$n.log 2>&1; echo "== $n rc=$?"; pick $L/$n.log; }
{ bench ep1 --ranks 1 --profile; bench ep8 --ranks 8; } >> $S 2>&1
PY=/opt/torch/.venv/bin/python3; SITE=$(mktemp -d)
$PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
PYTHONPATH=$SITE timeout 90 $PY $B/python/deepep_compat/run.py $B/deepep --impl ours --log-dir $L/t -- --num-processes 1 --num-experts 256 > $L/deepep.log 2>&1; echo "deepep test on ours rc=$?" >> $S
sed -n '/^== test_low_latency.py/,$p' $L/deepep.log | tail -30 >> $S; grep -hE "Error" $L/t/*.log 2>/dev/null | head -3 >> $S
( timeout 270 $B/gpu > $L/gpu.log 2>&1; echo "gpu rc=$?"; grep -E "^memory:|gpu tests:" $L/gpu.log; grep -E "FAILED|panicked" $L/gpu.log | head -8 ) >> $S 2>&1
( timeout 130 env OUT=$L NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 bash $B/python/gpu.sh $B $L > $L/python.log 2>&1; echo "python rc=$?"; grep -E " passed| failed|rror" $L/python.log | tail -6 ) > $L/py.sum 2>&1 &
( timeout 50 env EP_GPU_FUZZ_MAX_SECS=40 $B/gpu_fuzz > $L/fuzz.log 2>&1; echo "fuzz rc=$?"; tail -2 $L/fuzz.log
  timeout 70 $B/gpu_process > $L/gpu_process.log 2>&1; echo "gpu_process rc=$?"; tail -1 $L/gpu_process.log; grep -E "FAILED|panicked" $L/gpu_process.log | head -5 ) > $L/fz.sum 2>&1 &
wait; cat $L/py.sum $L/fz.sum >> $S
cp $S $OUT/summary.txt; tar czf $OUT/logs.tgz -C $L . ; cat $S
