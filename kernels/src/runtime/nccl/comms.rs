//! The NCCL calls: communicators (created, polled, aborted, destroyed) and grouped
//! point-to-point operations, as a [`Network`] ([`Nccl`]); [`Comms`] is them under the abort
//! logic of `abort::Guarded` (the module docs of `runtime::nccl` say how it all fits). Every
//! NCCL FFI call is here, at the boundary (a call's few CUDA driver calls, `call`'s, go through
//! the runtime's `driver` layer and cudarc's `result`).

use crate::error::GpuError;
use crate::runtime::nccl::abort::Guarded;
use crate::runtime::nccl::net::{Network, P2p};
use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys;
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// Set-up steps (communicator creation, the first grouped call's connections) get at least this
/// long, whatever the group's wait bound: NCCL's own set-up takes seconds on a healthy node.
pub const SETUP_FLOOR: Duration = Duration::from_secs(20);
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

/// How long `Nccl::abort_all` waits for NCCL to finish aborting.
pub const ABORT_WAIT: Duration = Duration::from_secs(10);

/// Communicator handles on their way to the abort helper thread.
struct Handles(Vec<sys::ncclComm_t>);

// SAFETY: an NCCL communicator may be aborted from any thread (that is what ncclCommAbort is
// for: a watchdog aborting a communicator another thread is blocked in); the handles are moved
// to exactly one thread, and their owner took them out of its list first (`Nccl::abort_all`),
// so it never touches them again.
unsafe impl Send for Handles {}

impl Handles {
    fn abort_all(&self) {
        for &c in &self.0 {
            if !c.is_null() {
                // SAFETY: `c` is a live communicator that its owner took out of its list to
                // abort it; after this call NCCL frees it and nothing uses it again.
                let _ = unsafe { sys::ncclCommAbort(c) };
            }
        }
    }
}

/// NCCL communicators, one per local GPU (index = the group's device index), as a [`Network`]
/// whose queues are CUDA streams. Every handle in `comms` is live: aborting or destroying takes
/// the handles out of the list before NCCL frees them, so no call reaches a freed one.
pub(crate) struct Nccl {
    comms: Vec<sys::ncclComm_t>,
    /// The rank of each communicator (for errors).
    ranks: Vec<usize>,
}

/// The NCCL communicators of a group under the abort logic (aborted on any error or past a
/// set-up bound, refused after that, destroyed at the end only when never aborted).
pub(crate) type Comms = Guarded<Nccl>;

impl Network for Nccl {
    type Queue = CUstream;

    fn devices(&self) -> usize {
        self.comms.len()
    }

    fn rank(&self, i: usize) -> usize {
        self.ranks.get(i).copied().unwrap_or(0)
    }

    /// Enqueues `ops[i]` on (`comms[i]`, `streams[i]`) inside one ncclGroupStart/End. Returns
    /// once NCCL took the group (a non-blocking communicator may answer `ncclInProgress`: its
    /// [`Network::progress`] says when it is queued).
    fn post(&mut self, streams: &[CUstream], ops: &[Vec<P2p>]) -> Result<(), GpuError> {
        let rank0 = self.rank(0);
        // SAFETY: no arguments; pairs with the ncclGroupEnd below on every path.
        let rc = unsafe { sys::ncclGroupStart() };
        if rc != sys::ncclResult_t::ncclSuccess {
            return Err(nccl_err("ncclGroupStart", rank0, rc, std::ptr::null_mut()));
        }
        let mut res = Ok(());
        'outer: for (i, list) in ops.iter().enumerate() {
            let (comm, stream) = (self.comms[i], streams[i] as sys::cudaStream_t);
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
                // SAFETY: `comm` is live (see `Nccl`); every buffer is a live device allocation
                // of at least `bytes` bytes on the communicator's device (the sizes are
                // bounded by `check_header`); the stream belongs to that device's context.
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
                        res = Err(nccl_err("ncclSend/ncclRecv", self.rank(i), e, comm));
                        break 'outer;
                    }
                }
            }
        }
        // SAFETY: closes the group opened above.
        let end = unsafe { sys::ncclGroupEnd() };
        res?;
        match end {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress => Ok(()),
            e => Err(nccl_err("ncclGroupEnd", rank0, e, std::ptr::null_mut())),
        }
    }

    fn progress(&mut self, i: usize, what: &'static str) -> Result<bool, GpuError> {
        let Some(&comm) = self.comms.get(i) else {
            return Err(GpuError::Nccl(format!(
                "rank {}: {what}: no communicator {i}",
                self.rank(i)
            )));
        };
        let mut st = sys::ncclResult_t::ncclInProgress;
        // SAFETY: `comm` is live (see `Nccl`); `st` receives its state.
        let rc = unsafe { sys::ncclCommGetAsyncError(comm, &mut st) };
        let state = if rc != sys::ncclResult_t::ncclSuccess {
            rc
        } else {
            st
        };
        match state {
            sys::ncclResult_t::ncclSuccess => Ok(true),
            sys::ncclResult_t::ncclInProgress => Ok(false),
            e => Err(nccl_err(what, self.rank(i), e, comm)),
        }
    }

    /// `ncclCommAbort` raises the abort flag at once (NCCL's kernels and proxy threads see it
    /// and quit) and then joins NCCL's own threads; that join runs on a helper thread and is
    /// waited for at most [`ABORT_WAIT`], so a set-up thread stuck inside NCCL cannot hang the
    /// caller (past the bound the helper is left to finish on its own).
    fn abort_all(&mut self) {
        let taken = std::mem::take(&mut self.comms);
        let comms = Handles(taken.clone());
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
            Handles(taken).abort_all();
        }
    }

    fn destroy_all(&mut self) {
        for c in std::mem::take(&mut self.comms) {
            if !c.is_null() {
                // SAFETY: `c` is live (see `Nccl`) and taken out of the list; the owner
                // synchronised all work (or released through [`Comms::release`], which aborts
                // when it could not). Destroy is blocking in NCCL also for non-blocking
                // communicators.
                let _ = unsafe { sys::ncclCommDestroy(c) };
            }
        }
    }
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
        let net = Nccl {
            comms,
            ranks: (0..n).collect(),
        };
        let mut c = Guarded::new(net, SETUP_FLOOR);
        if rc != sys::ncclResult_t::ncclSuccess {
            let e = nccl_err("ncclCommInitAll", 0, rc, std::ptr::null_mut());
            c.abort(&e);
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
        let net = Nccl {
            comms: if comm.is_null() { vec![] } else { vec![comm] },
            ranks: vec![rank],
        };
        let mut c = Guarded::new(net, setup_timeout(timeout));
        match rc {
            sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
                if !comm.is_null() =>
            {
                c.wait_ready(0, "ncclCommInitRankConfig (communicator set-up)", t0)?;
                Ok(c)
            }
            _ => {
                let e = nccl_err("ncclCommInitRankConfig", rank, rc, comm);
                c.abort(&e);
                Err(e)
            }
        }
    }

    /// Frees the communicators before the streams and memory they use: waits for `streams`
    /// (each with its context) at most `timeout`, then destroys the communicators when the
    /// owner is `healthy` and every stream finished cleanly, and aborts them otherwise
    /// ([`Guarded::release_with`] decides).
    pub fn release(
        self,
        streams: &[(std::sync::Arc<cudarc::driver::CudaContext>, CUstream)],
        timeout: Duration,
        healthy: bool,
    ) {
        self.release_with(healthy, || {
            crate::runtime::streams::drain_streams(streams, timeout)
                == crate::runtime::streams::Drain::Idle
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn setup_bound_has_a_floor_and_saturates() {
        assert_eq!(setup_timeout(Duration::from_millis(1)), SETUP_FLOOR);
        assert_eq!(setup_timeout(Duration::MAX), Duration::MAX);
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
