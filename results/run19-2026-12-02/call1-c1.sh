#!/usr/bin/env bash
# Run 19 call 1: validate v5 (main + faster LogFMT + combine wait-cost stats) on one H200, beside
# DeepEP built in the same call. Summary written as it goes.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$(dirname "$0")" && pwd)
L=$(mktemp -d /tmp/c1.XXXX); S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
cat $B/BUILD-INFO > $S
PY=/opt/torch/.venv/bin/python3; SITE=/tmp/site; mkdir -p $SITE
$PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
( cd $B/deepep && MAX_JOBS=12 TORCH_CUDA_ARCH_LIST=9.0 CPATH=/usr/local/cuda/include/cccl NVCC_APPEND_FLAGS="-I/usr/local/cuda/include/cccl" timeout 200 $PY setup.py build_ext --inplace > $L/deepep-build.log 2>&1; echo "deepep build rc=$? at $(el) s" > $L/build.rc ) &
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|profile batched +(Dispatch|Combine)|wire|MISMATCH|rror" "$1" | grep -v "^path" | cut -c1-220; }
( timeout 100 $B/gpu gpu_logfmt > $L/logfmt.log 2>&1; echo "[$(el)] logfmt rc=$?"; grep -E "gpu tests:|SKIPPED" $L/logfmt.log | tail -4; grep -E "FAILED|panicked" -A4 $L/logfmt.log | head -12 ) > $L/a.sum 2>&1 &
( timeout 80 $B/gpu device_api > $L/devapi.log 2>&1; echo "[$(el)] device_api rc=$?"; grep -E "gpu tests:" $L/devapi.log; grep -E "FAILED|panicked" -A4 $L/devapi.log | head -12 ) > $L/b.sum 2>&1 &
( mkdir -p $L/w; timeout 90 env OUT=$L/w NO_BENCH=1 NPROCS=2 SHARE_GPU=1 PYTEST_K="wait_cost or logfmt" PYTEST_ADDOPTS=-rP bash $B/python/gpu.sh $B $L/w > $L/w/python.log 2>&1; echo "[$(el)] py n2 wait_cost/logfmt rc=$?"; grep -hE "waits \[| passed| failed|^FAILED" $L/w/pytest-n2.log | sort | uniq | head -12 ) > $L/c.sum 2>&1 &
wait; cat $L/a.sum $L/b.sum $L/c.sum $L/build.rc >> $S; cp $S $OUT/s1.txt
for m in bf16 logfmt; do a=""; [ $m = logfmt ] && a="--logfmt"; ( timeout 40 $B/ep-bench --backend gpu --masked 0 --ranks 1 --profile $a > $L/ep1_$m.log 2>&1; echo "== [$(el)] ep1 $m rc=$?"; pick $L/ep1_$m.log ) >> $S 2>&1; done
cp $S $OUT/s1.txt
for v in logfmt plain; do extra=""; [ $v = logfmt ] && extra="--use-logfmt"
  echo "== [$(el)] DeepEP test $extra, both" >> $S
  timeout 110 $PY $B/python/deepep_compat/run.py $B/deepep --impl both --log-dir $L/t-$v -- --num-processes 1 --num-experts 256 $extra > $L/test-$v.log 2>&1; echo "rc=$?" >> $S
  sed -n '/^== test_low_latency.py/,$p' $L/test-$v.log | tail -14 >> $S; grep -hE "Error|assert" $L/t-$v/*.log 2>/dev/null | head -3 >> $S
  cp $S $OUT/s1.txt
done
left=$(( 575 - $(el) )); echo "== [$(el)] bench.py both (limit $left s)" >> $S
[ $left -gt 20 ] && PYTHONPATH="$B/deepep:$SITE" timeout $left $PY $B/python/bench.py --impl both --experts 256 --masked 0 > $L/bench.log 2>&1; echo "rc=$?" >> $S
grep -E '^\[rank|^==|impl|Host|Graph|Event' $L/bench.log | tail -n 20 >> $S
echo "[$(el)] done" >> $S; rm -f $OUT/s1.txt
tar czf $OUT/logs.tgz -C $L --exclude='*.so' . ; cat $S
