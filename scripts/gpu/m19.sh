#!/usr/bin/env bash
# Run 19's measurement call on one H200 (after the gate): DeepEP v1 built beside ours; the Python
# suite on the Python call path (EP_DISPATCH_TORCH_EXT=0, N=1); ep-bench at 64 and 128 virtual
# ranks (wall time, peak resident set); ep-bench EP1 kernel times bf16 and LogFMT with the phase
# profile; DeepEP's test on both (plain, --use-logfmt); bench.py beside DeepEP on the extension
# path and ours on the Python path.   bash scripts/gpu/m19.sh BIN_DIR DEEPEP_SRC
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
export NCCL_NVLS_ENABLE=0
B=$(cd "$1" && pwd); D=$(cd "$2" && pwd)
L=$(mktemp -d /tmp/m19.XXXX); S=$OUT/summary.txt
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
cat $B/BUILD-INFO > $S
PY=/opt/torch/.venv/bin/python3; SITE=/tmp/site-m; rm -rf $SITE; mkdir -p $SITE
$PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
export TORCH_EXTENSIONS_DIR=/tmp/ep-ext
if ! ls $D/deep_ep_cpp*.so > /dev/null 2>&1; then
  ( cd $D && MAX_JOBS=12 TORCH_CUDA_ARCH_LIST=9.0 CPATH=/usr/local/cuda/include/cccl NVCC_APPEND_FLAGS="-I/usr/local/cuda/include/cccl" timeout 200 $PY setup.py build_ext --inplace > $L/deepep-build.log 2>&1; echo "deepep build rc=$? at $(el) s" > $L/build.rc ) &
fi
( timeout 100 env OUT=$L NO_BENCH=1 NPROCS=1 EP_DISPATCH_TORCH_EXT=0 bash $B/python/gpu.sh $B $L > $L/python-path.log 2>&1; echo "[$(el)] python suite N=1 EP_DISPATCH_TORCH_EXT=0 rc=$?"; grep -E " passed| failed|^FAILED|^ERROR" $L/python-path.log | tail -5 ) > $L/a.sum 2>&1
RSS="$PY -c 'import resource,subprocess,sys,time; t=time.time(); r=subprocess.run(sys.argv[1:]); print(\"elapsed_s %.1f maxrss_kb %d rc %d\" % (time.time()-t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, r.returncode)); sys.exit(r.returncode)'"
for r in 64 128; do ( eval timeout 80 $RSS $B/ep-bench --backend gpu --masked 0 --ranks $r > $L/ep$r.log 2>&1; echo "== [$(el)] ep-bench --ranks $r rc=$?"; grep -E "elapsed_s|verified|send/recv|not measured|rror|kernel time" $L/ep$r.log | cut -c1-200 ) >> $L/a.sum 2>&1; done
wait; cat $L/a.sum $L/build.rc >> $S 2>/dev/null; cp $S $OUT/s1.txt
pick() { grep -E "batched.*(kernel time|CUPTI kernel)|speed-up|profile batched +(Dispatch|Combine)|wire|MISMATCH|rror" "$1" | grep -v "^path" | cut -c1-230; }
for m in bf16 logfmt; do a=""; [ $m = logfmt ] && a="--logfmt"; ( timeout 40 $B/ep-bench --backend gpu --masked 0 --ranks 1 --profile $a > $L/ep1_$m.log 2>&1; echo "== [$(el)] ep1 $m rc=$?"; pick $L/ep1_$m.log ) >> $S 2>&1; done
cp $S $OUT/s1.txt
for v in logfmt plain; do extra=""; [ $v = logfmt ] && extra="--use-logfmt"
  echo "== [$(el)] DeepEP's test $extra, --impl both (ours on the extension path)" >> $S
  PYTHONPATH=$SITE timeout 110 $PY $B/python/deepep_compat/run.py $D --impl both --log-dir $L/t-$v -- --num-processes 1 --num-experts 256 $extra > $L/test-$v.log 2>&1; echo "rc=$?" >> $S
  sed -n '/^== test_low_latency.py/,$p' $L/test-$v.log | tail -14 >> $S; grep -hE "Error|assert|Warning" $L/t-$v/*.log 2>/dev/null | head -3 >> $S
  cp $S $OUT/s1.txt
done
left=$(( 560 - $(el) )); echo "== [$(el)] bench.py --impl both, extension path (limit $left s)" >> $S
[ $left -gt 20 ] && PYTHONPATH="$D:$SITE" timeout $left $PY $B/python/bench.py --impl both --experts 256 --masked 0 > $L/bench.log 2>&1; echo "rc=$?" >> $S
grep -E '^\[rank|^==|call path' $L/bench.log | grep -v Guessing | tail -n 12 >> $S
left=$(( 575 - $(el) )); echo "== [$(el)] bench.py ours, EP_DISPATCH_TORCH_EXT=0 (limit $left s)" >> $S
[ $left -gt 20 ] && PYTHONPATH="$SITE" EP_DISPATCH_TORCH_EXT=0 timeout $left $PY $B/python/bench.py --experts 256 --masked 0 > $L/bench0.log 2>&1; echo "rc=$?" >> $S
grep -E '^\[rank|^==|call path' $L/bench0.log | grep -v Guessing | tail -n 6 >> $S
echo "[$(el)] done" >> $S; rm -f $OUT/s1.txt
tar czf $OUT/logs.tgz -C $L --exclude='*.so' . ; cat $S
