//! Who may join a job: a shared secret (the *job token*) and challenge-response proofs.
//!
//! Every rank of a job holds the same token: [`spawn_local`](crate::launcher::spawn_local) makes
//! a fresh random one for its children; under an external launcher (torchrun across nodes) the
//! operator sets `EP_JOB_TOKEN` to the same value on every node. The token itself never crosses
//! the network. Rank 0 sends each new connection a fresh random nonce; the connecting rank
//! answers with its own nonce and `HMAC-SHA256(token, "hello" | server nonce | client nonce |
//! rank | world size | job id)`; rank 0 then proves itself with the same MAC under the label
//! `"admit"`, before the rank sends anything of value (IPC handles, an NCCL id). A stranger
//! without the token can do neither, and a recorded exchange cannot be replayed (fresh nonces on
//! both sides).
//!
//! The connection is then bound to that exchange: both sides derive a *session key*,
//! `HMAC-SHA256(token, "session" | server nonce | client nonce | rank | world size | job id)`
//! (`session_key`), and every later frame in either direction carries an HMAC-SHA256 tag under
//! it over its direction, its number on the connection and its bytes (see the rendezvous' wire
//! format). A relay in the middle can neither alter, inject, replay, reorder nor reflect a frame
//! (the NCCL unique id, CUDA IPC handles, failure reports) without the rank that reads it
//! failing with an authentication error naming the peer. The frames are not encrypted: someone
//! who can read the traffic can read the blobs, so the rendezvous still belongs on a network
//! that only the cluster reads (a cluster's private fabric), as with NCCL itself.
//!
//! No cryptography of our own: HMAC and SHA-256 come from RustCrypto's `hmac` and `sha2` crates,
//! MAC comparison is theirs (constant time), randomness is the OS's (`getrandom`).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of a nonce (each side draws one per handshake).
pub const NONCE_LEN: usize = 32;
/// Bytes of a proof (HMAC-SHA256).
pub const MAC_LEN: usize = 32;
/// The shortest token accepted: 16 bytes (128 bits if random; `openssl rand -hex 32` gives 64).
pub const MIN_TOKEN_LEN: usize = 16;
/// The longest job id accepted (it is hashed into every proof).
pub const MAX_JOB_ID_LEN: usize = 1024;

/// The job's shared secret. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct JobToken(Vec<u8>);

impl std::fmt::Debug for JobToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "JobToken(<{} bytes, hidden>)", self.0.len())
    }
}

/// A token that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    #[error("a job token must be at least {MIN_TOKEN_LEN} bytes, got {len} (e.g. `openssl rand -hex 32`)")]
    TooShort { len: usize },
    #[error("the operating system gave no random bytes: {cause}")]
    NoRandomness { cause: String },
}

impl JobToken {
    /// A token from the given secret bytes (at least [`MIN_TOKEN_LEN`]).
    pub fn new(secret: impl Into<Vec<u8>>) -> Result<Self, TokenError> {
        let secret = secret.into();
        if secret.len() < MIN_TOKEN_LEN {
            return Err(TokenError::TooShort { len: secret.len() });
        }
        Ok(JobToken(secret))
    }

    /// A fresh token: 32 random bytes, hex-encoded (so it can travel in an environment
    /// variable). Returns the token and its text.
    pub fn generate() -> Result<(Self, String), TokenError> {
        let raw: [u8; 32] = random()?;
        let text: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        Ok((JobToken(text.clone().into_bytes()), text))
    }
}

/// `N` random bytes from the OS.
pub(crate) fn random<const N: usize>() -> Result<[u8; N], TokenError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| TokenError::NoRandomness {
        cause: e.to_string(),
    })?;
    Ok(b)
}

/// Which side a proof is for: the same inputs under two labels, so one side's proof is never
/// valid as the other's (and a third label for the session key, which never travels).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The connecting rank proves it holds the token.
    Hello,
    /// Rank 0 proves it holds the token.
    Admit,
    /// The key that authenticates the connection's later frames.
    Session,
}

/// What a proof binds: both nonces, the claimed rank and world size, and the job id.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claim<'a> {
    pub server_nonce: &'a [u8; NONCE_LEN],
    pub client_nonce: &'a [u8; NONCE_LEN],
    pub rank: u32,
    pub world: u32,
    pub job_id: &'a str,
}

/// HMAC-SHA256 under `key` (any length).
pub(crate) fn hmac(key: &[u8]) -> Hmac<Sha256> {
    // HMAC accepts keys of any length; new_from_slice cannot fail for it.
    <Hmac<Sha256> as Mac>::new_from_slice(key)
        .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"))
}

fn mac(secret: &[u8], role: Role, c: &Claim<'_>) -> Hmac<Sha256> {
    let mut m = hmac(secret);
    // Every field has a fixed length or a length prefix, so the input is unambiguous. The
    // labels name the protocol version: a proof of another version is never valid.
    m.update(match role {
        Role::Hello => b"ep-launch rendezvous v3 hello\0",
        Role::Admit => b"ep-launch rendezvous v3 admit\0",
        Role::Session => b"ep-launch rendezvous v3 session\0",
    });
    m.update(c.server_nonce);
    m.update(c.client_nonce);
    m.update(&c.rank.to_le_bytes());
    m.update(&c.world.to_le_bytes());
    m.update(&(c.job_id.len() as u64).to_le_bytes());
    m.update(c.job_id.as_bytes());
    m
}

fn finish(m: Hmac<Sha256>) -> [u8; MAC_LEN] {
    let out = m.finalize().into_bytes();
    let mut b = [0u8; MAC_LEN];
    b.copy_from_slice(&out);
    b
}

/// The proof for `role` over `claim`.
pub(crate) fn prove(token: &JobToken, role: Role, claim: &Claim<'_>) -> [u8; MAC_LEN] {
    finish(mac(&token.0, role, claim))
}

/// Whether `proof` is the proof for `role` over `claim` (constant-time comparison).
pub(crate) fn check(token: &JobToken, role: Role, claim: &Claim<'_>, proof: &[u8]) -> bool {
    mac(&token.0, role, claim).verify_slice(proof).is_ok()
}

/// The key of one connection, derived from its handshake (HMAC-SHA256 as the KDF, under the
/// token, over both nonces, the rank, the world size and the job id): fresh for every
/// connection, known only to the two ends. Without a token (a job that trusts everyone who can
/// reach the port) the key is derived from the handshake alone: the tags then catch corruption
/// and confusion between connections, not an attacker.
pub(crate) fn session_key(token: Option<&JobToken>, claim: &Claim<'_>) -> [u8; MAC_LEN] {
    finish(mac(token.map_or(&[][..], |t| &t.0), Role::Session, claim))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_bind_every_field_and_the_role() {
        let t = JobToken::new(*b"0123456789abcdef").unwrap();
        let (sn, cn) = ([1u8; NONCE_LEN], [2u8; NONCE_LEN]);
        let c = Claim {
            server_nonce: &sn,
            client_nonce: &cn,
            rank: 3,
            world: 8,
            job_id: "job",
        };
        let p = prove(&t, Role::Hello, &c);
        assert!(check(&t, Role::Hello, &c, &p));
        assert!(!check(&t, Role::Admit, &c, &p), "roles must differ");
        // The session key is neither proof, and depends on the token and the handshake.
        let k = session_key(Some(&t), &c);
        assert!(k != p && k != prove(&t, Role::Admit, &c));
        assert_ne!(k, session_key(None, &c));
        assert_ne!(k, session_key(Some(&t), &Claim { rank: 4, ..c }));
        let other = JobToken::new(*b"0123456789abcdeX").unwrap();
        assert!(!check(&other, Role::Hello, &c, &p));
        let (sn2, cn2) = ([9u8; NONCE_LEN], [9u8; NONCE_LEN]);
        for changed in [
            Claim {
                server_nonce: &sn2,
                ..c
            },
            Claim {
                client_nonce: &cn2,
                ..c
            },
            Claim { rank: 4, ..c },
            Claim { world: 9, ..c },
            Claim { job_id: "jo", ..c },
        ] {
            assert!(!check(&t, Role::Hello, &changed, &p), "{changed:?}");
        }
        assert!(!check(&t, Role::Hello, &c, &p[..31]));
        assert!(!check(&t, Role::Hello, &c, &[0u8; MAC_LEN]));
    }

    #[test]
    fn tokens_are_long_enough_random_and_hidden() {
        assert_eq!(
            JobToken::new(*b"short").unwrap_err(),
            TokenError::TooShort { len: 5 }
        );
        let (a, text) = JobToken::generate().unwrap();
        let (b, _) = JobToken::generate().unwrap();
        assert_ne!(a, b);
        assert_eq!(text.len(), 64);
        assert!(!format!("{a:?}").contains(&text));
        assert_eq!(JobToken::new(text.into_bytes()).unwrap(), a);
    }
}
