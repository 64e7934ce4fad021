//! Shrink mode (the rank mask; shrink.cuh): a block's look at
//! the mask (`masked_peers`, `is_gone`), the call's one verdict on a peer (`agree`), the waits
//! that propose "arrived" or "lost" (`wait_peer_signals`, `wait_peer_ack`); then the host's side
//! of the mask (runtime/shrink.rs: [`update_mask`], [`clean_mask`], [`mask_status`]).

use ep_reference::sync::Deadline;

use crate::gpu_protocol::orderings::{tag_matches, ACK_LOAD, RELAXED, SIGNAL_LOAD};
use crate::gpu_protocol::peers::{is_gone, PeerSet};
use crate::gpu_protocol::state::{BlockReport, Group, Kind, Launch, Rank, WaitEnd};
use crate::gpu_protocol::waits::{failed, report_peer_failed, report_timeout};
use crate::gpu_protocol::words::{
    is_poison, sig_tag, PH_DISPATCH_RECV, PH_DISPATCH_SEND, SIG_COUNT_BITS, SIG_COUNT_MASK,
};

/// shrink.cuh `DEC_RECV`, `DEC_ACK`: the decision word of a receive wait, of an ack wait.
pub const DEC_RECV: usize = 0;
pub const DEC_ACK: usize = 1;

/// shrink.cuh `masked_peers` (narrow) / `masked_peers_into` (wide): every peer masked on this
/// rank, in the build's words (empty without shrink).
pub(crate) fn masked_peers(g: &Group, kp: &Launch, me: &Rank) -> PeerSet {
    let mut m = PeerSet::empty(g.setup.build.word_bits());
    // if (!p.shrink) return 0u;
    if !kp.shrink {
        return m;
    }
    // for (int d = 0; d < p.R; d++) if (ld_volatile_u32((const u32*)shr_mask(me, p.R) + d) != 0u) m |= 1u << d;
    // (wide: out[d >> 5] |= 1u << (d & 31))
    for d in 0..me.mask.len() {
        if me.mask[d].load(RELAXED) != 0 {
            m.insert(d);
        }
    }
    m
}

/// shrink.cuh `peer_masked`: the wide build's look at the mask at the end, per peer, when it
/// acks (`END_MASKED(s)`: "`p.shrink && ld_volatile_u32((const u32*)shr_mask(me, p.R) + d) !=
/// 0u`").
pub(crate) fn peer_masked(kp: &Launch, me: &Rank, d: usize) -> bool {
    kp.shrink && me.mask[d].load(RELAXED) != 0
}

/// The receive's skip of a peer already gone (batched "`cnt = is_gone(c.gone, tid) ? PEER_LOST :
/// wait_peer_signals(...)`", per-expert "`got = is_gone(c.gone, s) ? PEER_LOST : ...`").
#[inline]
pub(crate) fn receive_skips(gone: PeerSet, s: usize) -> bool {
    #[cfg(not(ep_mutant = "gpu_masked_peer_waited"))]
    return is_gone(gone, s);
    // Mutant (with `receive_sees_mask`): the receive ignores the mask and waits for a masked
    // source as for any other.
    #[cfg(ep_mutant = "gpu_masked_peer_waited")]
    return {
        let _ = (gone, s);
        false
    };
}

/// `wait_peer_signals`' looks at the mask, before it waits and while it waits: "`int lost =
/// ld_volatile_u32((const u32*)w.mask_word) != 0u`" and "`if (ld_volatile_u32((const
/// u32*)w.mask_word) != 0u || globaltimer() - t0 > w.timeout_ns)`".
#[inline]
fn receive_sees_mask(me: &Rank, peer: usize) -> bool {
    #[cfg(not(ep_mutant = "gpu_masked_peer_waited"))]
    return me.mask[peer].load(RELAXED) != 0;
    #[cfg(ep_mutant = "gpu_masked_peer_waited")]
    return {
        let _ = (me, peer);
        false
    };
}

/// How a shrink-mode wait for a peer ended when it reported nothing (shrink.cuh: a count, or
/// `PEER_LOST`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Peer {
    /// Agreed "arrived": the count of this block's signal word (`wait_peer_ack`: 0).
    Arrived(u32),
    /// Agreed "lost" (`PEER_LOST`): the peer is masked now and sends nothing in this call.
    Lost,
}

/// What one poll of a shrink-mode wait saw.
enum Poll {
    /// The word is there (a signal: its count; an ack: 0).
    Here(u32),
    /// The device's error word is raised: "`return -1`" / "`return 0`".
    Error,
    /// The peer is masked (another block agreed "lost"): "`lost = 1`".
    Masked,
    /// Waiting again, a later call's poison over this call's signal.
    Poisoned,
}

/// shrink.cuh `agree` (`agree_at`): this call's verdict on `peer`, one decision word per
/// (rank, kernel kind, `which`, peer). The first verdict installed for the call wins: a CAS
/// loop from any older call's value ("`(old >> 1) < epoch`") to `(epoch << 1) | lost`; then
/// every block uses the installed verdict, whatever it proposed. A lost verdict masks the peer
/// (`atomicExch`) before the block goes on. Returns whether the peer is lost.
fn agree(me: &Rank, which: usize, peer: usize, epoch: u64, lost: bool) -> bool {
    let word = &me.decide[which * me.mask.len() + peer];
    // const u64 mine = (epoch << 1) | (u64)lost;
    let mine = (epoch << 1) | lost as u64;
    // u64 old = *(volatile u64*)w;
    let mut old = word.load(RELAXED);
    // while ((old >> 1) < epoch)
    while (old >> 1) < epoch {
        // const u64 prev = atomicCAS(w, old, mine); if (prev == old) { old = mine; break; } old = prev;
        match word.compare_exchange(old, mine, RELAXED, RELAXED) {
            Ok(_) => {
                old = mine;
                break;
            }
            Err(prev) => old = prev,
        }
    }
    // const int final_lost = (int)(old & 1ull);
    #[cfg(not(ep_mutant = "gpu_no_agreement"))]
    let final_lost = old & 1 == 1;
    // Mutant: the word is still written, but each block goes on with its own verdict.
    #[cfg(ep_mutant = "gpu_no_agreement")]
    let final_lost = {
        let _ = old;
        lost
    };
    // if (final_lost) atomicExch((int*)mask_word, 1);
    if final_lost {
        me.mask[peer].swap(1, RELAXED);
    }
    final_lost
}

/// shrink.cuh `wait_peer_signals`, shrink mode's receive wait (batched "`wait_peer_signals(
/// peer_wait(p, me, KIND, DEC_RECV, rank, tid, PH_DISPATCH_RECV), sig_bat(me) + tid, 0, 1, 0,
/// epoch)`"; per-expert over the L words of source s, "`sig_pe(me, R) + s, (u64)R, L, l,
/// epoch`"): waits for every word of `words` (this rank's signal words) to carry this call's
/// tag, looking at the error word, the mask and the clock. It proposes "arrived" only when every
/// word is there, "lost" when the peer is masked or the time ran out, then [`agree`]s. A block
/// that ran out while "arrived" was agreed waits again (another block saw every word: they are
/// in memory), bounded, and reports a timeout if that runs out. Returns the count of word
/// `mine`, [`Peer::Lost`], or how the wait failed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn wait_peer_signals(
    g: &Group,
    kp: &Launch,
    rank: usize,
    peer: usize,
    words: &[usize],
    mine: usize,
    epoch: u64,
    rep: &mut BlockReport,
) -> Result<Peer, WaitEnd> {
    let me = &g.ranks[rank];
    let e = g.err(rank);
    // const u64 tag = sig_tag(epoch);
    let tag = sig_tag(epoch);
    let poll = |w: usize, mask_too: bool| {
        // const u64 v = pw_load(w, a);
        let v = me.sig[w].load(SIGNAL_LOAD);
        // if (is_poison(v)) { lost = 1; break; }  (the peer's group failed: it is lost now)
        // (waiting again: report_error_at(..., ERR_PEER_FAILED, ...); return -1;)
        if is_poison(v) {
            return Some(if mask_too {
                Poll::Masked
            } else {
                Poll::Poisoned
            });
        }
        // if ((v >> SIG_COUNT_BITS) == tag) { if (i == mine) cmine = (long long)(v & SIG_COUNT_MASK); break; }
        if tag_matches(v >> SIG_COUNT_BITS, tag) {
            return Some(Poll::Here((v & SIG_COUNT_MASK) as u32));
        }
        // if ((++spins & 63u) == 0u) { if (ld_volatile_u32((const u32*)w.err) != 0u) return -1;
        if failed(e) {
            return Some(Poll::Error);
        }
        // if (ld_volatile_u32((const u32*)w.mask_word) != 0u || globaltimer() - t0 > w.timeout_ns) { lost = 1; break; }
        if mask_too && receive_sees_mask(me, peer) {
            return Some(Poll::Masked);
        }
        None
    };
    // int lost = ld_volatile_u32((const u32*)w.mask_word) != 0u;
    let mut lost = receive_sees_mask(me, peer);
    // const u64 t0 = globaltimer();
    let deadline = Deadline::after(kp.timeout);
    let mut cmine = 0;
    // for (int i = 0; i < nw && !lost; i++)
    for (i, &w) in words.iter().enumerate() {
        if lost {
            break;
        }
        match deadline.spin_until(|| poll(w, true)) {
            Some(Poll::Here(c)) => {
                if i == mine {
                    cmine = c;
                }
            }
            Some(Poll::Error) => return Err(WaitEnd::SawError),
            Some(Poll::Masked | Poll::Poisoned) | None => lost = true,
        }
    }
    // if (agree_at(w.decide_word, w.mask_word, epoch, lost)) return PEER_LOST;
    if agree(me, DEC_RECV, peer, epoch, lost) {
        return Ok(Peer::Lost);
    }
    // Agreed "arrived" after this block ran out: every word is in memory (bounded all the same).
    // for (int i = 0; i < nw && lost; i++)
    if lost {
        rep.waited_again = true;
        for (i, &w) in words.iter().enumerate() {
            // const u64 t1 = globaltimer();
            let deadline = Deadline::after(kp.timeout);
            match deadline.spin_until(|| poll(w, false)) {
                Some(Poll::Here(c)) => {
                    if i == mine {
                        cmine = c;
                    }
                }
                Some(Poll::Poisoned) => {
                    report_peer_failed(e, rank, peer, PH_DISPATCH_RECV, epoch);
                    return Err(WaitEnd::PeerFailed);
                }
                Some(_) => return Err(WaitEnd::SawError),
                None => {
                    // report_error_at(w.err, ..., ERR_TIMEOUT, rank, peer, phase, epoch, ...); return -1;
                    report_timeout(e, rank, peer, PH_DISPATCH_RECV, epoch, deadline.waited_ms());
                    return Err(WaitEnd::TimedOut);
                }
            }
        }
    }
    Ok(Peer::Arrived(cmine))
}

/// shrink.cuh `wait_peer_ack`, shrink mode's ack wait: as [`wait_ack`] (the ack word at least
/// `need`), but a wait that runs out, or finds the peer masked, proposes "lost" and reports
/// nothing; then [`agree`]s on the `DEC_ACK` word, and waits again (bounded, reported) if it ran
/// out while "arrived" was agreed.
///
/// [`wait_ack`]: crate::gpu_protocol::waits::wait_ack
pub(crate) fn wait_peer_ack(
    g: &Group,
    kp: &Launch,
    rank: usize,
    peer: usize,
    need: u64,
    call: u64,
    rep: &mut BlockReport,
) -> Result<Peer, WaitEnd> {
    let me = &g.ranks[rank];
    let e = g.err(rank);
    let addr = &me.ack[peer];
    // int lost = ld_volatile_u32((const u32*)w.mask_word) != 0u;
    let mut lost = me.mask[peer].load(RELAXED) != 0;
    // while (!lost) { if (pw_load(w, addr) >= need) break; ...
    if !lost {
        let deadline = Deadline::after(kp.timeout);
        let got = deadline.spin_until(|| {
            if addr.load(ACK_LOAD) >= need {
                return Some(Poll::Here(0));
            }
            // if (ld_volatile_u32((const u32*)w.err) != 0u) return 0;
            if failed(e) {
                return Some(Poll::Error);
            }
            // if (ld_volatile_u32((const u32*)w.mask_word) != 0u || globaltimer() - t0 > w.timeout_ns) lost = 1;
            if me.mask[peer].load(RELAXED) != 0 {
                return Some(Poll::Masked);
            }
            None
        });
        match got {
            Some(Poll::Here(_)) => {}
            Some(Poll::Error) => return Err(WaitEnd::SawError),
            Some(Poll::Masked | Poll::Poisoned) | None => lost = true,
        }
    }
    // if (agree_at(w.decide_word, w.mask_word, call, lost)) return PEER_LOST;
    if agree(me, DEC_ACK, peer, call, lost) {
        return Ok(Peer::Lost);
    }
    // while (lost && pw_load(w, addr) < need) { ... report_error_at(..., ERR_TIMEOUT, ...); return 0; }
    if lost {
        rep.waited_again = true;
        let deadline = Deadline::after(kp.timeout);
        let got = deadline.spin_until(|| {
            if addr.load(ACK_LOAD) >= need {
                return Some(Ok(()));
            }
            if failed(e) {
                return Some(Err(WaitEnd::SawError));
            }
            None
        });
        got.unwrap_or_else(|| {
            report_timeout(e, rank, peer, PH_DISPATCH_SEND, call, deadline.waited_ms());
            Err(WaitEnd::TimedOut)
        })?;
    }
    Ok(Peer::Arrived(0))
}

// ---------------------------------------------------------------- the host: the rank mask

/// Host: runtime/shrink.rs `GpuGroup::update_mask` in `rank`'s process
/// ("`driver::memset_d32_async(self.ptrs[rank].shrink + mask_offset(r) + 4 * peer as u64,
/// masked as u32, 1, raw[di])`"): masks or unmasks `peer` on `rank` only (the model runs one
/// rank per process), in stream order before `rank`'s next launch (the caller runs it before
/// that launch's blocks).
pub fn update_mask(g: &Group, rank: usize, peer: usize, masked: bool) {
    g.ranks[rank].mask[peer].store(masked as u64, RELAXED);
}

/// Host: runtime/shrink.rs `GpuGroup::clean_mask` on every rank, with no call in flight anywhere
/// (the caller joined every block) and before any rank's next call (the caller's barrier: it
/// spawns the next launches after this returns). Zeroes, as its `cuMemsetD32Async`s do, the
/// `signals` buffer (every signal and ack word), the `state` buffer (the epoch, the `ST_SENT`
/// and `ST_EXIT` counters) and the `shrink` buffer (the decision words and the mask), and the
/// first 16 bytes of every per-expert entry (`cuMemsetD2D32Async(p.pe_buf, peb, 0, 4, ...)`:
/// the epoch stamps). Every rank then starts again from epoch 0.
pub fn clean_mask(g: &Group) {
    for me in &g.ranks {
        // ("signals", p.sig, sig). Mutant: this memset is left out; a signal or ack of a call
        // before the clean stays in its word while the epochs start again, so that its tag is
        // that of a call to come.
        #[cfg(not(ep_mutant = "gpu_clean_keeps_signals"))]
        for w in me.sig.iter().chain(&me.ack) {
            w.store(0, RELAXED);
        }
        // ("state", p.state, state)
        // SAFETY: no block of any launch runs (the caller joined them all).
        unsafe { me.epoch.with_row_mut(0, |b| b.fill(0)) };
        me.sent.store(0, RELAXED);
        me.exit.store(0, RELAXED);
        // ("shrink", p.shrink, shrink)
        for w in me.decide.iter().chain(&me.mask) {
            w.store(0, RELAXED);
        }
        // "per-expert headers": the batched entries carry no stamp, and are not cleaned.
        if g.setup.kind == Kind::PerExpert {
            for row in 0..me.buf.rows() {
                // SAFETY: as above.
                unsafe { me.buf.with_row_mut(row, |b| b[..16].fill(0)) };
            }
        }
    }
}

/// Host: runtime/shrink.rs `GpuGroup::mask_status(rank)` once the stream synchronised (the
/// caller joined every block): true for every peer masked on `rank`.
pub fn mask_status(g: &Group, rank: usize) -> Vec<bool> {
    g.ranks[rank]
        .mask
        .iter()
        .map(|w| w.load(RELAXED) != 0)
        .collect()
}
