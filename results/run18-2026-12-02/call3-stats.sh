#!/usr/bin/env bash
# The stats in the kernels and the process's module table: the memory test, the device-API and
# error tests (stats of good and failed calls), the Python suite N=1/N=2 (the late-rank wait
# stats test), ep-bench EP1 (kernel time without stats), DeepEP's test on ours.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$(dirname "$0")" && pwd)
L=$(mktemp -d /tmp/stats.XXXX); S=$L/summary.txt
cat $B/BUILD-INFO > $S
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|MISMATCH|rror" "$1" | grep -v "^path" | cut -c1-200; }
( timeout 35 $B/ep-bench --backend gpu --masked 0 --ranks 1 > $L/ep1.log 2>&1; echo "== ep1 rc=$?"; pick $L/ep1.log ) >> $S 2>&1
( timeout 60 $B/gpu memory_of > $L/memory.log 2>&1; echo "memory rc=$?"; grep -E "^memory:|gpu tests:|panicked" $L/memory.log ) >> $S 2>&1
for f in device_api device_bad graph r1_both virtual_r2 error nccl; do timeout 60 $B/gpu $f > $L/t_$f.log 2>&1; echo "t $f rc=$? $(grep -E 'gpu tests:' $L/t_$f.log)"; grep -E "FAILED|panicked" -A3 $L/t_$f.log | head -8; done >> $S 2>&1
( timeout 150 env OUT=$L NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 bash $B/python/gpu.sh $B $L > $L/python.log 2>&1; echo "python rc=$?"; grep -E " passed| failed|rror" $L/python.log | tail -6; mkdir -p $L/w; timeout 60 env OUT=$L/w NO_BENCH=1 NPROCS=2 SHARE_GPU=1 PYTEST_K=wait_cost PYTEST_ADDOPTS=-rP bash $B/python/gpu.sh $B $L/w > $L/w/python.log 2>&1; grep -hE "waits \[" $L/w/pytest-n2.log | sort | uniq | head -8 ) >> $S 2>&1
PY=/opt/torch/.venv/bin/python3; SITE=$(mktemp -d)
$PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
PYTHONPATH=$SITE timeout 90 $PY $B/python/deepep_compat/run.py $B/deepep --impl ours --log-dir $L/t -- --num-processes 1 --num-experts 256 > $L/deepep.log 2>&1; echo "deepep test on ours rc=$?" >> $S
sed -n '/^== test_low_latency.py/,$p' $L/deepep.log | tail -12 >> $S; grep -hE "Error" $L/t/*.log 2>/dev/null | head -3 >> $S
RSS="$PY -c 'import resource,subprocess,sys,time; t=time.time(); r=subprocess.run(sys.argv[1:]); print(\"elapsed_s %.1f maxrss_kb %d rc %d\" % (time.time()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)); sys.exit(r.returncode)'"
for r in 64 128; do ( eval timeout 80 $RSS $B/ep-bench --backend gpu --masked 0 --ranks $r > $L/ep$r.log 2>&1; echo "== ep-bench --ranks $r rc=$?"; grep -E "elapsed_s|verified|send/recv|not measured|rror|kernel time" $L/ep$r.log | cut -c1-200 ) >> $S 2>&1; done
cp $S $OUT/summary.txt; tar czf $OUT/logs.tgz -C $L . ; cat $S
