//! Joining a job from the environment: [`Rendezvous::from_env`], where the torchrun-style
//! configuration ([`crate::env`]) meets the rendezvous.

use std::time::Duration;

use crate::env::ProcessConfig;
use crate::error::Error;
use crate::rendezvous::Rendezvous;

impl Rendezvous {
    /// Reads the torchrun-style environment ([`ProcessConfig::from_env`](crate::env::ProcessConfig::from_env))
    /// and forms the group.
    pub fn from_env(
        connect_timeout: Duration,
        op_timeout: Duration,
    ) -> std::result::Result<Self, Error> {
        let pc = ProcessConfig::from_env()?;
        Ok(Self::connect(
            &pc.rendezvous_config(connect_timeout, op_timeout),
        )?)
    }
}
