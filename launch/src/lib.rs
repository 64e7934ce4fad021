//! `ep-launch`: the CPU-side foundation for running ep-dispatch as one process per GPU.
//!
//! - [`env`](mod@env): the torchrun-style process configuration (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//!   `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`).
//! - [`rendezvous`]: a small TCP rendezvous with `all_gather`, `broadcast` and `barrier`
//!   of opaque byte blobs: how the NCCL unique id and the CUDA IPC handles of the communication
//!   buffers are exchanged. Every wait is bounded; a dead peer is reported promptly by rank.
//! - [`launcher`]: `spawn_local`, which starts N local ranks of a program (what
//!   `ep-bench --nprocs N` uses), and reports a failing rank.
//! - [`auth`]: the job token (`EP_JOB_TOKEN`) and the HMAC challenge-response that admits only
//!   the job's own ranks to the rendezvous (and proves rank 0 to them).
//! - [`time`]: saturating deadlines (`deadline(now, d)`), so no timeout value can panic.

pub mod auth;
pub mod env;
mod error;
#[cfg(unix)]
mod inherit;
mod job;
#[cfg(unix)]
pub mod launcher;
pub mod rendezvous;
pub mod time;
mod vars;

pub use env::{is_launched_by_ep_launch, is_launched_externally, EnvError, ProcessConfig};
pub use error::Error;
#[cfg(unix)]
pub use launcher::{
    spawn_local, spawn_local_with, ExitHow, Launch, LaunchError, LaunchOptions, LaunchReport,
    RankExit, EXIT_PEER_FAILURE, MAX_NPROCS,
};
pub use rendezvous::{Op, Rendezvous, RendezvousConfig, RendezvousError};
