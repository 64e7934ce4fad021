//! Signals (sender -> receiver: "call `epoch`'s data is in, `count` items") and credits
//! (receiver -> sender: "I am done reading call `epoch`, you may overwrite").
//!
//! # The ordering argument
//!
//! *Payload before signal.* The sender writes every payload row of a call with plain stores,
//! then [`Signal::post`]s with `Release`. The receiver [`Signal::wait`]s with `Acquire` and
//! only then reads the rows. The acquire load that returns the posted word synchronizes with
//! the release store that wrote it, so every payload write happens-before every payload read.
//! A `Relaxed` post would let the receiver see the word without the rows (the loom mutant
//! `signal_relaxed` shows exactly that).
//!
//! *No stale signal.* The word is `(epoch << 32) | count` and the receiver accepts only its own
//! call's epoch, so the word left over from call i (the buffers are reused) is never taken for
//! call i+1. Epoch 0 is never posted: the zeroed word means "nothing yet".
//!
//! *No overwrite of unread data.* Before writing call i's rows the sender waits, with
//! `Acquire`, for the receiver's credit to reach i - 1; the receiver grants it with `Release`
//! after its last read of call i - 1. So the reads of call i - 1 happen-before the writes of
//! call i. A receiver that gives up on a call (timeout) grants the credit anyway: it will not
//! read that call's rows any more, and a late writer of call i finishes those writes before its
//! own writes of call i + 1 (program order), which the receiver reads only after their signal.
//! A `Relaxed` credit load (the loom mutant `credit_relaxed`) lets call i + 1's writes race
//! with call i's reads.

use crate::error::{Result, Side};
use crate::mask::RankMask;
use crate::sync::{AtomicU64, Deadline, Ordering};
use crate::transport::mask_table::{MaskTable, Waiter};

#[cfg(not(ep_mutant = "signal_relaxed"))]
const POST: Ordering = Ordering::Release;
/// Mutant for the loom self-check: the signal no longer publishes the payload.
#[cfg(ep_mutant = "signal_relaxed")]
const POST: Ordering = Ordering::Relaxed;

#[cfg(not(ep_mutant = "credit_relaxed"))]
const CREDIT_LOAD: Ordering = Ordering::Acquire;
/// Mutant for the loom self-check: a sender may overwrite rows the receiver still reads.
#[cfg(ep_mutant = "credit_relaxed")]
const CREDIT_LOAD: Ordering = Ordering::Relaxed;

/// One sender's signal word in one receiver's memory.
#[derive(Debug)]
pub struct Signal(AtomicU64);

impl Default for Signal {
    fn default() -> Self {
        Signal::new()
    }
}

impl Signal {
    pub fn new() -> Signal {
        Signal(AtomicU64::new(0))
    }

    fn word(epoch: u64, count: u32) -> u64 {
        ((epoch & 0xFFFF_FFFF) << 32) | count as u64
    }

    /// Publishes call `epoch` (>= 1) with `count` items. Every write of the call's payload must
    /// precede this in program order (or happen-before it).
    pub fn post(&self, epoch: u64, count: u32) {
        debug_assert!(epoch & 0xFFFF_FFFF != 0, "epoch 0 is never posted");
        self.0.store(Self::word(epoch, count), POST);
    }

    /// Waits for call `epoch`'s signal and returns its count, or `None` past the deadline.
    /// After `Some`, the payload written before the post is visible.
    pub fn wait(&self, epoch: u64, deadline: &Deadline) -> Option<u32> {
        deadline.spin_until(|| self.poll(epoch))
    }

    /// One look for call `epoch`'s signal: its count if it is there (and then the payload
    /// written before the post is visible).
    pub fn poll(&self, epoch: u64) -> Option<u32> {
        let want = epoch & 0xFFFF_FFFF;
        let w = self.0.load(Ordering::Acquire);
        (w >> 32 == want).then_some(w as u32)
    }
}

/// The receiver's permission to overwrite its buffer: the last call it finished reading.
#[derive(Debug)]
pub struct Credit(AtomicU64);

impl Default for Credit {
    fn default() -> Self {
        Credit::new()
    }
}

impl Credit {
    pub fn new() -> Credit {
        Credit(AtomicU64::new(0))
    }

    /// The receiver is done with call `epoch` (all its reads precede this in program order).
    pub fn grant(&self, epoch: u64) {
        self.0.fetch_max(epoch, Ordering::Release);
    }

    /// The sender of call `epoch` waits until call `epoch - 1` was released. Returns `false`
    /// past the deadline.
    pub fn wait_writable(&self, epoch: u64, deadline: &Deadline) -> bool {
        deadline.spin_until(|| self.writable(epoch)).is_some()
    }

    /// One look: `Some` when call `epoch - 1` was released (and then the receiver's reads of
    /// it happen-before whatever the sender does next).
    pub fn writable(&self, epoch: u64) -> Option<()> {
        (self.0.load(CREDIT_LOAD) + 1 >= epoch).then_some(())
    }
}

/// The R x R credits of one kind of call: entry `dst * R + src` is `dst`'s permission for `src`
/// to overwrite `src`'s region in `dst`'s memory.
#[derive(Debug)]
pub struct CreditTable {
    credits: Vec<Credit>,
    ranks: usize,
}

impl CreditTable {
    pub fn new(ranks: usize) -> CreditTable {
        CreditTable {
            credits: (0..ranks * ranks).map(|_| Credit::new()).collect(),
            ranks,
        }
    }

    /// Sender `src` waits until every destination has released call `epoch - 1`; on timeout
    /// returns the destination it was waiting for.
    pub fn wait_all_writable(
        &self,
        src: usize,
        epoch: u64,
        deadline: &Deadline,
    ) -> Result<(), usize> {
        for dst in 0..self.ranks {
            if !self.credits[dst * self.ranks + src].wait_writable(epoch, deadline) {
                return Err(dst);
            }
        }
        Ok(())
    }

    /// `dst`'s permission for `src` to overwrite `src`'s region in `dst`'s memory.
    pub fn get(&self, dst: usize, src: usize) -> &Credit {
        &self.credits[dst * self.ranks + src]
    }

    /// Sender `src` waits until every destination not masked has released call `epoch - 1`,
    /// through `mask` (see [`MaskTable::wait`](super::MaskTable::wait)); `skip` holds the
    /// destinations masked when the call started, and gets those masked while it waited.
    pub fn wait_unmasked_writable(
        &self,
        mask: &MaskTable,
        w: Waiter,
        epoch: u64,
        deadline: &mut Deadline,
        skip: &mut RankMask,
    ) -> Result<()> {
        for dst in 0..self.ranks {
            if skip.is_masked(dst) {
                continue;
            }
            let credit = self.get(dst, w.rank);
            let got = mask.wait(w, dst, Side::Send, deadline, || credit.writable(epoch))?;
            if got.is_none() {
                skip.set(dst, true);
            }
        }
        Ok(())
    }

    /// Receiver `dst` is done with call `epoch` from every source: after its last read, or when
    /// it gives the call up.
    pub fn grant_all(&self, dst: usize, epoch: u64) {
        for c in &self.credits[dst * self.ranks..(dst + 1) * self.ranks] {
            c.grant(epoch);
        }
    }
}
