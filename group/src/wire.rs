//! The handshake record's wire constants (magic, protocol, bounds of every field) and the
//! reader of a peer's bytes, with why a record cannot be read ([`BlobError`]). Below the
//! handshake (which encodes and decodes records with it) and [`GroupError`](crate::GroupError)
//! (which wraps [`BlobError`]).

use crate::node::MAX_NODE_ID_LEN;

/// First bytes of every record.
pub const MAGIC: [u8; 4] = *b"EPhs";
/// Version of this record's layout and of the memory protocol it describes (2: the node id;
/// 3: the NCCL sizing, which decides every NCCL message's size on both sides; 4: shrink mode,
/// under which a rank skips the peers it masked, so every rank must run it or none).
pub const PROTOCOL: u8 = 4;
/// This library's version (every rank must run the same build of the layout).
pub const LIBRARY: &str = env!("CARGO_PKG_VERSION");
/// Longest library version string a record may carry.
pub const MAX_VERSION_LEN: usize = 64;
/// Largest payload (IPC handle, NCCL unique id) a record may carry.
pub const MAX_PAYLOAD: usize = 1024;
/// Bytes of a record without its version string and payload.
pub(crate) const FIXED: usize = 4 + 1 + 1 + 8 + 5 * 8 + 5 + 3 * 8 + 2 + 2;
/// Largest blob [`Hello::decode`](crate::handshake::Hello::decode) reads.
pub const MAX_BLOB: usize = FIXED + MAX_VERSION_LEN + MAX_NODE_ID_LEN + MAX_PAYLOAD;
/// Bound of each of R, E, T, H, K on the wire (the config's own limits are checked by
/// `Config::validate`; this only keeps a hostile value from being taken as a size anywhere).
pub const MAX_COUNT: u64 = 1 << 40;
/// Bound of the allocation size on the wire (1 PiB).
pub const MAX_ALLOC: u64 = 1 << 50;

/// Why a peer's record could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlobError {
    #[error("{len} bytes, more than the largest record ({max} bytes)")]
    Oversized { len: usize, max: usize },
    #[error("truncated at {field}: {need} more bytes needed, {have} left")]
    Truncated {
        field: &'static str,
        need: usize,
        have: usize,
    },
    #[error("not a handshake record (magic {found:02x?}, want {:02x?})", MAGIC)]
    BadMagic { found: [u8; 4] },
    #[error("{field} = {value} is out of range ({allowed})")]
    BadField {
        field: &'static str,
        value: u64,
        allowed: &'static str,
    },
    #[error("protocol {found}, this library speaks {}", PROTOCOL)]
    OtherProtocol { found: u8 },
    #[error("the library version is not printable ASCII")]
    BadVersion,
    #[error("the node id is not printable ASCII without spaces")]
    BadNode,
    #[error("{extra} trailing bytes after the payload")]
    Trailing { extra: usize },
}

pub(crate) struct Reader<'a> {
    pub(crate) b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, field: &'static str, n: usize) -> Result<&'a [u8], BlobError> {
        if self.b.len() < n {
            return Err(BlobError::Truncated {
                field,
                need: n,
                have: self.b.len(),
            });
        }
        let (head, tail) = self.b.split_at(n);
        self.b = tail;
        Ok(head)
    }
    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, BlobError> {
        Ok(self.take(field, 1)?[0])
    }
    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, BlobError> {
        Ok(u16::from_le_bytes(
            self.take(field, 2)?.try_into().expect("2 bytes"),
        ))
    }
    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, BlobError> {
        Ok(u64::from_le_bytes(
            self.take(field, 8)?.try_into().expect("8 bytes"),
        ))
    }
}
