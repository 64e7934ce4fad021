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
//! - **Instructions.** `fence.acq_rel.{gpu,sys}` (common.cuh `fence_rel`) is `fence(AcqRel)`;
//!   `st.release` a `Release` store; `ld.acquire` an `Acquire` load; `atomicAdd`, `atomicCAS`,
//!   `atomicExch` relaxed read-modify-writes (CUDA's atomics are relaxed); `ld.volatile` and the
//!   plain stores of `state` words relaxed atomics; `__threadfence_system` `fence(SeqCst)`. Scopes
//!   (.gpu / .sys) are not modelled: the kernels use the narrowest one that covers every rank.
//! - **Launches.** A launch is one thread per block. The next launch on a device's stream starts
//!   after every block of the previous one ended (the tests join them). Nothing else orders two
//!   calls: no host synchronisation between calls is assumed (`GpuGroup::launch` back to back,
//!   process mode, CUDA graph replay), so only the acks order a call's reads on one device before
//!   the next call's writes from another.
//! - **Pairs.** The kernels run every (source, destination) pair, self included, count 0 too. A
//!   model lists the pairs it checks ([`Setup::links`]); pairs share nothing but the block
//!   counters and the error word, which the model keeps.
//! - **Bounded waits.** `%globaltimer` is a [`Deadline`]: under loom a timeout of N ms is N polls
//!   and one of an hour or more never expires. The kernels look at the error word and the clock
//!   every 64 polls, the model on every poll.
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
//! No ordering is missing. Three observations:
//! - The `.release` of the signal stores (batched.cu:171, per_expert.cu:83) and of the ack
//!   stores (batched.cu:311, per_expert.cu:145) is redundant: the same thread has just run
//!   `fence.acq_rel` (batched.cu:168, per_expert.cu:82, `last_block_out`), which makes a relaxed
//!   store a release pattern. Harmless; kept as belt and braces.
//! - In per-expert dispatch a block that owns several experts writes the second expert's
//!   messages after the first expert's `fence_rel`, so only the first expert's writes rely on
//!   `wait_ack`'s acquire alone (the consecutive-calls model rewrites exactly those).
//! - A batched dispatch block whose `wait_ack` fails skips the send side, hence the
//!   `ST_SENT` count (batched.cu:92 jumps over :165). If only some blocks of a rank fail, the
//!   count is left non-zero and a later launch on the same state would signal before every
//!   block has written. The host's refusal of every call after a timeout (runtime.rs
//!   `check_usable`) is what keeps this from happening: it is needed, not just prudent. Back to
//!   back `launch`es without a sync (benchmarks, graph replay) after a timeout give garbage
//!   until the next sync reports the timeout.

use std::time::Duration;

use ep_reference::sync::{fence, AtomicU64, Deadline, Ordering, SharedRows};

/// Bytes of one payload entry: an 8-byte header and an 8-byte payload word.
pub const ROW_BYTES: usize = 16;

/// Phases reported in the error word (common.cuh `PH_*`).
pub const PH_DISPATCH_SEND: u32 = 0;
pub const PH_DISPATCH_RECV: u32 = 1;

// ---------------------------------------------------------------- orderings and their mutants

/// batched.cu:164 `fence_rel(p)` before the block counter's `atomicAdd`: publishes this block's
/// stores to the block that completes the count.
#[inline]
fn fence_before_sent_add() {
    #[cfg(not(ep_mutant = "gpu_counter_release"))]
    fence(Ordering::AcqRel);
    // Mutant: the release half is gone; the last block no longer gets this block's stores.
    #[cfg(ep_mutant = "gpu_counter_release")]
    fence(Ordering::Acquire);
}

/// batched.cu:168 `fence_rel(p)` of the block that completed the count, before the signal
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

/// per_expert.cu:82 `fence_rel(p)` of the block that owns the expert, before its signal.
#[inline]
fn fence_before_pe_signal() {
    #[cfg(not(ep_mutant = "gpu_signal_relaxed"))]
    fence(Ordering::AcqRel);
    #[cfg(ep_mutant = "gpu_signal_relaxed")]
    fence(Ordering::Acquire);
}

/// batched.cu:171 / per_expert.cu:83 `st_release` of a signal word.
#[cfg(not(ep_mutant = "gpu_signal_relaxed"))]
const SIGNAL_STORE: Ordering = Ordering::Release;
#[cfg(ep_mutant = "gpu_signal_relaxed")]
const SIGNAL_STORE: Ordering = Ordering::Relaxed;

/// common.cuh `wait_signal`: `ld_acquire(p, addr)`.
#[cfg(not(ep_mutant = "gpu_wait_relaxed"))]
const SIGNAL_LOAD: Ordering = Ordering::Acquire;
#[cfg(ep_mutant = "gpu_wait_relaxed")]
const SIGNAL_LOAD: Ordering = Ordering::Relaxed;

/// common.cuh `last_block_out`: `fence_rel(p)` before the exit counter's `atomicAdd`.
#[inline]
fn fence_before_exit_add() {
    #[cfg(not(any(ep_mutant = "gpu_exit_release", ep_mutant = "gpu_ack_store_relaxed")))]
    fence(Ordering::AcqRel);
    // Mutant: a block's reads are no longer published to the last block out (hence to the ack).
    #[cfg(any(ep_mutant = "gpu_exit_release", ep_mutant = "gpu_ack_store_relaxed"))]
    fence(Ordering::Acquire);
}

/// common.cuh `last_block_out`: `fence_rel(p)` of the last block out, after its `atomicAdd`.
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

/// batched.cu:311 / per_expert.cu:145 `st_release` of an ack word.
#[cfg(not(ep_mutant = "gpu_ack_store_relaxed"))]
const ACK_STORE: Ordering = Ordering::Release;
#[cfg(ep_mutant = "gpu_ack_store_relaxed")]
const ACK_STORE: Ordering = Ordering::Relaxed;

/// common.cuh `wait_ack`: `ld_acquire(p, addr)`.
#[cfg(not(ep_mutant = "gpu_ack_load_relaxed"))]
const ACK_LOAD: Ordering = Ordering::Acquire;
#[cfg(ep_mutant = "gpu_ack_load_relaxed")]
const ACK_LOAD: Ordering = Ordering::Relaxed;

/// `ld.volatile`, `atomicAdd`, `atomicCAS`, `atomicExch` and plain stores of state words.
const RELAXED: Ordering = Ordering::Relaxed;

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

/// One rank's words (common.cuh `RankPtrs`: `state`, `sig`, `bat_buf` / `pe_buf`).
pub struct Rank {
    pub device: usize,
    pub blocks: usize,
    /// `state[ST_EPOCH + KIND]`: calls completed (a u32 of plain memory on the device: read
    /// with `ld.volatile` at a block's start, stored by the last block out; loom checks that
    /// the exit counter and the launch boundary order the two).
    epoch: SharedRows,
    /// `state[ST_SENT + KIND]`: blocks that finished sending in this call.
    sent: AtomicU64,
    /// `state[ST_EXIT + KIND]`: blocks that left this call.
    exit: AtomicU64,
    /// `sig_bat(me)[s]` (batched) or `sig_pe(me)[l * R + s]` (per-expert): from source s.
    sig: Vec<AtomicU64>,
    /// `sig_bat_ack(me)[d]` / `sig_pe_ack(me)[d]`: destination d consumed call `value`.
    ack: Vec<AtomicU64>,
    /// `bat_buf` (entry s * T + pos) / `pe_buf` (entry (l * R + s) * T + t).
    buf: SharedRows,
}

/// One device's error word (common.cuh: `err[0]` flag, `err[1..6]` details, `err[7]` claim).
pub struct ErrorWord {
    flag: AtomicU64,
    claim: AtomicU64,
    /// rank, peer, phase, call, waited: five u32, written only by the claim's winner.
    fields: SharedRows,
}

/// Every rank's and device's words.
pub struct Group {
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
}

/// One call's inputs: `route[s][t]` = the (destination rank, local expert) of every valid slot of
/// token t on rank s (`topk_idx` after common.cuh `load_topk`).
#[derive(Debug, Clone)]
pub struct Input {
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
    pub epoch: u32,
    pub read: Vec<Entry>,
    pub failed_wait: Option<WaitEnd>,
    /// This block was the last out: it published the epoch and the acks.
    pub last_out: bool,
}

impl Group {
    pub fn new(setup: Setup) -> Group {
        let r_n = setup.ranks.len();
        let (t_n, l_n) = (setup.max_tokens, setup.local_experts);
        let n_dev = setup.ranks.iter().map(|r| r.0).max().map_or(0, |d| d + 1);
        let ranks = setup
            .ranks
            .iter()
            .map(|&(device, blocks)| Rank {
                device,
                blocks,
                epoch: SharedRows::new(1, 4),
                sent: AtomicU64::new(0),
                exit: AtomicU64::new(0),
                sig: (0..l_n * r_n).map(|_| AtomicU64::new(0)).collect(),
                ack: (0..r_n).map(|_| AtomicU64::new(0)).collect(),
                buf: SharedRows::new(l_n * r_n * t_n, ROW_BYTES),
            })
            .collect();
        let devices = (0..n_dev)
            .map(|_| ErrorWord {
                flag: AtomicU64::new(0),
                claim: AtomicU64::new(0),
                fields: SharedRows::new(1, 20),
            })
            .collect();
        Group {
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

    /// The tokens of `s` bound for `d`, in token order (batched.cu:68-91, `tokpos`).
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

fn write_entry(buf: &SharedRows, row: usize, header: u64, payload: u64) {
    // SAFETY: entry `row` of this region is written only by the one block that owns the unit,
    // and only after the ack of the previous call (whose reads it would overwrite); loom checks
    // both through the row's cell.
    unsafe {
        buf.with_row_mut(row, |b| {
            b[..8].copy_from_slice(&header.to_le_bytes());
            b[8..].copy_from_slice(&payload.to_le_bytes());
        })
    }
}

fn read_entry(buf: &SharedRows, row: usize) -> (u64, u64) {
    // SAFETY: read after the acquire of the signal that the writer released after this row's
    // write, and before the ack that lets the next call overwrite it; loom checks both.
    unsafe {
        buf.with_rows(row, 1, |b| {
            (
                u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
            )
        })
    }
}

/// common.cuh `signal_word`.
pub fn signal_word(epoch: u32, count: u32) -> u64 {
    ((epoch as u64) << 32) | count as u64
}

// ---------------------------------------------------------------- errors and bounded waits

/// common.cuh `failed`: `ld_volatile_u32(err) != 0`.
fn failed(e: &ErrorWord) -> bool {
    e.flag.load(RELAXED) != 0
}

/// common.cuh `report_timeout`: the first failing wait of the device writes the details, then
/// raises the flag; later ones only see it.
fn report_timeout(e: &ErrorWord, rank: usize, peer: usize, phase: u32, call: u32, waited: u64) {
    // if (atomicCAS(e + 7, 0u, 1u) == 0u)
    if e.claim.compare_exchange(0, 1, RELAXED, RELAXED).is_ok() {
        // e[1] = rank; e[2] = peer; e[3] = phase; e[4] = call; e[5] = waited / 1000;
        let words = [rank as u32, peer as u32, phase, call, waited as u32];
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
        // atomicExch(e, 1u);
        e.flag.swap(1, RELAXED);
    }
}

/// common.cuh `wait_signal`: waits until the word carries `epoch`; returns its count.
#[allow(clippy::too_many_arguments)]
fn wait_signal(
    g: &Group,
    kp: &Launch,
    addr: &AtomicU64,
    epoch: u32,
    rank: usize,
    peer: usize,
    phase: u32,
) -> Result<u32, WaitEnd> {
    let e = g.err(rank);
    // u64 t0 = globaltimer();
    let deadline = Deadline::after(kp.timeout);
    let got = deadline.spin_until(|| {
        // u64 v = ld_acquire(p, addr);
        let v = addr.load(SIGNAL_LOAD);
        // if ((u32)(v >> 32) == epoch) return (long long)(u32)v;
        if (v >> 32) as u32 == epoch {
            return Some(Ok(v as u32));
        }
        // if ((++spins & 63u) == 0u) { if (failed(p)) return -1; ... }
        if failed(e) {
            return Some(Err(WaitEnd::SawError));
        }
        None
    });
    got.unwrap_or_else(|| {
        // if (now - t0 > p.timeout_ns) { report_timeout(...); return -1; }
        report_timeout(e, rank, peer, phase, epoch, deadline.waited_ms());
        Err(WaitEnd::TimedOut)
    })
}

/// common.cuh `wait_ack`: waits until the ack word is at least `need`.
#[allow(clippy::too_many_arguments)]
fn wait_ack(
    g: &Group,
    kp: &Launch,
    addr: &AtomicU64,
    need: u32,
    call: u32,
    rank: usize,
    peer: usize,
    phase: u32,
) -> Result<(), WaitEnd> {
    let e = g.err(rank);
    let deadline = Deadline::after(kp.timeout);
    let got = deadline.spin_until(|| {
        // u64 v = ld_acquire(p, addr); if ((u32)v >= need) return true;
        if addr.load(ACK_LOAD) as u32 >= need {
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

/// Role: the start of every block (batched.cu:32-38, per_expert.cu:28-33): this call's epoch.
fn block_epoch(me: &Rank) -> u32 {
    // s_epoch = ld_volatile_u32(state + ST_EPOCH + KIND) + 1u;
    // SAFETY: the only write is the previous launch's last block out (`finish`), which ended
    // before this launch started.
    let calls = unsafe {
        me.epoch
            .with_rows(0, 1, |b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    };
    calls.wrapping_add(1)
}

/// Role: the sender of the next call waits for every destination's ack of the previous call
/// before it overwrites their buffers (batched.cu:43-46, per_expert.cu:37-38; threads tid < R,
/// one per destination).
fn sender_wait_acks(g: &Group, kp: &Launch, rank: usize, epoch: u32) -> Option<WaitEnd> {
    let mut bad = None;
    #[cfg(not(ep_mutant = "gpu_no_ack_wait"))]
    for d in g.dests(rank) {
        // bad = !wait_ack(p, sig_bat_ack(me, R) + tid, epoch - 1u, epoch, rank, tid, PH_DISPATCH_SEND);
        if let Err(e) = wait_ack(
            g,
            kp,
            &g.ranks[rank].ack[d],
            epoch.wrapping_sub(1),
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
/// block that completes the count stores every destination's signal with the epoch
/// (batched.cu:94-173).
fn batched_send(g: &Group, kp: &Launch, input: &Input, rank: usize, bid: usize, epoch: u32) {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let mut counts = Vec::new();
    for d in g.dests(rank) {
        let batch = g.batch(input, rank, d);
        // batched.cu:97 for (u = bid * NWARPS + warp; u < n * segs; u += blocks_per_rank * NWARPS)
        for (pos, &t) in batch.iter().enumerate() {
            if t % me.blocks != bid {
                continue;
            }
            // batched.cu:119-121 entry = tab[d].bat_buf + (rank * T + tokpos(t, d)) * entry_bytes;
            // seg_store(payload); batched.cu:128 ((int*)entry)[0] = t (the header)
            write_entry(
                &g.ranks[d].buf,
                rank * t_n + pos,
                t as u64,
                payload(input.call, rank, t),
            );
        }
        counts.push((d, batch.len() as u32));
    }
    // batched.cu:161 __syncthreads(); then thread 0:
    // batched.cu:164 fence_rel(p);
    fence_before_sent_add();
    // batched.cu:165 const u32 old = atomicAdd(state + ST_SENT + KIND, 1u);
    let old = me.sent.fetch_add(1, RELAXED);
    // batched.cu:166 if (old == (u32)p.blocks_per_rank - 1u)
    if old as usize == me.blocks - 1 {
        // batched.cu:167 state[ST_SENT + KIND] = 0u;
        me.sent.store(0, RELAXED);
        // batched.cu:168 fence_rel(p);
        fence_after_last_sent();
        // batched.cu:169 if (rank != p.fault_rank)
        if kp.fault_rank != Some(rank) {
            for (d, count) in counts {
                // batched.cu:171 st_release(p, sig_bat(tab[d]) + rank, signal_word(epoch, tot[d]));
                g.ranks[d].sig[rank].store(signal_word(epoch, count), SIGNAL_STORE);
            }
        }
    }
}

/// Role: a batched receiver block waits for every source's signal (acquire, bounded, stopped
/// by the error word), then reads its share of the entries (batched.cu:175-299).
fn batched_receive(
    g: &Group,
    kp: &Launch,
    rank: usize,
    bid: usize,
    epoch: u32,
    rep: &mut BlockReport,
) {
    let me = &g.ranks[rank];
    let t_n = g.setup.max_tokens;
    let mut counts = Vec::new();
    // batched.cu:179-185 if (tid < R) c = wait_signal(p, sig_bat(me) + tid, epoch, rank, tid, PH_DISPATCH_RECV);
    for s in g.sources(rank) {
        match wait_signal(g, kp, &me.sig[s], epoch, rank, s, PH_DISPATCH_RECV) {
            Ok(c) => counts.push((s, c as usize)),
            Err(e) => {
                rep.failed_wait.get_or_insert(e);
            }
        }
    }
    // batched.cu:186 if (__syncthreads_or(bad)) goto finish;
    if rep.failed_wait.is_some() {
        return;
    }
    // batched.cu:228 for (u0 = bid * NWARPS + warp; u0 < units; ...): entry j of every source's
    // batch, one after the other (sm.rcnt), belongs to block j % blocks.
    let mut j = 0;
    for (s, c) in counts {
        for pos in 0..c {
            if j % me.blocks == bid {
                // batched.cu:249-258 h = me.bat_buf + (s * T + j) * entry_bytes; loads of h
                let (token, payload) = read_entry(&me.buf, s * t_n + pos);
                rep.read.push(Entry {
                    src: s,
                    local: 0,
                    pos,
                    token,
                    payload,
                });
            }
            j += 1;
        }
    }
}

/// Role: a per-expert sender block writes one message per selection of each expert it owns,
/// stamped with the epoch, and signals each expert itself (per_expert.cu:41-85).
fn per_expert_send(g: &Group, kp: &Launch, input: &Input, rank: usize, bid: usize, epoch: u32) {
    let me = &g.ranks[rank];
    let (r_n, t_n, l_n) = (g.ranks.len(), g.setup.max_tokens, g.setup.local_experts);
    let dests: Vec<usize> = g.dests(rank).collect();
    // per_expert.cu:44 for (int e = bid; e < E; e += p.blocks_per_rank)
    for e in (bid..r_n * l_n).step_by(me.blocks) {
        // per_expert.cu:45 const int d = e / L, l = e % L;
        let (d, l) = (e / l_n, e % l_n);
        if !dests.contains(&d) {
            continue;
        }
        let region = (l * r_n + rank) * t_n;
        let mut count = 0u32;
        for (t, sels) in input.route[rank].iter().enumerate() {
            if sels.contains(&(d, l)) {
                // per_expert.cu:67-75 entry = region + tt * pe_entry_bytes; seg_store(payload);
                // ((u32*)entry)[0] = epoch; ((int*)entry)[1] = tt;
                write_entry(
                    &g.ranks[d].buf,
                    region + t,
                    ((epoch as u64) << 32) | t as u64,
                    payload(input.call, rank, t),
                );
                count += 1;
            }
        }
        // per_expert.cu:80 __syncthreads(); per_expert.cu:81 if (tid == 0 && rank != p.fault_rank)
        if kp.fault_rank != Some(rank) {
            // per_expert.cu:82 fence_rel(p);
            fence_before_pe_signal();
            // per_expert.cu:83 st_release(p, sig_pe(tab[d], R) + l * R + rank, signal_word(epoch, count));
            g.ranks[d].sig[l * r_n + rank].store(signal_word(epoch, count), SIGNAL_STORE);
        }
    }
}

/// Role: a per-expert receiver block, per local expert it owns and per source in order, waits
/// for the (l, s) signal, then finds this call's messages by their epoch stamp
/// (per_expert.cu:87-136).
fn per_expert_receive(
    g: &Group,
    kp: &Launch,
    rank: usize,
    bid: usize,
    epoch: u32,
    rep: &mut BlockReport,
) {
    let me = &g.ranks[rank];
    let (r_n, t_n, l_n) = (g.ranks.len(), g.setup.max_tokens, g.setup.local_experts);
    let sources: Vec<usize> = g.sources(rank).collect();
    // per_expert.cu:89 for (int l = bid; l < L; l += p.blocks_per_rank)
    for l in (bid..l_n).step_by(me.blocks) {
        for &s in &sources {
            // per_expert.cu:92 s_cnt = wait_signal(p, sig_pe(me, R) + l * R + s, epoch, rank, s, PH_DISPATCH_RECV);
            let cnt = match wait_signal(
                g,
                kp,
                &me.sig[l * r_n + s],
                epoch,
                rank,
                s,
                PH_DISPATCH_RECV,
            ) {
                Ok(c) => c as usize,
                // per_expert.cu:96 if (cnt < 0) goto finish;
                Err(e) => {
                    rep.failed_wait = Some(e);
                    return;
                }
            };
            let region = (l * r_n + s) * t_n;
            let mut found = 0;
            // per_expert.cu:99-101 for (c = 0; c < T && base - begin < cnt; ...) has = header[0] == epoch
            for j in 0..t_n {
                if found >= cnt {
                    break;
                }
                let (header, payload) = read_entry(&me.buf, region + j);
                if (header >> 32) as u32 == epoch {
                    rep.read.push(Entry {
                        src: s,
                        local: l,
                        pos: j,
                        token: header & 0xFFFF_FFFF,
                        payload,
                    });
                    found += 1;
                }
            }
        }
    }
}

/// Role: the end of every block (common.cuh `last_block_out`); returns whether this block is
/// the last one out.
fn last_block_out(me: &Rank) -> bool {
    // __syncthreads(); if (threadIdx.x == 0) { fence_rel(p);
    fence_before_exit_add();
    // u32 old = atomicAdd(state + ST_EXIT + kind, 1u); s_last = (old == blocks_per_rank - 1u);
    let old = me.exit.fetch_add(1, RELAXED);
    let last = old as usize == me.blocks - 1;
    if last {
        // state[ST_EXIT + kind] = 0u; fence_rel(p);
        me.exit.store(0, RELAXED);
        fence_after_last_exit();
    }
    last
}

/// Role: the last block out publishes the epoch and acknowledges to every source that this rank
/// consumed the call (batched.cu:301-313, per_expert.cu:138-147).
fn finish(g: &Group, rank: usize, epoch: u32, rep: &mut BlockReport) {
    let me = &g.ranks[rank];
    rep.last_out = last_block_out(me);
    if rep.last_out {
        // state[ST_EPOCH + KIND] = epoch;
        // SAFETY: every block of this launch read the word before its exit count, which the
        // last block out acquired (`last_block_out`); the next launch starts after this one.
        unsafe {
            me.epoch
                .with_row_mut(0, |b| b.copy_from_slice(&epoch.to_le_bytes()))
        };
        for s in g.sources(rank) {
            // st_release(p, sig_bat_ack(tab[s], R) + rank, (u64)epoch);
            g.ranks[s].ack[rank].store(epoch as u64, ACK_STORE);
        }
    }
}

/// One block of one dispatch launch, every role in kernel order (batched.cu
/// `ep_batched_dispatch` / per_expert.cu `ep_per_expert_dispatch`).
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
    rep.failed_wait = sender_wait_acks(g, kp, rank, epoch);
    // batched.cu:92 / per_expert.cu:39 if (__syncthreads_or(bad)) goto finish;
    if rep.failed_wait.is_none() {
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

/// A timed-out wait as the host reads it from a device's error word.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeout {
    pub rank: u32,
    pub peer: u32,
    pub phase: u32,
    pub call: u32,
}

/// The host side of kernels/src/runtime.rs that the protocol relies on.
#[derive(Debug, Default)]
pub struct Host {
    broken: Option<Timeout>,
}

impl Host {
    /// runtime.rs `GpuGroup::check_usable`: a group that failed refuses every later call.
    pub fn check_usable(&self) -> Result<(), Timeout> {
        match self.broken {
            Some(t) => Err(t),
            None => Ok(()),
        }
    }

    /// runtime.rs `GpuGroup::sync`, once the streams are synchronised (the caller joined every
    /// block of the launch): reads every device's error word; a raised flag fails the group.
    pub fn sync(&mut self, g: &Group) -> Result<(), Timeout> {
        self.check_usable()?;
        for e in &g.devices {
            // cuMemcpyDtoH of err after the stream synchronised: ordered by the join.
            if e.flag.load(RELAXED) != 0 {
                // SAFETY: every block of the launch ended (joined): no writer is left.
                let w: Vec<u32> = unsafe {
                    e.fields.with_rows(0, 1, |b| {
                        b.chunks(4)
                            .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                            .collect()
                    })
                };
                let t = Timeout {
                    rank: w[0],
                    peer: w[1],
                    phase: w[2],
                    call: w[3],
                };
                self.broken = Some(t);
                return Err(t);
            }
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
            assert_eq!(r0.epoch as u64, input.call);
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
        let want = Timeout {
            rank: 1,
            peer: 0,
            phase: PH_DISPATCH_RECV,
            call: 1,
        };
        assert_eq!(host.sync(&g), Err(want));
        assert_eq!(host.check_usable(), Err(want));
    }
}
