//! Which ranks of a process-mode group share a node, and so which peers a rank reaches through
//! CUDA IPC (NVLink) and which through NCCL.
//!
//! **The node id** of a process is, first found:
//! 1. `EP_NODE_ID`: any 1..=64 printable ASCII bytes without spaces. Set it to group ranks by
//!    hand (e.g. to emulate several nodes on one machine, or where hostnames are not unique);
//! 2. torchrun's `GROUP_RANK`: a decimal integer, the node's index in the job;
//! 3. the hostname (`/proc/sys/kernel/hostname`).
//!
//! A variable that is set but invalid (empty, too long, spaces or control bytes, a `GROUP_RANK`
//! that is no integer) is a [`NodeIdError`](crate::node::NodeIdError) naming the variable and
//! the value, never skipped in favour of the next source. Every rank sends its node id, and
//! which of the three it came from, in its handshake record ([`crate::handshake`]); ranks whose
//! ids come from different sources are refused there (a job where some nodes set `EP_NODE_ID`
//! and others do not), so ids of different kinds are never compared.
//!
//! **The plan** ([`plan()`]) is a pure function of the transport, every rank's node id and this
//! rank: which peers' buffers it maps through CUDA IPC and which peers the kernels reach through
//! NCCL staging (the kernels' `nccl_mask`, bit d = peer d).
//! - `Transport::Auto`: one node only, every peer through IPC; ranks on another node are refused
//!   with a [`GroupError::PeerMismatch`](crate::GroupError::PeerMismatch) naming both nodes (IPC cannot reach another machine).
//! - `Transport::Nccl`: every rank, this one included, through NCCL; no IPC.
//! - `Transport::TwoTier`: peers of this rank's node through IPC, the others through NCCL (on one
//!   node that is `Auto`).
//!
//! **One machine as several nodes** ([`emulation_env`]): a launcher gives rank i of N the node
//! `i / (N / nodes)` in `EP_NODE_ID`, and `NCCL_HOSTID` set per node. NCCL hashes the hostname
//! (and boot id) into a host hash unless `NCCL_HOSTID` replaces that string (`getHostHash` in
//! NCCL's `src/misc/utils.cc`); ranks with equal host hashes and one GPU are refused ("Duplicate
//! GPU detected", `src/init.cc`), ranks with different host hashes count as different nodes and
//! talk over NCCL's network transport (sockets here), as across real nodes.
//!
//! - [`crate::node`] (one floor below): this process's node id and where it came from;
//! - [`plan`](mod@plan): which peers a rank reaches through CUDA IPC and which through NCCL;
//! - [`emulate`]: several nodes on one machine.

pub mod emulate;
pub mod plan;

pub use emulate::{emulated_node, emulation_env, emulation_envs};
pub use plan::plan;
