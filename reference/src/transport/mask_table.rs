//! The CPU group's rank mask (DeepEP's shrink mode) and the waits that honour it.
//!
//! The ranks of a CPU group share memory, so the group has one mask, here: one bit per rank,
//! plus every rank's call counts (published when a call starts) for the unmask check. Masking
//! rank r on any endpoint masks it for every rank; doing it on every endpoint, as DeepEP's
//! users call `update_mask_buffer` on every rank's buffer, changes nothing more.
//!
//! # What a call does with the mask
//!
//! A call reads the mask when it starts. A rank that finds itself masked sends nothing, waits
//! for nobody, grants its credits (it reads nothing) and returns outputs the contract leaves
//! undefined: it still counts as a call, so a masked rank that goes on calling stays in step.
//! Any other rank neither waits for the credits of masked peers nor writes into their
//! regions nor signals them (its routing is [`RankMask::apply`]'d), and does not wait for
//! their signals nor read their regions. A peer masked *while* a call waits for it ends that
//! wait ([`MaskTable::wait`]); with `CpuOptions::enable_shrink` a wait that runs out masks the
//! peer it waited for instead of failing, and the call goes on without it.
//!
//! # Why the buffers stay safe
//!
//! Masking only ever removes accesses: every write into a peer's region still follows that
//! peer's credit for the previous call (acquire), and every read still follows the writer's
//! signal of this call (acquire); a masked peer is simply not written to and not read. The one
//! write that could race is the one masking would make tempting: skipping a masked peer's
//! credit wait (it may never come) and still writing into its region, which the peer may be
//! reading, if it was masked while reading. The loom model `masked_peer_is_skipped`
//! (verify/tests/loom_protocol.rs) catches exactly that (the mutant `masked_peer_written`).
//!
//! A masked peer's late signal stays in its slot, tagged with its call's epoch; it is never read
//! while the peer is masked, and after an unmask the next call waits for a later epoch.
//!
//! # The unmask rule
//!
//! Unmasking (`update_mask(r, false)`, `clean_mask()`) is valid only while every rank of the
//! group is between calls and all have made the same number of dispatch calls and the same
//! number of combine calls (a masked rank catches up by calling: its calls return at once), and
//! every rank's next call must start after the unmask (a barrier). Then every epoch tag left in
//! a slot is at most the group's call count, every credit has been granted up to it (masked
//! calls grant theirs), and the next call of every rank, the unmasked one's included, meets the
//! others at the same epoch. The counts are checked ([`Error::UnmaskOutOfStep`]); that no call
//! is in flight is the caller's part: a call in flight that started with the rank masked keeps
//! it masked to its end, which is harmless when every count is equal.
//!
//! A combine treats as masked every rank its dispatch's handle records (the mask at the end of
//! that dispatch) as well as the mask when it starts, so an unmask between a dispatch and its
//! combine does not make the combine wait for rows its dispatch never sent.

use crate::error::{Error, Op, Result, Side};
use crate::mask::RankMask;
use crate::sync::{AtomicU64, Deadline, Ordering};

/// The group's mask and every rank's call counts, in memory every rank reads.
#[derive(Debug)]
pub struct MaskTable {
    ranks: usize,
    /// Bit `r % 64` of word `r / 64`: rank r is masked.
    words: Vec<AtomicU64>,
    /// Per rank: the dispatch and combine calls it has started (its epochs).
    calls: Vec<[AtomicU64; 2]>,
}

/// Who waits, in which call: what a wait needs to mask a peer or to report a timeout.
#[derive(Debug, Clone, Copy)]
pub struct Waiter {
    pub rank: usize,
    /// `CpuOptions::enable_shrink`: a wait on a peer that runs out masks the peer.
    pub shrink: bool,
    pub op: Op,
    pub call: u64,
}

fn op_index(op: Op) -> usize {
    match op {
        Op::Dispatch => 0,
        Op::Combine => 1,
    }
}

impl MaskTable {
    pub fn new(ranks: usize) -> MaskTable {
        MaskTable {
            ranks,
            words: (0..ranks.div_ceil(64)).map(|_| AtomicU64::new(0)).collect(),
            calls: (0..ranks)
                .map(|_| [AtomicU64::new(0), AtomicU64::new(0)])
                .collect(),
        }
    }

    pub fn num_ranks(&self) -> usize {
        self.ranks
    }

    fn check_rank(&self, r: usize) -> Result<()> {
        if r >= self.ranks {
            return Err(Error::RankOutOfRange {
                rank: r,
                ranks: self.ranks,
            });
        }
        Ok(())
    }

    /// Whether rank `r` is masked now.
    pub fn is_masked(&self, r: usize) -> bool {
        self.words[r / 64].load(Ordering::Acquire) & (1 << (r % 64)) != 0
    }

    /// Whether `a` or `b` is masked now (one load where they share a word, as in every group
    /// of at most 64 ranks).
    pub fn either_masked(&self, a: usize, b: usize) -> bool {
        if a / 64 == b / 64 {
            let w = self.words[a / 64].load(Ordering::Acquire);
            w & ((1 << (a % 64)) | (1 << (b % 64))) != 0
        } else {
            self.is_masked(a) || self.is_masked(b)
        }
    }

    /// The mask now.
    pub fn snapshot(&self) -> RankMask {
        let mut m = RankMask::none(self.ranks);
        for (i, w) in self.words.iter().enumerate() {
            let w = w.load(Ordering::Acquire);
            if w == 0 {
                continue;
            }
            for b in 0..64 {
                if w & (1 << b) != 0 {
                    m.set(i * 64 + b, true);
                }
            }
        }
        m
    }

    /// Masks rank `r` (any time: masking only removes accesses).
    pub fn mask(&self, r: usize) {
        self.words[r / 64].fetch_or(1 << (r % 64), Ordering::AcqRel);
    }

    /// Rank `rank` starts call `call` of `op` (its epoch): published for the unmask check.
    pub fn begin_call(&self, rank: usize, op: Op, call: u64) {
        self.calls[rank][op_index(op)].store(call, Ordering::Release);
    }

    /// The calls of `op` that rank `rank` has started.
    pub fn calls(&self, rank: usize, op: Op) -> u64 {
        self.calls[rank][op_index(op)].load(Ordering::Acquire)
    }

    /// Every rank must have started as many calls of each kind as `me` (see the unmask rule in
    /// the module docs); else the first rank that has not, by [`Error::UnmaskOutOfStep`].
    fn check_in_step(&self, me: usize, peer: usize) -> Result<()> {
        for op in [Op::Dispatch, Op::Combine] {
            let calls = self.calls(me, op);
            for other in 0..self.ranks {
                let other_calls = self.calls(other, op);
                if other_calls != calls {
                    return Err(Error::UnmaskOutOfStep {
                        rank: me,
                        peer,
                        other,
                        op,
                        calls,
                        other_calls,
                    });
                }
            }
        }
        Ok(())
    }

    /// `update_mask(r, masked)` on rank `me`'s endpoint: masking is always valid; unmasking
    /// a masked rank follows the unmask rule (checked in part, see the module docs).
    pub fn update(&self, me: usize, r: usize, masked: bool) -> Result<()> {
        self.check_rank(r)?;
        if masked {
            self.mask(r);
            return Ok(());
        }
        if !self.is_masked(r) {
            return Ok(());
        }
        self.check_in_step(me, r)?;
        self.words[r / 64].fetch_and(!(1 << (r % 64)), Ordering::AcqRel);
        Ok(())
    }

    /// `clean_mask()` on rank `me`'s endpoint: unmasks every rank, under the unmask rule.
    pub fn clean(&self, me: usize) -> Result<()> {
        let Some(first) = self.snapshot().masked().next() else {
            return Ok(());
        };
        self.check_in_step(me, first)?;
        for w in &self.words {
            w.store(0, Ordering::Release);
        }
        Ok(())
    }

    /// Waits, until `deadline`, for `poll` to return the word of `peer` (a signal or a credit),
    /// and returns it; `Ok(None)` when the call goes on without `peer`: `peer` is (or becomes)
    /// masked, or the waiting rank itself is (its outputs are undefined then, and its peers
    /// may have stopped sending to it), or, with shrink, the wait ran out on another rank: then
    /// `peer` is masked here and `deadline` restarted, so that the call's remaining waits each
    /// still get a whole timeout (a call that masks m peers takes at most m + 1 timeouts).
    ///
    /// The word is looked for before the mask: a peer whose word is there is not given up.
    /// Without shrink, or when `peer` is the waiting rank itself (its own staging), a wait that
    /// runs out is [`Error::Timeout`], as without a mask.
    pub fn wait<T>(
        &self,
        w: Waiter,
        peer: usize,
        side: Side,
        deadline: &mut Deadline,
        mut poll: impl FnMut() -> Option<T>,
    ) -> Result<Option<T>> {
        enum Got<T> {
            Word(T),
            Masked,
        }
        let got = deadline.spin_until(|| match poll() {
            Some(v) => Some(Got::Word(v)),
            None => self.either_masked(peer, w.rank).then_some(Got::Masked),
        });
        match got {
            Some(Got::Word(v)) => Ok(Some(v)),
            Some(Got::Masked) => Ok(None),
            None if self.either_masked(peer, w.rank) => Ok(None),
            None if w.shrink && peer != w.rank => {
                self.mask(peer);
                *deadline = deadline.restarted();
                Ok(None)
            }
            None => Err(Error::timeout(w.rank, peer, w.op, side, w.call, deadline)),
        }
    }
}

#[cfg(all(test, not(ep_loom)))]
mod tests {
    use super::*;
    use std::time::Duration;

    fn waiter(rank: usize, shrink: bool) -> Waiter {
        Waiter {
            rank,
            shrink,
            op: Op::Dispatch,
            call: 3,
        }
    }

    #[test]
    fn bits_beyond_one_word() {
        let t = MaskTable::new(130);
        t.mask(0);
        t.mask(64);
        t.mask(129);
        assert_eq!(t.snapshot().masked().collect::<Vec<_>>(), vec![0, 64, 129]);
        assert!(t.either_masked(1, 129) && t.either_masked(64, 65) && !t.either_masked(1, 2));
        t.update(5, 64, false).unwrap();
        assert_eq!(t.snapshot().masked().collect::<Vec<_>>(), vec![0, 129]);
        t.clean(5).unwrap();
        assert!(t.snapshot().is_empty());
        assert_eq!(
            t.update(0, 130, true),
            Err(Error::RankOutOfRange {
                rank: 130,
                ranks: 130
            })
        );
    }

    #[test]
    fn unmask_needs_every_rank_in_step() {
        let t = MaskTable::new(3);
        for r in 0..3 {
            t.begin_call(r, Op::Dispatch, 2);
            t.begin_call(r, Op::Combine, 1);
        }
        t.mask(2);
        t.begin_call(0, Op::Dispatch, 3);
        t.begin_call(1, Op::Dispatch, 3);
        let want = Err(Error::UnmaskOutOfStep {
            rank: 0,
            peer: 2,
            other: 2,
            op: Op::Dispatch,
            calls: 3,
            other_calls: 2,
        });
        assert_eq!(t.update(0, 2, false), want);
        assert_eq!(t.clean(0), want);
        assert!(t.is_masked(2), "a refused unmask changes nothing");
        // Masking, and unmasking a rank that is not masked, need no check.
        t.update(0, 1, false).unwrap();
        t.begin_call(2, Op::Dispatch, 3);
        t.begin_call(1, Op::Combine, 2);
        assert!(matches!(
            t.clean(0),
            Err(Error::UnmaskOutOfStep {
                other: 1,
                op: Op::Combine,
                ..
            })
        ));
        t.begin_call(0, Op::Combine, 2);
        t.begin_call(2, Op::Combine, 2);
        t.update(1, 2, false).unwrap();
        assert!(t.snapshot().is_empty());
    }

    #[test]
    fn waits_end_on_the_word_the_mask_or_the_deadline() {
        let t = MaskTable::new(3);
        let short = Duration::from_millis(20);
        let mut d = Deadline::after(short);
        assert_eq!(
            t.wait(waiter(0, false), 1, Side::Recv, &mut d, || Some(7)),
            Ok(Some(7))
        );
        // Without shrink a wait that runs out is the timeout, and masks nothing.
        let e = t
            .wait(waiter(0, false), 1, Side::Recv, &mut d, || None::<u32>)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Timeout {
                    rank: 0,
                    peer: 1,
                    call: 3,
                    ..
                }
            ),
            "{e}"
        );
        assert!(t.snapshot().is_empty());
        // With shrink it masks the peer, and the deadline starts again.
        let mut d = Deadline::after(short);
        std::thread::sleep(Duration::from_millis(100));
        let got = t.wait(waiter(0, true), 2, Side::Send, &mut d, || None::<u32>);
        assert_eq!(got, Ok(None));
        assert!(t.is_masked(2) && d.waited_ms() < 100, "{}", d.waited_ms());
        // A masked peer's wait ends at once, unless its word is there.
        let mut d = Deadline::after(Duration::from_secs(3600));
        assert_eq!(
            t.wait(waiter(0, false), 2, Side::Recv, &mut d, || None::<u32>),
            Ok(None)
        );
        assert_eq!(
            t.wait(waiter(0, false), 2, Side::Recv, &mut d, || Some(1)),
            Ok(Some(1))
        );
        // A waiting rank that is itself masked waits for nobody and masks nobody.
        assert_eq!(
            t.wait(waiter(2, true), 0, Side::Recv, &mut d, || None::<u32>),
            Ok(None)
        );
        assert!(!t.is_masked(0));
        // Its own staging is never masked: that wait still fails.
        t.clean(0).unwrap();
        let mut d = Deadline::after(short);
        let e = t
            .wait(waiter(1, true), 1, Side::Send, &mut d, || None::<u32>)
            .unwrap_err();
        assert!(
            matches!(
                e,
                Error::Timeout {
                    rank: 1,
                    peer: 1,
                    ..
                }
            ),
            "{e}"
        );
        assert!(t.snapshot().is_empty());
    }
}
