//! The GPU runtime: contexts, peer access, communication buffers, the rank-address table, and
//! the launches of both paths.
//!
//! Ranks are spread over `num_gpus` devices (R / G consecutive ranks per device). All ranks of one
//! device run in ONE launch (`blocks_per_rank` blocks each, at most one block per multiprocessor,
//! so every block is resident at once and ranks may wait for one another). Every buffer a peer
//! writes comes from `cuMemAlloc` (not cudarc's stream-ordered pool, which peers cannot reach).
//! Signals carry the call's epoch (kept on the device, advanced by the kernels themselves), so a
//! call never takes an earlier call's signal and no host value changes between calls: a call is a
//! single kernel launch per device with no host synchronisation, and can be captured in a graph.
//! Every wait is bounded by `%globaltimer`; a wait that runs out writes (rank, peer, phase, call)
//! to a host-visible error word and the kernel exits; the host turns it into
//! [`ep_reference::Error::Timeout`].

use crate::compile::{self, Family};
use crate::GpuError;
use cudarc::driver::{result, sys, CudaContext};
use ep_reference::{
    input::{check_combine_inputs, check_dispatch_inputs},
    Config, DispatchOutput, Error, Mode, Op, Phase, RecvScales, RecvX, Side,
};
use half::bf16;
use std::ffi::c_void;
use std::sync::Arc;

mod device;
pub mod device_api;
mod errors;
mod group;
mod harness;
mod launch;
mod layout;
mod mask;
mod profile;

pub use device::probe_devices;
pub(crate) use device::{cuda, Dev, HostMirror};
pub use device_api::{
    CombineHook, CombineIn, DeviceDispatchOut, DeviceHandle, DispatchHook, DispatchIn,
    DispatchOutSizes, RankEp, Tokens,
};
pub(crate) use layout::*;
pub use layout::{bytes_per_rank, bytes_per_rank_with, entry_bytes, pe_entry_bytes, NTHREADS};

/// Which of the two transports to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Path {
    /// One message per selection, one signal per (expert, source).
    PerExpert,
    /// One deduplicated batch and one signal per (source, destination).
    Batched,
}

impl Path {
    pub fn name(self) -> &'static str {
        match self {
            Path::PerExpert => "per-expert",
            Path::Batched => "batched",
        }
    }
}

/// How the batched path reaches a peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Transport {
    /// NVLink (peer access, or CUDA IPC between processes) for every peer that shares it, NCCL
    /// for the others (one rank per GPU needed there).
    #[default]
    Auto,
    /// NCCL for every peer, this rank itself included (one rank per GPU: NCCL refuses two ranks
    /// on one device). Both paths: batched (one payload message per peer) and per-expert (one
    /// message per (peer, local expert) batch, needs [`NcclSizes::Exact`]).
    Nccl,
    /// Process mode across nodes: CUDA IPC (NVLink) to the peers of this rank's node, NCCL to
    /// the others; the node of every rank comes from the handshake (`crate::topology`). On one
    /// node (and in a single-process group) it is `Auto`.
    TwoTier,
}

/// How the NCCL transport sizes its payload messages (peers reached through NCCL only).
///
/// - `Exact`: dispatch first exchanges the batch headers, the host waits for them (a bounded
///   poll of the streams), reads the counts, checks them (`check_header`) and sends exactly the
///   rows there are; combine reuses those counts. A host round trip per dispatch: the host
///   blocks mid-call to read device data, so the call is neither ordered on a caller's stream
///   nor graph-capturable, and the device API refuses it. Both paths. The default: it sends the
///   fewest bytes (capacity doubles combine's at the standard setting), and on NCCL's network
///   transport, the one this transport exists for, it wins the round trip by 2.1x
///   (BENCHMARKS.md, "The network transport"; on NCCL's NVLink transport capacity wins).
/// - `Capacity`: headers and payloads go in ONE NCCL group with no host synchronisation (the
///   send headers are poisoned first, so a rank stopped by bad input sends a count its peers
///   reject on the device instead of an earlier call's header):
///   dispatch sends the header plus the full T entries per peer, combine T * min(K, L) rows per
///   peer (the most selections one source can have on one destination: at most T tokens, each
///   selects at most min(K, L) of its L experts); the unpack kernels read the real counts from
///   the received header (bounded on the device). Stream-ordered and, as NCCL point-to-point
///   calls may be captured into CUDA graphs, capturable. Batched path only: per-expert would
///   have to send L * T entries per peer (every local expert's full region), so it is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NcclSizes {
    /// Header round trip through the host, then exact payload sizes.
    #[default]
    Exact,
    /// Header + fixed capacity in one group, no host round trip.
    Capacity,
}

impl NcclSizes {
    pub fn name(self) -> &'static str {
        match self {
            NcclSizes::Exact => "exact",
            NcclSizes::Capacity => "capacity",
        }
    }
}

/// Process mode's exchange: every rank's blob, in rank order (e.g. `Rendezvous::all_gather`).
pub type AllGather<'a> = dyn FnMut(&[u8]) -> Result<Vec<Vec<u8>>, String> + 'a;

/// Options of a [`GpuGroup`].
#[derive(Debug, Clone, Copy)]
pub struct GpuOptions {
    /// Devices to spread the ranks over (R % num_gpus == 0).
    pub num_gpus: usize,
    /// Bound of every wait, in nanoseconds.
    pub timeout_ns: u64,
    /// Blocks per rank; None: the multiprocessors of a device divided among its ranks.
    pub blocks_per_rank: Option<usize>,
    /// Batched combine: a source reads the rows of owners on its own GPU in place instead of
    /// receiving them as a put (signals unchanged). Peers on other GPUs always get the put.
    pub zero_copy_local: bool,
    /// Which transport the batched path uses per peer pair.
    pub transport: Transport,
    /// NCCL transport: exact sizes after a host round trip, or a fixed capacity without one.
    pub nccl_sizes: NcclSizes,
    /// Trap (end the CUDA context, as DeepEP's kernels do) right after recording an error,
    /// instead of leaving the kernel cleanly and raising at the next call. The error is still
    /// named: its host mirror survives the trap. Off by default (a trap poisons the context).
    pub trap_on_error: bool,
    /// Shrink mode (DeepEP's `enable_shrink`): a wait for a peer that runs out masks that peer
    /// on the waiting rank instead of failing the call; a masked peer is neither sent to nor
    /// waited for, and the selections of its experts count as -1 (docs/contract.md, "Masked
    /// ranks"). The mask: [`GpuGroup::mask_status`], [`GpuGroup::update_mask`],
    /// [`GpuGroup::clean_mask`]. CUDA IPC and peer access only (not over NCCL, whose receives
    /// the kernels cannot bound), at most 32 ranks.
    pub enable_shrink: bool,
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            num_gpus: 1,
            timeout_ns: 2_000_000_000,
            blocks_per_rank: None,
            zero_copy_local: true,
            transport: Transport::Auto,
            nccl_sizes: NcclSizes::default(),
            trap_on_error: false,
            enable_shrink: false,
        }
    }
}

/// R ranks on one or more GPUs: the communication buffers, and dispatch/combine on both paths.
pub struct GpuGroup {
    /// Unique per group in this process (device-API handles name their group).
    pub(crate) id: u64,
    pub(crate) cfg: Config,
    pub(crate) devs: Vec<Dev>,
    pub(crate) ptrs: Vec<RankPtrs>,
    pub(crate) params: KParams,
    pub(crate) blocks_per_rank: usize,
    pub(crate) smem: usize,
    pub(crate) n_tokens: Vec<usize>,
    pub(crate) topk: Vec<Vec<i64>>,
    pub(crate) last_dispatch: Option<Path>,
    pub(crate) calls: [u64; 4],
    pub(crate) broken: Option<GpuError>,
    /// Per device: bit d set when its rank reaches peer d through NCCL.
    pub(crate) masks: Vec<u32>,
    /// The NCCL communicators (one per device) when any mask is nonzero.
    pub(crate) comms: Option<crate::nccl::Comms>,
    /// Per device, from the last dispatch's headers: selections sent to each peer (rows that
    /// come back in combine) and received from each peer (rows that go back).
    pub(crate) sels: Vec<(Vec<usize>, Vec<usize>)>,
    /// Process mode: the one rank this process runs (its table holds the peers' IPC addresses).
    pub(crate) own: Option<usize>,
    /// Peer allocations opened through CUDA IPC (closed on drop).
    /// Held for its Drop (closes the mappings).
    #[allow(dead_code)]
    pub(crate) ipc_opened: IpcMappings,
    pub(crate) last_op: Option<Op>,
    /// NCCL sizing mode and the last exact dispatch's headers (per device).
    pub(crate) nx: NcclState,
}

/// The NCCL transport's host state: the sizing mode, and per device the headers of the last
/// exact-size dispatch (sent, received: R * (2 + L) words each), which size the per-expert
/// combine's messages.
#[derive(Debug, Clone, Default)]
pub(crate) struct NcclState {
    pub(crate) sizes: NcclSizes,
    /// The sizing of the last dispatch whose exchange was queued (combine follows it).
    pub(crate) dispatch_sizes: Option<NcclSizes>,
    pub(crate) hdrs: Vec<(Vec<i32>, Vec<i32>)>,
}

impl NcclState {
    pub(crate) fn new(sizes: NcclSizes, devices: usize) -> NcclState {
        NcclState {
            sizes,
            dispatch_sizes: None,
            hdrs: vec![(Vec::new(), Vec::new()); devices],
        }
    }
}

impl Drop for GpuGroup {
    fn drop(&mut self) {
        // [issue 10 item 5] Communicators go before the streams and memory they use: a bounded
        // wait for the streams, then destroy (idle, healthy) or abort (busy, failed).
        let t = std::time::Duration::from_nanos(self.params.timeout_ns);
        if let Some(c) = self.comms.take() {
            c.release(&self.streams(), t, self.broken.is_none());
        }
        // Then a bounded wait for every stream: our kernels end within their own wait bound, so
        // twice the group's bound (at least 1 s) suffices for anything that can finish. A stream
        // still busy after that waits on a peer that stopped (an NCCL receive the abort did not
        // end: run 12's NCCL stall trial hung here, in an unbounded synchronize). Freeing memory
        // under it would block as well (cuMemFree synchronises), so the devices and the peers'
        // mappings are then leaked, not freed: the caller gets to report its error instead of
        // hanging, and the process's exit reclaims them.
        let bound = t.saturating_mul(2).max(std::time::Duration::from_secs(1));
        if drain_streams(&self.streams(), bound) == Drain::Busy {
            std::mem::forget(std::mem::take(&mut self.devs));
            std::mem::forget(std::mem::replace(
                &mut self.ipc_opened,
                IpcMappings {
                    ctx: None,
                    ptrs: Vec::new(),
                },
            ));
        }
        // Otherwise the fields: the devices synchronise (idle now) and free their allocations,
        // `ipc_opened` closes the peers' mappings (its own Drop, which also runs when
        // `new_process` fails half-way).
    }
}

/// How a bounded wait for a set of streams ended ([`drain_streams`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Drain {
    /// Every stream finished its work.
    Idle,
    /// Some stream was still running at the bound.
    Busy,
    /// None was running, but some context could not be bound or some stream reported an
    /// error (a faulted context): nothing more will run there.
    Failed,
}

/// Polls every stream (each with its context) until it finishes, at most `bound` in all. Every
/// stream is looked at, so a failed one never hides a busy one after it.
pub(crate) fn drain_streams(
    streams: &[(Arc<CudaContext>, sys::CUstream)],
    bound: std::time::Duration,
) -> Drain {
    let t0 = std::time::Instant::now();
    let mut failed = false;
    for (ctx, s) in streams {
        if ctx.bind_to_thread().is_err() {
            failed = true;
            continue;
        }
        loop {
            // SAFETY: `s` is a live stream of the bound context.
            match unsafe { sys::cuStreamQuery(*s) } {
                sys::CUresult::CUDA_SUCCESS => break,
                sys::CUresult::CUDA_ERROR_NOT_READY if t0.elapsed() < bound => {
                    std::thread::sleep(std::time::Duration::from_micros(50))
                }
                sys::CUresult::CUDA_ERROR_NOT_READY => return Drain::Busy,
                _ => {
                    failed = true;
                    break;
                }
            }
        }
    }
    if failed {
        Drain::Failed
    } else {
        Drain::Idle
    }
}

/// Peer allocations opened through CUDA IPC, closed on drop (also on an error path of
/// `new_process`, before the group exists).
pub(crate) struct IpcMappings {
    pub(crate) ctx: Option<Arc<CudaContext>>,
    pub(crate) ptrs: Vec<sys::CUdeviceptr>,
}

impl Drop for IpcMappings {
    fn drop(&mut self) {
        if let Some(ctx) = &self.ctx {
            let _ = ctx.bind_to_thread();
            for &p in &self.ptrs {
                // SAFETY: `p` was opened with cuIpcOpenMemHandle on this context; the work that
                // used it is finished (the group's Drop synchronised its streams first).
                let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
            }
        }
    }
}

pub(crate) fn kind(op: Op, path: Path) -> usize {
    match (op, path) {
        (Op::Dispatch, Path::Batched) => 0,
        (Op::Dispatch, Path::PerExpert) => 1,
        (Op::Combine, Path::Batched) => 2,
        (Op::Combine, Path::PerExpert) => 3,
    }
}

impl GpuGroup {
    /// Process mode: this process's rank.
    pub fn own_rank(&self) -> Option<usize> {
        self.own
    }

    pub fn config(&self) -> &Config {
        &self.cfg
    }

    pub fn num_gpus(&self) -> usize {
        self.devs.len()
    }

    pub fn blocks_per_rank(&self) -> usize {
        self.blocks_per_rank
    }

    /// "NVIDIA H200 (sm_90, 132 SMs) x 1".
    pub fn describe_devices(&self) -> String {
        let d = &self.devs[0];
        let name = d.ctx.name().unwrap_or_else(|_| "?".into());
        let (a, b) = d.ctx.compute_capability().unwrap_or((0, 0));
        format!("{name} (sm_{a}{b}, {} SMs) x {}", d.sms, self.devs.len())
    }

    /// Test hook: `Some(r)` makes rank r never signal, in dispatch and in combine (its peers'
    /// waits time out).
    #[doc(hidden)]
    pub fn set_fault_rank(&mut self, rank: Option<usize>) {
        self.params.fault_rank = rank.map(|r| r as i32).unwrap_or(-1);
    }

    /// The NCCL transport's sizing mode (see [`NcclSizes`]).
    pub fn nccl_sizes(&self) -> NcclSizes {
        self.nx.sizes
    }

    /// Changes the NCCL sizing mode for later calls. In process mode every rank must make the
    /// same change before the same call (the two sides of a message must agree on its size):
    /// the handshake compares the modes the ranks start with, a later divergence is not
    /// detected.
    pub fn set_nccl_sizes(&mut self, sizes: NcclSizes) {
        self.nx.sizes = sizes;
    }

    /// Whether the group reaches any peer through NCCL.
    pub fn uses_nccl(&self) -> bool {
        self.comms.is_some()
    }

    /// The bound of every wait.
    pub fn set_timeout_ns(&mut self, ns: u64) {
        self.params.timeout_ns = ns;
    }

    /// What the kernels have recorded so far, without waiting for them: `Ok` while nothing
    /// failed, else the error the next call would raise (naming rank, peer, phase and call for
    /// a timeout). Reads the error words' host mirrors only: no stream is synchronised, so it
    /// may be called while kernels run, e.g. to bound a caller's own wait. Unlike [`check`],
    /// it does not need the calls to have finished, and an error it sees is raised again by
    /// every later call.
    ///
    /// [`check`]: GpuGroup::check
    pub fn poll(&self) -> Result<(), GpuError> {
        self.check_usable()
    }

    /// Refuses a call on a group that failed: an error `check` or `sync` already returned, or
    /// one the kernels recorded since (read from the error words' host mirrors: no stream is
    /// synchronised, so a call enqueued behind a failed one raises at its entry).
    pub(crate) fn check_usable(&self) -> Result<(), GpuError> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        match self.recorded_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    pub(crate) fn dev_of(&self, rank: usize) -> usize {
        if self.own.is_some() {
            return 0;
        }
        rank / (self.cfg.num_ranks / self.devs.len())
    }

    /// Calls launched so far per (op, path): [batched dispatch, per-expert dispatch, batched
    /// combine, per-expert combine].
    pub fn calls(&self) -> [u64; 4] {
        self.calls
    }

    /// The streams and contexts, for event timing (crate-internal).
    pub(crate) fn streams(&self) -> Vec<(Arc<CudaContext>, sys::CUstream)> {
        self.devs
            .iter()
            .map(|d| (d.ctx.clone(), d.stream))
            .collect()
    }
}
