#!/usr/bin/env bash
# LogFMT on the GPU and the stats: the LogFMT GPU tests, the Python suite N=1/N=2 (LogFMT, the
# late-rank wait stats), ep-bench EP1 bf16 and --logfmt (CUPTI), DeepEP's test on ours with
# --use-logfmt, then the whole GPU test suite for regressions. The summary is written as it goes.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$(dirname "$0")" && pwd)
L=$(mktemp -d /tmp/final.XXXX); S=$OUT/summary.txt
cat $B/BUILD-INFO > $S
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|profile batched +Combine|wire|MISMATCH|rror" "$1" | grep -v "^path" | cut -c1-220; }
( timeout 90 $B/gpu gpu_logfmt > $L/logfmt.log 2>&1; echo "logfmt rc=$?"; grep -E "^ok|gpu tests:|SKIPPED" $L/logfmt.log | tail -12; grep -E "FAILED|panicked" -A4 $L/logfmt.log | head -12 ) >> $S 2>&1
( timeout 110 env OUT=$L NO_BENCH=1 NPROCS="1 2" SHARE_GPU=1 bash $B/python/gpu.sh $B $L > $L/python.log 2>&1; echo "python rc=$?"; grep -E " passed| failed|^FAILED|^ERROR" $L/python.log | tail -8 ) >> $S 2>&1
( mkdir -p $L/w; timeout 40 env OUT=$L/w NO_BENCH=1 NPROCS=2 SHARE_GPU=1 PYTEST_K=wait_cost PYTEST_ADDOPTS=-rP bash $B/python/gpu.sh $B $L/w > $L/w/python.log 2>&1; echo "wait-cost rc=$?"; grep -hE "waits \[| passed| failed" $L/w/pytest-n2.log | sort | uniq | head -10 ) >> $S 2>&1
for m in bf16 logfmt; do a=""; [ $m = logfmt ] && a="--logfmt"; ( timeout 35 $B/ep-bench --backend gpu --masked 0 --ranks 1 --profile $a > $L/ep1_$m.log 2>&1; echo "== ep1 $m rc=$?"; pick $L/ep1_$m.log ) >> $S 2>&1; done
PY=/opt/torch/.venv/bin/python3; SITE=$(mktemp -d)
$PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
PYTHONPATH=$SITE timeout 80 $PY $B/python/deepep_compat/run.py $B/deepep --impl ours --log-dir $L/t -- --num-processes 1 --num-experts 256 --use-logfmt > $L/deepep.log 2>&1; echo "deepep test --use-logfmt on ours rc=$?" >> $S
sed -n '/^== test_low_latency.py/,$p' $L/deepep.log | tail -12 >> $S; grep -hE "Error|assert" $L/t/*.log 2>/dev/null | head -3 >> $S
tar czf $OUT/logs1.tgz -C $L .
( timeout 60 $B/gpu device_api > $L/gpu.log 2>&1; echo "gpu device_api rc=$?"; grep -E "gpu tests:" $L/gpu.log; grep -E "FAILED|panicked|INCOMPLETE" -A3 $L/gpu.log | head -12; grep -cE "^test .* ok" $L/gpu.log ) >> $S 2>&1
tar czf $OUT/logs.tgz -C $L . ; rm -f $OUT/logs1.tgz; cat $S
