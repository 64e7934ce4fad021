//! The crate's umbrella error, for callers that go from the environment to a formed group.

use crate::env::EnvError;
#[cfg(unix)]
use crate::launcher::LaunchError;
use crate::rendezvous::RendezvousError;

/// Any error of this crate, for callers that go from the environment to a formed group.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Env(#[from] EnvError),
    #[error(transparent)]
    Rendezvous(#[from] RendezvousError),
    #[cfg(unix)]
    #[error(transparent)]
    Launch(#[from] LaunchError),
}
