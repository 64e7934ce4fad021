//! What can go wrong ([`RendezvousError`]), naming this rank, the peer, the operation and the
//! sequence number; the `Abort` frame that relays a failure, both ways.

use std::time::Duration;

use crate::rendezvous::frame::{Op, MAX_ABORT};

/// A rendezvous failure. Every variant names this rank (`rank`); those about a peer name it
/// (`peer`), the operation (`op`) and the call's sequence number (`seq`, 0 while connecting).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RendezvousError {
    #[error("rank {rank}: invalid rendezvous configuration: {detail}")]
    InvalidConfig { rank: usize, detail: String },
    #[error("rank {rank}: cannot listen on {addr}: {cause}")]
    Bind {
        rank: usize,
        addr: String,
        cause: String,
    },
    #[error("rank {rank}: could not connect to rank {peer} at {addr} within {timeout:?}: {cause}")]
    Connect {
        rank: usize,
        peer: usize,
        addr: String,
        timeout: Duration,
        cause: String,
    },
    #[error("rank {rank}: {op} #{seq} timed out after {timeout:?} waiting for rank {peer}")]
    Timeout {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        timeout: Duration,
    },
    #[error("rank {rank}: peer rank {peer} lost during {op} #{seq}: {cause}")]
    PeerLost {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        cause: String,
    },
    #[error("rank {rank}: protocol error with rank {peer} in {op} #{seq}: {detail}")]
    Protocol {
        rank: usize,
        peer: usize,
        op: Op,
        seq: u64,
        detail: String,
    },
    #[error(
        "rank {rank}: barrier #{seq} with tag {tag:?}, but rank {peer} is at barrier {peer_tag:?}"
    )]
    BarrierMismatch {
        rank: usize,
        peer: usize,
        seq: u64,
        tag: String,
        peer_tag: String,
    },
    #[error("rank {rank}: {op} #{seq} aborted: rank {reporter} reported a failure of rank {peer}: {detail}")]
    Aborted {
        rank: usize,
        peer: usize,
        reporter: usize,
        op: Op,
        seq: u64,
        detail: String,
    },
    #[error("rank {rank}: {op} #{seq} refused: the group already failed ({first})")]
    Broken {
        rank: usize,
        op: Op,
        seq: u64,
        first: Box<RendezvousError>,
    },
    #[error("rank {rank}: the rendezvous at {addr} is reachable from other hosts, so the job needs a shared secret: set EP_JOB_TOKEN to the same value on every rank (e.g. `openssl rand -hex 32`), or set EP_RDZV_OPEN=1 to let anyone who can reach that port join the job")]
    NoJobToken { rank: usize, addr: String },
    #[error("rank {rank}: authentication with rank {peer} failed: {detail}")]
    Unauthenticated {
        rank: usize,
        peer: usize,
        detail: String,
    },
    #[error("rank {rank}: cannot accept connections on {addr}: {cause}")]
    Accept {
        rank: usize,
        addr: String,
        cause: String,
    },
    #[error("rank {rank}: {op} #{seq}: a blob of {len} bytes exceeds the limit of {limit} bytes (Limits::max_blob)")]
    BlobTooLarge {
        rank: usize,
        op: Op,
        seq: u64,
        len: usize,
        limit: usize,
    },
}

impl RendezvousError {
    /// The rank that got this error.
    pub fn rank(&self) -> usize {
        match self {
            RendezvousError::InvalidConfig { rank, .. }
            | RendezvousError::Bind { rank, .. }
            | RendezvousError::Connect { rank, .. }
            | RendezvousError::Timeout { rank, .. }
            | RendezvousError::PeerLost { rank, .. }
            | RendezvousError::Protocol { rank, .. }
            | RendezvousError::BarrierMismatch { rank, .. }
            | RendezvousError::Aborted { rank, .. }
            | RendezvousError::Broken { rank, .. }
            | RendezvousError::NoJobToken { rank, .. }
            | RendezvousError::Unauthenticated { rank, .. }
            | RendezvousError::Accept { rank, .. }
            | RendezvousError::BlobTooLarge { rank, .. } => *rank,
        }
    }

    /// Whether another rank is to blame (it died, hung, or misbehaved): a process exiting on
    /// such an error should use [`EXIT_PEER_FAILURE`](crate::launcher::EXIT_PEER_FAILURE), so a
    /// launcher reports the culprit rather than the first survivor to notice.
    pub fn is_caused_by_peer(&self) -> bool {
        self.peer().is_some_and(|p| p != self.rank())
    }

    /// The rank this error is about (the one that died, timed out or misbehaved), if any.
    pub fn peer(&self) -> Option<usize> {
        match self {
            RendezvousError::InvalidConfig { .. }
            | RendezvousError::Bind { .. }
            | RendezvousError::NoJobToken { .. }
            | RendezvousError::Accept { .. }
            | RendezvousError::BlobTooLarge { .. } => None,
            RendezvousError::Unauthenticated { peer, .. } => Some(*peer),
            RendezvousError::Connect { peer, .. }
            | RendezvousError::Timeout { peer, .. }
            | RendezvousError::PeerLost { peer, .. }
            | RendezvousError::Protocol { peer, .. }
            | RendezvousError::BarrierMismatch { peer, .. }
            | RendezvousError::Aborted { peer, .. } => Some(*peer),
            RendezvousError::Broken { first, .. } => first.peer(),
        }
    }
}

pub type Result<T> = std::result::Result<T, RendezvousError>;

/// Abort payload: failure kind, culprit rank, message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AbortKind {
    Lost = 1,
    Timeout = 2,
    Other = 3,
}

pub(crate) fn abort_payload(err: &RendezvousError) -> Vec<u8> {
    let (kind, culprit, msg) = match err {
        RendezvousError::PeerLost { peer, cause, .. } => (AbortKind::Lost, *peer, cause.clone()),
        RendezvousError::Timeout { peer, .. } => (AbortKind::Timeout, *peer, err.to_string()),
        RendezvousError::Broken { first, .. } => return abort_payload(first),
        other => (
            AbortKind::Other,
            other.peer().unwrap_or(usize::MAX),
            other.to_string(),
        ),
    };
    let mut v = vec![kind as u8];
    v.extend_from_slice(&(culprit.min(u32::MAX as usize) as u32).to_le_bytes());
    let mut end = msg.len().min(MAX_ABORT - v.len());
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    v.extend_from_slice(&msg.as_bytes()[..end]);
    v
}

impl RendezvousError {
    /// The peer whose connection is gone, for which sending an abort is pointless.
    pub(crate) fn peer_if_lost(&self) -> Option<usize> {
        match self {
            RendezvousError::PeerLost { peer, .. } => Some(*peer),
            _ => None,
        }
    }
}

/// The error an `Abort` frame from `reporter` means to this rank.
pub(crate) fn abort_error(
    rank: usize,
    reporter: usize,
    op: Op,
    seq: u64,
    payload: &[u8],
) -> RendezvousError {
    if payload.len() < 5 {
        return RendezvousError::Aborted {
            rank,
            peer: reporter,
            reporter,
            op,
            seq,
            detail: "malformed abort report".into(),
        };
    }
    let culprit = u32::from_le_bytes([payload[1], payload[2], payload[3], payload[4]]) as usize;
    let culprit = if culprit == u32::MAX as usize {
        reporter
    } else {
        culprit
    };
    let msg = String::from_utf8_lossy(&payload[5..]).into_owned();
    match payload[0] {
        k if k == AbortKind::Lost as u8 => RendezvousError::PeerLost {
            rank,
            peer: culprit,
            op,
            seq,
            cause: format!("reported by rank {reporter}: {msg}"),
        },
        k if k == AbortKind::Timeout as u8 && culprit != rank => RendezvousError::Aborted {
            rank,
            peer: culprit,
            reporter,
            op,
            seq,
            detail: format!("timed out: {msg}"),
        },
        _ => RendezvousError::Aborted {
            rank,
            peer: culprit,
            reporter,
            op,
            seq,
            detail: msg,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_reports_are_truncated_to_their_limit() {
        let err = RendezvousError::InvalidConfig {
            rank: 1,
            detail: "é".repeat(MAX_ABORT),
        };
        let p = abort_payload(&err);
        assert!(p.len() <= MAX_ABORT);
        assert!(std::str::from_utf8(&p[5..]).is_ok());
    }
}
