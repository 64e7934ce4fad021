//! One connection of the star: buffered, bounded reads of whole frames, sealed sends with a
//! deadline, and the faults a link reports.

use std::collections::VecDeque;
use std::io::{ErrorKind, Read, Write};
use std::net::TcpStream;
use std::time::Instant;

use crate::rendezvous::frame::{parse, Facing, Frame, FrameLimits, Kind, HEADER_LEN, POLL_SLEEP};
use crate::rendezvous::seal::{Seal, TAG_LEN};

/// Why a link cannot deliver more frames.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The peer said goodbye (and may have closed).
    Clean,
    /// The connection closed or reset without a goodbye.
    Lost(String),
    /// The peer sent bytes that are not a valid frame.
    Bad(String),
    /// A frame failed its integrity check (see [`seal`]): altered, injected, replayed or
    /// reordered on the way.
    Forged(String),
}

/// One connection to a peer: a nonblocking socket, the bytes read so far and the frames parsed.
pub(crate) struct Link {
    pub(crate) peer: usize,
    pub(crate) stream: TcpStream,
    pub(crate) limits: FrameLimits,
    pub(crate) rbuf: Vec<u8>,
    pub(crate) inbox: VecDeque<Frame>,
    pub(crate) fault: Option<Fault>,
    /// Once the handshake is done: the tags of what is sent and received.
    pub(crate) seal: Option<Seal>,
    /// A rank's link to rank 0: the admission has arrived (see [`Link::held`]).
    pub(crate) admitted: bool,
}

impl Link {
    pub(crate) fn new(
        peer: usize,
        stream: TcpStream,
        limits: FrameLimits,
    ) -> std::io::Result<Link> {
        stream.set_nonblocking(true)?;
        stream.set_nodelay(true)?;
        Ok(Link {
            peer,
            stream,
            limits,
            rbuf: Vec::new(),
            inbox: VecDeque::new(),
            fault: None,
            seal: None,
            admitted: false,
        })
    }

    /// Bytes held for this link: unparsed input plus parsed frames not yet consumed.
    pub(crate) fn buffered(&self) -> usize {
        self.rbuf.len()
            + self
                .inbox
                .iter()
                .map(|f| HEADER_LEN + f.payload.len())
                .sum::<usize>()
    }

    /// Reads whatever is available without blocking (but never more than the link's read
    /// budget: past it the peer waits, on TCP flow control, until frames are consumed) and
    /// parses complete frames into the inbox. Returns whether anything happened.
    pub(crate) fn pump(&mut self) -> bool {
        if self.fault.is_some() {
            return false;
        }
        let budget = self.limits.read_budget();
        let mut progress = false;
        // Bytes held back while the limits changed (see `held`) are parsed first.
        if !self.rbuf.is_empty() && !self.held() {
            let before = self.inbox.len();
            if !self.parse_frames() {
                return true;
            }
            progress = self.inbox.len() != before;
        }
        let mut closed: Option<String> = None;
        let mut chunk = [0u8; 64 * 1024];
        loop {
            let room = budget.saturating_sub(self.buffered()).min(chunk.len());
            if room == 0 || self.held() {
                break;
            }
            match self.stream.read(&mut chunk[..room]) {
                Ok(0) => {
                    closed = Some(
                        "connection closed without a goodbye (process exited or crashed)".into(),
                    );
                    break;
                }
                Ok(n) => {
                    self.rbuf.extend_from_slice(&chunk[..n]);
                    progress = true;
                    if !self.parse_frames() {
                        break;
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    closed = Some(format!("connection error: {e}"));
                    break;
                }
            }
        }
        if let Some(cause) = closed {
            progress = true;
            if self.fault.is_none() {
                // Frames parsed before the close stay deliverable; the fault only says that no
                // more will come, and whether the peer said goodbye first.
                let clean = self.inbox.iter().any(|f| f.kind == Kind::Bye);
                self.fault = Some(if clean {
                    Fault::Clean
                } else {
                    Fault::Lost(cause)
                });
            }
        }
        progress
    }

    /// Whether parsing waits: a rank has rank 0's admission in hand (or has taken it from the
    /// inbox) but has not checked its proof yet. What follows it (the welcome, maybe a
    /// broadcast) is parsed under the limits for a proven rank 0, and checked against its tag,
    /// once the proof is checked and the link sealed; under none before.
    pub(crate) fn held(&self) -> bool {
        self.limits.facing == Facing::RootUnproven && self.admitted
    }

    /// Moves every complete frame from the read buffer to the inbox; false (and a fault) on
    /// bytes that are not a valid frame for this link.
    pub(crate) fn parse_frames(&mut self) -> bool {
        let mut consumed = 0;
        let ok = loop {
            if self.held() {
                break true;
            }
            let trailer = if self.seal.is_some() { TAG_LEN } else { 0 };
            match parse(&self.rbuf[consumed..], &self.limits, trailer) {
                Ok(Some((frame, n))) => {
                    if let Some(seal) = self.seal.as_mut() {
                        let bytes = &self.rbuf[consumed..consumed + n];
                        let (head, rest) = bytes.split_at(HEADER_LEN);
                        let (payload, tag) = rest.split_at(rest.len() - TAG_LEN);
                        if let Err(detail) = seal.open_next(head, payload, tag) {
                            self.fault = Some(Fault::Forged(detail));
                            break false;
                        }
                    }
                    consumed += n;
                    if self.limits.facing == Facing::RootUnproven && frame.kind == Kind::Admit {
                        self.admitted = true;
                    }
                    self.inbox.push_back(frame);
                }
                Ok(None) => break true,
                Err(detail) => {
                    self.fault = Some(Fault::Bad(detail));
                    break false;
                }
            }
        };
        self.rbuf.drain(..consumed);
        ok
    }

    /// Waits (bounded by `until`) for the next frame; `Err` says why none came.
    pub(crate) fn next_frame(&mut self, until: Instant) -> std::result::Result<Frame, String> {
        loop {
            let progress = self.pump();
            if let Some(f) = self.inbox.pop_front() {
                return Ok(f);
            }
            match &self.fault {
                Some(Fault::Clean) => return Err("the peer said goodbye".into()),
                Some(Fault::Lost(c) | Fault::Bad(c) | Fault::Forged(c)) => return Err(c.clone()),
                None => {}
            }
            if Instant::now() >= until {
                return Err("timed out waiting for the next handshake message".into());
            }
            if !progress {
                std::thread::sleep(POLL_SLEEP);
            }
        }
    }

    /// Writes one whole frame (as [`encode`] made it) before `deadline`, reading meanwhile so
    /// neither side can block the other on full buffers. On a sealed link the frame goes out
    /// with its tag (the header's length counting it).
    pub(crate) fn send(
        &mut self,
        frame: &[u8],
        deadline: Instant,
    ) -> std::result::Result<(), SendFault> {
        let Some(seal) = self.seal.as_mut() else {
            return self.write_parts(&[frame], deadline);
        };
        if frame.len() < HEADER_LEN {
            return Err(SendFault::Lost(format!(
                "internal error: a {}-byte frame is shorter than its header",
                frame.len()
            )));
        }
        let (head, payload) = frame.split_at(HEADER_LEN);
        let mut head: [u8; HEADER_LEN] = head
            .try_into()
            .unwrap_or_else(|_| unreachable!("split at HEADER_LEN"));
        let len = (payload.len() + TAG_LEN) as u64;
        head[20..28].copy_from_slice(&len.to_le_bytes());
        let tag = seal.seal_next(&head, payload);
        self.write_parts(&[&head, payload, &tag], deadline)
    }

    /// Writes `parts` one after the other, whole, before `deadline` (see [`Link::send`]).
    pub(crate) fn write_parts(
        &mut self,
        parts: &[&[u8]],
        deadline: Instant,
    ) -> std::result::Result<(), SendFault> {
        for part in parts {
            let mut off = 0;
            while off < part.len() {
                match self.stream.write(&part[off..]) {
                    Ok(0) => {
                        return Err(SendFault::Lost("connection closed (wrote 0 bytes)".into()))
                    }
                    Ok(n) => off += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        if Instant::now() >= deadline {
                            return Err(SendFault::Timeout);
                        }
                        self.pump();
                        std::thread::sleep(POLL_SLEEP);
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(SendFault::Lost(format!("send failed: {e}"))),
                }
            }
        }
        Ok(())
    }
}

pub(crate) enum SendFault {
    Lost(String),
    Timeout,
}
