//! The NCCL calls: communicators (created, polled, aborted, destroyed), grouped
//! point-to-point operations, the bounded polls (the module docs of `runtime::nccl` say how).

use crate::error::GpuError;
use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys;
use std::cell::Cell;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Set-up steps (communicator creation, the first grouped call's connections) get at least this
/// long, whatever the group's wait bound: NCCL's own set-up takes seconds on a healthy node.
pub const SETUP_FLOOR: Duration = Duration::from_secs(20);
/// Host poll interval of every bounded wait here.
const POLL: Duration = Duration::from_micros(50);
/// NCCL_VERSION(2, 28, 3): the `ncclConfig_t` layout of the `nccl-02028` bindings.
const CONFIG_VERSION: u32 = 22803;
/// NCCL_CONFIG_UNDEF_INT.
const UNDEF: i32 = i32::MIN;

/// The bound of a set-up step for a group whose waits are bounded by `timeout`.
pub fn setup_timeout(timeout: Duration) -> Duration {
    timeout.max(SETUP_FLOOR)
}

/// Whether libnccl can be loaded. Never panics.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen libnccl and reports whether that worked.
    unsafe { sys::is_culib_present() }
}

fn no_nccl() -> GpuError {
    GpuError::NoDevice("no NCCL (libnccl.so.2 not found)".into())
}

/// NCCL's text for the last error of `comm` (may be empty).
fn last_error(comm: sys::ncclComm_t) -> String {
    // SAFETY: ncclGetLastError returns NULL or a NUL-terminated string owned by NCCL, valid
    // until the next NCCL call on this thread; it is copied at once.
    unsafe {
        let p = sys::ncclGetLastError(comm);
        if p.is_null() {
            String::new()
        } else {
            std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

fn nccl_err(what: &str, rank: usize, rc: sys::ncclResult_t, comm: sys::ncclComm_t) -> GpuError {
    let msg = last_error(comm);
    if msg.is_empty() {
        GpuError::Nccl(format!("rank {rank}: {what}: {rc:?}"))
    } else {
        GpuError::Nccl(format!("rank {rank}: {what}: {rc:?} ({msg})"))
    }
}

/// How a bounded poll ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PollEnd {
    Ready,
    Failed(sys::ncclResult_t),
    TimedOut,
}

/// Polls `state` until it leaves `ncclInProgress`, or until `limit` has passed since `t0`. The
/// state is read at least once, also past the deadline.
pub(crate) fn poll_until(
    t0: Instant,
    limit: Duration,
    mut state: impl FnMut() -> sys::ncclResult_t,
) -> PollEnd {
    loop {
        match state() {
            sys::ncclResult_t::ncclSuccess => return PollEnd::Ready,
            sys::ncclResult_t::ncclInProgress => {}
            e => return PollEnd::Failed(e),
        }
        if t0.elapsed() >= limit {
            return PollEnd::TimedOut;
        }
        std::thread::sleep(POLL);
    }
}

/// The bytes of an NCCL unique id (what rank 0 hands to the others through the rendezvous).
pub fn unique_id() -> Result<Vec<u8>, GpuError> {
    if !nccl_present() {
        return Err(no_nccl());
    }
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    // SAFETY: `id` is a valid ncclUniqueId to fill.
    let rc = unsafe { sys::ncclGetUniqueId(&mut id) };
    if rc != sys::ncclResult_t::ncclSuccess {
        return Err(GpuError::Nccl(format!("ncclGetUniqueId: {rc:?}")));
    }
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// NCCL_CONFIG_INITIALIZER with `blocking = 0`.
fn nonblocking_config() -> sys::ncclConfig_t {
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

/// How long `Comms::abort` waits for NCCL to finish aborting.
pub const ABORT_WAIT: Duration = Duration::from_secs(10);

/// Communicator handles on their way to the abort helper thread.
struct Handles(Vec<sys::ncclComm_t>);

// SAFETY: an NCCL communicator may be aborted from any thread (that is what ncclCommAbort is
// for: a watchdog aborting a communicator another thread is blocked in); the handles are moved
// to exactly one thread, and their owner never touches them again (`Comms::aborted`).
unsafe impl Send for Handles {}

impl Handles {
    fn abort_all(&self) {
        for &c in &self.0 {
            if !c.is_null() {
                // SAFETY: `c` is a live communicator whose owner marked it aborted; after this
                // call NCCL frees it and nothing uses it again.
                let _ = unsafe { sys::ncclCommAbort(c) };
            }
        }
    }
}

/// Communicators, one per local GPU (index = the group's device index).
pub(crate) struct Comms {
    pub comms: Vec<sys::ncclComm_t>,
    /// The rank of each communicator (for errors).
    ranks: Vec<usize>,
    /// Bound of a set-up step (creation, a grouped call's enqueue and connections).
    setup: Duration,
    /// Set once every communicator was aborted: they are freed and never touched again.
    /// A `Cell`: aborting is allowed through a shared reference (Comms is not `Sync`, its raw
    /// communicator handles already make it so).
    aborted: Cell<bool>,
}

impl Comms {
    /// One process, every GPU of the group: `ncclCommInitAll` over ordinals 0..n (rank = ordinal).
    /// The caller has bound a context on each device already. Blocking communicators: every
    /// peer is in this process.
    pub fn init_all(n: usize) -> Result<Comms, GpuError> {
        if !nccl_present() {
            return Err(no_nccl());
        }
        let ndev = i32::try_from(n)
            .map_err(|_| GpuError::Unsupported(format!("{n} NCCL devices in one process")))?;
        let mut comms = vec![std::ptr::null_mut(); n];
        let devs: Vec<i32> = (0..ndev).collect();
        // SAFETY: `comms` has room for n communicators, `devs` lists n valid ordinals.
        let rc = unsafe { sys::ncclCommInitAll(comms.as_mut_ptr(), ndev, devs.as_ptr()) };
        let c = Comms {
            comms,
            ranks: (0..n).collect(),
            setup: SETUP_FLOOR,
            aborted: Cell::new(false),
        };
        if rc != sys::ncclResult_t::ncclSuccess {
            let e = nccl_err("ncclCommInitAll", 0, rc, std::ptr::null_mut());
            c.abort();
            return Err(e);
        }
        Ok(c)
    }

    /// One rank of `nranks` (one process per GPU), from rank 0's unique id. Non-blocking: waits
    /// at most [`setup_timeout`]`(timeout)` for the peers, then aborts and fails with
    /// [`GpuError::NcclTimeout`].
    pub fn init_rank(
        nranks: usize,
        rank: usize,
        id: &[u8],
        timeout: Duration,
    ) -> Result<Comms, GpuError> {
        if !nccl_present() {
            return Err(no_nccl());
        }
        let (n, rk) = match (i32::try_from(nranks), i32::try_from(rank)) {
            (Ok(n), Ok(rk)) if rank < nranks => (n, rk),
            _ => {
                return Err(GpuError::Unsupported(format!(
                    "NCCL rank {rank} of {nranks}"
                )))
            }
        };
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        if id.len() != uid.internal.len() {
            return Err(GpuError::Nccl(format!(
                "rank {rank}: unique id of {} bytes, want 128",
                id.len()
            )));
        }
        for (d, &b) in uid.internal.iter_mut().zip(id) {
            *d = b as _;
        }
        let mut config = nonblocking_config();
        let mut comm: sys::ncclComm_t = std::ptr::null_mut();
        let t0 = Instant::now();
        // SAFETY: `comm` receives the communicator; `config` is a complete ncclConfig_t of this
        // library's layout (size and version say which); the id came from ncclGetUniqueId.
        let rc = unsafe { sys::ncclCommInitRankConfig(&mut comm, n, uid, rk, &mut config) };
        // From here on `c` owns whatever NCCL created: every error path below aborts it.
        let c = Comms {
            comms: if comm.is_null() { vec![] } else { vec![comm] },
            ranks: vec![rank],
            setup: setup_timeout(timeout),
            aborted: Cell::new(false),
        };
        match rc {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                if !comm.is_null() =>
            {
                c.wait_ready(0, "ncclCommInitRankConfig (communicator set-up)", t0)?;
                Ok(c)
            }
            _ => {
                let e = nccl_err("ncclCommInitRankConfig", rank, rc, comm);
                c.abort();
                Err(e)
            }
        }
    }

    /// Polls communicator `i` until it is ready (bounded by the set-up bound from `t0`). On an
    /// error or past the deadline every communicator is aborted.
    fn wait_ready(&self, i: usize, what: &'static str, t0: Instant) -> Result<(), GpuError> {
        let comm = self.comms[i];
        let rank = self.ranks.get(i).copied().unwrap_or(0);
        let end = poll_until(t0, self.setup, || {
            let mut st = sys::ncclResult_t::ncclInProgress;
            // SAFETY: `comm` is a live communicator of this object (not aborted: callers check);
            // `st` receives its state.
            let rc = unsafe { sys::ncclCommGetAsyncError(comm, &mut st) };
            if rc != sys::ncclResult_t::ncclSuccess {
                rc
            } else {
                st
            }
        });
        match end {
            PollEnd::Ready => Ok(()),
            PollEnd::Failed(rc) => {
                let e = nccl_err(what, rank, rc, comm);
                self.abort();
                Err(e)
            }
            PollEnd::TimedOut => {
                self.abort();
                Err(GpuError::NcclTimeout {
                    rank,
                    what,
                    waited_ms: t0.elapsed().as_millis().min(u64::MAX as u128) as u64,
                })
            }
        }
    }

    /// Whether the communicators were aborted (then they must not be used).
    pub fn is_aborted(&self) -> bool {
        self.aborted.get()
    }

    /// Aborts every communicator (unblocks and frees its kernels and proxy threads). Idempotent.
    /// `ncclCommAbort` raises the abort flag at once (NCCL's kernels and proxy threads see it and
    /// quit) and then joins NCCL's own threads; that join runs on a helper thread and is waited
    /// for at most [`ABORT_WAIT`], so a set-up thread stuck inside NCCL cannot hang the caller
    /// (past the bound the helper is left to finish on its own).
    pub fn abort(&self) {
        if self.aborted.replace(true) {
            return;
        }
        let comms = Handles(self.comms.clone());
        let (tx, rx) = std::sync::mpsc::channel();
        let helper = std::thread::Builder::new()
            .name("ep-nccl-abort".into())
            .spawn(move || {
                let comms = comms;
                comms.abort_all();
                let _ = tx.send(());
            });
        if helper.is_ok() {
            let _ = rx.recv_timeout(ABORT_WAIT);
        } else {
            // No thread to spare: abort here (unbounded, as NCCL itself).
            Handles(self.comms.clone()).abort_all();
        }
    }

    /// Frees the communicators before the streams and memory they use: waits for `streams`
    /// (each with its context) at most `timeout`, then destroys the communicators when the
    /// owner is `healthy` and every stream finished cleanly, and aborts them otherwise (a
    /// receive from a dead peer never finishes, and an orderly destroy after a failure may wait
    /// on a peer; an abort makes NCCL's kernels quit, so the streams drain).
    pub fn release(
        self,
        streams: &[(std::sync::Arc<cudarc::driver::CudaContext>, CUstream)],
        timeout: Duration,
        healthy: bool,
    ) {
        if self.is_aborted() {
            return;
        }
        if !healthy {
            self.abort();
            return;
        }
        if crate::runtime::streams::drain_streams(streams, timeout)
            != crate::runtime::streams::Drain::Idle
        {
            self.abort();
        }
        // Drop destroys what was not aborted.
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        if !self.aborted.get() {
            for &c in self.comms.iter().filter(|c| !c.is_null()) {
                // SAFETY: the owner synchronised all work (or released through
                // [`Comms::release`], which aborts when it could not); `c` is not used again.
                // Destroy is blocking in NCCL also for non-blocking communicators.
                let _ = unsafe { sys::ncclCommDestroy(c) };
            }
        }
    }
}

/// One point-to-point operation of a group.
#[derive(Debug)]
pub(crate) enum P2p {
    Send { buf: u64, bytes: usize, peer: usize },
    Recv { buf: u64, bytes: usize, peer: usize },
}

/// Where a group's point-to-point operations go: one list per device (per rank, where NCCL
/// runs one rank per GPU), posted as one group: NCCL on the GPU ([`NcclNet`]: [`grouped`],
/// bounded, aborting on a timeout); a CPU network in `runtime::exchange`'s tests, which pairs
/// every rank's plan as NCCL would.
pub(crate) trait Network {
    fn group(&mut self, ops: &[Vec<P2p>]) -> Result<(), GpuError>;
}

/// The NCCL communicators of a group on its streams (one per device), as a [`Network`].
pub(crate) struct NcclNet<'a> {
    pub(crate) comms: &'a Comms,
    pub(crate) streams: &'a [CUstream],
}

impl Network for NcclNet<'_> {
    fn group(&mut self, ops: &[Vec<P2p>]) -> Result<(), GpuError> {
        grouped(self.comms, self.streams, ops)
    }
}

/// Enqueues `ops[i]` on (comms[i], streams[i]) inside one ncclGroupStart/End. Zero-byte
/// operations are left out (both sides know the same sizes, so they leave out the same pairs).
/// Returns once the work is queued on the streams (a non-blocking communicator's
/// `ncclInProgress` is polled, bounded by the set-up bound). On any error, or past that bound,
/// the communicators are aborted before the error is returned.
pub(crate) fn grouped(
    comms: &Comms,
    streams: &[CUstream],
    ops: &[Vec<P2p>],
) -> Result<(), GpuError> {
    if comms.is_aborted() {
        return Err(GpuError::Nccl(
            "the NCCL communicators were aborted after an earlier error".into(),
        ));
    }
    if comms.comms.len() < ops.len() || streams.len() < ops.len() {
        return Err(GpuError::Nccl(format!(
            "{} operation lists for {} communicators and {} streams",
            ops.len(),
            comms.comms.len(),
            streams.len()
        )));
    }
    let t0 = Instant::now();
    let rank0 = comms.ranks.first().copied().unwrap_or(0);
    // SAFETY: no arguments; pairs with the ncclGroupEnd below on every path.
    let rc = unsafe { sys::ncclGroupStart() };
    if rc != sys::ncclResult_t::ncclSuccess {
        let e = nccl_err("ncclGroupStart", rank0, rc, std::ptr::null_mut());
        comms.abort();
        return Err(e);
    }
    let mut res = Ok(());
    'outer: for (i, list) in ops.iter().enumerate() {
        let (comm, stream) = (comms.comms[i], streams[i] as sys::cudaStream_t);
        for op in list {
            let (ptr, bytes, peer, send) = match *op {
                P2p::Send { buf, bytes, peer } => (buf, bytes, peer, true),
                P2p::Recv { buf, bytes, peer } => (buf, bytes, peer, false),
            };
            if bytes == 0 {
                continue;
            }
            let Ok(peer32) = i32::try_from(peer) else {
                res = Err(GpuError::Nccl(format!("NCCL peer {peer}")));
                break 'outer;
            };
            // SAFETY: every buffer is a live device allocation of at least `bytes` bytes on the
            // communicator's device (the sizes are bounded by `check_header`); the stream
            // belongs to that device's context.
            let rc = unsafe {
                if send {
                    sys::ncclSend(
                        ptr as *const c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        peer32,
                        comm,
                        stream,
                    )
                } else {
                    sys::ncclRecv(
                        ptr as *mut c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        peer32,
                        comm,
                        stream,
                    )
                }
            };
            match rc {
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {}
                e => {
                    let rank = comms.ranks.get(i).copied().unwrap_or(0);
                    res = Err(nccl_err("ncclSend/ncclRecv", rank, e, comm));
                    break 'outer;
                }
            }
        }
    }
    // SAFETY: closes the group opened above.
    let end = unsafe { sys::ncclGroupEnd() };
    if let Err(e) = res {
        comms.abort();
        return Err(e);
    }
    match end {
        sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => {}
        e => {
            let err = nccl_err("ncclGroupEnd", rank0, e, std::ptr::null_mut());
            comms.abort();
            return Err(err);
        }
    }
    // A non-blocking communicator may still be enqueueing (the first call also connects to its
    // peers): nothing else may go on its stream, and no other NCCL call be made, until it is
    // ready. A blocking one answers ncclSuccess at once.
    for i in 0..ops.len() {
        comms.wait_ready(i, "a grouped ncclSend/ncclRecv (connection set-up)", t0)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_until_ends_on_ready_error_or_deadline() {
        let mut n = 0;
        let end = poll_until(Instant::now(), Duration::from_secs(5), || {
            n += 1;
            if n < 3 {
                sys::ncclResult_t::ncclInProgress
            } else {
                sys::ncclResult_t::ncclSuccess
            }
        });
        assert_eq!((end, n), (PollEnd::Ready, 3));
        let end = poll_until(Instant::now(), Duration::from_secs(5), || {
            sys::ncclResult_t::ncclRemoteError
        });
        assert_eq!(end, PollEnd::Failed(sys::ncclResult_t::ncclRemoteError));
        // A state that never leaves ncclInProgress (a peer that never joins) ends at the bound.
        let t0 = Instant::now();
        let end = poll_until(t0, Duration::from_millis(30), || {
            sys::ncclResult_t::ncclInProgress
        });
        assert_eq!(end, PollEnd::TimedOut);
        let waited = t0.elapsed();
        assert!(waited >= Duration::from_millis(30), "{waited:?}");
        assert!(waited < Duration::from_secs(5), "{waited:?}");
        // Past the deadline already: the state is still read once.
        let mut reads = 0;
        let end = poll_until(t0, Duration::ZERO, || {
            reads += 1;
            sys::ncclResult_t::ncclSuccess
        });
        assert_eq!((end, reads), (PollEnd::Ready, 1));
    }

    #[test]
    fn setup_bound_has_a_floor_and_saturates() {
        assert_eq!(setup_timeout(Duration::from_millis(1)), SETUP_FLOOR);
        assert_eq!(setup_timeout(Duration::MAX), Duration::MAX);
        // Instant + the bound never overflows in poll_until: it only compares elapsed times.
        assert_eq!(
            poll_until(Instant::now(), Duration::MAX, || {
                sys::ncclResult_t::ncclSuccess
            }),
            PollEnd::Ready
        );
    }

    #[test]
    fn the_config_is_nccl_config_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!((c.magic, c.version, c.blocking), (0xcafebeef, 22803, 0));
        assert_eq!(
            (c.cgaClusterSize, c.nvlinkCentricSched),
            (i32::MIN, i32::MIN)
        );
    }
}
