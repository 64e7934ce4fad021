#!/usr/bin/env bash
# Session 8 call 8: the final code beside DeepEP v1 (567632d, built here from .deepep): ep-bench
# EP1 (bf16 row- and column-major scales, LogFMT, with the phase profile), T = 1 and 16 (column-
# major), EP8 at E = 256 and 288; DeepEP's test_low_latency.py on ours and on DeepEP (plain,
# --use-logfmt); bench.py --impl both.
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
X=$(cd "$(dirname "$0")" && pwd); B=$(cd $X/.. && pwd); D=$(cd .deepep && pwd)
L=/tmp/c8; mkdir -p $L; S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
cat $B/BUILD-INFO > $S
PY=/opt/torch/.venv/bin/python3; SITE=/tmp/site8; rm -rf $SITE; mkdir -p $SITE
$PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
export TORCH_EXTENSIONS_DIR=/tmp/ep-ext
( cd $D && MAX_JOBS=14 TORCH_CUDA_ARCH_LIST=9.0 CPATH=/usr/local/cuda/include/cccl NVCC_APPEND_FLAGS="-I/usr/local/cuda/include/cccl" timeout 200 $PY setup.py build_ext --inplace > $L/deepep-build.log 2>&1; echo "deepep build rc=$? at $(el) s" > $L/build.rc ) &
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|batched.*send/recv.*CUPTI|speed-up|profile batched +(Dispatch|Combine)|wire|MISMATCH|rror" "$1" | grep -v "^path" | cut -c1-230; }
( timeout 40 $B/ep-bench --backend gpu --masked 0 --ranks 1 --iters 300 --profile > $L/ep1.log 2>&1; echo "== [$(el)] ep1 bf16 rc=$?"; pick $L/ep1.log ) >> $S 2>&1
( timeout 40 $B/ep-bench --backend gpu --masked 0 --ranks 1 --iters 300 --profile --scales-column-major > $L/ep1col.log 2>&1; echo "== [$(el)] ep1 bf16 column-major scales rc=$?"; pick $L/ep1col.log ) >> $S 2>&1
( timeout 40 $B/ep-bench --backend gpu --masked 0 --ranks 1 --iters 300 --profile --logfmt > $L/ep1lf.log 2>&1; echo "== [$(el)] ep1 logfmt rc=$?"; pick $L/ep1lf.log ) >> $S 2>&1
( timeout 60 $B/ep-bench --backend gpu --masked 0 --ranks 1 --iters 200 --sweep-tokens 1,16 --scales-column-major > $L/sw.log 2>&1; echo "== [$(el)] T=1,16 rc=$?"; pick $L/sw.log ) >> $S 2>&1
( timeout 40 $B/ep-bench --backend gpu --masked 0 --ranks 8 --iters 100 > $L/ep8.log 2>&1; echo "== [$(el)] ep8 E=256 rc=$?"; pick $L/ep8.log ) >> $S 2>&1
( timeout 40 $B/ep-bench --backend gpu --ranks 8 --experts 288 --iters 100 > $L/ep8s.log 2>&1; echo "== [$(el)] ep8 seed config (E=288, 5% masked) rc=$?"; pick $L/ep8s.log ) >> $S 2>&1
( timeout 90 $B/gpu_process > $L/gpu_process.log 2>&1; echo "== [$(el)] gpu_process (one rank a process: the one-entry IoTable build) rc=$?"; grep -E "FAILED|panicked|failed;|passed;" $L/gpu_process.log | tail -3 ) >> $S 2>&1
wait; cat $L/build.rc >> $S
for v in plain logfmt; do extra=""; [ $v = logfmt ] && extra="--use-logfmt"
  echo "== [$(el)] DeepEP's test $extra, --impl both (ours on the extension path)" >> $S
  PYTHONPATH=$SITE timeout 120 $PY $B/python/deepep_compat/run.py $D --impl both --log-dir $L/t-$v -- --num-processes 1 --num-experts 256 $extra > $L/test-$v.log 2>&1; echo "rc=$?" >> $S
  sed -n '/^== test_low_latency.py/,$p' $L/test-$v.log | tail -14 >> $S; grep -hE "Error|assert" $L/t-$v/*.log 2>/dev/null | head -3 >> $S
done
echo "== [$(el)] bench.py --impl both, extension path" >> $S
PYTHONPATH="$D:$SITE" timeout 150 $PY $B/python/bench.py --impl both --experts 256 --masked 0 > $L/bench.log 2>&1; echo "rc=$?" >> $S
grep -E '^\[rank|^==|call path' $L/bench.log | grep -v Guessing | tail -n 12 >> $S
echo "[$(el)] done" >> $S
tar czf $OUT/logs.tgz -C $L --exclude='*.so' . ; cat $S
