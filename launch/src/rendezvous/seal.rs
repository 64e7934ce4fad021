//! The integrity of an established connection: every frame after the handshake carries a tag.
//!
//! Both ends derive the connection's key from the handshake ([`crate::auth::session_key`]).
//! Each frame they send afterwards is followed by `tag = HMAC-SHA256(key, direction | n |
//! header | payload)`, where `direction` is 0 from rank 0 to the rank and 1 back, and `n`
//! counts the frames sent that way on this connection (0, 1, ...); the header's length field
//! counts the tag too, so the framing needs no knowledge of it. The reader checks each tag
//! against the frame number it expects next: a frame altered, injected, dropped (the next one
//! then has the wrong number), replayed, reordered or reflected back to its sender fails, and
//! the connection fails with it ([`super::Fault::Forged`]).

use hmac::Mac;

use crate::auth::{self, MAC_LEN};

/// Bytes of the tag after every sealed frame.
pub(crate) const TAG_LEN: usize = MAC_LEN;

/// The sealing state of one end of a connection.
pub(crate) struct Seal {
    key: [u8; MAC_LEN],
    /// Direction byte of what this end sends (the other end receives with the other one).
    out: u8,
    sent: u64,
    received: u64,
}

impl std::fmt::Debug for Seal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seal")
            .field("sent", &self.sent)
            .field("received", &self.received)
            .finish_non_exhaustive()
    }
}

impl Seal {
    /// Rank 0's end (`root`) or a rank's end of a connection with key `key`.
    pub(crate) fn new(key: [u8; MAC_LEN], root: bool) -> Seal {
        Seal {
            key,
            out: if root { 0 } else { 1 },
            sent: 0,
            received: 0,
        }
    }

    fn tag(
        &self,
        direction: u8,
        n: u64,
        header: &[u8],
        payload: &[u8],
    ) -> hmac::Hmac<sha2::Sha256> {
        let mut m = auth::hmac(&self.key);
        m.update(&[direction]);
        m.update(&n.to_le_bytes());
        m.update(header);
        m.update(payload);
        m
    }

    /// The tag of the next frame this end sends (`header`, whose length already counts the tag,
    /// and `payload`).
    pub(crate) fn seal_next(&mut self, header: &[u8], payload: &[u8]) -> [u8; TAG_LEN] {
        let m = self.tag(self.out, self.sent, header, payload);
        self.sent = self.sent.wrapping_add(1);
        let mut t = [0u8; TAG_LEN];
        t.copy_from_slice(&m.finalize().into_bytes());
        t
    }

    /// Checks the next frame received (`header`, `payload`, then `tag`); `Err` says why not.
    pub(crate) fn open_next(
        &mut self,
        header: &[u8],
        payload: &[u8],
        tag: &[u8],
    ) -> Result<(), String> {
        let n = self.received;
        self.tag(1 - self.out, n, header, payload)
            .verify_slice(tag)
            .map_err(|_| {
                format!(
                    "frame {n} on this connection fails its integrity check: it was altered, \
                     injected, replayed or reordered between the two ranks (or the peer does \
                     not share this connection's key)"
                )
            })?;
        self.received = n.wrapping_add(1);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tags_bind_direction_order_and_every_byte() {
        let key = [7u8; MAC_LEN];
        let (mut root, mut rank) = (Seal::new(key, true), Seal::new(key, false));
        let frames: [(&[u8], &[u8]); 3] =
            [(b"head-1", b"one"), (b"head-2", b""), (b"head-3", b"3")];
        let tags: Vec<_> = frames.iter().map(|(h, p)| root.seal_next(h, p)).collect();
        // In order: every frame opens.
        let mut a = Seal::new(key, false);
        for ((h, p), t) in frames.iter().zip(&tags) {
            a.open_next(h, p, t).unwrap();
        }
        // Altered header, payload or tag; replayed, reordered, dropped; reflected to its sender;
        // another key: each fails.
        let fresh = || Seal::new(key, false);
        assert!(fresh().open_next(b"head-X", b"one", &tags[0]).is_err());
        assert!(fresh().open_next(b"head-1", b"onE", &tags[0]).is_err());
        let mut bad = tags[0];
        bad[31] ^= 1;
        assert!(fresh().open_next(b"head-1", b"one", &bad).is_err());
        assert!(fresh()
            .open_next(b"head-1", b"one", &tags[0][..31])
            .is_err());
        let mut b = fresh();
        b.open_next(b"head-1", b"one", &tags[0]).unwrap();
        assert!(b.open_next(b"head-1", b"one", &tags[0]).is_err(), "replay");
        assert!(
            fresh().open_next(b"head-2", b"", &tags[1]).is_err(),
            "reorder/drop"
        );
        let mut c = Seal::new(key, true);
        assert!(
            c.open_next(b"head-1", b"one", &tags[0]).is_err(),
            "reflection"
        );
        let mut d = Seal::new([8u8; MAC_LEN], false);
        assert!(
            d.open_next(b"head-1", b"one", &tags[0]).is_err(),
            "another key"
        );
        // The other direction has its own numbering.
        let t = rank.seal_next(b"up", b"x");
        Seal::new(key, true).open_next(b"up", b"x", &t).unwrap();
    }
}
