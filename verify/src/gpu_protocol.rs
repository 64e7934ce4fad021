//! The GPU kernels' synchronisation as Rust on the `ep_reference::sync` shim, so that loom can
//! check it (`tests/loom_gpu_protocol.rs`, built with `--cfg ep_loom`; the same functions run on
//! std threads in the normal build).
//!
//! One function per role. Each step names the `.cu` line it mirrors (files under
//! `kernels/src/cu/`). Only the synchronisation is kept: routing tables, quantisation and the
//! expansion into canonical rows are computation on data that the orderings below publish.
//! Payload entries are [`ROW_BYTES`]-byte rows of [`SharedRows`]: every access touches a loom
//! cell, so loom reports a read that the orderings do not place after its write ("Causality
//! violation"), and a write of call 2 that could land on a row call 1 still reads.
//!
//! # How the device maps onto the model
//! - **A block is one thread.** The kernels order a block's threads with `__syncthreads` and let
//!   thread 0 fence, count and signal. A `bar.sync` then thread 0's `fence.acq_rel` is cumulative
//!   in the PTX memory model, so one thread doing the block's work in program order has the same
//!   orderings. The model has one warp per block: send unit (token) t belongs to block
//!   `t % blocks`, receive unit j (over every source's entries) to block `j % blocks`.
//! - **Instructions.** `fence.acq_rel.{gpu,sys}` (common.cuh:160 `fence_rel`) is `fence(AcqRel)`;
//!   `st.release` a `Release` store; `ld.acquire` an `Acquire` load; `atomicAdd`, `atomicCAS`,
//!   `atomicExch` relaxed read-modify-writes (CUDA's atomics are relaxed); `ld.volatile` and the
//!   plain stores of the `state` counters relaxed atomics; `__threadfence_system`
//!   `fence(SeqCst)`. The u64 epoch word (`ST_EPOCH64`, common.cuh:238 `ld_epoch`) and the
//!   payload entries are plain memory (loom cells). Scopes (.gpu / .sys) are not modelled: the
//!   kernels use the narrowest one that covers every rank.
//! - **Launches.** A launch is one thread per block, of stage 0 (the whole call over NVLink;
//!   the NCCL stages 1/2 only split it around a host exchange and are not modelled). The next
//!   launch on a device's stream starts after every block of the previous one ended (the tests
//!   join them). Nothing else orders two
//!   calls: no host synchronisation between calls is assumed (`GpuGroup::launch` back to back,
//!   process mode, CUDA graph replay), so only the acks order a call's reads on one device before
//!   the next call's writes from another.
//! - **Pairs.** The kernels run every (source, destination) pair, self included, count 0 too. A
//!   model lists the pairs it checks ([`Setup::links`]); pairs share nothing but the block
//!   counters and the error word, which the model keeps.
//! - **Bounded waits.** `%globaltimer` is a [`Deadline`]: under loom a timeout of N ms is N polls
//!   and one of an hour or more never expires. The kernels look at the error word and the clock
//!   every 64 polls, the model on every poll.
//! - **Input checks.** `load_topk` / `read_ntok` (common.cuh:351, :383) report a bad index or
//!   token count with `report_error` before anything is written; [`Launch::bad_input`] makes
//!   one rank's routing bad. Peer-supplied counts are bounded with `peer_bad` (common.cuh:223);
//!   the model's peers are honest, so that check only mirrors the path.
//!
//! # Mutants
//! `--cfg ep_mutant="..."` weakens one ordering; `.ci/loom.sh` builds each and requires a model
//! to fail. A weakened fence keeps only its other half (`fence(Acquire)` or `fence(Release)`).
//! The signal and ack stores come right after a `fence.acq_rel` of the same thread, which is
//! itself a release fence: making only the store relaxed is an equivalent mutant (the protocol
//! stays correct, and loom agrees). So `gpu_signal_relaxed` and `gpu_ack_store_relaxed` drop
//! the store's release *and* the release half of the fences before it in that thread.
//!
//! # What the model found in the kernels
//! Checked against the kernels after the device-API change (u64 epochs, tagged signals, input
//! and peer-data checks on the device, the NCCL stage split). No ordering is missing.
//! Observations:
//! - The `.release` of the signal stores (batched.cu:184, per_expert.cu:96) and of the ack
//!   stores (batched.cu:350, per_expert.cu:179) is redundant: the same thread has just run
//!   `fence.acq_rel` (batched.cu:181, per_expert.cu:94, common.cuh:407 in `last_block_out`),
//!   which makes a relaxed store a release pattern. Harmless; kept as belt and braces.
//! - In per-expert dispatch a block that owns several experts writes the second expert's
//!   messages after the first expert's `fence_rel` (per_expert.cu:94), so only the first
//!   expert's writes rely on `wait_ack`'s acquire alone (the consecutive-calls model rewrites
//!   exactly those).
//! - Tags: `sig_tag` (common.cuh:237) wraps between epochs 2^40 - 2 (tag 2^40 - 1) and
//!   2^40 - 1 (tag 1); that is the only place where a stale tag is *larger* than the current
//!   one, so a receiver that compared with `>=` (as `wait_ack` rightly does for acks) would
//!   take the previous call's signal there and nowhere else. The `*_tag_wrap` models run two
//!   calls across it (mutant `gpu_tag_ge`). 2^40 - 1 -> 2^40 is tag 1 -> 2, no wrap.
//! - A rank whose routing or token count is bad (`in_bad`, batched.cu:46, per_expert.cu:42)
//!   skips its ack waits and goes to `finish` in every block (each block checks the same
//!   routing), so it neither sends nor receives nor counts itself in `ST_SENT`; but its last
//!   block out still publishes the epoch and acks every source (batched.cu:345-350,
//!   per_expert.cu:175-179) for a call whose data it never read. That is sound: an ack only
//!   lets a source overwrite this rank's receive buffers, and the epochs stay in step, so a
//!   next call launched without a sync is exchanged correctly (model
//!   `bad_input_receiver_then_good_call`). Its peers see no signal: on the same device their
//!   waits stop on the error flag within 64 polls; on another device they run the whole
//!   `timeout_ns` and report a timeout there, which the host ranks after the input error
//!   (errors.rs:86 `cause_first`, :99 `check`). If the caller's routing changed while the
//!   launch ran, blocks could disagree on `in_bad` and the next item applies.
//! - A batched dispatch block whose `wait_ack` fails skips the send side, hence the
//!   `ST_SENT` count (batched.cu:99 jumps over :178). If only some blocks of a rank fail, the
//!   count is left non-zero and a later launch on the same state would signal before every
//!   block has written. The host's refusal of every call after an error (errors.rs:116 sets
//!   `broken`, runtime/mod.rs:220 `check_usable`, first thing in launch.rs:17 `launch_inner`
//!   and :308 `sync`) is what keeps this from happening: it is needed, not just prudent. Back
//!   to back `launch`es without a sync (benchmarks, graph replay) after an error give garbage
//!   until the next sync reports it.
//! - Not an ordering, but the same shape (NCCL transport, not modelled: the model runs stage
//!   0): a rank with bad input also skips, in its pack stage (`p.stage` 1), the writes of
//!   `snd_hdr` and the staged batches (batched.cu:99 jumps over :131-:171), and
//!   launch.rs:141 `nccl_dispatch_exchange` reads `snd_hdr` back after `wait_streams` (:167)
//!   without reading the error word: the previous call's headers (valid once, so `check_pair`,
//!   :193, passes) and batches go to the peers, whose unpack stage (NCCL sources: no signal to
//!   wait for, batched.cu:194) takes them as this call's. The next `sync` reports the input
//!   error, so a caller that syncs gets the error; until then the peers hold the previous
//!   call's rows. Fixed: `nccl_dispatch_exchange` now reads the error word (`check()`) right
//!   after `wait_streams`, before any batch is sent; the peers' NCCL waits then end at their
//!   bound instead of taking stale rows (not yet run on a GPU).

use std::time::Duration;

use ep_reference::sync::{fence, AtomicU64, Deadline, Ordering, SharedRows};

/// Bytes of one payload entry: a 16-byte header (four u32) and an 8-byte payload word.
pub const ROW_BYTES: usize = 24;

/// Phases reported in the error word (common.cuh:18-19 `PH_*`).
pub const PH_DISPATCH_SEND: u32 = 0;
pub const PH_DISPATCH_RECV: u32 = 1;

/// Error codes of `err[0]` (common.cuh:184-188 `ERR_*`) that the model raises.
pub const ERR_TIMEOUT: u32 = 1;
pub const ERR_EXPERT_RANGE: u32 = 2;
pub const ERR_PEER_DATA: u32 = 5;
/// common.cuh:190, :197: the peer-supplied counts the receivers bound.
const PF_BATCH_TOKENS: u32 = 0;
const PF_PE_COUNT: u32 = 7;

/// common.cuh:235 `SIG_COUNT_BITS`: a signal word is `tag << 24 | count`.
pub const SIG_COUNT_BITS: u32 = 24;
const SIG_COUNT_MASK: u64 = (1 << SIG_COUNT_BITS) - 1;

// ---------------------------------------------------------------- orderings and their mutants

/// batched.cu:176 `fence_rel(p)` before the block counter's `atomicAdd`: publishes this block's
/// stores to the block that completes the count.
#[inline]
fn fence_before_sent_add() {
    #[cfg(not(ep_mutant = "gpu_counter_release"))]
    fence(Ordering::AcqRel);
    // Mutant: the release half is gone; the last block no longer gets this block's stores.
    #[cfg(ep_mutant = "gpu_counter_release")]
    fence(Ordering::Acquire);
}

/// batched.cu:181 `fence_rel(p)` of the block that completed the count, before the signal
/// stores: acquires the other blocks' stores (their fence + add) and releases them with its own.
#[inline]
fn fence_after_last_sent() {
    #[cfg(not(any(ep_mutant = "gpu_counter_acquire", ep_mutant = "gpu_signal_relaxed")))]
    fence(Ordering::AcqRel);
    // Mutant: the last block does not acquire the other blocks' stores.
    #[cfg(ep_mutant = "gpu_counter_acquire")]
    fence(Ordering::Release);
    // Mutant (with the relaxed signal store): nothing releases what this fence acquired.
    #[cfg(ep_mutant = "gpu_signal_relaxed")]
    fence(Ordering::Acquire);
}

/// per_expert.cu:94 `fence_rel(p)` of the block that owns the expert, before its signal.
#[inline]
fn fence_before_pe_signal() {
    #[cfg(not(ep_mutant = "gpu_signal_relaxed"))]
    fence(Ordering::AcqRel);
    #[cfg(ep_mutant = "gpu_signal_relaxed")]
    fence(Ordering::Acquire);
}

/// batched.cu:184 / per_expert.cu:96 `st_release` of a signal word.
#[cfg(not(ep_mutant = "gpu_signal_relaxed"))]
const SIGNAL_STORE: Ordering = Ordering::Release;
#[cfg(ep_mutant = "gpu_signal_relaxed")]
const SIGNAL_STORE: Ordering = Ordering::Relaxed;

/// common.cuh:250 `wait_signal`: `ld_acquire(p, addr)`.
#[cfg(not(ep_mutant = "gpu_wait_relaxed"))]
const SIGNAL_LOAD: Ordering = Ordering::Acquire;
#[cfg(ep_mutant = "gpu_wait_relaxed")]
const SIGNAL_LOAD: Ordering = Ordering::Relaxed;

/// common.cuh:402 `last_block_out`: `fence_rel(p)` before the exit counter's `atomicAdd`.
#[inline]
fn fence_before_exit_add() {
    #[cfg(not(any(ep_mutant = "gpu_exit_release", ep_mutant = "gpu_ack_store_relaxed")))]
    fence(Ordering::AcqRel);
    // Mutant: a block's reads are no longer published to the last block out (hence to the ack).
    #[cfg(any(ep_mutant = "gpu_exit_release", ep_mutant = "gpu_ack_store_relaxed"))]
    fence(Ordering::Acquire);
}

/// common.cuh:407 `last_block_out`: `fence_rel(p)` of the last block out, after its `atomicAdd`.
#[inline]
fn fence_after_last_exit() {
    #[cfg(not(any(ep_mutant = "gpu_exit_acquire", ep_mutant = "gpu_ack_store_relaxed")))]
    fence(Ordering::AcqRel);
    // Mutant: the last block out does not acquire the other blocks' reads before it acks.
    #[cfg(ep_mutant = "gpu_exit_acquire")]
    fence(Ordering::Release);
    #[cfg(ep_mutant = "gpu_ack_store_relaxed")]
    fence(Ordering::Acquire);
}

/// batched.cu:350 / per_expert.cu:179 `st_release` of an ack word.
#[cfg(not(ep_mutant = "gpu_ack_store_relaxed"))]
const ACK_STORE: Ordering = Ordering::Release;
#[cfg(ep_mutant = "gpu_ack_store_relaxed")]
const ACK_STORE: Ordering = Ordering::Relaxed;

/// common.cuh:268 `wait_ack`: `ld_acquire(p, addr)`.
#[cfg(not(ep_mutant = "gpu_ack_load_relaxed"))]
const ACK_LOAD: Ordering = Ordering::Acquire;
#[cfg(ep_mutant = "gpu_ack_load_relaxed")]
const ACK_LOAD: Ordering = Ordering::Relaxed;

/// `ld.volatile`, `atomicAdd`, `atomicCAS`, `atomicExch` and plain stores of state counters.
const RELAXED: Ordering = Ordering::Relaxed;

/// common.cuh:251 the receiver's match: the word's tag must equal this call's.
#[inline]
fn tag_matches(word_tag: u64, tag: u64) -> bool {
    #[cfg(not(ep_mutant = "gpu_tag_ge"))]
    return word_tag == tag;
    // Mutant: `>=`, as for acks; right for every pair of consecutive calls but the tag's wrap.
    #[cfg(ep_mutant = "gpu_tag_ge")]
    return word_tag >= tag;
}

// ---------------------------------------------------------------- memory

/// Which kernel a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// batched.cu `ep_batched_dispatch`.
    Batched,
    /// per_expert.cu `ep_per_expert_dispatch`.
    PerExpert,
}

/// The shape of a model.
#[derive(Debug, Clone)]
pub struct Setup {
    pub kind: Kind,
    /// Per rank: (device, blocks of its launch).
    pub ranks: Vec<(usize, usize)>,
    /// The (source, destination) pairs that take part.
    pub links: Vec<(usize, usize)>,
    /// T: entries per (source, destination) region (per (local expert, source) region).
    pub max_tokens: usize,
    /// L: local experts per rank.
    pub local_experts: usize,
}

/// One rank's words (common.cuh:35 `RankPtrs`: `state`, `sig`, `bat_buf` / `pe_buf`).
pub struct Rank {
    pub device: usize,
    pub blocks: usize,
    /// `((u64*)state)[ST_EPOCH64 + KIND]`: calls completed (a u64 of plain memory on the
    /// device: read with `ld.volatile` at a block's start, stored by the last block out; loom
    /// checks that the exit counter and the launch boundary order the two).
    epoch: SharedRows,
    /// `state[ST_SENT + KIND]`: blocks that finished sending in this call.
    sent: AtomicU64,
    /// `state[ST_EXIT + KIND]`: blocks that left this call.
    exit: AtomicU64,
    /// `sig_bat(me)[s]` (batched) or `sig_pe(me)[l * R + s]` (per-expert): from source s.
    sig: Vec<AtomicU64>,
    /// `sig_bat_ack(me)[d]` / `sig_pe_ack(me)[d]`: destination d consumed call `value` (u64).
    ack: Vec<AtomicU64>,
    /// `bat_buf` (entry s * T + pos) / `pe_buf` (entry (l * R + s) * T + t).
    buf: SharedRows,
}

/// One device's error word (common.cuh:176-183: `err[0]` code, `err[1..7]` details, `err[7]`
/// claim).
pub struct ErrorWord {
    code: AtomicU64,
    claim: AtomicU64,
    /// `err[1..7]`: six u32, written only by the claim's winner.
    fields: SharedRows,
}

/// Every rank's and device's words.
pub struct Group {
    /// Calls of this kind completed before the model's first call (0 for a new group): every
    /// epoch word and ack starts there, every signal word holds that call's signal.
    pub base: u64,
    pub setup: Setup,
    pub ranks: Vec<Rank>,
    pub devices: Vec<ErrorWord>,
}

/// What a launch gets in `KParams` that the protocol reads.
#[derive(Debug, Clone, Copy)]
pub struct Launch {
    /// `timeout_ns` (under loom: polls, see [`Deadline`]).
    pub timeout: Duration,
    /// `fault_rank`: this rank never signals (the test hook).
    pub fault_rank: Option<usize>,
    /// This rank's `topk_idx` holds an expert out of range: `load_topk` reports it
    /// (`ERR_EXPERT_RANGE`) and the rank takes the `in_bad` path.
    pub bad_input: Option<usize>,
}

/// One call's inputs: `route[s][t]` = the (destination rank, local expert) of every valid slot of
/// token t on rank s (`topk_idx` after common.cuh:351 `load_topk`).
#[derive(Debug, Clone)]
pub struct Input {
    /// 1, 2, ...: this call's index in the model; its epoch is [`Group::base`] + `call`.
    pub call: u64,
    pub route: Vec<Vec<Vec<(usize, usize)>>>,
}

/// The payload word of token t of rank s in call c (the model's `x` row).
pub fn payload(call: u64, s: usize, t: usize) -> u64 {
    (call << 32) | ((s as u64) << 16) | t as u64
}

/// One entry a receiving block consumed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Entry {
    pub src: usize,
    /// Local expert (per-expert path; 0 in the batched path).
    pub local: usize,
    /// Batched: position in batch(src -> me); per-expert: the slot (token).
    pub pos: usize,
    /// The source token written in the entry's header.
    pub token: u64,
    pub payload: u64,
}

/// How a block's wait ended when it did not get what it waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitEnd {
    /// This wait ran out of time and reported it (or lost the report to an earlier one).
    TimedOut,
    /// Another wait on this device had failed: this one saw the flag and left.
    SawError,
}

/// What one block did in one call.
#[derive(Debug, Clone, Default)]
pub struct BlockReport {
    pub epoch: u64,
    pub read: Vec<Entry>,
    pub failed_wait: Option<WaitEnd>,
    /// This block found its rank's input bad (`in_bad`) and went to the end.
    pub bad_input: bool,
    /// This block was the last out: it published the epoch and the acks.
    pub last_out: bool,
}

impl Group {
    pub fn new(setup: Setup) -> Group {
        Group::after_calls(setup, 0)
    }

    /// A group whose ranks have completed `base` calls (acked, every signal word left by call
    /// `base` with count 0): the tag-wrap models start just before the wrap.
    pub fn after_calls(setup: Setup, base: u64) -> Group {
        let r_n = setup.ranks.len();
        let (t_n, l_n) = (setup.max_tokens, setup.local_experts);
        let n_dev = setup.ranks.iter().map(|r| r.0).max().map_or(0, |d| d + 1);
        let ranks = setup
            .ranks
            .iter()
            .map(|&(device, blocks)| {
                let epoch = SharedRows::new(1, 8);
                // SAFETY: not shared yet.
                unsafe { epoch.with_row_mut(0, |b| b.copy_from_slice(&base.to_le_bytes())) };
                let left = if base == 0 { 0 } else { signal_word(base, 0) };
                Rank {
                    device,
                    blocks,
                    epoch,
                    sent: AtomicU64::new(0),
                    exit: AtomicU64::new(0),
                    sig: (0..l_n * r_n).map(|_| AtomicU64::new(left)).collect(),
                    ack: (0..r_n).map(|_| AtomicU64::new(base)).collect(),
                    buf: SharedRows::new(l_n * r_n * t_n, ROW_BYTES),
                }
            })
            .collect();
        let devices = (0..n_dev)
            .map(|_| ErrorWord {
                code: AtomicU64::new(0),
                claim: AtomicU64::new(0),
                fields: SharedRows::new(1, 24),
            })
            .collect();
        Group {
            base,
            setup,
            ranks,
            devices,
        }
    }

    fn dests(&self, rank: usize) -> impl Iterator<Item = usize> + '_ {
        self.setup
            .links
            .iter()
            .filter(move |l| l.0 == rank)
            .map(|l| l.1)
    }

    fn sources(&self, rank: usize) -> impl Iterator<Item = usize> + '_ {
        self.setup
            .links
            .iter()
            .filter(move |l| l.1 == rank)
            .map(|l| l.0)
    }

    fn err(&self, rank: usize) -> &ErrorWord {
        &self.devices[self.ranks[rank].device]
    }

    /// The tokens of `s` bound for `d`, in token order (batched.cu:75-98, `tokpos`).
    fn batch(&self, input: &Input, s: usize, d: usize) -> Vec<usize> {
        (0..input.route[s].len())
            .filter(|&t| input.route[s][t].iter().any(|sel| sel.0 == d))
            .collect()
    }

    /// What rank `d` must have consumed in a complete call, in (source, local, pos) order.
    pub fn expected(&self, input: &Input, d: usize) -> Vec<Entry> {
        let mut want = Vec::new();
        for s in self.sources(d) {
            match self.setup.kind {
                Kind::Batched => {
                    for (pos, t) in self.batch(input, s, d).into_iter().enumerate() {
                        want.push(Entry {
                            src: s,
                            local: 0,
                            pos,
                            token: t as u64,
                            payload: payload(input.call, s, t),
                        });
                    }
                }
                Kind::PerExpert => {
                    for l in 0..self.setup.local_experts {
                        for (t, sels) in input.route[s].iter().enumerate() {
                            if sels.contains(&(d, l)) {
                                want.push(Entry {
                                    src: s,
                                    local: l,
                                    pos: t,
                                    token: t as u64,
                                    payload: payload(input.call, s, t),
                                });
                            }
                        }
                    }
                }
            }
        }
        want.sort();
        want
    }
}

/// Every block's reads of one call, merged in (source, local, pos) order.
pub fn merged(reports: &[BlockReport]) -> Vec<Entry> {
    let mut all: Vec<Entry> = reports.iter().flat_map(|r| r.read.clone()).collect();
    all.sort();
    all
}

fn write_entry(buf: &SharedRows, row: usize, header: [u32; 4], payload: u64) {
    // SAFETY: entry `row` of this region is written only by the one block that owns the unit,
    // and only after the ack of the previous call (whose reads it would overwrite); loom checks
    // both through the row's cell.
    unsafe {
        buf.with_row_mut(row, |b| {
            for (i, w) in header.iter().enumerate() {
                b[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
            }
            b[16..].copy_from_slice(&payload.to_le_bytes());
        })
    }
}

/// One load of an entry: its four header words and its payload.
fn read_entry(buf: &SharedRows, row: usize) -> ([u32; 4], u64) {
    // SAFETY: read after the acquire of the signal that the writer released after this row's
    // write, and before the ack that lets the next call overwrite it; loom checks both.
    unsafe {
        buf.with_rows(row, 1, |b| {
            let w = |i: usize| u32::from_le_bytes(b[4 * i..4 * i + 4].try_into().expect("4 bytes"));
            (
                [w(0), w(1), w(2), w(3)],
                u64::from_le_bytes(b[16..24].try_into().expect("8 bytes")),
            )
        })
    }
}

/// common.cuh:237 `sig_tag`: `epoch mod (2^40 - 1) + 1`, never 0.
pub fn sig_tag(epoch: u64) -> u64 {
    epoch % ((1 << 40) - 1) + 1
}

/// common.cuh:280 `signal_word`: `tag << 24 | count`.
pub fn signal_word(epoch: u64, count: u32) -> u64 {
    (sig_tag(epoch) << SIG_COUNT_BITS) | (count as u64 & SIG_COUNT_MASK)
}

// ---------------------------------------------------------------- errors and bounded waits

/// common.cuh:200 `failed`: `ld_volatile_u32(err) != 0`.
fn failed(e: &ErrorWord) -> bool {
    e.code.load(RELAXED) != 0
}

/// common.cuh:205 `report_error`: the first error of the device writes the details, then
/// raises the code; later ones only see it.
fn report_error(e: &ErrorWord, code: u32, words: [u32; 6]) {
    // if (atomicCAS(w + 7, 0u, 1u) == 0u)
    if e.claim.compare_exchange(0, 1, RELAXED, RELAXED).is_ok() {
        // w[1] = a; ... w[6] = f;
        // SAFETY: only the claim's one winner writes the row, once; the host reads it after
        // every block of the launch ended.
        unsafe {
            e.fields.with_row_mut(0, |b| {
                for (i, w) in words.iter().enumerate() {
                    b[4 * i..4 * i + 4].copy_from_slice(&w.to_le_bytes());
                }
            })
        }
        // __threadfence_system();
        fence(Ordering::SeqCst);
        // atomicExch(w, code);
        e.code.swap(code as u64, RELAXED);
    }
}

/// common.cuh:219 `report_timeout`: rank, peer, phase, call (low), waited us, call (high).
fn report_timeout(e: &ErrorWord, rank: usize, peer: usize, phase: u32, call: u64, waited: u64) {
    let words = [
        rank as u32,
        peer as u32,
        phase,
        call as u32,
        (waited * 1000) as u32,
        (call >> 32) as u32,
    ];
    report_error(e, ERR_TIMEOUT, words);
}

/// common.cuh:223 `peer_bad`: a peer-supplied `value` outside [0, limit] is reported.
fn peer_bad(e: &ErrorWord, rank: usize, peer: usize, field: u32, value: i64, limit: i64) -> bool {
    if (0..=limit).contains(&value) {
        return false;
    }
    let words = [
        rank as u32,
        peer as u32,
        field,
        value as u32,
        0,
        limit as u32,
    ];
    report_error(e, ERR_PEER_DATA, words);
    true
}

/// common.cuh:245 `wait_signal`: waits until the word carries this call's tag; returns its count.
#[allow(clippy::too_many_arguments)]
fn wait_signal(
    g: &Group,
    kp: &Launch,
    addr: &AtomicU64,
    epoch: u64,
    rank: usize,
    peer: usize,
    phase: u32,
) -> Result<u32, WaitEnd> {
    let e = g.err(rank);
    // u64 t0 = globaltimer();
    let deadline = Deadline::after(kp.timeout);
    // const u64 tag = sig_tag(epoch);
    let tag = sig_tag(epoch);
    let got = deadline.spin_until(|| {
        // u64 v = ld_acquire(p, addr);
        let v = addr.load(SIGNAL_LOAD);
        // if ((v >> SIG_COUNT_BITS) == tag) return (long long)(v & SIG_COUNT_MASK);
        if tag_matches(v >> SIG_COUNT_BITS, tag) {
            return Some(Ok((v & SIG_COUNT_MASK) as u32));
        }
        // if ((++spins & 63u) == 0u) { if (failed(p)) return -1; ... }
        if failed(e) {
            return Some(Err(WaitEnd::SawError));
        }
        None
    });
    got.unwrap_or_else(|| {
        // if (now - t0 > p.timeout_ns) { report_timeout(p, rank, peer, phase, epoch, now - t0); return -1; }
        report_timeout(e, rank, peer, phase, epoch, deadline.waited_ms());
        Err(WaitEnd::TimedOut)
    })
}

/// common.cuh:264 `wait_ack`: waits until the ack word is at least `need` (u64 epochs).
#[allow(clippy::too_many_arguments)]
fn wait_ack(
    g: &Group,
    kp: &Launch,
    addr: &AtomicU64,
    need: u64,
    call: u64,
    rank: usize,
    peer: usize,
    phase: u32,
) -> Result<(), WaitEnd> {
    let e = g.err(rank);
    let deadline = Deadline::after(kp.timeout);
    let got = deadline.spin_until(|| {
        // u64 v = ld_acquire(p, addr); if (v >= need) return true;
        if addr.load(ACK_LOAD) >= need {
            return Some(Ok(()));
        }
        // if (failed(p)) return false;
        if failed(e) {
            return Some(Err(WaitEnd::SawError));
        }
        None
    });
    got.unwrap_or_else(|| {
        report_timeout(e, rank, peer, phase, call, deadline.waited_ms());
        Err(WaitEnd::TimedOut)
    })
}

// ---------------------------------------------------------------- the roles

/// Role: the start of every block (batched.cu:33-38, per_expert.cu:29-34): this call's epoch.
fn block_epoch(me: &Rank) -> u64 {
    // s_epoch = ld_epoch(state, KIND) + 1ull;
    // SAFETY: the only write is the previous launch's last block out (`finish`), which ended
    // before this launch started.
    let calls = unsafe {
        me.epoch
            .with_rows(0, 1, |b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
    };
    calls + 1
}

/// Role: the device-side input check (batched.cu:46, per_expert.cu:42 `load_topk(..., true)`,
/// common.cuh:351-380): a bad index is reported before anything is written. Returns `in_bad`.
fn input_check(g: &Group, kp: &Launch, rank: usize) -> bool {
    if kp.bad_input != Some(rank) {
        return false;
    }
    // common.cuh:357 report_error(p.err, ERR_EXPERT_RANGE, rank, token, slot, value, value >> 32, E);
    let e_n = (g.ranks.len() * g.setup.local_experts) as u32;
    report_error(
        g.err(rank),
        ERR_EXPERT_RANGE,
        [rank as u32, 0, 0, e_n, 0, e_n],
    );
    true
}

/// Role: the sender of the next call waits for every destination's ack of the previous call
/// before it overwrites their buffers (batched.cu:51-53, per_expert.cu:43-44; threads tid < R,
/// one per destination; skipped when the input is bad).
fn sender_wait_acks(g: &Group, kp: &Launch, rank: usize, epoch: u64) -> Option<WaitEnd> {
    let mut bad = None;
    #[cfg(not(ep_mutant = "gpu_no_ack_wait"))]
    for d in g.dests(rank) {
        // bad = !wait_ack(p, sig_bat_ack(me, R) + tid, epoch - 1ull, epoch, rank, tid, PH_DISPATCH_SEND);
        if let Err(e) = wait_ack(
            g,
            kp,
            &g.ranks[rank].ack[d],
            epoch - 1,
            epoch,
            rank,
            d,
            PH_DISPATCH_SEND,
        ) {
            bad.get_or_insert(e);
        }
    }
    #[cfg(ep_mutant = "gpu_no_ack_wait")]
    let _ = (g, kp, rank, epoch);
    bad
}

/// Role: a batched sender block writes its share of every batch, then counts itself out; the
/// block that completes the count stores every destination's signal with the call's tag
/// (batched.cu:106-186).
fn batched_send(g: &Group, kp: &Launch, input: &Input, rank: usize, bid: usize, epoch: u64) {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let mut counts = Vec::new();
    for d in g.dests(rank) {
        let batch = g.batch(input, rank, d);
        // batched.cu:109 for (u = bid * NWARPS + warp; u < n * segs; u += blocks_per_rank * NWARPS)
        for (pos, &t) in batch.iter().enumerate() {
            if t % me.blocks != bid {
                continue;
            }
            // batched.cu:131-133 entry = tab[d].bat_buf + (rank * T + tokpos(t, d)) * entry_bytes;
            // seg_store(payload); batched.cu:140 ((int*)entry)[0] = t (the header)
            write_entry(
                &g.ranks[d].buf,
                rank * t_n + pos,
                [t as u32, 0, 0, 0],
                payload(input.call, rank, t),
            );
        }
        counts.push((d, batch.len() as u32));
    }
    // batched.cu:173 __syncthreads(); then thread 0 (:175):
    // batched.cu:176 fence_rel(p);
    fence_before_sent_add();
    // batched.cu:178 const u32 old = atomicAdd(state + ST_SENT + KIND, 1u);
    let old = me.sent.fetch_add(1, RELAXED);
    // batched.cu:179 if (old == (u32)p.blocks_per_rank - 1u)
    if old as usize == me.blocks - 1 {
        // batched.cu:180 state[ST_SENT + KIND] = 0u;
        me.sent.store(0, RELAXED);
        // batched.cu:181 fence_rel(p);
        fence_after_last_sent();
        // batched.cu:182 if (rank != p.fault_rank)
        if kp.fault_rank != Some(rank) {
            for (d, count) in counts {
                // batched.cu:184 st_release(p, sig_bat(tab[d]) + rank, signal_word(epoch, (u32)sm.tot[d]));
                g.ranks[d].sig[rank].store(signal_word(epoch, count), SIGNAL_STORE);
            }
        }
    }
}

/// Role: a batched receiver block waits for every source's signal (acquire, bounded, stopped
/// by the error word), bounds the count, then reads its share of the entries
/// (batched.cu:188-337).
fn batched_receive(
    g: &Group,
    kp: &Launch,
    rank: usize,
    bid: usize,
    epoch: u64,
    rep: &mut BlockReport,
) {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let mut counts = Vec::new();
    // batched.cu:192 if (tid < R)
    for s in g.sources(rank) {
        // batched.cu:196 c = wait_signal(p, sig_bat(me) + tid, epoch, rank, tid, PH_DISPATCH_RECV);
        match wait_signal(g, kp, &me.sig[s], epoch, rank, s, PH_DISPATCH_RECV) {
            Ok(c) => {
                // batched.cu:197 bad = c < 0 || peer_bad(p, rank, tid, PF_BATCH_TOKENS, c, T);
                if peer_bad(g.err(rank), rank, s, PF_BATCH_TOKENS, c as i64, t_n as i64) {
                    rep.failed_wait.get_or_insert(WaitEnd::SawError);
                } else {
                    counts.push((s, c as usize));
                }
            }
            Err(e) => {
                rep.failed_wait.get_or_insert(e);
            }
        }
    }
    // batched.cu:200 if (__syncthreads_or(bad)) goto finish;
    if rep.failed_wait.is_some() {
        return;
    }
    // batched.cu:252 for (u0 = bid * NWARPS + warp; u0 < units; ...): entry j of every source's
    // batch, one after the other (sm.rcnt), belongs to block j % blocks.
    let mut j = 0;
    for (s, c) in counts {
        for pos in 0..c {
            if j % me.blocks == bid {
                // batched.cu:273-282 h = me.bat_buf + (s * T + j) * entry_bytes; loads of h
                let (header, payload) = read_entry(&me.buf, s * t_n + pos);
                rep.read.push(Entry {
                    src: s,
                    local: 0,
                    pos,
                    token: header[0] as u64,
                    payload,
                });
            }
            j += 1;
        }
    }
}

/// Role: a per-expert sender block writes one message per selection of each expert it owns,
/// stamped with the u64 epoch, and signals each expert itself (per_expert.cu:52-98).
fn per_expert_send(g: &Group, kp: &Launch, input: &Input, rank: usize, bid: usize, epoch: u64) {
    let me = &g.ranks[rank];
    let (r_n, t_n, l_n) = (g.ranks.len(), g.setup.max_tokens, g.setup.local_experts);
    let dests: Vec<usize> = g.dests(rank).collect();
    // per_expert.cu:55 for (int e = bid; e < E && p.stage != 2; e += p.blocks_per_rank)
    for e in (bid..r_n * l_n).step_by(me.blocks) {
        // per_expert.cu:56 const int d = e / L, l = e % L;
        let (d, l) = (e / l_n, e % l_n);
        if !dests.contains(&d) {
            continue;
        }
        let region = (l * r_n + rank) * t_n;
        let mut count = 0u32;
        for (t, sels) in input.route[rank].iter().enumerate() {
            if let Some(k) = sels.iter().position(|&sel| sel == (d, l)) {
                // per_expert.cu:78-81 entry = region + tt * pe_entry_bytes; seg_store(payload);
                // per_expert.cu:83-86 header {(u32)epoch, tt, slot, (u32)(epoch >> 32)}
                write_entry(
                    &g.ranks[d].buf,
                    region + t,
                    [epoch as u32, t as u32, k as u32, (epoch >> 32) as u32],
                    payload(input.call, rank, t),
                );
                count += 1;
            }
        }
        // per_expert.cu:92 __syncthreads(); per_expert.cu:93 if (tid == 0 && rank != p.fault_rank)
        if kp.fault_rank != Some(rank) {
            // per_expert.cu:94 fence_rel(p);
            fence_before_pe_signal();
            // per_expert.cu:96 st_release(p, sig_pe(tab[d], R) + l * R + rank, signal_word(epoch, (u32)count));
            g.ranks[d].sig[l * r_n + rank].store(signal_word(epoch, count), SIGNAL_STORE);
        }
    }
}

/// Role: a per-expert receiver block, per local expert it owns and per source in order, waits
/// for the (l, s) signal, then finds this call's messages by their epoch stamp
/// (per_expert.cu:100-169).
fn per_expert_receive(
    g: &Group,
    kp: &Launch,
    rank: usize,
    bid: usize,
    epoch: u64,
    rep: &mut BlockReport,
) {
    let me = &g.ranks[rank];
    let (r_n, t_n, l_n) = (g.ranks.len(), g.setup.max_tokens, g.setup.local_experts);
    let sources: Vec<usize> = g.sources(rank).collect();
    // per_expert.cu:102 for (int l = bid; l < L && p.stage != 1; l += p.blocks_per_rank)
    for l in (bid..l_n).step_by(me.blocks) {
        for &s in &sources {
            // per_expert.cu:107 c = wait_signal(p, sig_pe(me, R) + l * R + s, epoch, rank, s, PH_DISPATCH_RECV);
            let got = wait_signal(
                g,
                kp,
                &me.sig[l * r_n + s],
                epoch,
                rank,
                s,
                PH_DISPATCH_RECV,
            );
            // per_expert.cu:108 if (c >= 0 && peer_bad(p, rank, s, PF_PE_COUNT, c, T)) c = -1;
            let got = got.and_then(|c| {
                if peer_bad(g.err(rank), rank, s, PF_PE_COUNT, c as i64, t_n as i64) {
                    Err(WaitEnd::SawError)
                } else {
                    Ok(c as usize)
                }
            });
            let cnt = match got {
                Ok(c) => c,
                // per_expert.cu:114 if (cnt < 0) goto finish;
                Err(e) => {
                    rep.failed_wait = Some(e);
                    return;
                }
            };
            let region = (l * r_n + s) * t_n;
            let mut found = 0;
            // per_expert.cu:117 for (c = 0; c < T && base - begin < cnt; ...)
            for j in 0..t_n {
                if found >= cnt {
                    break;
                }
                // per_expert.cu:123-124 one 16-byte load of the header;
                // has = hv.x == (u32)epoch && hv.w == (u32)(epoch >> 32)
                let (h, payload) = read_entry(&me.buf, region + j);
                if h[0] == epoch as u32 && h[3] == (epoch >> 32) as u32 {
                    rep.read.push(Entry {
                        src: s,
                        local: l,
                        pos: j,
                        token: h[1] as u64,
                        payload,
                    });
                    found += 1;
                }
            }
        }
    }
}

/// Role: the end of every block (common.cuh:398-412 `last_block_out`); returns whether this
/// block is the last one out.
fn last_block_out(me: &Rank) -> bool {
    // common.cuh:400 __syncthreads(); :401 if (threadIdx.x == 0) { :402 fence_rel(p);
    fence_before_exit_add();
    // common.cuh:403 u32 old = atomicAdd(state + ST_EXIT + kind, 1u);
    let old = me.exit.fetch_add(1, RELAXED);
    // common.cuh:404 s_last = (old == (u32)p.blocks_per_rank - 1u);
    let last = old as usize == me.blocks - 1;
    if last {
        // common.cuh:406-407 state[ST_EXIT + kind] = 0u; fence_rel(p);
        me.exit.store(0, RELAXED);
        fence_after_last_exit();
    }
    last
}

/// Role: the last block out publishes the epoch and acknowledges to every source that this rank
/// consumed the call (batched.cu:339-352, per_expert.cu:171-181; stage 0).
fn finish(g: &Group, rank: usize, epoch: u64, rep: &mut BlockReport) {
    let me = &g.ranks[rank];
    rep.last_out = last_block_out(me);
    // batched.cu:345 / per_expert.cu:175 if (last_out && p.stage != 1)
    if rep.last_out {
        // batched.cu:347 / per_expert.cu:178 ((u64*)state)[ST_EPOCH64 + KIND] = epoch;
        // SAFETY: every block of this launch read the word before its exit count, which the
        // last block out acquired (`last_block_out`); the next launch starts after this one.
        unsafe {
            me.epoch
                .with_row_mut(0, |b| b.copy_from_slice(&epoch.to_le_bytes()))
        };
        for s in g.sources(rank) {
            // batched.cu:350 / per_expert.cu:179 st_release(p, sig_bat_ack(tab[s], R) + rank, (u64)epoch);
            g.ranks[s].ack[rank].store(epoch, ACK_STORE);
        }
    }
}

/// One block of one dispatch launch, every role in kernel order (batched.cu:19
/// `ep_batched_dispatch` / per_expert.cu:16 `ep_per_expert_dispatch`).
pub fn dispatch_block(
    g: &Group,
    kp: &Launch,
    input: &Input,
    rank: usize,
    bid: usize,
) -> BlockReport {
    let me = &g.ranks[rank];
    let epoch = block_epoch(me);
    let mut rep = BlockReport {
        epoch,
        ..BlockReport::default()
    };
    // batched.cu:46 / per_expert.cu:42 const int in_bad = load_topk(...) | s_bad;
    rep.bad_input = input_check(g, kp, rank);
    // batched.cu:52 / per_expert.cu:44 if (!in_bad && tid < R ...) bad = !wait_ack(...);
    if !rep.bad_input {
        rep.failed_wait = sender_wait_acks(g, kp, rank, epoch);
    }
    // batched.cu:99 / per_expert.cu:45 if (__syncthreads_or(bad)) goto finish;
    if !rep.bad_input && rep.failed_wait.is_none() {
        match g.setup.kind {
            Kind::Batched => {
                batched_send(g, kp, input, rank, bid, epoch);
                batched_receive(g, kp, rank, bid, epoch, &mut rep);
            }
            Kind::PerExpert => {
                per_expert_send(g, kp, input, rank, bid, epoch);
                per_expert_receive(g, kp, rank, bid, epoch, &mut rep);
            }
        }
    }
    finish(g, rank, epoch, &mut rep);
    rep
}

// ---------------------------------------------------------------- the host

/// A device error as the host decodes it (kernels/src/runtime/errors.rs:31 `decode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceError {
    Timeout {
        rank: u32,
        peer: u32,
        phase: u32,
        /// The whole u64 epoch: words 4 (low) and 6 (high).
        call: u64,
    },
    /// `ERR_EXPERT_RANGE`: this rank's routing was bad.
    BadInput { rank: u32 },
    /// `ERR_PEER_DATA`.
    PeerData { rank: u32, peer: u32, field: u32 },
}

/// The host side of kernels/src/runtime/ that the protocol relies on.
#[derive(Debug, Default)]
pub struct Host {
    broken: Option<DeviceError>,
}

impl Host {
    /// runtime/mod.rs:220 `GpuGroup::check_usable`: a group that failed refuses every later
    /// call (launch.rs:17 `launch_inner`, :308 `sync`).
    pub fn check_usable(&self) -> Result<(), DeviceError> {
        match self.broken {
            Some(t) => Err(t),
            None => Ok(()),
        }
    }

    /// launch.rs:307 `GpuGroup::sync` then errors.rs:99 `check`, once the streams are
    /// synchronised (the caller joined every block of the launch): reads every device's error
    /// word; the first error, input and peer errors before timeouts (errors.rs:86
    /// `cause_first`), fails the group.
    pub fn sync(&mut self, g: &Group) -> Result<(), DeviceError> {
        self.check_usable()?;
        let mut found = Vec::new();
        for e in &g.devices {
            // cuMemcpyDtoH of err after the stream synchronised: ordered by the join.
            let code = e.code.load(RELAXED) as u32;
            if code == 0 {
                continue;
            }
            // SAFETY: every block of the launch ended (joined): no writer is left.
            let w: Vec<u32> = unsafe {
                e.fields.with_rows(0, 1, |b| {
                    b.chunks(4)
                        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                        .collect()
                })
            };
            found.push(match code {
                ERR_TIMEOUT => DeviceError::Timeout {
                    rank: w[0],
                    peer: w[1],
                    phase: w[2],
                    call: w[3] as u64 | (w[5] as u64) << 32,
                },
                ERR_EXPERT_RANGE => DeviceError::BadInput { rank: w[0] },
                _ => DeviceError::PeerData {
                    rank: w[0],
                    peer: w[1],
                    field: w[2],
                },
            });
        }
        // errors.rs:114 found.sort_by_key(cause_first);
        found.sort_by_key(|e| matches!(e, DeviceError::Timeout { .. }));
        if let Some(&e) = found.first() {
            // errors.rs:116 self.broken = Some(e.clone());
            self.broken = Some(e);
            return Err(e);
        }
        Ok(())
    }
}

#[cfg(all(test, not(ep_loom)))]
mod tests {
    //! The model on std threads: not a proof (loom's tests are), but it shows the functions run
    //! the protocol end to end in the normal build.
    use super::*;
    use std::sync::Arc;
    use std::thread;

    fn two_calls(kind: Kind) {
        let setup = Setup {
            kind,
            ranks: vec![(0, 2), (1, 1)],
            links: vec![(0, 1)],
            max_tokens: 2,
            local_experts: 2,
        };
        let g = Arc::new(Group::new(setup));
        let kp = Launch {
            timeout: Duration::from_secs(10),
            fault_rank: None,
            bad_input: None,
        };
        let inputs: Vec<Input> = (1..=3)
            .map(|c| Input {
                call: c,
                route: vec![vec![vec![(1, 0)], vec![(1, 1)]], vec![]],
            })
            .collect();
        let rx = {
            let (g, inputs) = (g.clone(), inputs.clone());
            thread::spawn(move || {
                for input in &inputs {
                    let rep = dispatch_block(&g, &kp, input, 1, 0);
                    assert_eq!(rep.read, g.expected(input, 1), "call {}", input.call);
                    assert!(rep.last_out);
                }
            })
        };
        for input in &inputs {
            let b1 = {
                let (g, input) = (g.clone(), input.clone());
                thread::spawn(move || dispatch_block(&g, &kp, &input, 0, 1))
            };
            let r0 = dispatch_block(&g, &kp, input, 0, 0);
            let r1 = b1.join().unwrap();
            assert_eq!(r0.epoch, input.call);
            assert!(r0.last_out ^ r1.last_out, "exactly one block is last out");
        }
        rx.join().unwrap();
    }

    #[test]
    fn batched_two_blocks_three_calls_std() {
        for _ in 0..50 {
            two_calls(Kind::Batched);
        }
    }

    #[test]
    fn per_expert_two_blocks_three_calls_std() {
        for _ in 0..50 {
            two_calls(Kind::PerExpert);
        }
    }

    #[test]
    fn fault_rank_times_out_and_the_host_refuses_the_next_call() {
        let setup = Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 1), (0, 2)],
            links: vec![(0, 1)],
            max_tokens: 1,
            local_experts: 1,
        };
        let g = Arc::new(Group::new(setup));
        let kp = Launch {
            timeout: Duration::from_millis(50),
            fault_rank: Some(0),
            bad_input: None,
        };
        let input = Input {
            call: 1,
            route: vec![vec![vec![(1, 0)]], vec![]],
        };
        let blocks: Vec<_> = [(0, 0), (1, 0), (1, 1)]
            .into_iter()
            .map(|(r, b)| {
                let (g, input) = (g.clone(), input.clone());
                thread::spawn(move || dispatch_block(&g, &kp, &input, r, b))
            })
            .collect();
        let reps: Vec<BlockReport> = blocks.into_iter().map(|b| b.join().unwrap()).collect();
        assert!(reps[1].failed_wait.is_some() && reps[2].failed_wait.is_some());
        let mut host = Host::default();
        let want = DeviceError::Timeout {
            rank: 1,
            peer: 0,
            phase: PH_DISPATCH_RECV,
            call: 1,
        };
        assert_eq!(host.sync(&g), Err(want));
        assert_eq!(host.check_usable(), Err(want));
    }

    #[test]
    fn tags_are_never_zero_and_wrap_once_per_2_40_minus_1_calls() {
        let m = (1u64 << 40) - 1;
        assert_eq!(sig_tag(0), 1);
        assert_eq!(sig_tag(1), 2);
        assert_eq!(sig_tag(m - 1), m, "the largest tag");
        assert_eq!(sig_tag(m), 1, "the wrap");
        assert_eq!(sig_tag(m + 1), 2);
        assert_eq!(sig_tag(u64::MAX), u64::MAX % m + 1);
        for e in [1, m - 1, m, m + 1, u64::MAX] {
            assert_ne!(sig_tag(e), 0);
            assert_ne!(sig_tag(e), sig_tag(e - 1), "consecutive calls differ");
        }
        let w = signal_word(m - 1, 5);
        assert_eq!(
            (w >> SIG_COUNT_BITS, w & SIG_COUNT_MASK),
            (m, 5),
            "tag fills the top 40 bits"
        );
    }

    #[test]
    fn bad_input_rank_skips_its_sends_acks_and_the_host_names_it() {
        let setup = Setup {
            kind: Kind::Batched,
            ranks: vec![(0, 1), (1, 1)],
            links: vec![(0, 1)],
            max_tokens: 1,
            local_experts: 1,
        };
        let g = Arc::new(Group::new(setup));
        let kp = Launch {
            timeout: Duration::from_millis(50),
            fault_rank: None,
            bad_input: Some(1),
        };
        let input = Input {
            call: 1,
            route: vec![vec![vec![(1, 0)]], vec![]],
        };
        let blocks: Vec<_> = [0, 1]
            .into_iter()
            .map(|r| {
                let (g, input) = (g.clone(), input.clone());
                thread::spawn(move || dispatch_block(&g, &kp, &input, r, 0))
            })
            .collect();
        let reps: Vec<BlockReport> = blocks.into_iter().map(|b| b.join().unwrap()).collect();
        assert!(reps[1].bad_input && reps[1].read.is_empty() && reps[1].last_out);
        assert_eq!(
            g.ranks[0].ack[1].load(RELAXED),
            1,
            "the bad rank acks call 1"
        );
        let mut host = Host::default();
        assert_eq!(host.sync(&g), Err(DeviceError::BadInput { rank: 1 }));
        assert_eq!(host.check_usable(), Err(DeviceError::BadInput { rank: 1 }));
    }
}
