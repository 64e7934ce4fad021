//! The model's memory and its shape: the kernel and the ranks, pairs and sizes of a model
//! ([`Setup`]), every rank's words ([`Rank`]) and every device's error word ([`ErrorWord`]) in
//! a [`Group`], what a launch and a call get ([`Launch`], [`Input`]), what a block reports
//! ([`BlockReport`], [`Entry`], [`WaitEnd`]), and the stores and loads of a payload entry.

use std::time::Duration;

use ep_reference::sync::{AtomicU64, SharedRows};

use crate::gpu_protocol::peers::{Build, PeerSet};
use crate::gpu_protocol::words::{signal_word, ROW_BYTES};

/// Which kernel a model runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// batched_dispatch.cu `ep_batched::dispatch`.
    Batched,
    /// per_expert.cu `ep_per_expert::dispatch`.
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
    /// The kernel build, which decides the shape of its peer sets (`peers`): [`Build::Narrow`]
    /// up to 32 ranks, as the host picks it, or the wide build at a scaled-down word size.
    pub build: Build,
}

/// One rank's words (common.cuh `RankPtrs`: `state`, `sig`, `bat_buf` / `pe_buf`).
pub struct Rank {
    pub device: usize,
    pub blocks: usize,
    /// `((u64*)state)[ST_EPOCH64 + KIND]`: calls completed (a u64 of plain memory on the
    /// device: read with `ld.volatile` at a block's start, stored by the last block out; loom
    /// checks that the exit counter and the launch boundary order the two).
    pub(crate) epoch: SharedRows,
    /// `state[ST_SENT + KIND]`: blocks that finished sending in this call.
    pub(crate) sent: AtomicU64,
    /// `state[ST_EXIT + KIND]`: blocks that left this call, plus [`EXIT_FAILED`] for each of
    /// them that saw the group failed (frame.cuh `last_block_out`).
    ///
    /// [`EXIT_FAILED`]: crate::gpu_protocol::words::EXIT_FAILED
    pub(crate) exit: AtomicU64,
    /// `sig_bat(me)[s]` (batched) or `sig_pe(me)[l * R + s]` (per-expert): from source s.
    pub(crate) sig: Vec<AtomicU64>,
    /// `sig_bat_ack(me)[d]` / `sig_pe_ack(me)[d]`: destination d consumed call `value` (u64).
    pub(crate) ack: Vec<AtomicU64>,
    /// `bat_buf` (entry s * T + pos) / `pe_buf` (entry (l * R + s) * T + t).
    pub(crate) buf: SharedRows,
    /// NCCL capacity mode: `snd_hdr` word 0 (tokens) of destination d's header, row d (i32).
    pub(crate) snd_hdr: SharedRows,
    /// NCCL capacity mode: `snd_buf`, the staged batch for destination d at entry d * T + pos.
    pub(crate) snd_buf: SharedRows,
    /// NCCL capacity mode: `rcv_hdr` word 0 (tokens) of source s's header, row s (i32).
    pub(crate) rcv_hdr: SharedRows,
    /// Shrink mode: the rank mask, `shr_mask(me, R)[d]` (an int: `mask[d] != 0`, peer d is
    /// masked on this rank; read with `ld_volatile_u32`, set with `atomicExch`).
    pub(crate) mask: Vec<AtomicU64>,
    /// Shrink mode: `shr_decide(me, R, KIND, which)[peer]` at `which * R + peer` (`which`:
    /// [`DEC_RECV`] or [`DEC_ACK`]; the model runs one kernel kind): the verdict of the latest
    /// call that decided on the peer, `(epoch << 1) | lost`.
    ///
    /// [`DEC_RECV`]: crate::gpu_protocol::DEC_RECV
    /// [`DEC_ACK`]: crate::gpu_protocol::DEC_ACK
    pub(crate) decide: Vec<AtomicU64>,
}

/// One device's error word (common.cuh, the comment above `ERR_TIMEOUT`: `err[0]` code, `err[1..7]` details, `err[7]`
/// claim).
pub struct ErrorWord {
    pub(crate) code: AtomicU64,
    pub(crate) claim: AtomicU64,
    /// `err[1..7]`: six u32, written only by the claim's winner.
    pub(crate) fields: SharedRows,
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
    ///
    /// [`Deadline`]: ep_reference::sync::Deadline
    pub timeout: Duration,
    /// `fault_rank`: this rank never signals (the test hook).
    pub fault_rank: Option<usize>,
    /// This rank's `topk_idx` holds an expert out of range: the routing check (common.cuh
    /// `load_topk<true>`, both kernels) reports it (`ERR_EXPERT_RANGE`) and the rank takes the
    /// `in_bad` path.
    pub bad_input: Option<usize>,
    /// `shrink`: shrink mode (the rank mask; shrink.cuh). A wait for a peer that
    /// runs out masks the peer instead of reporting an error.
    pub shrink: bool,
    /// This rank's receive fails at once as a wait that ran out (it reports `ERR_TIMEOUT` for
    /// its first source without waiting): a failure that the timeout models already reach by
    /// the clock, made certain so that a model can follow what the failed rank's next launches
    /// do.
    pub fail_receive: Option<usize>,
}

/// One call's inputs: `route[s][t]` = the (destination rank, local expert) of every valid slot of
/// token t on rank s (`topk_idx` after the routing check).
#[derive(Debug, Clone)]
pub struct Input {
    /// 1, 2, ...: this call's index in the model, which tags its payloads ([`payload`]); its
    /// epoch is [`Group::base`] + `call`, less the calls made before the last [`clean_mask`]
    /// (which restarts every rank from epoch 0).
    ///
    /// [`clean_mask`]: crate::gpu_protocol::clean_mask
    pub call: u64,
    pub route: Vec<Vec<Vec<(usize, usize)>>>,
}

/// The payload word of token t of rank s in call c (the model's `x` row).
pub fn payload(call: u64, s: usize, t: usize) -> u64 {
    (call << 32) | ((s as u64) << 16) | t as u64
}

/// Bit 63 of a payload word: sent by a rank whose group had failed before the launch. Such a
/// rank's data cannot be trusted (its combine sends the rows of a dispatch that failed, its
/// handle is a failed call's), so the model marks it, and no receiver may ever read one
/// (mutant `gpu_no_failed_check`).
pub const STALE: u64 = 1 << 63;

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
    /// The peer's poison (`is_poison`): its group failed; reported as `ERR_PEER_FAILED`.
    PeerFailed,
}

/// What one block did in one call.
#[derive(Debug, Clone, Default)]
pub struct BlockReport {
    pub epoch: u64,
    pub read: Vec<Entry>,
    pub failed_wait: Option<WaitEnd>,
    /// This block found its rank's input bad (`in_bad`) and went to the end.
    pub bad_input: bool,
    /// This block found its rank's group failed at its start (`s_fail`), or its input bad, and
    /// stored the poison instead of the call's signals (poison.cuh `poison_peers`).
    pub poisoned: bool,
    /// This block's `s_fail` (`p.refused || failed(p)` at its start): its rank's group had
    /// failed before it started (mutant `gpu_no_failed_check`: never set).
    pub failed_start: bool,
    /// This block was the last out: it published the epoch and the acks (a send half's
    /// blocks never are: it counts no exit).
    pub last_out: bool,
    /// `last_block_out`'s `*call_failed`: this block saw the group failed (its `s_fail`, or the
    /// error word loaded at its end) or a block out before it did (the exit count's
    /// `EXIT_FAILED` part). For the last block out: some block of the rank's launch did.
    pub call_failed: bool,
    /// The last block out of a launch (never a send half: `p.stage != 1`) found the call
    /// failed (`call_failed`) and wrote a failed call's outputs ("`if (last_out && call_failed)
    /// { if (dispatch) fail_dispatch_outputs(p, c.io, me); ... }`": every count
    /// 0, frame.cuh).
    pub failed_outputs: bool,
    /// Shrink mode: every peer this block left out: masked at its start (`gone0`, shrink.cuh
    /// `masked_peers`) and lost in this call (`s_gone`, agreed by every block that waited for
    /// the peer), as the block's thread 0 last took the set: batched dispatch's snapshot after
    /// the receive (`GONE_SNAPSHOT(gone)`; the wide build's copy of every word through shared
    /// memory), else the live set at the block's end.
    pub gone: PeerSet,
    /// Shrink mode: this block's own wait for a peer ran out while the agreed verdict was
    /// "arrived", and it waited again (`wait_peer_signals` / `wait_peer_ack` after `agree_at`).
    pub waited_again: bool,
    /// A report of this block lost the claim of the error word ("`atomicCAS(w + 7, 0u, 1u)`"
    /// read 1) and waited for the winner's code (common.cuh `report_error_at`; the model's
    /// record, `waits::take_claim`).
    pub claim_lost: bool,
    /// That wait ran out before the code was seen (loom starved the winner for the whole bound,
    /// `waits::CLAIM_WAIT`: on the device, a winner stalled for 100 us between two adjacent
    /// instructions). The block may then find the group not failed at its end, and its rank's
    /// last block out may miss its failure: the one case the tests' `check_exit` excuses.
    pub claim_unseen: bool,
    /// The receive hook's receive half: a source's count was taken from the signal word
    /// pre-loaded at the block's start (`wait_signal_pre` with no further load).
    pub preload_taken: bool,
    /// The receive hook's receive half: a pre-loaded signal word was not this call's (an
    /// earlier call's tag, or none yet), and the block waited for the signal again.
    pub preload_stale: bool,
}

impl Group {
    pub fn new(setup: Setup) -> Group {
        Group::after_calls(setup, 0)
    }

    /// A group whose ranks have completed `base` calls (acked, every signal word left by call
    /// `base` with count 0): the tag-wrap models start just before the wrap.
    pub fn after_calls(setup: Setup, base: u64) -> Group {
        let r_n = setup.ranks.len();
        setup.build.check(r_n);
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
                    snd_hdr: SharedRows::new(r_n, 4),
                    snd_buf: SharedRows::new(r_n * t_n, ROW_BYTES),
                    rcv_hdr: SharedRows::new(r_n, 4),
                    mask: (0..r_n).map(|_| AtomicU64::new(0)).collect(),
                    decide: (0..2 * r_n).map(|_| AtomicU64::new(0)).collect(),
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

    pub(crate) fn dests(&self, rank: usize) -> impl Iterator<Item = usize> + '_ {
        self.setup
            .links
            .iter()
            .filter(move |l| l.0 == rank)
            .map(|l| l.1)
    }

    pub(crate) fn sources(&self, rank: usize) -> impl Iterator<Item = usize> + '_ {
        self.setup
            .links
            .iter()
            .filter(move |l| l.1 == rank)
            .map(|l| l.0)
    }

    pub(crate) fn err(&self, rank: usize) -> &ErrorWord {
        &self.devices[self.ranks[rank].device]
    }

    /// The tokens of `s` bound for `d`, in token order (batched dispatch's `sm.tokpos`).
    pub(crate) fn batch(&self, input: &Input, s: usize, d: usize) -> Vec<usize> {
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

pub(crate) fn write_entry(buf: &SharedRows, row: usize, header: [u32; 4], payload: u64) {
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
pub(crate) fn read_entry(buf: &SharedRows, row: usize) -> ([u32; 4], u64) {
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
