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

mod device;
pub mod device_api;
mod device_io;
mod driver;
mod error_word;
mod footprint;
mod group;
mod harness;
mod launch;
mod layout;
mod modules;
pub mod nccl;
mod options;
mod process;
mod profile;
mod shrink;
mod streams;

pub use device::{probe, probe_devices};
pub use device_api::{CombineHook, DeviceHandle, DispatchHook, RankEp};
pub use device_io::{
    CombineIn, CombineOpts, DeviceDispatchOut, DispatchIn, DispatchOutSizes, Tokens,
};
/// The path a call runs (ep-reference's: the CPU backend runs the same two).
pub use ep_reference::Path;
pub use footprint::{footprint, hint_bytes, ALLOC_GRANULE};
pub use group::GpuGroup;
pub use layout::{
    all_peers, bytes_per_rank, bytes_per_rank_with, check_ranks, entry_bytes, pe_entry_bytes,
    smem_bytes, PeerMask, Variant, MAX_RANKS, NARROW_RANKS, NTHREADS, SMEM_LIMIT_SM90,
};
pub use options::{Buffers, GpuOptions, NcclSizes, Transport};
pub use process::{PeerPlan, ProcessRank};
pub use profile::PROF_SLOTS;
