//! The wire format (see [`crate::rendezvous`]): the constants, the operations ([`Op`]), the
//! frame kinds, the payload limits of each kind and direction, and a frame's encoding and
//! checked parsing; the list of blobs a gather returns.

use std::time::Duration;

use crate::auth::{MAC_LEN, NONCE_LEN};
use crate::rendezvous::seal::TAG_LEN;

pub(crate) const MAGIC: [u8; 4] = *b"EPRZ";
/// Bumped whenever the wire format changes; a peer with another version is refused.
/// Version 3: every frame after the handshake carries a tag (`seal`).
pub const PROTOCOL_VERSION: u16 = 3;
pub(crate) const HEADER_LEN: usize = 28;
/// The largest payload one frame may carry (an all-gather result included). Far above what the
/// control plane needs (an NCCL unique id is 128 bytes, a CUDA IPC handle 64), low enough that a
/// garbage length from a stray peer cannot make us allocate the machine away.
pub const MAX_PAYLOAD: u64 = 1 << 30;
/// How long the poll loops sleep when no socket made progress.
pub(crate) const POLL_SLEEP: Duration = Duration::from_micros(200);
/// Payload sizes of the handshake frames.
pub(crate) const CHALLENGE_LEN: usize = 1 + NONCE_LEN;
pub(crate) const HELLO_LEN: usize = 4 + NONCE_LEN + MAC_LEN;
pub(crate) const ADMIT_LEN: usize = MAC_LEN;
pub(crate) const WELCOME_LEN: usize = 4;
/// The largest failure report (its message is truncated to fit).
pub(crate) const MAX_ABORT: usize = 64 * 1024;
/// Challenge flag: rank 0 requires a proof of the job token.
pub(crate) const FLAG_TOKEN: u8 = 1;

/// The collective (or phase) an error happened in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Connect,
    AllGather,
    Broadcast,
    Barrier,
    CheckPeers,
}

impl Op {
    pub(crate) fn code(self) -> u8 {
        match self {
            Op::Connect => 0,
            Op::AllGather => 1,
            Op::Broadcast => 2,
            Op::Barrier => 3,
            Op::CheckPeers => 4,
        }
    }
    pub(crate) fn from_code(c: u8) -> Option<Op> {
        Some(match c {
            0 => Op::Connect,
            1 => Op::AllGather,
            2 => Op::Broadcast,
            3 => Op::Barrier,
            4 => Op::CheckPeers,
            _ => return None,
        })
    }
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Connect => "connect",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::Barrier => "barrier",
            Op::CheckPeers => "check_peers",
        })
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Hello = 1,
    Welcome = 2,
    Data = 3,
    Abort = 4,
    Bye = 5,
    Challenge = 6,
    Admit = 7,
}

impl Kind {
    pub(crate) fn from_code(c: u8) -> Option<Kind> {
        Some(match c {
            1 => Kind::Hello,
            2 => Kind::Welcome,
            3 => Kind::Data,
            4 => Kind::Abort,
            5 => Kind::Bye,
            6 => Kind::Challenge,
            7 => Kind::Admit,
            _ => return None,
        })
    }
}

/// Which way a link faces, for the payload limits of what it may receive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Facing {
    /// Rank 0's side of a connection that has not proved who it is: only a hello may come.
    Unidentified,
    /// Rank 0's side of a link to an admitted rank.
    Member,
    /// A rank's side of its link to rank 0 before rank 0 has proved itself: only handshake
    /// frames (the welcome may follow the admission in the same read), so an impostor cannot
    /// make the rank buffer more than a failure report.
    RootUnproven,
    /// A rank's side of its link to rank 0.
    Root,
}

/// What one link may receive: a payload limit per frame kind (and, for `Data`, per operation),
/// derived from the world size and [`Limits::max_blob`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct FrameLimits {
    pub(crate) facing: Facing,
    pub(crate) world: usize,
    pub(crate) max_blob: usize,
}

impl FrameLimits {
    /// Rank 0's all-gather reply: a count, then world x (length, blob).
    pub(crate) fn gathered(&self) -> u64 {
        (self.world as u64)
            .saturating_mul(8 + self.max_blob as u64)
            .saturating_add(4)
            .min(MAX_PAYLOAD)
    }

    /// The largest payload a frame of `kind` for `op` may carry on this link.
    pub(crate) fn max_payload(&self, kind: Kind, op: Op) -> std::result::Result<u64, String> {
        if self.facing == Facing::Unidentified && kind != Kind::Hello {
            return Err(format!(
                "a new connection must start with a hello, not {kind:?}"
            ));
        }
        if self.facing == Facing::RootUnproven
            && !matches!(
                kind,
                Kind::Challenge | Kind::Admit | Kind::Welcome | Kind::Abort
            )
        {
            return Err(format!("rank 0 sent {kind:?} before admitting this rank"));
        }
        Ok(match kind {
            Kind::Hello => HELLO_LEN as u64,
            Kind::Challenge => CHALLENGE_LEN as u64,
            Kind::Admit => ADMIT_LEN as u64,
            Kind::Welcome => WELCOME_LEN as u64,
            Kind::Abort => MAX_ABORT as u64,
            Kind::Bye => 0,
            Kind::Data => match (self.facing, op) {
                (_, Op::Connect | Op::CheckPeers) => 0,
                (Facing::Root, Op::AllGather | Op::Barrier) => self.gathered(),
                _ => self.max_blob as u64,
            },
        })
    }

    /// The most bytes the link buffers (unparsed bytes plus parsed frames not yet consumed):
    /// one largest frame, so a peer cannot make it hold more than what it may legitimately send.
    pub(crate) fn read_budget(&self) -> usize {
        // Past the handshake (a member, a proven rank 0) every frame carries its tag.
        let largest = match self.facing {
            Facing::Unidentified => HELLO_LEN as u64,
            Facing::RootUnproven => MAX_ABORT as u64,
            Facing::Member => (self.max_blob.max(MAX_ABORT) + TAG_LEN) as u64,
            Facing::Root => self.gathered().max(MAX_ABORT as u64) + TAG_LEN as u64,
        };
        HEADER_LEN + largest as usize
    }
}

#[derive(Debug)]
pub(crate) struct Frame {
    pub(crate) kind: Kind,
    pub(crate) op: Op,
    pub(crate) seq: u64,
    pub(crate) src: usize,
    pub(crate) payload: Vec<u8>,
}

pub(crate) fn encode(kind: Kind, op: Op, seq: u64, src: usize, payload: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(HEADER_LEN + payload.len());
    v.extend_from_slice(&MAGIC);
    v.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    v.push(kind as u8);
    v.push(op.code());
    v.extend_from_slice(&seq.to_le_bytes());
    v.extend_from_slice(&(src as u32).to_le_bytes()); // src < world <= u32::MAX (RendezvousConfig::validate)
    v.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    v.extend_from_slice(payload);
    v
}

/// Parses one frame from the front of `buf`: `Ok(None)` when more bytes are needed.
/// `trailer`: the bytes after the payload that the header's length counts too (the tag of a
/// sealed link, [`TAG_LEN`]; 0 before the handshake is done). The frame's payload excludes them;
/// the caller checks them, at `total - trailer..total`.
pub(crate) fn parse(
    buf: &[u8],
    limits: &FrameLimits,
    trailer: usize,
) -> std::result::Result<Option<(Frame, usize)>, String> {
    if buf.len() < HEADER_LEN {
        // Reject a wrong magic as early as possible (a stray client, an HTTP probe, ...).
        let n = buf.len().min(4);
        if buf[..n] != MAGIC[..n] {
            return Err(format!(
                "bad magic {:02x?} (not an ep-launch rendezvous peer)",
                &buf[..n]
            ));
        }
        return Ok(None);
    }
    if buf[..4] != MAGIC {
        return Err(format!(
            "bad magic {:02x?} (not an ep-launch rendezvous peer)",
            &buf[..4]
        ));
    }
    let u16_at = |i: usize| u16::from_le_bytes([buf[i], buf[i + 1]]);
    let u32_at = |i: usize| u32::from_le_bytes([buf[i], buf[i + 1], buf[i + 2], buf[i + 3]]);
    let u64_at = |i: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&buf[i..i + 8]);
        u64::from_le_bytes(b)
    };
    let version = u16_at(4);
    if version != PROTOCOL_VERSION {
        return Err(format!(
            "peer speaks rendezvous protocol version {version}, this rank version {PROTOCOL_VERSION}"
        ));
    }
    let kind = Kind::from_code(buf[6]).ok_or_else(|| format!("unknown frame kind {}", buf[6]))?;
    let op = Op::from_code(buf[7]).ok_or_else(|| format!("unknown operation code {}", buf[7]))?;
    let seq = u64_at(8);
    let src = u32_at(16) as usize;
    let len = u64_at(20);
    let limit = limits.max_payload(kind, op)?.min(MAX_PAYLOAD);
    let Some(payload_len) = len.checked_sub(trailer as u64) else {
        return Err(format!(
            "{kind:?} frame for {op} of {len} bytes is too short for its {trailer}-byte tag"
        ));
    };
    if payload_len > limit {
        return Err(format!(
            "{kind:?} frame for {op} of {payload_len} bytes exceeds the limit {limit}"
        ));
    }
    let total = HEADER_LEN + len as usize;
    if buf.len() < total {
        return Ok(None);
    }
    let payload = buf[HEADER_LEN..total - trailer].to_vec();
    Ok(Some((
        Frame {
            kind,
            op,
            seq,
            src,
            payload,
        },
        total,
    )))
}

pub(crate) fn encode_blobs(blobs: &[Vec<u8>]) -> Vec<u8> {
    let total: usize = blobs.iter().map(|b| b.len() + 8).sum();
    let mut v = Vec::with_capacity(4 + total);
    v.extend_from_slice(&(blobs.len() as u32).to_le_bytes()); // one per rank: <= world <= u32::MAX
    for b in blobs {
        v.extend_from_slice(&(b.len() as u64).to_le_bytes());
        v.extend_from_slice(b);
    }
    v
}

pub(crate) fn decode_blobs(buf: &[u8]) -> std::result::Result<Vec<Vec<u8>>, String> {
    let take = |pos: &mut usize, n: usize| -> std::result::Result<&[u8], String> {
        let end = pos
            .checked_add(n)
            .filter(|&e| e <= buf.len())
            .ok_or_else(|| format!("all_gather payload truncated at byte {}", *pos))?;
        let s = &buf[*pos..end];
        *pos = end;
        Ok(s)
    };
    let mut pos = 0;
    let mut b4 = [0u8; 4];
    b4.copy_from_slice(take(&mut pos, 4)?);
    let count = u32::from_le_bytes(b4) as usize;
    let mut out = Vec::with_capacity(count.min(1 << 16));
    for _ in 0..count {
        let mut b8 = [0u8; 8];
        b8.copy_from_slice(take(&mut pos, 8)?);
        let len = u64::from_le_bytes(b8);
        let len = usize::try_from(len).map_err(|_| format!("blob length {len} too large"))?;
        out.push(take(&mut pos, len)?.to_vec());
    }
    if pos != buf.len() {
        return Err(format!(
            "all_gather payload has {} trailing bytes",
            buf.len() - pos
        ));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(facing: Facing) -> FrameLimits {
        FrameLimits {
            facing,
            world: 4,
            max_blob: 1000,
        }
    }

    #[test]
    fn frames_round_trip_and_reject_garbage() {
        let member = limits(Facing::Member);
        let bytes = encode(Kind::Data, Op::Barrier, 7, 3, b"hello");
        let (f, n) = parse(&bytes, &member, 0).unwrap().unwrap();
        assert_eq!(n, bytes.len());
        assert_eq!(
            (f.kind, f.op, f.seq, f.src),
            (Kind::Data, Op::Barrier, 7, 3)
        );
        assert_eq!(f.payload, b"hello");
        // Incomplete: needs more bytes, not an error.
        assert!(parse(&bytes[..bytes.len() - 1], &member, 0)
            .unwrap()
            .is_none());
        assert!(parse(&bytes[..3], &member, 0).unwrap().is_none());
        // Wrong magic, wrong version, huge length.
        assert!(parse(b"GET / HTTP/1.1\r\n", &member, 0)
            .unwrap_err()
            .contains("magic"));
        let mut v = bytes.clone();
        v[4] = 99;
        assert!(parse(&v, &member, 0).unwrap_err().contains("version"));
        let mut v = bytes.clone();
        v[20..28].copy_from_slice(&(MAX_PAYLOAD + 1).to_le_bytes());
        assert!(parse(&v, &member, 0).unwrap_err().contains("exceeds"));
    }

    #[test]
    fn payload_limits_follow_the_operation_and_direction() {
        let header_claiming = |kind: Kind, op: Op, len: u64| {
            let mut v = encode(kind, op, 1, 1, &[]);
            v[20..28].copy_from_slice(&len.to_le_bytes());
            v
        };
        let (member, root, new) = (
            limits(Facing::Member),
            limits(Facing::Root),
            limits(Facing::Unidentified),
        );
        // A blob from a rank: max_blob; rank 0's gathered reply: world x (8 + max_blob) + 4.
        let blob = header_claiming(Kind::Data, Op::AllGather, 1000);
        assert!(parse(&blob, &member, 0).unwrap().is_none());
        let over = header_claiming(Kind::Data, Op::AllGather, 1001);
        assert!(parse(&over, &member, 0).unwrap_err().contains("exceeds"));
        assert!(parse(&over, &root, 0).unwrap().is_none());
        let gathered = header_claiming(Kind::Data, Op::AllGather, 4 * 1008 + 4);
        assert!(parse(&gathered, &root, 0).unwrap().is_none());
        let gathered = header_claiming(Kind::Data, Op::AllGather, 4 * 1008 + 5);
        assert!(parse(&gathered, &root, 0).unwrap_err().contains("exceeds"));
        let bcast = header_claiming(Kind::Data, Op::Broadcast, 1001);
        assert!(parse(&bcast, &root, 0).unwrap_err().contains("exceeds"));
        // Handshake frames: their exact sizes; data on connect: none.
        for (kind, len) in [
            (Kind::Hello, HELLO_LEN),
            (Kind::Challenge, CHALLENGE_LEN),
            (Kind::Admit, ADMIT_LEN),
            (Kind::Welcome, WELCOME_LEN),
            (Kind::Bye, 0),
            (Kind::Abort, MAX_ABORT),
        ] {
            let ok = header_claiming(kind, Op::Connect, len as u64);
            assert!(parse(&ok, &root, 0).is_ok(), "{kind:?}");
            let big = header_claiming(kind, Op::Connect, len as u64 + 1);
            assert!(parse(&big, &root, 0).is_err(), "{kind:?}");
        }
        assert!(parse(&header_claiming(Kind::Data, Op::Connect, 1), &member, 0).is_err());
        // A new connection may only say hello, of hello size.
        assert!(parse(
            &header_claiming(Kind::Hello, Op::Connect, HELLO_LEN as u64),
            &new,
            0
        )
        .unwrap()
        .is_none());
        assert!(
            parse(&header_claiming(Kind::Data, Op::AllGather, 1), &new, 0)
                .unwrap_err()
                .contains("must start with a hello")
        );
        assert!(parse(&header_claiming(Kind::Hello, Op::Connect, 1 << 30), &new, 0).is_err());
        // On a sealed link the length counts the tag too: the limit is on what precedes it,
        // and a frame too short to hold a tag is refused.
        let tagged = header_claiming(Kind::Data, Op::AllGather, 1000 + TAG_LEN as u64);
        assert!(parse(&tagged, &member, TAG_LEN).unwrap().is_none());
        let tagged = header_claiming(Kind::Data, Op::AllGather, 1001 + TAG_LEN as u64);
        assert!(parse(&tagged, &member, TAG_LEN)
            .unwrap_err()
            .contains("exceeds"));
        let short = header_claiming(Kind::Bye, Op::Connect, TAG_LEN as u64 - 1);
        assert!(parse(&short, &member, TAG_LEN)
            .unwrap_err()
            .contains("too short"));
        // And what a link buffers is one largest frame.
        assert_eq!(new.read_budget(), HEADER_LEN + HELLO_LEN);
        assert_eq!(member.read_budget(), HEADER_LEN + MAX_ABORT + TAG_LEN);
    }

    #[test]
    fn blob_lists_round_trip_and_truncation_is_an_error() {
        let blobs = vec![b"a".to_vec(), vec![], vec![7u8; 300]];
        let enc = encode_blobs(&blobs);
        assert_eq!(decode_blobs(&enc).unwrap(), blobs);
        for cut in 0..enc.len() {
            assert!(decode_blobs(&enc[..cut]).is_err(), "cut at {cut}");
        }
        let mut long = enc.clone();
        long.push(0);
        assert!(decode_blobs(&long).unwrap_err().contains("trailing"));
    }
}
