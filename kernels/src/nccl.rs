//! The NCCL side of the NCCL transport (cudarc's `nccl-02028` bindings, loaded at run time): one
//! communicator per GPU, grouped point-to-point sends and receives on the group's streams. Every
//! call here needs libnccl; [`nccl_present`] says whether it is there, so nothing panics on a
//! machine without it.

use crate::GpuError;
use cudarc::driver::sys::CUstream;
use cudarc::nccl::{result, sys};
use std::ffi::c_void;

/// Whether libnccl can be loaded. Never panics.
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen libnccl and reports whether that worked.
    unsafe { sys::is_culib_present() }
}

fn nccl<T>(what: &str, r: Result<T, result::NcclError>) -> Result<(), GpuError> {
    r.map(|_| ())
        .map_err(|e| GpuError::Nccl(format!("{what}: {e:?}")))
}

/// The bytes of an NCCL unique id (what rank 0 hands to the others through the rendezvous).
pub fn unique_id() -> Result<Vec<u8>, GpuError> {
    if !nccl_present() {
        return Err(GpuError::NoDevice(
            "no NCCL (libnccl.so.2 not found)".into(),
        ));
    }
    let id =
        result::get_uniqueid().map_err(|e| GpuError::Nccl(format!("ncclGetUniqueId: {e:?}")))?;
    Ok(id.internal.iter().map(|&c| c as u8).collect())
}

/// Communicators, one per local GPU (index = the group's device index).
pub(crate) struct Comms {
    pub comms: Vec<sys::ncclComm_t>,
    aborted: bool,
}

impl Comms {
    /// One process, every GPU of the group: `ncclCommInitAll` over ordinals 0..n (rank = ordinal).
    /// The caller has bound a context on each device already.
    pub fn init_all(n: usize) -> Result<Comms, GpuError> {
        if !nccl_present() {
            return Err(GpuError::NoDevice(
                "no NCCL (libnccl.so.2 not found)".into(),
            ));
        }
        let mut comms = vec![std::ptr::null_mut(); n];
        let devs: Vec<i32> = (0..n as i32).collect();
        // SAFETY: `comms` has room for n communicators, `devs` lists n valid ordinals.
        nccl("ncclCommInitAll", unsafe {
            result::comm_init_all(comms.as_mut_ptr(), n as i32, devs.as_ptr())
        })?;
        Ok(Comms {
            comms,
            aborted: false,
        })
    }

    /// One rank of `nranks` (one process per GPU), from rank 0's unique id.
    pub fn init_rank(nranks: usize, rank: usize, id: &[u8]) -> Result<Comms, GpuError> {
        if !nccl_present() {
            return Err(GpuError::NoDevice(
                "no NCCL (libnccl.so.2 not found)".into(),
            ));
        }
        let mut uid = sys::ncclUniqueId { internal: [0; 128] };
        if id.len() != uid.internal.len() {
            return Err(GpuError::Nccl(format!(
                "unique id of {} bytes, want 128",
                id.len()
            )));
        }
        for (d, &b) in uid.internal.iter_mut().zip(id) {
            *d = b as _;
        }
        let mut comm = std::ptr::null_mut();
        // SAFETY: `comm` receives the communicator; the id came from ncclGetUniqueId on rank 0.
        nccl("ncclCommInitRank", unsafe {
            result::comm_init_rank(&mut comm, nranks as i32, uid, rank as i32)
        })?;
        Ok(Comms {
            comms: vec![comm],
            aborted: false,
        })
    }

    /// After a timed-out wait: abort every communicator (unblocks and frees its kernels).
    pub fn abort(&mut self) {
        if !self.aborted {
            for &c in &self.comms {
                // SAFETY: `c` is a live communicator of this object; not used again after abort.
                let _ = unsafe { result::comm_abort(c) };
            }
            self.aborted = true;
        }
    }
}

impl Drop for Comms {
    fn drop(&mut self) {
        if !self.aborted {
            for &c in &self.comms {
                // SAFETY: all work was synchronised by the owner; `c` is not used again.
                let _ = unsafe { result::comm_destroy(c) };
            }
        }
    }
}

/// One point-to-point operation of a group.
pub(crate) enum P2p {
    Send { buf: u64, bytes: usize, peer: usize },
    Recv { buf: u64, bytes: usize, peer: usize },
}

/// Enqueues `ops[i]` on (comms[i], streams[i]) inside one ncclGroupStart/End. Zero-byte
/// operations are left out (both sides know the same sizes, so they leave out the same pairs).
pub(crate) fn grouped(
    comms: &Comms,
    streams: &[CUstream],
    ops: &[Vec<P2p>],
) -> Result<(), GpuError> {
    nccl("ncclGroupStart", result::group_start())?;
    let mut res = Ok(());
    'outer: for (i, list) in ops.iter().enumerate() {
        let (comm, stream) = (comms.comms[i], streams[i] as sys::cudaStream_t);
        for op in list {
            // SAFETY: every buffer is a live device allocation of at least `bytes` bytes on the
            // communicator's device; the stream belongs to that device's context.
            let r = unsafe {
                match *op {
                    P2p::Send { bytes: 0, .. } | P2p::Recv { bytes: 0, .. } => continue,
                    P2p::Send { buf, bytes, peer } => result::send(
                        buf as *const c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        peer as i32,
                        comm,
                        stream,
                    ),
                    P2p::Recv { buf, bytes, peer } => result::recv(
                        buf as *mut c_void,
                        bytes,
                        sys::ncclDataType_t::ncclUint8,
                        peer as i32,
                        comm,
                        stream,
                    ),
                }
            };
            if let Err(e) = r {
                res = Err(GpuError::Nccl(format!("ncclSend/ncclRecv: {e:?}")));
                break 'outer;
            }
        }
    }
    let end = nccl("ncclGroupEnd", result::group_end());
    res.and(end)
}
