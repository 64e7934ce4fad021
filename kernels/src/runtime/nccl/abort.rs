//! The abort logic of a network transport, the same for NCCL and for the CPU network of the
//! tests: the bounded wait for a step to complete ([`poll_until`]), and [`Guarded`], which holds
//! a [`Network`]'s communicators and aborts them on any failure of a group or past the bound of
//! its wait, records why, refuses every later group with an error naming that cause, and at the
//! end destroys them only when they were never aborted.

use crate::error::GpuError;
use crate::runtime::nccl::net::{Network, P2p};
use std::fmt::Display;
use std::time::{Duration, Instant};

/// Host poll interval of every bounded wait here.
const POLL: Duration = Duration::from_micros(50);

/// How a bounded poll ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PollEnd<E> {
    Ready,
    Failed(E),
    TimedOut,
}

/// Polls `state` (`Ok(true)`: done, `Ok(false)`: in progress) until it is done or failed, or
/// until `limit` has passed since `t0`. The state is read at least once, also past the
/// deadline.
pub(crate) fn poll_until<E>(
    t0: Instant,
    limit: Duration,
    mut state: impl FnMut() -> Result<bool, E>,
) -> PollEnd<E> {
    loop {
        match state() {
            Ok(true) => return PollEnd::Ready,
            Ok(false) => {}
            Err(e) => return PollEnd::Failed(e),
        }
        if t0.elapsed() >= limit {
            return PollEnd::TimedOut;
        }
        std::thread::sleep(POLL);
    }
}

/// A network's communicators with the abort logic around them. Once aborted (an error of a
/// group, a step past its bound, or [`Guarded::abort`] from the owner's own bounded waits) they
/// are never used again: every later [`Guarded::group`] is refused, and dropping does not
/// destroy them.
pub(crate) struct Guarded<N: Network> {
    net: N,
    /// Bound of a set-up step (creation, a group's enqueue and connections).
    setup: Duration,
    /// Why the communicators were aborted, once they were.
    aborted: Option<String>,
}

impl<N: Network> Guarded<N> {
    /// `net`'s communicators, whose set-up steps are bounded by `setup`.
    pub(crate) fn new(net: N, setup: Duration) -> Guarded<N> {
        Guarded {
            net,
            setup,
            aborted: None,
        }
    }

    /// Whether the communicators were aborted (then they must not be used).
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.is_some()
    }

    /// Aborts every communicator, recording `why` (a later group's refusal names it).
    /// Idempotent: only the first call aborts, and its cause stays.
    pub(crate) fn abort(&mut self, why: impl Display) {
        if self.aborted.is_some() {
            return;
        }
        self.aborted = Some(why.to_string());
        self.net.abort_all();
    }

    /// Posts `ops[i]` on (communicator i, `queues[i]`) as one group and waits (bounded by the
    /// set-up bound) until every communicator has it queued; a first group also connects to the
    /// peers, which waits on them. Refused once the communicators were aborted. On any error
    /// of the group, or past that bound, the communicators are aborted before the error is
    /// returned ([`GpuError::NcclTimeout`] past the bound).
    pub(crate) fn group(&mut self, queues: &[N::Queue], ops: &[Vec<P2p>]) -> Result<(), GpuError> {
        if let Some(why) = &self.aborted {
            return Err(GpuError::Nccl(format!(
                "the NCCL communicators were aborted after an earlier error ({why})"
            )));
        }
        if self.net.devices() < ops.len() || queues.len() < ops.len() {
            return Err(GpuError::Nccl(format!(
                "{} operation lists for {} communicators and {} streams",
                ops.len(),
                self.net.devices(),
                queues.len()
            )));
        }
        let t0 = Instant::now();
        if let Err(e) = self.net.post(queues, ops) {
            self.abort(&e);
            return Err(e);
        }
        // A non-blocking communicator may still be enqueueing (the first call also connects to
        // its peers): nothing else may go on its stream, and no other call be made, until it is
        // ready. A blocking one answers at once.
        for i in 0..ops.len() {
            self.wait_ready(i, "a grouped ncclSend/ncclRecv (connection set-up)", t0)?;
        }
        Ok(())
    }

    /// Polls communicator `i` until it is ready (bounded by the set-up bound from `t0`). On an
    /// error or past the deadline every communicator is aborted.
    pub(crate) fn wait_ready(
        &mut self,
        i: usize,
        what: &'static str,
        t0: Instant,
    ) -> Result<(), GpuError> {
        let rank = self.net.rank(i);
        let net = &mut self.net;
        match poll_until(t0, self.setup, || net.progress(i, what)) {
            PollEnd::Ready => Ok(()),
            PollEnd::Failed(e) => {
                self.abort(&e);
                Err(e)
            }
            PollEnd::TimedOut => {
                let bound = self.setup.as_millis();
                self.abort(format_args!(
                    "rank {rank}: {what} did not complete within {bound} ms"
                ));
                Err(GpuError::NcclTimeout {
                    rank,
                    what,
                    waited_ms: t0.elapsed().as_millis().min(u64::MAX as u128) as u64,
                })
            }
        }
    }

    /// The end of the communicators: nothing more when they were aborted already; aborted when
    /// the owner is not `healthy` (an orderly destroy after a failure may wait on a peer), or
    /// when its queues are not `drained` (checked only when healthy: a receive from a dead peer
    /// never finishes; an abort makes the transfers quit, so the queues drain); destroyed
    /// otherwise (when `self` drops).
    pub(crate) fn release_with(mut self, healthy: bool, drained: impl FnOnce() -> bool) {
        if self.is_aborted() {
            return;
        }
        if !healthy {
            self.abort("released by an owner that failed");
            return;
        }
        if !drained() {
            self.abort("released with work still queued");
        }
        // Drop destroys what was not aborted.
    }

    /// The network itself (the tests' CPU network: its memory, what it was asked to do).
    #[cfg(test)]
    pub(crate) fn net_mut(&mut self) -> &mut N {
        &mut self.net
    }
}

impl<N: Network> Drop for Guarded<N> {
    fn drop(&mut self) {
        if self.aborted.is_none() {
            self.net.destroy_all();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::nccl::mock::{Calls, CpuComms, CpuNet, Fault};
    use std::cell::Cell;
    use std::rc::Rc;

    /// Two ranks of 64 bytes each on the CPU network, set-up steps bounded by `setup`.
    fn two(setup: Duration) -> (CpuComms, Rc<Calls>) {
        let net = CpuNet::new(2, 64);
        let calls = net.calls.clone();
        (CpuComms::cpu(net, setup), calls)
    }

    /// Rank 0 sends its first 8 bytes to rank 1's bytes 8..16.
    fn one_message(g: &mut CpuComms) -> Vec<Vec<P2p>> {
        let (a, b) = (g.net_mut().base[0], g.net_mut().base[1]);
        vec![
            vec![P2p::Send {
                buf: a,
                bytes: 8,
                peer: 1,
            }],
            vec![P2p::Recv {
                buf: b + 8,
                bytes: 8,
                peer: 0,
            }],
        ]
    }

    /// The refusal of a group after an abort: an NCCL error that says so and names the cause.
    fn refused(r: Result<(), GpuError>, cause: &str) {
        match r {
            Err(GpuError::Nccl(m)) => {
                assert!(m.contains("aborted after an earlier error"), "{m}");
                assert!(
                    m.contains(cause),
                    "the refusal does not name {cause:?}: {m}"
                );
            }
            other => panic!("want the refusal naming {cause:?}, got {other:?}"),
        }
    }

    #[test]
    fn poll_until_ends_on_ready_error_or_deadline() {
        let mut n = 0;
        let end = poll_until(Instant::now(), Duration::from_secs(5), || {
            n += 1;
            Ok::<bool, &str>(n >= 3)
        });
        assert_eq!((end, n), (PollEnd::Ready, 3));
        let end = poll_until(Instant::now(), Duration::from_secs(5), || {
            Err::<bool, &str>("remote error")
        });
        assert_eq!(end, PollEnd::Failed("remote error"));
        // A state that never completes (a peer that never joins) ends at the bound.
        let t0 = Instant::now();
        let end = poll_until(t0, Duration::from_millis(30), || Ok::<bool, ()>(false));
        assert_eq!(end, PollEnd::TimedOut);
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(30), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        // Past the deadline already: the state is still read once.
        let mut reads = 0;
        let end = poll_until(t0, Duration::ZERO, || {
            reads += 1;
            Ok::<bool, ()>(true)
        });
        assert_eq!((end, reads), (PollEnd::Ready, 1));
        // Instant + the bound never overflows: poll_until only compares elapsed times.
        assert_eq!(
            poll_until(Instant::now(), Duration::MAX, || Ok::<bool, ()>(true)),
            PollEnd::Ready
        );
    }

    /// A healthy group moves the bytes and leaves the communicators up; dropping them destroys
    /// them once, never aborts.
    #[test]
    fn a_healthy_group_delivers_and_ends_in_one_destroy() {
        let (mut g, calls) = two(Duration::from_secs(5));
        let at = g.net_mut().base[0];
        g.addr(at, 8).copy_from_slice(&[7; 8]);
        let ops = one_message(&mut g);
        g.exchange(&ops).unwrap();
        g.exchange(&ops).unwrap();
        let at = g.net_mut().base[1] + 8;
        assert_eq!(g.addr(at, 8), &[7; 8]);
        assert!(!g.is_aborted());
        assert_eq!((calls.posts.get(), calls.aborts.get()), (2, 0));
        drop(g);
        assert_eq!((calls.aborts.get(), calls.destroys.get()), (0, 1));
    }

    /// A group that fails (NCCL: a send, receive or group end returns an error) returns that
    /// error, aborts the communicators, and every later group is refused before it reaches the
    /// network, naming the failure; the aborted communicators are never destroyed.
    #[test]
    fn a_failed_group_aborts_and_every_later_group_is_refused_naming_why() {
        let (mut g, calls) = two(Duration::from_secs(5));
        let ops = one_message(&mut g);
        g.exchange(&ops).unwrap();
        g.net_mut().fault = Some(Fault::Post);
        match g.exchange(&ops) {
            Err(GpuError::Nccl(m)) => assert!(m.contains("injected"), "{m}"),
            other => panic!("want the injected error, got {other:?}"),
        }
        assert!(g.is_aborted());
        assert_eq!((calls.posts.get(), calls.aborts.get()), (2, 1));
        // The network would work again: the refusal is the abort logic's, not the network's.
        g.net_mut().fault = None;
        for _ in 0..2 {
            refused(g.exchange(&ops), "ncclSend/ncclRecv: injected");
        }
        assert_eq!((calls.posts.get(), calls.aborts.get()), (2, 1));
        drop(g);
        assert_eq!((calls.aborts.get(), calls.destroys.get()), (1, 0));
    }

    /// A group that never completes (a peer that never connects) ends at the set-up bound with
    /// `NcclTimeout` naming the rank and the step, the communicators aborted, and later groups
    /// refused naming the timeout.
    #[test]
    fn a_group_that_never_completes_times_out_and_aborts() {
        let bound = Duration::from_millis(30);
        let (mut g, calls) = two(bound);
        let ops = one_message(&mut g);
        g.net_mut().fault = Some(Fault::Stall);
        let t0 = Instant::now();
        let r = g.exchange(&ops);
        let waited = t0.elapsed();
        match r {
            Err(GpuError::NcclTimeout {
                rank: 0,
                what: "a grouped ncclSend/ncclRecv (connection set-up)",
                waited_ms,
            }) => assert!(waited_ms >= 30, "{waited_ms}"),
            other => panic!("want NcclTimeout, got {other:?}"),
        }
        assert!(
            waited >= bound && waited < Duration::from_secs(5),
            "{waited:?}"
        );
        assert!(g.is_aborted());
        assert_eq!(calls.aborts.get(), 1);
        g.net_mut().fault = None;
        refused(g.exchange(&ops), "did not complete within 30 ms");
        assert_eq!(calls.posts.get(), 1);
        drop(g);
        assert_eq!((calls.aborts.get(), calls.destroys.get()), (1, 0));
    }

    /// An error the communicators report while a group completes (NCCL: an asynchronous error
    /// such as a peer's) aborts them as well, with that error.
    #[test]
    fn an_asynchronous_error_aborts() {
        let (mut g, calls) = two(Duration::from_secs(5));
        let ops = one_message(&mut g);
        g.net_mut().fault = Some(Fault::Async);
        match g.exchange(&ops) {
            Err(GpuError::Nccl(m)) => assert!(m.contains("ncclRemoteError"), "{m}"),
            other => panic!("want the asynchronous error, got {other:?}"),
        }
        assert!(g.is_aborted());
        g.net_mut().fault = None;
        refused(g.exchange(&ops), "ncclRemoteError");
        drop(g);
        assert_eq!((calls.aborts.get(), calls.destroys.get()), (1, 0));
    }

    /// The owner's own bounded waits (the group's stream wait past its timeout) abort through
    /// the same state: later groups are refused naming the first cause; aborting is idempotent.
    #[test]
    fn an_abort_by_the_owner_is_recorded_once() {
        let (mut g, calls) = two(Duration::from_secs(5));
        let ops = one_message(&mut g);
        g.abort("rank 0 timed out waiting for rank 1");
        g.abort("a second cause");
        assert!(g.is_aborted());
        assert_eq!(calls.aborts.get(), 1);
        refused(g.exchange(&ops), "rank 0 timed out waiting for rank 1");
        drop(g);
        assert_eq!((calls.aborts.get(), calls.destroys.get()), (1, 0));
    }

    /// Operation lists for more communicators than there are: refused, nothing aborted (the
    /// communicators did nothing wrong), and the next group goes through.
    #[test]
    fn too_many_lists_are_refused_without_aborting() {
        let (mut g, calls) = two(Duration::from_secs(5));
        let mut ops = one_message(&mut g);
        ops.push(Vec::new());
        match g.exchange(&ops) {
            Err(GpuError::Nccl(m)) => assert!(m.contains("3 operation lists for 2"), "{m}"),
            other => panic!("{other:?}"),
        }
        assert!(!g.is_aborted());
        ops.pop();
        g.exchange(&ops).unwrap();
        assert_eq!((calls.posts.get(), calls.aborts.get()), (1, 0));
    }

    /// The release at the end: destroyed when healthy and drained; aborted when the owner
    /// failed (its queues not even waited for) or its queues did not drain; nothing more when
    /// aborted already. Never both.
    #[test]
    fn release_destroys_only_healthy_drained_communicators() {
        for (healthy, drains, aborted_before, want) in [
            (true, true, false, (0, 1)),
            (true, false, false, (1, 0)),
            (false, true, false, (1, 0)),
            (true, true, true, (1, 0)),
            (false, false, true, (1, 0)),
        ] {
            let (mut g, calls) = two(Duration::from_secs(5));
            if aborted_before {
                g.abort("earlier");
            }
            let asked = Cell::new(false);
            g.release_with(healthy, || {
                asked.set(true);
                drains
            });
            let case = (healthy, drains, aborted_before);
            assert_eq!((calls.aborts.get(), calls.destroys.get()), want, "{case:?}");
            assert_eq!(asked.get(), healthy && !aborted_before, "{case:?}");
        }
    }
}
