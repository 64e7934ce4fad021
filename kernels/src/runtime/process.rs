//! Process mode, the GPU library's half: one rank per process. Forming such a group takes two
//! steps around an exchange that the process-group layer (ep-group) drives:
//!
//! 1. [`ProcessRank::new`]: this rank's one `cuMemAlloc` allocation on its GPU and what it
//!    publishes: the allocation's CUDA IPC handle and, from rank 0, the NCCL unique id
//!    ([`ProcessRank::payload`]), with the allocation's size ([`ProcessRank::alloc_bytes`]);
//! 2. the exchange (ep-group: the handshake record of every rank travels with the payload and
//!    is checked before anything is mapped; every rank's node decides the [`PeerPlan`]);
//! 3. [`ProcessRank::join`]: every peer's payload, in rank order, and this rank's plan: the
//!    peers' handles are opened (each mapping checked against this rank's layout of it), the
//!    NCCL communicator formed where the plan needs one, and the address table uploaded.
//!
//! The kernels are those of a single-process group.

use crate::error::{cuda, GpuError};
use crate::runtime::device::{probe_devices, Dev};
use crate::runtime::driver;
use crate::runtime::footprint::{footprint, plan_sizes};
use crate::runtime::group::{check_shrink, kparams, link, next_group_id, upload_table};
use crate::runtime::group::{GpuGroup, IpcMappings};
use crate::runtime::layout::{
    carve_rank, check_ranks, smem_bytes, total_bytes, PeerMask, RankPtrs, NUM_BUFFERS,
};
use crate::runtime::options::{GpuOptions, Transport};
use cudarc::driver::{result, sys};
use ep_reference::{CombineFormat, Config, Error};

/// How one rank reaches its peers (the process-group layer computes it from every rank's node).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerPlan {
    /// Peer d is in the set: reached through NCCL staging (the kernels' `nccl_mask`).
    pub nccl_mask: PeerMask,
    /// Peers whose buffers this rank maps through CUDA IPC (this rank excluded), ascending.
    pub ipc_peers: Vec<usize>,
    /// Distinct nodes in the group.
    pub nodes: usize,
}

impl PeerPlan {
    /// Whether this rank needs NCCL communicators.
    pub fn uses_nccl(&self) -> bool {
        !self.nccl_mask.is_empty()
    }

    /// Peers reached through NCCL, ascending.
    pub fn nccl_peers(&self) -> Vec<usize> {
        self.nccl_mask.ranks()
    }
}

/// Process mode: this process's rank, allocated, before the exchange (see the module docs).
/// Dropping it frees the allocation.
pub struct ProcessRank {
    cfg: Config,
    opts: GpuOptions,
    rank: usize,
    dev: Dev,
    base: sys::CUdeviceptr,
    sizes: [usize; NUM_BUFFERS],
    total: usize,
    smem: usize,
    bpr: usize,
    payload: Vec<u8>,
}

impl ProcessRank {
    /// The checks that come before anything is opened: the config, a driver with GPU `ordinal`,
    /// and the rank within the group's (at most [`MAX_RANKS`](crate::runtime::MAX_RANKS)) ranks. [`ProcessRank::new`] makes them too;
    /// the process-group layer makes them first, so that they are reported before anything it
    /// reads itself (the node id).
    pub fn check(cfg: &Config, rank: usize, ordinal: usize) -> Result<(), GpuError> {
        cfg.validate()?;
        let r = cfg.num_ranks;
        check_ranks(r)?;
        if rank >= r {
            return Err(Error::RankOutOfRange { rank, ranks: r }.into());
        }
        probe_devices(ordinal + 1).map_err(GpuError::NoDevice)?;
        Ok(())
    }

    /// This process runs rank `rank` of `cfg.num_ranks` on GPU `ordinal`: allocates its buffers
    /// in one cuMemAlloc allocation (zeroed before its handle leaves this process) and prepares
    /// its payload: the allocation's CUDA IPC handle (64 bytes; zeros under `Transport::Nccl`,
    /// which maps nothing) and, from rank 0, the NCCL unique id (always under `Transport::Nccl`;
    /// under `Transport::TwoTier` when libnccl is here). Whenever some peer may be reached
    /// through NCCL (every transport but `Auto`), the allocation holds the NCCL staging.
    pub fn new(
        cfg: &Config,
        opts: GpuOptions,
        rank: usize,
        ordinal: usize,
    ) -> Result<ProcessRank, GpuError> {
        ProcessRank::check(cfg, rank, ordinal)?;
        let nccl = opts.transport == Transport::Nccl;
        // NCCL staging memory: whenever some peer may be reached through NCCL. Under TwoTier
        // that is known after the exchange, and the allocation (whose size the handshake
        // checks) comes before it: a two-tier rank always has the staging.
        let staging = opts.transport != Transport::Auto;
        let mut dev = Dev::new(ordinal, rank, 1, cfg.num_ranks)?;
        // The plain build under Transport::Auto without shrink mode: every peer through CUDA
        // IPC (topology's plan), none through NCCL.
        dev.load_kernels(opts.transport == Transport::Auto && !opts.enable_shrink)?;
        let smem = smem_bytes(cfg);
        let bpr = opts.blocks_per_rank.unwrap_or(dev.sms).max(1);
        dev.check_residency(smem, 1, bpr)?;
        let need = footprint(cfg, &opts, staging)?.saturating_add(1 << 20);
        let (free, _) = cuda("cuMemGetInfo", result::mem_get_info())?;
        if need > free {
            return Err(Error::OutOfMemory {
                needed: need as u64,
                available: free as u64,
            }
            .into());
        }
        let sizes = plan_sizes(cfg, staging, opts.buffers)?;
        let total = total_bytes(&sizes)?;
        let base = dev.alloc(total)?; // zeroed before its handle leaves this process
        let mut payload = vec![0u8; 64];
        if !nccl {
            // `base` is a cuMemAlloc allocation of the bound context.
            let h = cuda("cuIpcGetMemHandle", driver::ipc_handle(base))?;
            for (d, &b) in payload.iter_mut().zip(h.reserved.iter()) {
                *d = b as u8;
            }
        }
        // Rank 0's NCCL unique id: always under Nccl; under TwoTier when libnccl is here (whether
        // any rank needs it is known after the exchange; a missing id is reported then).
        if rank == 0 && (nccl || (staging && crate::runtime::nccl::nccl_present())) {
            payload.extend(crate::runtime::nccl::unique_id()?);
        }
        Ok(ProcessRank {
            cfg: *cfg,
            opts,
            rank,
            dev,
            base,
            sizes,
            total,
            smem,
            bpr,
            payload,
        })
    }

    /// Bytes of this rank's one allocation (the buffer its peers map).
    pub fn alloc_bytes(&self) -> usize {
        self.total
    }

    /// What this rank publishes in the exchange (see [`ProcessRank::new`]).
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Forms the group from every rank's payload (`all`, in rank order, as the exchange returned
    /// them) and this rank's `plan`: opens the handles of `plan.ipc_peers` (each mapping must be
    /// at least as large as this rank's layout of the peer's buffer), joins the one NCCL
    /// communicator where the plan reaches a peer through NCCL (non-blocking set-up bounded by
    /// the group's timeout), uploads the address table.
    pub fn join(self, all: &[Vec<u8>], plan: &PeerPlan) -> Result<GpuGroup, GpuError> {
        let ProcessRank {
            cfg,
            opts,
            rank,
            mut dev,
            base,
            sizes,
            total,
            smem,
            bpr,
            ..
        } = self;
        let r = cfg.num_ranks;
        check_shrink(&opts, r, plan.uses_nccl())?;
        if all.len() != r || all.iter().any(|b| b.len() < 64) {
            return Err(GpuError::Process(format!(
                "handle exchange returned {} blobs, want {r} of at least 64 bytes",
                all.len()
            )));
        }
        let mut ptrs = vec![RankPtrs::default(); r];
        ptrs[rank] = carve_rank(base, &sizes);
        let mut ipc_opened = IpcMappings {
            ctx: Some(dev.ctx.clone()),
            ptrs: Vec::new(),
        };
        for &peer in &plan.ipc_peers {
            let b = &all[peer];
            let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
            for (d, &x) in h.reserved.iter_mut().zip(&b[..64]) {
                *d = x as _;
            }
            // `h` is the handle rank `peer` exported for its live allocation; the mapping is
            // closed by `check_mapping` on a mismatch, else by `ipc_opened`'s Drop.
            let p = cuda(
                &format!("cuIpcOpenMemHandle (rank {rank}, peer {peer})"),
                driver::ipc_open(h),
            )?;
            // The mapping must be at least as large as our layout of the peer's buffer (on
            // failure check_mapping closes `p` itself; the guard closes the earlier ones).
            check_mapping(rank, peer, p, total)?;
            ipc_opened.ptrs.push(p);
            ptrs[peer] = carve_rank(p, &sizes);
        }
        let comms = if plan.uses_nccl() {
            if all[0].len() < 64 + 128 {
                return Err(GpuError::NoDevice(format!(
                    "rank {rank}: ranks on {} nodes need NCCL between nodes, and rank 0 sent no \
                     NCCL unique id (no libnccl there)",
                    plan.nodes
                )));
            }
            // Non-blocking set-up, bounded by the group's timeout. Every rank
            // of the group joins the one communicator (NCCL rank = group rank); only the pairs
            // in the mask ever connect (NCCL connects a pair on its first send/receive).
            let t = std::time::Duration::from_nanos(opts.timeout_ns);
            Some(crate::runtime::nccl::Comms::init_rank(
                r,
                rank,
                &all[0][64..],
                t,
            )?)
        } else {
            None
        };
        upload_table(&mut dev, &ptrs)?;
        let params = kparams(&cfg, &opts, bpr, rank, 1, true)?;
        let masks = vec![plan.nccl_mask];
        let nccl = comms.map(|c| link(c, &cfg, &params, std::slice::from_ref(&dev), &masks, &ptrs));
        Ok(GpuGroup {
            id: next_group_id(),
            cfg,
            devs: vec![dev],
            ptrs,
            params,
            blocks_per_rank: bpr,
            smem,
            n_tokens: vec![0; r],
            topk: vec![Vec::new(); r],
            last_dispatch: None,
            calls: [0; 4],
            broken: None,
            masks,
            nccl,
            own: Some(rank),
            ipc_opened,
            last_op: None,
            nccl_sizes: opts.nccl_sizes,
            buffers: opts.buffers,
            combine_format: CombineFormat::Bf16,
        })
    }
}

/// After rank `rank` opened `peer`'s IPC handle at `p`: the mapped allocation must start at `p`
/// and hold at least `need` bytes (this rank's layout of the peer's buffers). On failure the
/// mapping is closed here and the error names both ranks and both sizes.
fn check_mapping(
    rank: usize,
    peer: usize,
    p: sys::CUdeviceptr,
    need: usize,
) -> Result<(), GpuError> {
    // `p` is a live mapping opened by cuIpcOpenMemHandle on the bound context.
    let err = match driver::address_range(p) {
        Err(e) => Some(GpuError::Cuda(format!(
            "cuMemGetAddressRange on rank {peer}'s mapped buffer (rank {rank}): {:?}",
            e.0
        ))),
        Ok((base, size)) if base != p || size < need => Some(GpuError::PeerMismatch {
            field: "mapped allocation bytes",
            ours: format!("{need} bytes at the handle's address"),
            theirs: format!("{size} bytes, {} bytes in", p.wrapping_sub(base)),
            rank,
            peer,
        }),
        Ok(_) => None,
    };
    match err {
        None => Ok(()),
        Some(e) => {
            // SAFETY: `p` was opened with cuIpcOpenMemHandle on the bound context, nothing was
            // queued on it, and the caller drops it on this error (closed once, here).
            let _ = unsafe { driver::ipc_close(p) };
            Err(e)
        }
    }
}
