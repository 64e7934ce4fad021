#!/usr/bin/env bash
# Run 19 call 5: a second and third sample of DeepEP's test beside DeepEP (ours on the C++
# extension path), and bench.py --impl both once more.   bash scripts/gpu/r19c5.sh BIN_DIR DEEPEP_SRC
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:$LD_LIBRARY_PATH
B=$(cd "$1" && pwd); D=$(cd "$2" && pwd); S=$OUT/summary.txt; L=$(mktemp -d)
T0=$EPOCHREALTIME; el() { awk -v a="$T0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%d", b - a }'; }
cat $B/BUILD-INFO > $S
PY=/opt/torch/.venv/bin/python3; SITE=/tmp/site-c5; mkdir -p $SITE
$PY -m pip install -q --no-deps --no-index --target $SITE $B/ep_dispatch-*.whl
export TORCH_EXTENSIONS_DIR=/tmp/ep-ext EP_DISPATCH_TORCH_EXT=1
ls $D/deep_ep_cpp*.so > /dev/null 2>&1 || (cd $D && MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0 CPATH=/usr/local/cuda/include/cccl NVCC_APPEND_FLAGS="-I/usr/local/cuda/include/cccl" timeout 200 $PY setup.py build_ext --inplace > $L/deepep-build.log 2>&1; echo "deepep build rc=$? at $(el) s" >> $S)
for i in 1 2; do
  echo "== [$(el)] DeepEP's test, --impl both, sample $i" >> $S
  PYTHONPATH=$SITE timeout 110 $PY $B/python/deepep_compat/run.py $D --impl both --log-dir $L/t$i -- --num-processes 1 --num-experts 256 > $L/test$i.log 2>&1; echo "rc=$?" >> $S
  sed -n '/^== test_low_latency.py/,$p' $L/test$i.log | tail -12 >> $S; grep -h "avg_t=" $L/t$i/*.log | grep "Dispatch + combine" | head -2 >> $S
done
left=$(( 570 - $(el) )); echo "== [$(el)] bench.py --impl both (limit $left s)" >> $S
[ $left -gt 20 ] && PYTHONPATH="$D:$SITE" timeout $left $PY $B/python/bench.py --impl both --experts 256 --masked 0 > $L/bench.log 2>&1; echo "rc=$?" >> $S
grep -E '^\[rank|^==' $L/bench.log | grep -v Guessing | tail -n 10 >> $S
echo "[$(el)] done" >> $S; tar czf $OUT/logs.tgz -C $L --exclude='*.so' . ; cat $S
