//! Forming a process-mode group: this rank's allocation (ep-kernels' [`ProcessRank`]), the
//! handshake round that carries its IPC handle (or the NCCL unique id) with its record, the plan
//! of which peers share its node, then the group.

use crate::error::GroupError;
use crate::handshake::exchange::{exchange_records, AllGather};
use crate::handshake::record::Hello;
use crate::node::{node_id, NodeId};
use crate::topology::plan::plan;
use ep_kernels::runtime::{GpuGroup, GpuOptions, ProcessRank};
use ep_reference::Config;

/// Process mode: this process runs rank `rank` of `cfg.num_ranks` on GPU `ordinal` (was
/// `GpuGroup::new_process`). Every rank allocates its buffers in one cuMemAlloc allocation;
/// `all_gather` (e.g. `ep_launch::Rendezvous::all_gather`) exchanges a blob per rank: its
/// handshake record (with its node id, [`crate::topology`]), the allocation's CUDA IPC handle
/// and, from rank 0, the NCCL unique id. Transport::Auto: every peer is reached through CUDA
/// IPC and the NVLink kernels run between processes exactly as between ranks of one process
/// (one node only). Transport::Nccl: every peer, self included, through NCCL; no IPC.
/// Transport::TwoTier: the peers of this rank's node through CUDA IPC (only their handles are
/// opened), the others through NCCL ([`crate::topology::plan()`]).
/// All ranks must call it with the same config and options.
pub fn new_process(
    cfg: &Config,
    opts: GpuOptions,
    rank: usize,
    ordinal: usize,
    all_gather: &mut AllGather<'_>,
) -> Result<GpuGroup, GroupError> {
    ProcessRank::check(cfg, rank, ordinal)?;
    let node = node_id()?;
    let me = ProcessRank::new(cfg, opts, rank, ordinal)?;
    // Versions, config, transport and allocation size travel with the
    // handle; every peer is checked before anything is mapped.
    let hello = Hello::new(cfg, &opts, rank, me.alloc_bytes(), node);
    let recs = exchange_records(all_gather, &hello, me.payload())?;
    let nodes: Vec<NodeId> = recs.iter().map(|(h, _)| h.node.clone()).collect();
    let all: Vec<Vec<u8>> = recs.into_iter().map(|(_, p)| p).collect();
    // Which peers share this node (IPC) and which do not (NCCL).
    let plan = plan(opts.transport, &nodes, rank)?;
    Ok(me.join(&all, &plan)?)
}
