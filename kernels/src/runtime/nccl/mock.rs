//! A CPU network for the tests ([`CpuNet`]): R ranks, one per "device", each with the memory of
//! its one allocation at a base of its own. A group pairs, for every (sender, receiver), the
//! sender's sends to the receiver with the receiver's receives from the sender, in order, as
//! NCCL does; zero-byte operations are left out on both sides (as NCCL's `post` leaves them out).
//! Sizes that differ on the two sides of a message are an error naming both; otherwise the
//! bytes are copied. It runs under the same abort logic as NCCL (`abort::Guarded`), and can be
//! told to fail ([`Fault`]) to exercise it.

use crate::error::GpuError;
use crate::runtime::nccl::abort::Guarded;
use crate::runtime::nccl::net::{Network, P2p};
use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

/// A failure to inject into every later call of its kind (until cleared).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// `post` fails (NCCL: ncclSend/ncclRecv or ncclGroupEnd returns an error).
    Post,
    /// `progress` never completes (NCCL: a peer that never joins or never connects).
    Stall,
    /// `progress` reports an asynchronous error (NCCL: ncclRemoteError from a peer).
    Async,
}

/// What the abort logic did to the network, shared with the test (it outlives the network).
#[derive(Debug, Default)]
pub(crate) struct Calls {
    pub(crate) posts: Cell<usize>,
    pub(crate) aborts: Cell<usize>,
    pub(crate) destroys: Cell<usize>,
}

pub(crate) struct CpuNet {
    pub(crate) mem: Vec<Vec<u8>>,
    pub(crate) base: Vec<u64>,
    pub(crate) fault: Option<Fault>,
    pub(crate) calls: Rc<Calls>,
}

impl CpuNet {
    /// `ranks` ranks of `bytes` bytes each, rank r's at (r + 1) << 40.
    pub(crate) fn new(ranks: usize, bytes: usize) -> CpuNet {
        CpuNet {
            mem: vec![vec![0u8; bytes]; ranks],
            base: (0..ranks).map(|r| (r as u64 + 1) << 40).collect(),
            fault: None,
            calls: Rc::default(),
        }
    }

    /// The `n` bytes at address `a` of some rank's allocation.
    pub(crate) fn addr(&mut self, a: u64, n: usize) -> &mut [u8] {
        for (m, &b) in self.mem.iter_mut().zip(&self.base) {
            if a >= b && a + n as u64 <= b + m.len() as u64 {
                let o = (a - b) as usize;
                return &mut m[o..o + n];
            }
        }
        panic!("address {a:#x} + {n} outside every rank's allocation");
    }

    /// Panics on a call after the communicators ended: on NCCL it would use a freed one.
    fn alive(&self, call: &str) {
        let (a, d) = (self.calls.aborts.get(), self.calls.destroys.get());
        assert!(a == 0 && d == 0, "{call} after {a} aborts and {d} destroys");
    }
}

impl Network for CpuNet {
    type Queue = ();

    fn devices(&self) -> usize {
        if self.calls.aborts.get() + self.calls.destroys.get() > 0 {
            0
        } else {
            self.mem.len()
        }
    }

    fn rank(&self, i: usize) -> usize {
        i
    }

    fn post(&mut self, _: &[()], ops: &[Vec<P2p>]) -> Result<(), GpuError> {
        self.alive("post");
        self.calls.posts.set(self.calls.posts.get() + 1);
        if self.fault == Some(Fault::Post) {
            return Err(GpuError::Nccl("rank 0: ncclSend/ncclRecv: injected".into()));
        }
        let r = ops.len();
        for src in 0..r {
            for dst in 0..r {
                let sends: Vec<(u64, usize)> = ops[src]
                    .iter()
                    .filter_map(|o| match *o {
                        P2p::Send { buf, bytes, peer } if peer == dst && bytes > 0 => {
                            Some((buf, bytes))
                        }
                        _ => None,
                    })
                    .collect();
                let recvs: Vec<(u64, usize)> = ops[dst]
                    .iter()
                    .filter_map(|o| match *o {
                        P2p::Recv { buf, bytes, peer } if peer == src && bytes > 0 => {
                            Some((buf, bytes))
                        }
                        _ => None,
                    })
                    .collect();
                if sends.len() != recvs.len() {
                    return Err(GpuError::Nccl(format!(
                        "rank {src} posts {} sends to rank {dst}, which posts {} receives",
                        sends.len(),
                        recvs.len()
                    )));
                }
                for (i, (&(sa, sn), &(ra, rn))) in sends.iter().zip(&recvs).enumerate() {
                    if sn != rn {
                        return Err(GpuError::Nccl(format!(
                            "message {i} from rank {src} to rank {dst}: {sn} bytes sent, {rn} expected"
                        )));
                    }
                    let data = self.addr(sa, sn).to_vec();
                    self.addr(ra, rn).copy_from_slice(&data);
                }
            }
        }
        Ok(())
    }

    fn progress(&mut self, i: usize, what: &'static str) -> Result<bool, GpuError> {
        self.alive("progress");
        match self.fault {
            Some(Fault::Stall) => Ok(false),
            Some(Fault::Async) => Err(GpuError::Nccl(format!(
                "rank {i}: {what}: ncclRemoteError (injected)"
            ))),
            _ => Ok(true),
        }
    }

    fn abort_all(&mut self) {
        self.alive("abort");
        self.calls.aborts.set(self.calls.aborts.get() + 1);
    }

    fn destroy_all(&mut self) {
        self.alive("destroy");
        self.calls.destroys.set(self.calls.destroys.get() + 1);
    }
}

/// The CPU network under the abort logic, as `GpuGroup` holds NCCL's ([`Comms`](super::Comms)).
pub(crate) type CpuComms = Guarded<CpuNet>;

impl CpuComms {
    /// The CPU network under the abort logic, set-up steps bounded by `setup`.
    pub(crate) fn cpu(net: CpuNet, setup: Duration) -> CpuComms {
        Guarded::new(net, setup)
    }

    /// One group of every rank's operations (`ops[r]`: rank r's).
    pub(crate) fn exchange(&mut self, ops: &[Vec<P2p>]) -> Result<(), GpuError> {
        self.group(&vec![(); ops.len()], ops)
    }

    /// [`CpuNet::addr`].
    pub(crate) fn addr(&mut self, a: u64, n: usize) -> &mut [u8] {
        self.net_mut().addr(a, n)
    }
}
