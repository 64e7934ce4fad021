#!/usr/bin/env bash
# A module per batched stage: ep-bench EP1/EP8 (CUPTI), DeepEP's test on ours (hooks), the memory
# test, the Python suite N=1/N=2, the GPU tests of graphs and halves.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$(dirname "$0")" && pwd)
L=$(mktemp -d /tmp/stage.XXXX); S=$L/summary.txt
cat $B/BUILD-INFO > $S
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|profile batched +(Dispatch|Combine) (send|recv)|MISMATCH|rror" "$1" | grep -v "^path" | cut -c1-200; }
bench() { local n=$1; shift; timeout 35 $B/ep-bench --backend gpu --masked 0 "$@" > $L/$n.log 2>&1; echo "== $n rc=$?"; pick $L/$n.log; }
{ bench ep1 --ranks 1 --profile; bench ep8 --ranks 8; bench ep1_t16 --ranks 1 --tokens 16; bench ep1_t1 --ranks 1 --tokens 1; } >> $S 2>&1
PY=/opt/torch/.venv/bin/python3; SITE=$(mktemp -d)
$PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
PYTHONPATH=$SITE timeout 90 $PY $B/python/deepep_compat/run.py $B/deepep --impl ours --log-dir $L/t -- --num-processes 1 --num-experts 256 > $L/deepep.log 2>&1; echo "deepep test on ours rc=$?" >> $S
sed -n '/^== test_low_latency.py/,$p' $L/deepep.log | tail -12 >> $S; grep -hE "Error" $L/t/*.log 2>/dev/null | head -3 >> $S
( timeout 60 $B/gpu memory_of > $L/memory.log 2>&1; echo "memory rc=$?"; grep -E "^memory:|gpu tests:|panicked" $L/memory.log ) >> $S 2>&1
( timeout 120 env OUT=$L NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 bash $B/python/gpu.sh $B $L > $L/python.log 2>&1; echo "python rc=$?"; grep -E " passed| failed|rror" $L/python.log | tail -6 ) >> $S 2>&1
for f in graph r1_both virtual_r2; do timeout 40 $B/gpu $f > $L/t_$f.log 2>&1; echo "t $f rc=$? $(grep -E 'gpu tests:' $L/t_$f.log)"; grep -E "FAILED|panicked" $L/t_$f.log | head -3; done >> $S 2>&1
cp $S $OUT/summary.txt; tar czf $OUT/logs.tgz -C $L . ; cat $S
