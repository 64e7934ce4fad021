//! The names of the environment variables a rank reads and a launcher sets, in one place so
//! that callers, launchers and the descriptor hand-over ([`crate::env`], `crate::inherit`) spell
//! them the same way.

pub const RANK: &str = "RANK";
pub const WORLD_SIZE: &str = "WORLD_SIZE";
pub const LOCAL_RANK: &str = "LOCAL_RANK";
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
pub const MASTER_ADDR: &str = "MASTER_ADDR";
pub const MASTER_PORT: &str = "MASTER_PORT";
/// Optional: the port rank 0's rendezvous listens on, when it must differ from `MASTER_PORT`.
pub const EP_RDZV_PORT: &str = "EP_RDZV_PORT";
/// Set by torchrun (torchelastic) in its workers; its agent's store already holds `MASTER_PORT`.
pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// Set by [`spawn_local`](crate::launcher::spawn_local) in its children (value `ep-launch`), so a
/// program can tell this launcher from an external one.
pub const EP_LAUNCHER: &str = "EP_LAUNCHER";
/// The job's shared secret (see [`crate::auth`]).
pub const EP_JOB_TOKEN: &str = "EP_JOB_TOKEN";
/// `1` to run without a token across hosts.
pub const EP_RDZV_OPEN: &str = "EP_RDZV_OPEN";
/// Optional job identity bound into the proofs.
pub const EP_JOB_ID: &str = "EP_JOB_ID";
/// Set by [`spawn_local`](crate::launcher::spawn_local) for rank 0 only: the number of an
/// inherited descriptor, the listening socket of the rendezvous port, already bound.
pub const EP_RDZV_LISTEN_FD: &str = "EP_RDZV_LISTEN_FD";
