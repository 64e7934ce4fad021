//! The host side of kernels/src/runtime/ that the protocol relies on, run once every block of
//! the launches ended: the error word as the host decodes it, the check after a sync (the first
//! error, cause first, fails the group for good), and the host's reads of ack words and
//! entries. The host's side of the rank mask is in `shrink`.

use crate::gpu_protocol::orderings::RELAXED;
use crate::gpu_protocol::state::{read_entry, Group};
use crate::gpu_protocol::words::{ERR_EXPERT_RANGE, ERR_PEER_FAILED, ERR_TIMEOUT};

/// A device error as the host decodes it (kernels/src/runtime/error_word.rs `decode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceError {
    Timeout {
        rank: u32,
        peer: u32,
        phase: u32,
        /// The whole u64 epoch: words 4 (low) and 6 (high).
        call: u64,
    },
    /// `ERR_EXPERT_RANGE`: this rank's routing was bad.
    BadInput { rank: u32 },
    /// `ERR_PEER_FAILED`: the receiving rank found the peer's poison in its call `call`.
    PeerFailed { rank: u32, peer: u32, call: u64 },
    /// `ERR_PEER_DATA`: the receiving rank, the peer, the field (`PF_*`) and its value.
    PeerData {
        rank: u32,
        peer: u32,
        field: u32,
        value: u32,
    },
}

/// The host side of kernels/src/runtime/ that the protocol relies on.
#[derive(Debug, Default)]
pub struct Host {
    broken: Option<DeviceError>,
}

impl Host {
    /// runtime/mod.rs `GpuGroup::check_usable`: a group that failed refuses every later
    /// call (the first thing in launch.rs `launch_inner` and error_word.rs `sync`).
    pub fn check_usable(&self) -> Result<(), DeviceError> {
        match self.broken {
            Some(t) => Err(t),
            None => Ok(()),
        }
    }

    /// error_word.rs `GpuGroup::sync` then `GpuGroup::check`, once the streams are
    /// synchronised (the caller joined every block of the launch): reads every device's error
    /// word; the first error, input errors, then peer data, then timeouts (`cause_first`),
    /// fails the group.
    pub fn sync(&mut self, g: &Group) -> Result<(), DeviceError> {
        self.check_usable()?;
        let mut found: Vec<DeviceError> = (0..g.devices.len())
            .filter_map(|dev| device_error(g, dev))
            .collect();
        // found.sort_by_key(cause_first);
        found.sort_by_key(cause_first);
        if let Some(&e) = found.first() {
            // self.broken = Some(e.clone());
            self.broken = Some(e);
            return Err(e);
        }
        Ok(())
    }
}

/// error_word.rs `cause_first`: bad input is the cause, bad peer data next, then timeouts (waits
/// for a stopped rank), a peer's published failure (its poison) last: always a consequence.
fn cause_first(e: &DeviceError) -> u8 {
    match e {
        DeviceError::PeerFailed { .. } => 3,
        DeviceError::Timeout { .. } => 2,
        DeviceError::PeerData { .. } => 1,
        DeviceError::BadInput { .. } => 0,
    }
}

/// Device `dev`'s error word as error_word.rs `decode` reads it (None: nothing reported). Call once
/// every block of the launches has ended (joined): the host copies the word after the stream
/// synchronised.
pub fn device_error(g: &Group, dev: usize) -> Option<DeviceError> {
    let e = &g.devices[dev];
    // cuMemcpyDtoH of err after the stream synchronised: ordered by the join.
    let code = e.code.load(RELAXED) as u32;
    if code == 0 {
        return None;
    }
    // SAFETY: every block of the launch ended (joined): no writer is left.
    let w: Vec<u32> = unsafe {
        e.fields.with_rows(0, 1, |b| {
            b.chunks(4)
                .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
                .collect()
        })
    };
    Some(match code {
        ERR_TIMEOUT => DeviceError::Timeout {
            rank: w[0],
            peer: w[1],
            phase: w[2],
            call: w[3] as u64 | (w[5] as u64) << 32,
        },
        ERR_EXPERT_RANGE => DeviceError::BadInput { rank: w[0] },
        ERR_PEER_FAILED => DeviceError::PeerFailed {
            rank: w[0],
            peer: w[1],
            call: w[3] as u64 | (w[5] as u64) << 32,
        },
        _ => DeviceError::PeerData {
            rank: w[0],
            peer: w[1],
            field: w[2],
            value: w[3],
        },
    })
}

/// `rank`'s ack word of destination `d` (`sig_bat_ack(rank)[d]` / `sig_pe_ack`: the last call
/// `d` acknowledged to `rank`), read by the host once every block ended (the caller joined them).
pub fn ack_word(g: &Group, rank: usize, d: usize) -> u64 {
    g.ranks[rank].ack[d].load(RELAXED)
}

/// Entry `row` of `rank`'s receive buffer (`bat_buf` / `pe_buf`) as the host reads it once
/// every block ended (the caller joined them): its header words and payload.
pub fn entry_at(g: &Group, rank: usize, row: usize) -> ([u32; 4], u64) {
    read_entry(&g.ranks[rank].buf, row)
}
