//! # ep-group
//!
//! Process groups on the GPU library (ep-kernels): one rank per process, torchrun style.
//!
//! - [`new_process`] forms a process-mode group: this rank's allocation (ep-kernels'
//!   `ProcessRank`), one all-gather round through a caller-supplied exchange ([`AllGather`],
//!   e.g. `ep_launch::Rendezvous::all_gather`) carrying its CUDA IPC handle or rank 0's NCCL
//!   unique id behind its [`handshake`] record, then which peers share its node
//!   ([`topology`]: CUDA IPC to those, NCCL to the others) and the group;
//! - [`handshake`]: nothing a peer says about its memory is trusted unchecked (versions,
//!   kernel fingerprint, config, transport, allocation size, node), before anything is mapped;
//! - [`topology`]: the plan of every peer's transport from the ranks' node ids, and emulated
//!   nodes on one machine;
//! - [`node`]: the node id of a process (`EP_NODE_ID`, `GROUP_RANK`, the hostname), and
//!   [`wire`]: the handshake record's wire format; both below the handshake, the topology and
//!   [`GroupError`] (which wraps their errors), so that no folder imports another in a circle;
//! - `mp` (feature `testing`, off by default): the rank's side of a launched test or benchmark
//!   job (rendezvous, group, random inputs checked against the oracle, fault injection), what
//!   each rank of `ep-bench --nprocs` and of the process-mode tests runs (ep-bench times its
//!   calls in between);
//! - [`GroupError`]: the GPU library's [`ep_kernels::GpuError`] and what process mode adds.

mod error;
mod form;
pub mod handshake;
#[cfg(feature = "testing")]
pub mod mp;
pub mod node;
pub mod topology;
pub mod wire;

pub use error::GroupError;
pub use form::new_process;
pub use handshake::AllGather;
