#!/usr/bin/env bash
# The loom suite: the CPU protocol on the shipped code (loom_protocol) and the CUDA kernels'
# protocol as a model (loom_gpu_protocol); then the mutants, each of which a model must reject.
# One target dir, built with --cfg ep_loom. A mutant adds --cfg ep_mutant="NAME" to the workspace
# crates only, through a RUSTC_WORKSPACE_WRAPPER whose path names the mutant: cargo keys the
# workspace crates' artifacts on that path, so dependencies (loom, ...) are built once and each
# mutant recompiles only the workspace crates.
# loom_gpu_protocol's batched_two_senders_one_receiver_two_calls runs at preemption bound 3 (set
# in the test; EP_LOOM_FULL_BOUND=1 gives it LOOM_MAX_PREEMPTIONS): 445 s -> 287 s cold here.
set -euo pipefail
cd "$(dirname "$0")/.."
export LOOM_MAX_PREEMPTIONS="${LOOM_MAX_PREEMPTIONS:-4}"
export RUSTFLAGS="--cfg ep_loom"
export CARGO_TARGET_DIR=target/loom
t0=$SECONDS

echo "-- loom models (LOOM_MAX_PREEMPTIONS=$LOOM_MAX_PREEMPTIONS)"
cargo test --release -p ep-verify --test loom_protocol --test loom_gpu_protocol --test loom_gpu_shrink
echo "-- loom models: $((SECONDS - t0)) s"

# mutant cfg value : test file : the model that must catch it [: what its failure must say,
# if not a loom causality violation]
mutants=(
  "signal_relaxed:loom_protocol:payload_then_signal"
  "finish_relaxed:loom_protocol:staging_workers_then_sender"
  "credit_relaxed:loom_protocol:consecutive_dispatches"
  # shrink mode: a masked destination's credit is skipped, so its region must not be written
  "masked_peer_written:loom_protocol:masked_peer_is_skipped"
  "gpu_counter_release:loom_gpu_protocol:batched_two_senders_one_receiver"
  "gpu_counter_acquire:loom_gpu_protocol:batched_two_senders_one_receiver"
  "gpu_signal_relaxed:loom_gpu_protocol:batched_two_senders_one_receiver"
  "gpu_signal_relaxed:loom_gpu_protocol:per_expert_two_senders_one_receiver"
  "gpu_wait_relaxed:loom_gpu_protocol:batched_two_senders_one_receiver"
  "gpu_wait_relaxed:loom_gpu_protocol:per_expert_two_senders_one_receiver"
  "gpu_exit_release:loom_gpu_protocol:batched_one_sender_two_receivers"
  "gpu_exit_acquire:loom_gpu_protocol:batched_one_sender_two_receivers"
  "gpu_ack_store_relaxed:loom_gpu_protocol:batched_consecutive_calls"
  "gpu_ack_store_relaxed:loom_gpu_protocol:per_expert_consecutive_calls"
  "gpu_ack_load_relaxed:loom_gpu_protocol:batched_consecutive_calls"
  "gpu_ack_load_relaxed:loom_gpu_protocol:per_expert_consecutive_calls"
  "gpu_no_ack_wait:loom_gpu_protocol:batched_consecutive_calls"
  "gpu_no_ack_wait:loom_gpu_protocol:per_expert_consecutive_calls"
  # a `>=` tag match survives every model but the ones across the tag's wrap
  "gpu_tag_ge:loom_gpu_protocol:batched_tag_wrap"
  "gpu_tag_ge:loom_gpu_protocol:per_expert_tag_wrap"
  # and the model of everything at once must reject each of its orderings too
  "gpu_counter_release:loom_gpu_protocol:batched_two_senders_one_receiver_two_calls"
  "gpu_counter_acquire:loom_gpu_protocol:batched_two_senders_one_receiver_two_calls"
  "gpu_signal_relaxed:loom_gpu_protocol:batched_two_senders_one_receiver_two_calls"
  "gpu_wait_relaxed:loom_gpu_protocol:batched_two_senders_one_receiver_two_calls"
  "gpu_ack_store_relaxed:loom_gpu_protocol:batched_two_senders_one_receiver_two_calls"
  "gpu_ack_load_relaxed:loom_gpu_protocol:batched_two_senders_one_receiver_two_calls"
  "gpu_no_ack_wait:loom_gpu_protocol:batched_two_senders_one_receiver_two_calls"
  # the receive hook's split (batched dispatch over NVLink: send half, then receive half): the
  # receive half's pre-load of the signals, its fallback wait on a stale pre-load, the ack that
  # only the receive half publishes, and the pre-loaded tag across the wrap
  "gpu_preload_relaxed:loom_gpu_protocol:batched_hook_split_one_call"
  "gpu_wait_relaxed:loom_gpu_protocol:batched_hook_split_one_call"
  "gpu_no_ack_wait:loom_gpu_protocol:batched_hook_split_consecutive_calls"
  "gpu_tag_ge:loom_gpu_protocol:batched_hook_split_tag_wrap"
  # not an ordering: the host's poisoning of the NCCL send headers (capacity mode) is gone, and
  # the peer must be caught taking the previous call's header and rows as this call's
  "gpu_no_hdr_poison:loom_gpu_protocol:capacity_bad_input_sender_header_poisoned:took a stale header"
  # shrink mode (the rank mask), not orderings either: blocks that go on with their own verdicts
  # on a peer lost at the timeout's edge, a receive that waits for a masked peer (whose signal
  # carries this call's tag), a clean that leaves the signal words (whose tags come round again)
  "gpu_no_agreement:loom_gpu_shrink:shrink_two_blocks_agree_at_the_timeout_edge:disagree on the lost peers"
  "gpu_no_agreement:loom_gpu_shrink:shrink_per_expert_two_blocks_agree_at_the_timeout_edge:disagree on the lost peers"
  "gpu_masked_peer_waited:loom_gpu_shrink:shrink_masked_peer_signals_ignored:read a masked peer's entries"
  "gpu_clean_keeps_signals:loom_gpu_shrink:shrink_unmask_with_clean"
  # a failed rank, not orderings: launches enqueued behind a failed one that skip
  # the error word's check send a failed group's data with a valid signal; with the check but
  # without the poison, the peer never learns of the failure and only times out
  "gpu_no_failed_check:loom_gpu_protocol:failed_rank_poisons_enqueued_calls:took a failed rank's data"
  "gpu_no_failed_check:loom_gpu_protocol:per_expert_failed_rank_poisons_enqueued_calls:took a failed rank's data"
  "gpu_no_poison:loom_gpu_protocol:failed_rank_poisons_enqueued_calls:learn of rank 0's failure from its poison"
  "gpu_no_poison:loom_gpu_protocol:per_expert_failed_rank_poisons_enqueued_calls:learn of rank 0's failure from its poison"
  # the exit count's failure flag (common.cuh last_block_out, EXIT_FAILED), not an ordering: with
  # an add of 1u whatever a block saw, the last block out knows only its own look at the error
  # word, and a block that got its signal misses another block's failed wait
  "gpu_exit_no_fail_flag:loom_gpu_protocol:batched_one_sender_two_receivers:must know that a block saw the call fail"
  # the claim loser's wait for the code (common.cuh report_error_at), not an ordering: without
  # it, a report that lost the claim to a block of another rank of its device may go out with
  # the error word still 0, and its rank's last block out misses its failure
  "gpu_loser_no_wait:loom_gpu_protocol:fault_two_ranks_one_device_both_time_out:must know that a block saw the call fail"
)
killed=0
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for m in "${mutants[@]}"; do
  IFS=: read -r name test model want <<<"$m"
  want="${want:-Causality violation}"
  wrapper="$PWD/$CARGO_TARGET_DIR/mutants/$name/rustc"
  mkdir -p "$(dirname "$wrapper")"
  printf '#!/bin/sh\nexec "$@" --cfg '\''ep_mutant="%s"'\''\n' "$name" >"$wrapper"
  chmod +x "$wrapper"
  echo "-- mutant $name: loom must find \"$want\" in $test::$model"
  exact=()
  case "$test" in loom_gpu_protocol|loom_gpu_shrink) exact=(--exact) ;; esac
  if RUSTC_WORKSPACE_WRAPPER="$wrapper" \
    cargo test --release -p ep-verify --test "$test" -- "${exact[@]}" "$model" >"$log" 2>&1; then
    echo "FAIL: mutant $name survived: loom found nothing in $model"
    tail -n 30 "$log"
    exit 1
  fi
  if ! grep -qE "^running [1-9]" "$log"; then
    echo "FAIL: no test matched $model"
    exit 1
  fi
  if ! grep -q "$want" "$log"; then
    echo "FAIL: mutant $name failed, but not with \"$want\":"
    tail -n 30 "$log"
    exit 1
  fi
  echo "ok: mutant $name killed: $(grep -m1 "$want" "$log")"
  killed=$((killed + 1))
done
echo "-- loom step: $((SECONDS - t0)) s, $killed of ${#mutants[@]} mutants killed"
