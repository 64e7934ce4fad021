#!/usr/bin/env bash
# Fault runs of process mode, on the GPU machine.
#
#   bash scripts/gpu/faults.sh BIN_DIR        (BIN_DIR holds the ep-bench binary)
#
# Two processes (ranks 0 and 1 of `ep-bench --nprocs`, started here with the torchrun-style environment
# that ep_launch::spawn_local sets, so this script holds each rank's pid) run a small config:
# rendezvous, group set-up, bitwise-checked rounds, then back-to-back calls of both paths. A
# fault-free baseline run gives the run's wall time W and, from rank 0's per-path lines
# (`avg_t=... us | Combine ..., avg_t=... us`), the timed calls' share P at its end; each trial
# waits a random W - 0.3 s - u (P + 0.2 s) (a random point of a call; without those figures, a
# random 0.25 W to 0.95 W), then one rank, chosen at random, is
#   kill : killed with SIGKILL (kill -9), or
#   stall: stopped with SIGSTOP (alive, holding its buffers and sockets, doing nothing);
# the survivor must then exit on its own within the limit, with an error that names the lost
# rank ("rank <victim>"). Detect time = fault to the survivor's exit. The stopped rank is killed
# afterwards. After each transport's trials a fresh group on the same GPUs
# (`ep-bench --nprocs 2 --rounds 1 --iters 1`, outputs checked bitwise) shows they are usable
# (each trial also starts new groups on them, but a failure there would read as the fault's).
#
# Transports: ipc (NVLink/peer memory through CUDA IPC; with one GPU both ranks share it) and
# nccl (needs one rank per GPU, so two GPUs; skipped with a reason on one).
#
# Environment: FAULT_TRIALS (10 per transport x fault), FAULT_TIMEOUT_MS (the GPU wait bound,
# 1500), FAULT_DETECT_LIMIT_S (how long a survivor may take, whole seconds; default the wait
# bound + 1 s rounded up: ep_group::mp bounds every host wait after the group
# forms by the job's wait bound, barriers included), FAULT_BUDGET_S (the whole script, 150: trials that no longer fit
# are skipped and counted), FAULT_ITERS (timed calls per path and op; default 100 on one GPU,
# where time-sliced processes take ~4.4 ms a call, 3000 on two), FAULT_SEED (bash RANDOM seed),
# FAULT_TRANSPORTS (default "ipc nccl"), FAULT_KINDS (default "kill stall"), FAULT_LOGDIR
# (per-trial rank logs, with the ranks' EP_MP_TRACE progress lines; default a temporary folder),
# FAULT_GPUS (GPU count, default from nvidia-smi; with none the script prints SKIPPED and exits 0).
#
# Exit status: 0 when every injected fault ended on the survivor within the limit naming the
# lost rank and every usable-check passed; 1 otherwise; 2 on bad usage.

set -u
BIN=${1:-}
if [ -z "$BIN" ] || [ ! -x "$BIN/ep-bench" ]; then
  echo "usage: $0 BIN_DIR (with an executable BIN_DIR/ep-bench)" >&2
  exit 2
fi
MP=$(cd "$BIN" && pwd)/ep-bench
TRIALS=${FAULT_TRIALS:-10}
TMO=${FAULT_TIMEOUT_MS:-1500}
LIMIT=${FAULT_DETECT_LIMIT_S:-$(( (TMO + 1999) / 1000 ))}
case "$LIMIT" in ''|*[!0-9]*) echo "FAULT_DETECT_LIMIT_S: whole seconds, got '$LIMIT'" >&2; exit 2 ;; esac
BUDGET=${FAULT_BUDGET_S:-150}
TRANSPORTS=${FAULT_TRANSPORTS:-ipc nccl}
KINDS=${FAULT_KINDS:-kill stall}
case " $TRANSPORTS " in *" ipc "*|*" nccl "*) ;; *) echo "FAULT_TRANSPORTS: expected ipc and/or nccl, got '$TRANSPORTS'" >&2; exit 2 ;; esac
RANDOM=${FAULT_SEED:-$$}
LOGDIR=${FAULT_LOGDIR:-$(mktemp -d /tmp/ep-faults.XXXXXX)}
mkdir -p "$LOGDIR"
NG=${FAULT_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}
NG=${NG:-0}
if [ "$NG" -lt 1 ]; then
  echo "SKIPPED: fault trials: no GPU (nvidia-smi lists none; FAULT_GPUS=N overrides, for testing the script)"
  exit 0
fi
if [ "$NG" -ge 2 ]; then GPUS=2; ITERS=${FAULT_ITERS:-3000}; else GPUS=1; ITERS=${FAULT_ITERS:-100}; fi
# A small config: set-up and checks are quick, the timed calls are most of the run.
# (ep-gpu-mp's configuration before it folded into ep-bench: seed 7, 5% masked slots.)
SMALL=(--experts 8 --tokens 16 --hidden 512 --top-k 4 --dispatch fp8 --seed 7 --masked 0.05)
CFG=("${SMALL[@]}" --rounds 2 --timeout-secs "$(awk -v t="$TMO" 'BEGIN { printf "%.3f", t / 1000 }')")
T_START=$EPOCHREALTIME
PORT=$(( 20000 + RANDOM % 20000 ))

now() { echo "$EPOCHREALTIME"; }
elapsed() { awk -v a="$T_START" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
left() { awk -v a="$T_START" -v b="$EPOCHREALTIME" -v t="$BUDGET" 'BEGIN { printf "%d", t - (b - a) }'; }
log() { echo "[faults $(elapsed) s] $*"; }

RESULTS="$LOGDIR/results.tsv"   # block fault trial victim delay_s status detect_s rc named message
: > "$RESULTS"
USABLE="$LOGDIR/usable.tsv"      # block rc seconds
: > "$USABLE"
declare -a PIDS=()               # ep-bench pids of the running trial (for cleanup)
CUR=""                           # that trial's folder

# Kills (by pid) the ranks of the current trial that are still running. A pid is signalled only
# while its wrapper has not reaped it (no exit file yet), so it cannot have been reused.
cleanup() {
  local r
  for r in 0 1; do
    if [ -n "${PIDS[$r]:-}" ] && [ -n "$CUR" ] && [ ! -s "$CUR/r$r.exit" ]; then
      kill -9 "${PIDS[$r]}" 2>/dev/null
    fi
  done
  wait 2>/dev/null
  PIDS=()
}

# start_rank DIR RANK TRANSPORT PORT: one rank in the background; its wrapper writes
# DIR/rRANK.pid (the ep-bench pid) and, when it ends, DIR/rRANK.exit ("rc end-time").
start_rank() {
  local dir=$1 r=$2 tr=$3 port=$4
  (
    env -u TORCHELASTIC_RUN_ID -u EP_RDZV_PORT \
      RANK="$r" WORLD_SIZE=2 LOCAL_RANK="$r" LOCAL_WORLD_SIZE=2 \
      MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" EP_LAUNCHER=ep-launch EP_MP_TRACE=1 \
      "$MP" --transport "$tr" --gpus "$GPUS" --iters "$ITERS" "${CFG[@]}" \
      > "$dir/r$r.log" 2>&1 &
    echo $! > "$dir/r$r.pid"
    wait $!
    echo "$? $EPOCHREALTIME" > "$dir/r$r.exit"
  ) 2>>"$dir/wrapper.log" &
}

# pid_of DIR RANK: waits (at most 5 s) for the wrapper to write the pid.
pid_of() {
  local i
  for i in $(seq 1 500); do
    [ -s "$1/r$2.pid" ] && { cat "$1/r$2.pid"; return 0; }
    sleep 0.01
  done
  return 1
}

# wait_exit DIR RANK LIMIT_S: 0 once DIR/rRANK.exit exists (within LIMIT_S), else 1.
wait_exit() {
  local dir=$1 r=$2 until
  until=$(awk -v n="$EPOCHREALTIME" -v l="$3" 'BEGIN { printf "%.3f", n + l }')
  while [ ! -s "$dir/r$r.exit" ]; do
    if awk -v n="$EPOCHREALTIME" -v u="$until" 'BEGIN { exit !(n > u) }'; then
      return 1
    fi
    sleep 0.02
  done
  return 0
}

# One fault-free run (name, --transport value): sets W0 to its wall time in seconds, or
# returns 1.
W0=""
baseline() {
  local name=$1 tr=$2 dir="$LOGDIR/$1-baseline" t0 r rc ok=0
  mkdir -p "$dir"
  PORT=$((PORT + 2))
  t0=$(now)
  CUR=$dir
  start_rank "$dir" 0 "$tr" "$PORT"
  start_rank "$dir" 1 "$tr" "$PORT"
  PIDS=("$(pid_of "$dir" 0)" "$(pid_of "$dir" 1)")
  for r in 0 1; do
    if ! wait_exit "$dir" "$r" 90; then ok=1; fi
  done
  cleanup
  for r in 0 1; do
    rc=$(cut -d' ' -f1 "$dir/r$r.exit" 2>/dev/null)
    [ "${rc:-x}" = 0 ] || ok=1
  done
  if [ "$ok" != 0 ]; then
    log "baseline $name FAILED (no fault injected): rank logs in $dir"
    tail -n 5 "$dir"/r0.log "$dir"/r1.log | sed 's/^/    /'
    return 1
  fi
  W0=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.2f", b - a }')
  # The timed calls' share of the run, from rank 0's per-path lines (us per call of each op and
  # path, ITERS calls plus 5 warm-ups each): P seconds at the end of the run, before teardown.
  P=$(grep -oE 'avg_t=[0-9.]+ us \| Combine bandwidth: [^,]+, avg_t=[0-9.]+' "$dir/r0.log" \
    | sed -E 's/^avg_t=([0-9.]+) us .*avg_t=([0-9.]+)$/\1 \2/' \
    | awk -v n="$ITERS" '{ s += $1 + $2 } END { printf "%.3f", s * (n + 5) / 1e6 }')
}
P=0

# One trial: name, --transport value, fault (kill|stall), trial number, baseline wall time.
trial() {
  local name=$1 tr=$2 fault=$3 n=$4 w0=$5
  local dir="$LOGDIR/$name-$fault-$n" victim survivor frac delay vpid t_inj status detect rc named msg lim
  mkdir -p "$dir"
  CUR=$dir
  victim=$(( RANDOM % 2 )); survivor=$(( 1 - victim ))
  PORT=$((PORT + 2))
  start_rank "$dir" 0 "$tr" "$PORT"
  start_rank "$dir" 1 "$tr" "$PORT"
  PIDS=("$(pid_of "$dir" 0)" "$(pid_of "$dir" 1)")
  vpid=${PIDS[$victim]}
  # Faults land in the calls, after both ranks formed the group (EP_MP_TRACE's "group formed"
  # line): forming it is bounded by the set-up bound (30 s: kernels compile, NCCL connects), not
  # by the wait bound the survivor limit is made of, so a fault there is another experiment.
  # Then a random point of the calls: u * (P + 0.2 s), P the timed calls' share of the
  # baseline; without the per-path figures, u * 0.7 of what the baseline ran after set-up.
  local formed=0 i t_formed
  for i in $(seq 1 3000); do
    grep -q 'group formed' "$dir/r0.log" 2>/dev/null && grep -q 'group formed' "$dir/r1.log" 2>/dev/null \
      && { formed=1; break; }
    [ -s "$dir/r0.exit" ] || [ -s "$dir/r1.exit" ] && break
    sleep 0.01
  done
  t_formed=$(now)
  delay=$(awk -v r="$RANDOM" -v w="$w0" -v p="$P" 'BEGIN {
    u = r / 32767
    d = (p > 0.05) ? u * (p + 0.2) : u * 0.7 * w
    printf "%.3f", d }')
  frac=$(awk -v d="$delay" -v p="$P" 'BEGIN { printf "%.2f", (p > 0) ? d / p : 0 }')
  [ "$formed" = 1 ] || log "$name $fault #$n: the group did not form within 30 s (see $dir)"
  sleep "$delay"
  if [ -s "$dir/r$victim.exit" ]; then
    status="missed(victim-already-exited)"
    wait_exit "$dir" "$survivor" 30 || true
    t_inj=""
  else
    t_inj=$(now)
    if [ "$fault" = kill ]; then kill -9 "$vpid" 2>/dev/null; else kill -STOP "$vpid" 2>/dev/null; fi
    # The detect limit, shortened only when the script's budget would not allow it.
    lim=$(( $(left) - 8 )); [ "$lim" -gt "$LIMIT" ] && lim=$LIMIT; [ "$lim" -lt 3 ] && lim=3
    if wait_exit "$dir" "$survivor" "$lim"; then
      status=ended
    elif [ "$lim" -lt "$LIMIT" ]; then
      status="cut(budget)"
    else
      status=HANG
    fi
  fi
  # Whatever is still running (the stopped victim, a hung survivor) is killed by its pid.
  cleanup
  rc=$(cut -d' ' -f1 "$dir/r$survivor.exit" 2>/dev/null); rc=${rc:-none}
  detect=""
  if [ "$status" = ended ] && [ -n "$t_inj" ]; then
    detect=$(awk -v a="$t_inj" -v b="$(cut -d' ' -f2 "$dir/r$survivor.exit")" 'BEGIN { printf "%.2f", b - a }')
  fi
  msg=$(grep -h '^ep-bench:' "$dir/r$survivor.log" 2>/dev/null | tail -n 1)
  named=no
  if echo "$msg" | grep -Eq "rank ${victim}([^0-9]|\$)"; then named=yes; fi
  if [ "$status" = ended ] && [ "$rc" = 0 ]; then
    status="ended(rc0: finished before noticing)"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$fault" "$n" "$victim" "$delay" \
    "$status" "$detect" "$rc" "$named" "$msg" >> "$RESULTS"
  log "$name $fault #$n: rank $victim ${delay} s after the group formed (${frac} of the timed ${P} s): survivor rank $survivor $status rc=$rc detect=${detect:--} s named=$named: ${msg:-<no error line>}"
  if [ "$status" != ended ]; then
    # Where each rank was when the trial ended (EP_MP_TRACE progress lines).
    for r in 0 1; do
      log "    rank $r's last steps: $(grep -h '^\[rank' "$dir/r$r.log" 2>/dev/null | tail -n 3 | tr '\n' '|')"
    done
  fi
}

# A fresh 2-rank group on the same GPUs, checked bitwise (launched by ep-bench itself; one
# timed call per path and op, the fewest ep-bench takes).
usable() {
  local name=$1 tr=$2 t0 rc
  t0=$(now)
  timeout -k 3 60 "$MP" --nprocs 2 --transport "$tr" --gpus "$GPUS" --iters 1 --rounds 1 \
    "${SMALL[@]}" --timeout-secs 10 > "$LOGDIR/usable-$name.log" 2>&1
  rc=$?
  local secs
  secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  printf '%s\t%s\t%s\n' "$name" "$rc" "$secs" >> "$USABLE"
  log "usable after $name faults: a new 2-rank group on the same GPU(s): rc=$rc (${secs} s)$([ $rc = 0 ] && echo ', outputs bitwise equal to the oracle')"
  grep -E 'bit-identical|failed|ep-bench:' "$LOGDIR/usable-$name.log" | head -n 4 | sed 's/^/    /'
}

summary() {
  echo
  echo "== fault summary ($(elapsed) s, $NG GPU(s), ranks on $GPUS GPU(s), GPU wait bound $TMO ms, survivor limit $LIMIT s)"
  printf '%-6s %-6s %7s %9s %8s %6s %6s %5s %8s  %s\n' transport fault trials injected survived named hangs cut "usable" "detect s min/median/max"
  local tr fault
  for tr in $TRANSPORTS; do
    for fault in $KINDS; do
      awk -F'\t' -v tr="$tr" -v f="$fault" -v usable="$(awk -F'\t' -v tr="$tr" '$1 == tr { u = ($2 == 0 ? "yes" : "NO") } END { print (u == "" ? "-" : u) }' "$USABLE")" '
        $1 == tr && $2 == f {
          n++
          if ($6 !~ /^missed/) inj++
          if ($6 ~ /^ended/) surv++
          if ($6 == "ended" && $9 == "yes") named++
          if ($6 == "HANG") hang++
          if ($6 ~ /^cut/) cut++
          if ($7 != "") d[++m] = $7
        }
        END {
          if (n == 0) exit
          # sort the detect times (insertion sort; a few dozen values)
          for (i = 2; i <= m; i++) { v = d[i]; j = i - 1; while (j > 0 && d[j] > v) { d[j+1] = d[j]; j-- } d[j+1] = v }
          det = (m == 0) ? "-" : sprintf("%.2f / %.2f / %.2f", d[1], (m % 2) ? d[(m+1)/2] : (d[m/2] + d[m/2+1]) / 2, d[m])
          printf "%-6s %-6s %7d %9d %8d %6d %6d %5d %8s  %s\n", tr, f, n, inj, surv, named, hang, cut, usable, det
        }' "$RESULTS"
    done
  done
  echo "(survived: the survivor exited on its own within the limit; named: its error names the lost rank;"
  echo " rc0 rows: the fault came after the survivor's last wait; per-trial lines above, rank logs in $LOGDIR)"
}

on_term() {
  log "terminated (step time limit): stopping"
  cleanup
  summary
  exit 124
}
trap on_term TERM INT

log "ep-bench: $MP; $NG GPU(s) visible, ranks on $GPUS; trials $TRIALS per transport x fault; budget $BUDGET s; logs $LOGDIR"
fail=0
for tr in $TRANSPORTS; do
  mtr=$tr; [ "$tr" = ipc ] && mtr=auto
  if [ "$tr" = nccl ] && [ "$GPUS" -lt 2 ]; then
    echo "SKIPPED: nccl fault trials: NCCL needs one rank per GPU and this machine has $NG GPU(s)"
    continue
  fi
  if [ "$(left)" -lt 20 ]; then
    echo "CUT: $tr fault trials not started (budget $BUDGET s spent)"
    continue
  fi
  # The first run on a fresh machine pays one-time costs (CUDA and NCCL set-up: 13.9 s against
  # 4.4-5.3 s per run in run 12), which would aim every fault past the end of the trials' runs:
  # it only warms up, the second run is the baseline.
  if ! baseline "$tr" "$mtr" || ! baseline "$tr" "$mtr"; then
    fail=1
    continue
  fi
  w0=$W0
  log "baseline $tr (no fault): both ranks exited 0 in $w0 s"
  log "baseline $tr: timed calls ~$P s at the end of the run (faults aimed there)"
  # kill and stall trials alternate, so a budget cut shortens both alike.
  for n in $(seq 1 "$TRIALS"); do
    for fault in $KINDS; do
      need=$(awk -v w="$w0" -v t="$TMO" 'BEGIN { printf "%d", w + t / 1000 + 5 }')
      if [ "$(left)" -lt "$need" ]; then
        echo "CUT: $tr $fault trial $n not run (budget: $(left) s left, a trial needs ~$need s)"
        continue
      fi
      trial "$tr" "$mtr" "$fault" "$n" "$w0"
    done
  done
  if [ "$(left)" -ge 10 ]; then
    usable "$tr" "$mtr"
  else
    echo "CUT: usable check after $tr not run (budget)"
  fi
done
summary
if awk -F'\t' '($6 !~ /^missed/ && $6 !~ /^cut/ && ($6 !~ /^ended/ || ($6 == "ended" && $9 != "yes"))) { bad = 1 } END { exit !bad }' "$RESULTS"; then
  fail=1
fi
if awk -F'\t' '$2 != 0 { bad = 1 } END { exit !bad }' "$USABLE"; then fail=1; fi
exit $fail
