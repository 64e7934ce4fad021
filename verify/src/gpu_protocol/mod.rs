//! The GPU kernels' synchronisation as Rust on the `ep_reference::sync` shim, so that loom can
//! check it (`tests/loom_gpu_protocol.rs`, built with `--cfg ep_loom`; the same functions run on
//! std threads in the normal build).
//!
//! One function per role. Each step cites the kernel code it mirrors (files under
//! `kernels/src/cu/`) by function and a quoted fragment, not by line number; the kernels carry
//! `// loom: gpu_protocol::<item>` comments at the same places. Only the synchronisation is
//! kept: routing tables, quantisation and the expansion into canonical rows are computation on
//! data that the orderings below publish. Payload entries are [`ROW_BYTES`]-byte rows of
//! [`SharedRows`]: every access touches a loom cell, so loom reports a read that the orderings
//! do not place after its write ("Causality violation"), and a write of call 2 that could land
//! on a row call 1 still reads.
//!
//! # Modules
//! By role, from the bottom up; each imports only modules before it here, by name
//! (`crate::gpu_protocol::<module>::<item>`): `words` (entry size, codes, the signal word),
//! `peers` (sets of peers in the build's words: [`PeerSet`], [`Build`]), `orderings` (every
//! fence, load and store ordering, with its mutants), `state` (the model's shape and memory),
//! `waits` (the error word, the bounded waits), `shrink` (the rank mask: agreement, masked
//! waits, the host's mask calls), `gone` (a block's set of gone peers: the narrow build's
//! word, the wide build's shared words, their copies and barriers), `block` (what every block runs around its
//! sends and receives: epoch, input check, ack waits, last block out, a failed call's
//! outputs), `batched` and
//! `per_expert` (each kernel's send and receive), `dispatch` ([`dispatch_block`]), `hook` (the
//! receive hook's two launches of batched dispatch over NVLink: [`hook_send_block`],
//! [`hook_recv_block`]), `nccl` (capacity mode's poison, pack, exchange and unpack), `host` (the error word as the host
//! decodes it, the check after a sync). Every public item is re-exported here
//! (`ep_verify::gpu_protocol::<item>`); `tests` runs the model on std threads.
//!
//! # How the device maps onto the model
//! - **A block is one thread.** The kernels order a block's threads with `__syncthreads` and let
//!   one thread fence, count and signal. A `bar.sync` then that thread's `fence.acq_rel` is
//!   cumulative in the PTX memory model, so one thread doing the block's work in program order
//!   has the same orderings. The model has one warp per block: send unit (token) t belongs to
//!   block `t % blocks`, receive unit j (over every source's entries) to block `j % blocks`.
//!   Which thread of the block does a step matters only through the barriers around it: batched
//!   dispatch's ack wait is thread `32 + d` (`a.waits`), its signal thread 0, its receive waits
//!   threads `tid < R`; each is followed or preceded by a `__syncthreads[_or]`.
//! - **Instructions.** `fence.acq_rel.{gpu,sys}` (common.cuh `fence_rel`) is `fence(AcqRel)`;
//!   `atom.acq_rel.{gpu,sys}.add` (common.cuh `count_in`, the `ST_SENT` and `ST_EXIT` counts)
//!   an `AcqRel` read-modify-write; `st.release` a `Release` store; `ld.acquire` an `Acquire` load; `atomicAdd`, `atomicCAS`,
//!   `atomicExch` relaxed read-modify-writes (CUDA's atomics are relaxed); `ld.volatile` and the
//!   plain stores of the `state` counters relaxed atomics; `__threadfence_system`
//!   `fence(SeqCst)`. The u64 epoch word (`ST_EPOCH64`, common.cuh `ld_epoch`) and the
//!   payload entries are plain memory (loom cells). Scopes (.gpu / .sys) are not modelled: the
//!   kernels use the narrowest one that covers every rank.
//! - **Launches.** [`dispatch_block`] is one block of a stage-0 launch (the whole call over
//!   NVLink / peer memory). The receive hook splits a batched dispatch over NVLink into two
//!   launches of the same kernel on the rank's stream: stage 1, the send half
//!   ([`hook_send_block`]: the ack waits, the send and the signal; it counts no exit and
//!   publishes nothing, "`if (stage == 1) return;`"), then stage 2,
//!   the receive half ([`hook_recv_block`]: a pre-load of every source's signal at kernel start,
//!   `preload_signals`, whose value `wait_signal_pre` takes if it already carries the call's
//!   tag; no routing, input check or ack wait; its last block out publishes the epoch and acks
//!   every source, as stage 0's). Both halves read the same epoch. Batched combine's stage 2
//!   pre-loads its own signal words the same way and is not modelled (the dispatch's model
//!   covers the pattern), nor is per-expert dispatch's split, nor the split in shrink mode or
//!   the wide build. The NCCL transport splits a call into stage 1 (pack), a host NCCL
//!   exchange and stage 2 (unpack), with no signals or acks for NCCL peers (`via_nccl`: the
//!   stream orders them); only its capacity mode's header poisoning is modelled
//!   ([`batched_pack_block`], [`nccl_capacity_exchange`], [`batched_unpack_block`]). `finish`
//!   takes the launch's stage and transport (`block::Stage`). The next
//!   launch on a device's stream starts after every block of the previous one ended (the tests
//!   join them). Nothing else orders two calls: no host synchronisation between calls is
//!   assumed (`GpuGroup::launch` back to back, process mode, CUDA graph replay), so only the
//!   acks order a call's reads on one device before the next call's writes from another.
//! - **Pairs.** The kernels run every (source, destination) pair, self included, count 0 too. A
//!   model lists the pairs it checks ([`Setup::links`]); pairs share nothing but the block
//!   counters and the error word, which the model keeps.
//! - **Bounded waits.** `%globaltimer` is a [`Deadline`]: under loom a timeout of N ms is N polls
//!   and one of an hour or more never expires. The kernels look at the error word and the clock
//!   every 64 polls, the model on every poll. The one wait not bounded by the launch's
//!   `timeout_ns`, a report's wait for the claim's winner (common.cuh `report_error_at`: 100 us),
//!   has a fixed bound of a few polls (`waits::CLAIM_WAIT`, which says why it is not
//!   unbounded and what a wait that runs out means).
//! - **Builds** ([`Setup::build`], [`Build`]; layout.rs `Variant`, common.cuh `WIDE`). A set of
//!   peers is a [`PeerSet`]: one u32 in the narrow build (R <= 32), `EP_MASK_WORDS` words in
//!   the wide one (bit d % 32 of word d / 32). The wide build keeps a block's gone set in
//!   shared memory and copies it between barriers (`GONE_SNAPSHOT`: thread `tid < W` copies
//!   word `tid`, then `__syncthreads()`); its model block is thread 0 (everything, as above)
//!   plus one thread per word past the first ([`gone_word_thread`] over a [`BlockShared`]),
//!   and its models scale the word down (2 bits: rank 2 of 3 is the first peer of word 1, as
//!   rank 32 of 33 is in the kernel's words). Its mutants ([`WideMutant`]: a snapshot of word
//!   0 only, no barrier after the copies) are runtime values that the `shrink_wide_*` models
//!   run and must fail. The wide build's finish reads the mask per peer (`END_MASKED`).
//!   Not modelled: the NCCL peer mask (the model's NCCL stages take every peer over NCCL, and
//!   shrink mode is CUDA IPC only), combine's sets (the same macros).
//! - **Shrink mode** ([`Launch::shrink`]; shrink.cuh). Each
//!   rank's mask words (`int`: `ld.volatile` reads, `atomicExch`) and decision words (u64, one
//!   per (recv | ack, peer) of the model's kernel kind: a volatile read, then `atomicCAS`) are
//!   relaxed atomics of its [`Rank`]. A block reads the mask at its start (`masked_peers`:
//!   `gone0`, a [`PeerSet`]); a masked peer is neither waited for nor sent to nor read (no count, no entry),
//!   and the last block out acks no peer masked by then. Any other peer's wait
//!   (`wait_peer_signals`, `wait_peer_ack`) proposes "arrived" once every word the peer owes is
//!   there, "lost" when the peer turns out masked or the [`Deadline`] runs out, and `agree`
//!   installs the call's first verdict for every block (a lost one masks the peer; a block that
//!   ran out under "arrived" waits again, bounded). A model loses a rank at the timeout's edge
//!   (a wait of one poll that its signal may or may not beat), by never signalling
//!   (`fault_rank`), or by the host's [`update_mask`] before a launch. [`clean_mask`] is the
//!   host's zeroing (runtime/shrink.rs `GpuGroup::clean_mask`), run with every launch joined:
//!   every rank restarts from epoch 0. Not modelled: combine's shrink path (the same
//!   `wait_peer_signals` / `wait_peer_ack` and the same no-ack rule, on the combine words),
//!   the routing's "a masked owner's selection counts as -1" and the peer-written row counts
//!   and headers it then leaves unread (computation on data the model has no words for: only
//!   the signal's count and the entries), NCCL peers (shrink mode is CUDA IPC / peer access
//!   only), and the host's barrier after a clean (the joins).
//! - **Input checks.** Batched dispatch checks its routing in its one routing pass (the `route`
//!   lambda, "`v < -1 || v >= (i64)E`": `ERR_EXPERT_RANGE`; then the repeats, `ERR_DUP_EXPERT`),
//!   per-expert dispatch in common.cuh `load_topk<true>`, both the token count in
//!   `read_ntok` (`ERR_TOKENS`); all report with `report_error` before anything is written and
//!   set `in_bad`. [`Launch::bad_input`] makes one rank's routing bad. Peer-supplied counts are
//!   bounded with `peer_bad` (common.cuh); the model's peers are honest on NVLink, so there that
//!   check only mirrors the path; over NCCL the poisoned header exercises it.
//! - **The one-rank path** (batched_dispatch.cu `direct`: "`R == 1 && p.stage == 0 && p.nccl_mask[0] ==
//!   0u`", the narrow build's; the wide build past 32 ranks has none) is not modelled and needs no model: the rank is its own only source and destination,
//!   its blocks write the caller's canonical rows straight from `x` with no batch, no signal and
//!   no expansion, so no block reads what another block or rank wrote in this call. What is
//!   left of the protocol there is the model's: the ack wait (on its own ack, published by the
//!   previous launch's last block out, which the stream ordered before this launch: `ack0`
//!   already holds `epoch - 1` and nothing is waited for) and `last_block_out` with the epoch
//!   and self-ack (`frame_end`, checked by `batched_one_sender_two_receivers`).
//!
//! # Mutants
//! `--cfg ep_mutant="..."` weakens one ordering; `.ci/loom.sh` builds each and requires a model
//! to fail. A weakened fence keeps only its other half (`fence(Acquire)` or `fence(Release)`).
//! Per-expert's signal store comes right after a `fence.acq_rel` of the same thread, which is
//! itself a release fence: making only the store relaxed is an equivalent mutant (the protocol
//! stays correct, and loom agrees). So `gpu_signal_relaxed` drops that store's release *and* the
//! release half of the fence before it. The batched signal stores and the ack stores follow
//! the thread's count-in instead (`count_in`, an `atom.acq_rel`), whose release is the count's
//! only: `gpu_signal_relaxed` and `gpu_ack_store_relaxed` relax those stores alone.
//! `gpu_preload_relaxed` relaxes the receive half's pre-load of the signals, so that a count
//! taken from it orders none of the entries' reads (`batched_hook_split_one_call`).
//! `gpu_no_hdr_poison` is not an ordering: it drops the host's poisoning of the NCCL send
//! headers, and the model `capacity_bad_input_sender_header_poisoned` must see the peer take the
//! previous call's header as this call's (an assertion, not a causality violation).
//! Shrink mode's mutants are not orderings either, and only the `shrink_*` models kill them:
//! `gpu_no_agreement` (each block goes on with its own verdict; `shrink_*two_blocks_agree_at_the_timeout_edge`:
//! the blocks of a rank disagree), `gpu_masked_peer_waited` (the receive ignores the mask;
//! `shrink_masked_peer_signals_ignored`: a masked peer's entries are read) and
//! `gpu_clean_keeps_signals` (the clean leaves the signal and ack words; `shrink_unmask_with_clean`:
//! a call-1 signal is taken for call 2's, a causality violation).
//! `gpu_exit_no_fail_flag` is not an ordering either: `last_block_out` adds `1u` whatever the
//! block saw, so no block brings its failure into the exit count and the last block out knows
//! only its own look at the error word; `batched_one_sender_two_receivers` must see a last
//! block out that read its entries and misses the other block's failed wait (an assertion of
//! the tests' `check_exit`; `batched_two_senders_one_receiver_two_calls` sees it too).
//! `fault_timeout_stops_every_waiter` does not: with the claim loser's wait every block there
//! whose wait failed sees the error word raised at its end by itself.
//! `gpu_loser_no_wait` is not an ordering either: `report_error` without the claim loser's
//! wait for the code; `fault_two_ranks_one_device_both_time_out`
//! must see a rank whose only block lost the claim to a block of the other rank of its device,
//! went out with the error word still 0, and, as the last block out, did not know its call
//! failed (`check_exit`).
//!
//! # What the model found in the kernels
//! Checked against the kernels as they are: u64 epochs, tagged signals, input and peer-data
//! checks on the device, the NCCL stage split, the pre-loaded ack, the one-pass routing check,
//! the one-rank path, per-expert over NCCL, capacity-mode NCCL sizes, the receive hook's stage
//! 2 of batched dispatch over NVLink (the pre-loaded signals, no routing or input check), the
//! exit count's failure flag (`last_block_out`'s `EXIT_FAILED`) and the claim loser's wait
//! (`report_error_at`), each modelled. No ordering is missing.
//! Observations:
//! - The `.release` of per-expert's signal store ("`st_release(p, sig_pe(tab[d], R) + ...`") is
//!   redundant: the same thread has just run `fence.acq_rel`, which makes a relaxed store a
//!   release pattern. Harmless; kept as belt and braces. The batched signal stores
//!   ("`st_release(p, sig_bat(tab[d]) + rank, signal_word(epoch, ...))`") and the ack stores
//!   (`frame_end`, "`st_release(p, ack_words(c.tab[s], p.R, KIND) + c.rank, c.epoch)`") need
//!   theirs: the count-in before them is a read-modify-write, not a fence (mutants
//!   `gpu_signal_relaxed`, `gpu_ack_store_relaxed`).
//! - Batched dispatch's ack wait moved: thread `32 + d` issues its first `ld_acquire`
//!   of `sig_bat_ack(me, R) + d` (frame.cuh `ack_waiter`: `a.v0`, the model's `ack0`) at kernel
//!   start, before `s_epoch` is read and before the routing checks, and calls `wait_ack` only
//!   after `in_bad` is known and only if "`a.v0 < c.epoch - 1ull`" (`wait_acks`). That is the
//!   same protocol: `a.v0` is an acquire load, and a value
//!   `>= epoch - 1` is a release store of the destination's last block out that happened after
//!   its reads of call `epoch - 1` (acks only grow); nothing is written to a destination before
//!   the `__syncthreads_or(wait_acks<KIND>(...))` that follows, whatever thread acquired. The model now does the
//!   same (`preload_acks`, then `sender_wait_acks` skips an ack already seen); per-expert
//!   dispatch still waits in threads `tid < R` after `load_topk`, without a pre-load.
//! - The receive hook's receive half (batched dispatch, stage 2 over NVLink) pre-loads its
//!   sources' signals the same way: thread `s < R` issues "`pre.sig0 = ld_acquire(p, sig_bat(me) +
//!   tid)`" at kernel start, before `s_epoch` is read, and `wait_signal_pre` takes the count
//!   from it with no further load when it carries this call's tag and is not the poison. The
//!   same protocol as `wait_signal`: a word with this call's tag is the source's release store
//!   after its entries (its send half's signal), and the acquire that read it orders every
//!   later load of the block after it; a stale word (the previous call's signal, pre-loaded
//!   before this call's send half signalled) or the poison goes to `wait_signal`, which loads
//!   again. The model does the same (`preload_signals`, mutant `gpu_preload_relaxed`; models
//!   `batched_hook_split_*`). The receive half skips the input check and the routing: its
//!   send half, launched before it on the same stream, checked them and raised the error word
//!   on bad input, so the receive half's `s_fail` is set and it reads nothing ("`if
//!   (s_fail<KIND>) return;`"), then publishes the epoch and acks, as stage 0 does on bad input. No ack
//!   wait is lost by the split: the send half waits for the acks before it sends, and the
//!   receive half sends nothing.
//! - Every block's `last_block_out` brings into the exit count whether it saw the group failed
//!   (thread 0, after the block's `__syncthreads()`: "`const bool f = fail_start ||
//!   failed(p)`", `fail_start` the block's `s_fail`, then "`count_in(p, state +
//!   ST_EXIT + kind, f ? 1u + EXIT_FAILED : 1u)`"; the blocks out count below bit 16, "`(old &
//!   (EXIT_FAILED - 1u)) == (u32)p.blocks_per_rank - 1u`"), and the last block out writes a
//!   failed call's outputs when "`s_failed = f || old >= EXIT_FAILED`" (`call_failed`), with no
//!   load of the error word after the count. The model does the same (`block::last_block_out`,
//!   [`BlockReport::call_failed`], [`BlockReport::failed_outputs`]), and the models check in
//!   every interleaving that the last block out of a launch in which some block saw the call
//!   fail (its `s_fail`, bad input, poison or a failed wait) knows it (mutant
//!   `gpu_exit_no_fail_flag`: `batched_one_sender_two_receivers`, where a block whose wait ran
//!   out reports and another block, which got its signal and read its entries, goes out last
//!   and may see the error word still 0). A block whose own wait failed, or whose input was
//!   bad, counts as failed only through its own look at the error word (`f`), which its own
//!   report orders after the code's raise only when it won the claim. A report that lost the
//!   claim ("`atomicCAS(w + 7, 0u, 1u)`" read 1) was not ordered after the winner's
//!   "`atomicExch(w, code)`": when the winner was a block of another rank on the same device
//!   (one error word for every rank a launch runs there) and no block of this rank brought the
//!   flag, this rank's last block out could find `call_failed` false and leave a failed call's
//!   outputs unwritten (two ranks on one device, both waiting for a rank that never signals,
//!   one block each). The kernels close it: the loser of the claim waits, bounded by
//!   100 us of `%globaltimer`, until the code is nonzero ("`while (ld_volatile_u32(w) == 0u &&
//!   globaltimer() - t0 < 100000ull) {}`" in `report_error_at`), so whoever reported sees
//!   `failed(p)` from then on. The model does the same (`waits::report_error`, bounded by
//!   `waits::CLAIM_WAIT`), and `fault_two_ranks_one_device_both_time_out` checks it (mutant
//!   `gpu_loser_no_wait`: the gap, found again). What is left: a winner that stalls for the
//!   whole 100 us between its `atomicCAS` and its `atomicExch` (six stores and a
//!   `__threadfence_system()`, no wait; one way would be a context preempted in between, whose
//!   blocks resume after `%globaltimer` ran on, a loser's poll before the winner's
//!   `atomicExch`). loom can schedule such a stall (it can starve the winner for any number of
//!   the loser's polls, at the cost of preemptions), so a wait that runs out is recorded
//!   ([`BlockReport::claim_unseen`]), and it is the one case in which the tests' `check_exit`
//!   lets a last block out miss a failure.
//! - In per-expert dispatch a block that owns several experts writes the second expert's
//!   messages after the first expert's `fence_rel` (before its signal), so only the first
//!   expert's writes rely on `wait_ack`'s acquire alone (the consecutive-calls model rewrites
//!   exactly those).
//! - Tags: `sig_tag` (common.cuh) wraps between epochs 2^40 - 2 (tag 2^40 - 1) and
//!   2^40 - 1 (tag 1); that is the only place where a stale tag is *larger* than the current
//!   one, so a receiver that compared with `>=` (as `wait_ack` rightly does for acks) would
//!   take the previous call's signal there and nowhere else. The `*_tag_wrap` models run two
//!   calls across it (mutant `gpu_tag_ge`). 2^40 - 1 -> 2^40 is tag 1 -> 2, no wrap.
//! - A rank whose routing or token count is bad (`in_bad`: "`__syncthreads_or(bad) |
//!   s_bad<KIND>`", `bad` from `load_topk<true>` in both kernels) skips its ack waits (it goes
//!   to the end before `wait_acks`; its `a.v0` load is left unused) in every block (each
//!   block checks the same routing), so it neither sends nor receives nor counts itself in
//!   `ST_SENT`; it stores the poison instead (poison.cuh `poison_peers`, "`if (s_fail ||
//!   in_bad)`"); and its last block out still publishes the epoch and acks every source
//!   ("`if (last_out ...)`", in `frame_end` past the send half's return) for a call whose data it never read. That is sound: an
//!   ack only lets a source overwrite this rank's receive buffers, and the epochs stay in step;
//!   a next call launched without a sync finds the group failed and is poisoned in turn (model
//!   `bad_input_receiver_then_enqueued_call`). Its peers never see a valid signal: on the same
//!   device their waits stop on the error flag or the poison within 64 polls; on another device
//!   on the poison (`ERR_PEER_FAILED`) or their own bound, which the host ranks after the input
//!   error (error_word.rs `cause_first`: input, peer data, timeouts, then a peer's failure;
//!   `GpuGroup::check`). If the caller's routing changed while the launch ran, blocks could
//!   disagree on `in_bad` and the next item applies.
//! - A batched dispatch block whose `wait_ack` fails skips the send side ("`return
//!   !__syncthreads_or(wait_acks<KIND>(...));`" goes to the end past the `ST_SENT` count-in). If
//!   only some blocks of a rank fail, the count is left non-zero and a later launch on the same
//!   state would signal before every block has written. What keeps this from happening is that
//!   no later launch of a failed group sends at all: every block reads the error word at its
//!   start (`s_fail`) and stores the poison instead (poison.cuh; model
//!   `failed_rank_poisons_enqueued_calls`, mutants `gpu_no_failed_check`, `gpu_no_poison`),
//!   launches enqueued behind the failed one (benchmarks, graph replay, process mode) included;
//!   and the host refuses every call after an error (error_word.rs `GpuGroup::check` sets `broken`;
//!   `check_usable`, first thing in launch.rs `launch_inner` and error_word.rs `sync`), launching the refused
//!   call as poison only (`poison_refused`, `KParams.refused`). Before the check, such launches
//!   sent a failed call's state with valid signals: a peer took a combine of the rows of a
//!   failed dispatch for good.
//! - Shrink mode's agreement orders nothing: `agree_at` is a relaxed CAS (and the mask a
//!   relaxed `atomicExch`), so a block that ran out while another block's "arrived" was agreed
//!   has no happens-before with that block's acquire of the signal. What makes its reads safe
//!   is its own wait again ("Agreed "arrived" after this block ran out"), an acquire load of
//!   the same words: without it the block would read the entries unordered after their writes.
//!   That wait is bounded and reports a timeout when it runs out, which would need the store,
//!   already seen by a block of the same rank, to stay invisible for a whole timeout. loom's
//!   own progress rule (a load after a yield does not return again a value the thread saw
//!   before it, when a newer one exists) makes it succeed at its first poll in the models,
//!   which accept a reported timeout all the same; `shrink_*two_blocks_agree_at_the_timeout_edge`
//!   requires some interleaving where a block waited again and then read its entries.
//! - Shrink mode's "no ack to a masked peer" is read from the mask by the last block out
//!   ("`const u32 masked = masked_peers(p, me)`"), not from its own `gone`: a peer lost by
//!   another block is in it, because every block's `atomicExch` of the mask comes before that
//!   block's `last_block_out` count-in (its release), which the last block acquires. A peer that
//!   is masked here without knowing it (lost at the timeout's edge, or masked by the host)
//!   learns it at its next call's ack wait for this rank (every pair runs, count 0 too), which
//!   runs out and masks this rank in turn (model `shrink_masked_peer_signals_ignored`): the
//!   masks end up symmetric with no message of their own.
//! - NCCL transport, exact sizes (`NcclSizes::Exact`, not modelled): a rank with bad input also
//!   skips, in its pack stage (`p.stage` 1), the writes of `snd_hdr` and the staged batches, so
//!   what sits there is an earlier call's, valid-looking. nccl/call.rs `dispatch_exchange`
//!   reads the error word ("`group.check()?;`") after the header exchange and `wait_streams`,
//!   before it reads the headers back to size the payload: no batch of the call is sent, and the
//!   peers' NCCL waits end at their bound instead of taking stale rows.
//! - NCCL transport, capacity sizes (`NcclSizes::Capacity`, modelled for batched dispatch):
//!   header and the whole T-entry region go in one grouped exchange with no host look. The
//!   host first sets every send-header word to `POISON_HDR` = i32::MAX (nccl/call.rs
//!   `poison_send_headers`, in stream order before the pack kernel); a good pack stage
//!   overwrites it, a bad one leaves it; the peer's unpack (stage 2: "`c = ((const
//!   int*)me.rcv_hdr)[tid * HDR_WORDS(L)]`" instead of `wait_signal`) bounds it with
//!   `peer_bad(..., PF_BATCH_TOKENS, c, T)` and reports `ERR_PEER_DATA` instead of taking the
//!   previous call's header and rows (model `capacity_bad_input_sender_header_poisoned`, mutant
//!   `gpu_no_hdr_poison`). Not modelled there: the other header words (selections, rows per
//!   local expert: the same poison, bounded by `PF_SELECTIONS` / `PF_EXPERT_ROWS` after the
//!   token count already failed), the combine exchange, per-expert over NCCL (exact sizes only:
//!   `check_nccl_sizes`), and NCCL's own transfer, which the model treats as a rendezvous of
//!   both ranks' streams between the two stages.
//!
//! [`SharedRows`]: ep_reference::sync::SharedRows
//! [`Deadline`]: ep_reference::sync::Deadline

mod batched;
mod block;
mod dispatch;
mod gone;
mod hook;
mod host;
mod nccl;
mod orderings;
mod peers;
mod per_expert;
mod poison;
mod shrink;
mod state;
mod waits;
mod words;

#[cfg(all(test, not(ep_loom)))]
mod tests;

pub use dispatch::{dispatch_block, dispatch_block_in};
pub use gone::{gone_word_thread, BlockShared};
pub use hook::{hook_recv_block, hook_send_block};
pub use host::{ack_word, device_error, entry_at, DeviceError, Host};
pub use nccl::{
    batched_pack_block, batched_unpack_block, nccl_capacity_exchange, poison_send_headers,
    POISON_HDR,
};
pub use peers::{is_gone, Build, PeerSet, WideMutant, MASK_WORDS, WORD_BITS};
pub use shrink::{clean_mask, mask_status, update_mask, DEC_ACK, DEC_RECV};
pub use state::{
    merged, payload, BlockReport, Entry, ErrorWord, Group, Input, Kind, Launch, Rank, Setup,
    WaitEnd, STALE,
};
pub use words::{
    is_poison, sig_tag, signal_word, ERR_EXPERT_RANGE, ERR_PEER_DATA, ERR_PEER_FAILED, ERR_TIMEOUT,
    PF_BATCH_TOKENS, PH_DISPATCH_RECV, PH_DISPATCH_SEND, ROW_BYTES, SIG_COUNT_BITS, SIG_POISON,
};
