//! A rank's configuration of the rendezvous ([`RendezvousConfig`], [`Limits`]) and its checks.

use std::net::{SocketAddr, ToSocketAddrs};
use std::time::Duration;

use crate::auth::{self, JobToken};
use crate::rendezvous::address::Host;
use crate::rendezvous::error::{RendezvousError, Result};
use crate::rendezvous::frame::MAX_PAYLOAD;

/// Where rank 0 is, who this process is, and the time bounds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousConfig {
    pub rank: usize,
    pub world_size: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// Bound on forming the group: rank 0 waits this long for all ranks, the others this long
    /// to reach rank 0 and be welcomed.
    pub connect_timeout: Duration,
    /// Bound on each collective call.
    pub op_timeout: Duration,
    /// The job's shared secret: every rank must hold the same one. `None` runs unauthenticated,
    /// which [`Rendezvous::connect`](crate::Rendezvous::connect) allows only on a loopback `master_addr` or with `open`.
    pub token: Option<JobToken>,
    /// Allow a job without a token across hosts (`EP_RDZV_OPEN=1`): anyone who can reach the
    /// port can then join as a free rank.
    pub open: bool,
    /// The job's identity, bound into every proof (`EP_JOB_ID`, else torchrun's
    /// `TORCHELASTIC_RUN_ID`, else empty): two jobs that share a token still cannot mix.
    pub job_id: String,
    /// Bounds against hostile or broken peers.
    pub limits: Limits,
    /// Rank 0 (Unix): the descriptor of a listening socket already bound to `master_port`,
    /// inherited from the launcher (`EP_RDZV_LISTEN_FD`), listened on instead of binding, so
    /// the port cannot be taken between the launcher choosing it and rank 0 listening.
    pub inherited_listener: Option<i32>,
}

/// Bounds on what a peer can make this process hold or wait for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest blob one rank may contribute to a collective (and so the largest `Data`
    /// frame; rank 0's all-gather reply may hold `world_size` of them, up to [`MAX_PAYLOAD`]).
    pub max_blob: usize,
    /// Rank 0: connections that have not yet proved who they are, at most (fewer where rank 0
    /// runs out of descriptors); when full, the oldest is dropped to make room for a new one
    /// once it has had 20 ms to answer, and the new one is closed otherwise.
    pub max_pending: usize,
    /// Rank 0: how long a new connection has to complete its handshake before it is dropped.
    /// Each rank: how long it waits for rank 0's challenge before reconnecting.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_blob: 64 << 20,
            max_pending: 64,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}

impl RendezvousConfig {
    /// A loopback configuration (used by tests and by single-node jobs).
    pub fn local(rank: usize, world_size: usize, port: u16, timeout: Duration) -> Self {
        RendezvousConfig {
            rank,
            world_size,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            connect_timeout: timeout,
            op_timeout: timeout,
            token: None,
            open: false,
            job_id: String::new(),
            limits: Limits::default(),
            inherited_listener: None,
        }
    }

    /// This configuration with `token` as the job's secret.
    pub fn with_token(mut self, token: JobToken) -> Self {
        self.token = Some(token);
        self
    }

    /// Checks the configuration as [`Rendezvous::connect`](crate::Rendezvous::connect) does, without touching the network.
    pub fn check(&self) -> Result<()> {
        self.validate()
    }

    /// Whether `master_addr` names this host only (a loopback IP or `localhost`): a job there
    /// may run without a token. Anything else, names included, counts as reachable from other
    /// hosts.
    pub fn is_loopback(&self) -> bool {
        Host::parse(&self.master_addr).is_ok_and(|h| h.is_loopback())
    }

    pub(crate) fn validate(&self) -> Result<()> {
        let bad = |detail: String| {
            Err(RendezvousError::InvalidConfig {
                rank: self.rank,
                detail,
            })
        };
        if self.world_size == 0 || self.world_size > u32::MAX as usize {
            return bad(format!("world_size {} out of 1..=2^32-1", self.world_size));
        }
        if self.rank >= self.world_size {
            return bad(format!(
                "rank {} >= world_size {}",
                self.rank, self.world_size
            ));
        }
        if let Err(detail) = Host::parse(&self.master_addr) {
            return bad(detail);
        }
        if self.connect_timeout.is_zero() || self.op_timeout.is_zero() {
            return bad("timeouts must be nonzero".into());
        }
        let l = &self.limits;
        if l.max_blob == 0 || l.max_blob as u64 > MAX_PAYLOAD {
            return bad(format!(
                "limits.max_blob {} out of 1..={MAX_PAYLOAD}",
                l.max_blob
            ));
        }
        if l.max_pending == 0 || l.handshake_timeout.is_zero() {
            return bad("limits.max_pending and limits.handshake_timeout must be nonzero".into());
        }
        if self.job_id.len() > auth::MAX_JOB_ID_LEN {
            return bad(format!(
                "job id of {} bytes, above the limit {}",
                self.job_id.len(),
                auth::MAX_JOB_ID_LEN
            ));
        }
        if self.token.is_none() && !self.open && self.world_size > 1 && !self.is_loopback() {
            return Err(RendezvousError::NoJobToken {
                rank: self.rank,
                addr: self.addr_string(),
            });
        }
        Ok(())
    }

    pub(crate) fn addr_string(&self) -> String {
        if self.master_addr.contains(':') && !self.master_addr.starts_with('[') {
            format!("[{}]:{}", self.master_addr, self.master_port)
        } else {
            format!("{}:{}", self.master_addr, self.master_port)
        }
    }

    pub(crate) fn resolve(&self) -> std::result::Result<Vec<SocketAddr>, String> {
        let addrs: Vec<SocketAddr> = match Host::parse(&self.master_addr)? {
            Host::Ip(ip) => vec![SocketAddr::new(ip, self.master_port)],
            Host::Name(name) => (name, self.master_port)
                .to_socket_addrs()
                .map_err(|e| format!("cannot resolve {}: {e}", self.addr_string()))?
                .collect(),
        };
        if addrs.is_empty() {
            return Err(format!("{} resolves to no address", self.addr_string()));
        }
        Ok(addrs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rendezvous::collective::Rendezvous;

    #[test]
    fn a_multi_host_job_needs_a_token_or_open() {
        let mut c = RendezvousConfig::local(0, 2, 29500, Duration::from_secs(1));
        for loopback in ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"] {
            c.master_addr = loopback.into();
            assert!(c.is_loopback(), "{loopback}");
            c.check().unwrap();
        }
        for remote in ["10.1.2.3", "node17", "::ffff:10.0.0.1", "192.0.2.1"] {
            c.master_addr = remote.into();
            assert!(!c.is_loopback(), "{remote}");
            let e = c.check().unwrap_err();
            assert!(
                matches!(e, RendezvousError::NoJobToken { rank: 0, .. }),
                "{e}"
            );
            let msg = e.to_string();
            assert!(
                msg.contains("EP_JOB_TOKEN") && msg.contains("EP_RDZV_OPEN=1"),
                "{msg}"
            );
            // One rank alone needs no secret; open or a token makes it acceptable.
            let alone = RendezvousConfig {
                world_size: 1,
                ..c.clone()
            };
            alone.check().unwrap();
            RendezvousConfig {
                open: true,
                ..c.clone()
            }
            .check()
            .unwrap();
            c.clone()
                .with_token(JobToken::new(*b"0123456789abcdef").unwrap())
                .check()
                .unwrap();
        }
    }

    #[test]
    fn invalid_configs_are_typed() {
        let mut c = RendezvousConfig::local(2, 2, 1, Duration::from_secs(1));
        assert!(matches!(
            Rendezvous::connect(&c),
            Err(RendezvousError::InvalidConfig { rank: 2, .. })
        ));
        c.rank = 0;
        c.op_timeout = Duration::ZERO;
        assert!(matches!(
            Rendezvous::connect(&c),
            Err(RendezvousError::InvalidConfig { rank: 0, .. })
        ));
    }
}
