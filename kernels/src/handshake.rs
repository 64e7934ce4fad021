//! Process mode's handshake: nothing a peer says about its memory is trusted unchecked.
//!
//! Before any peer allocation is mapped (or any NCCL communicator formed), every rank publishes a
//! [`Hello`]: the library and protocol versions, a fingerprint of the CUDA sources its kernels
//! were compiled from (they define what a peer writes where), the full [`Config`] (mode, `round_scale` and
//! `ue8m0` included), the transport and its NCCL sizing, the wait bound, `zero_copy_local`, its rank, and the byte
//! size of its one allocation. The record travels in the same all-gather round as the CUDA IPC
//! handle (or the NCCL unique id): [`exchange`] prepends it to the caller's payload, and strips
//! and checks every peer's record before handing the payloads back. Every rank compares every
//! peer with itself, so all ranks fail together, before anything is mapped, when any two differ.
//!
//! Decoding is defensive: the length is checked before anything is read (at most [`MAX_BLOB`]
//! bytes), the magic and the protocol byte come first, every field is bounded, and trailing bytes
//! are refused. A malformed record is [`GpuError::PeerBlob`] naming the peer; any difference is
//! [`GpuError::PeerMismatch`] naming the field, both values and both ranks.
//!
//! After a peer's IPC handle is opened, `check_mapping` asks the driver how large the mapped
//! allocation is and refuses one smaller than this rank's layout of it.
//!
//! Wire format (little-endian): `b"EPhs"`, protocol `u8`, library version (`u8` length, 1..=64
//! printable ASCII bytes), kernel fingerprint `u64`, R, E, T, H, K (`u64` each), mode `u8` (0 bf16, 1 fp8), mode flags `u8`
//! (bit 0 round_scale, bit 1 ue8m0; 0 for bf16), transport `u8` (0 auto, 1 nccl, 2 two-tier),
//! zero_copy_local `u8` (0/1), NCCL sizes `u8` (0 exact, 1 capacity), shrink `u8` (0/1), timeout_ns `u64`, rank `u64`, allocation bytes `u64`, node id source
//! `u8` (0 `EP_NODE_ID`, 1 `GROUP_RANK`, 2 hostname), node id (`u8` length, 1..=64 printable ASCII
//! bytes without spaces), payload length `u16` (<= [`MAX_PAYLOAD`]), payload.
//!
//! The node id (`crate::topology`) is the one field peers may differ in: it says which peers
//! share this rank's node (CUDA IPC) and which do not (NCCL, `Transport::TwoTier`). Its source
//! must be the same on every rank (ids of different kinds are never compared).

use crate::error::GpuError;
use crate::runtime::AllGather;
use crate::runtime::{GpuOptions, NcclSizes, Transport};
use crate::topology::{NodeId, NodeSource, MAX_NODE_ID_LEN};
use ep_reference::{Config, Mode};

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
const FIXED: usize = 4 + 1 + 1 + 8 + 5 * 8 + 5 + 3 * 8 + 2 + 2;
/// Largest blob [`Hello::decode`] reads.
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

/// What one rank says about itself (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub protocol: u8,
    pub library: String,
    /// [`kernel_fingerprint`] of the sender's build.
    pub kernels: u64,
    pub config: Config,
    pub transport: Transport,
    /// How NCCL messages are sized (both sides of a message must size it alike).
    pub nccl_sizes: NcclSizes,
    /// Shrink mode ([`GpuOptions::enable_shrink`]).
    pub shrink: bool,
    pub zero_copy_local: bool,
    pub timeout_ns: u64,
    pub rank: usize,
    /// Bytes of this rank's one allocation (the buffer its peers map).
    pub alloc_bytes: u64,
    /// The node this rank runs on (`crate::topology`).
    pub node: NodeId,
}

impl Hello {
    /// This rank's record: this build's versions, `cfg`, `opts` and `node` as given.
    pub fn new(
        cfg: &Config,
        opts: &GpuOptions,
        rank: usize,
        alloc_bytes: usize,
        node: NodeId,
    ) -> Hello {
        Hello {
            protocol: PROTOCOL,
            library: LIBRARY.to_string(),
            kernels: kernel_fingerprint(),
            config: *cfg,
            transport: opts.transport,
            nccl_sizes: opts.nccl_sizes,
            shrink: opts.enable_shrink,
            zero_copy_local: opts.zero_copy_local,
            timeout_ns: opts.timeout_ns,
            rank,
            alloc_bytes: alloc_bytes as u64,
            node,
        }
    }

    /// The record followed by `payload`. Fails (this rank's fault, not a peer's) when the version
    /// string or the payload is longer than a record may carry.
    pub fn encode(&self, payload: &[u8]) -> Result<Vec<u8>, GpuError> {
        let v = self.library.as_bytes();
        let node = self.node.id.as_bytes();
        if v.is_empty()
            || v.len() > MAX_VERSION_LEN
            || payload.len() > MAX_PAYLOAD
            || node.is_empty()
            || node.len() > MAX_NODE_ID_LEN
        {
            return Err(GpuError::Process(format!(
                "handshake: version of {} bytes (1..={MAX_VERSION_LEN}), node id of {} bytes \
                 (1..={MAX_NODE_ID_LEN}) or payload of {} bytes (at most {MAX_PAYLOAD})",
                v.len(),
                node.len(),
                payload.len()
            )));
        }
        let c = &self.config;
        let mut b = Vec::with_capacity(FIXED + v.len() + payload.len());
        b.extend_from_slice(&MAGIC);
        b.push(self.protocol);
        b.push(v.len() as u8);
        b.extend_from_slice(v);
        b.extend_from_slice(&self.kernels.to_le_bytes());
        for n in [
            c.num_ranks,
            c.num_experts,
            c.max_tokens_per_rank,
            c.hidden,
            c.top_k,
        ] {
            b.extend_from_slice(&(n as u64).to_le_bytes());
        }
        let (mode, flags) = match c.mode {
            Mode::Bf16 => (0u8, 0u8),
            Mode::Fp8 { round_scale, ue8m0 } => (1, round_scale as u8 | (ue8m0 as u8) << 1),
        };
        b.push(mode);
        b.push(flags);
        b.push(match self.transport {
            Transport::Auto => 0,
            Transport::Nccl => 1,
            Transport::TwoTier => 2,
        });
        b.push(self.zero_copy_local as u8);
        b.push(match self.nccl_sizes {
            NcclSizes::Exact => 0,
            NcclSizes::Capacity => 1,
        });
        b.push(self.shrink as u8);
        b.extend_from_slice(&self.timeout_ns.to_le_bytes());
        b.extend_from_slice(&(self.rank as u64).to_le_bytes());
        b.extend_from_slice(&self.alloc_bytes.to_le_bytes());
        b.push(self.node.source.wire());
        b.push(node.len() as u8);
        b.extend_from_slice(node);
        b.extend_from_slice(&(payload.len() as u16).to_le_bytes());
        b.extend_from_slice(payload);
        Ok(b)
    }

    /// Reads a record and its payload. Only the magic and the protocol byte are read before the
    /// protocol is known to be this one ([`verify_all`] reports another protocol as a mismatch).
    pub fn decode(blob: &[u8]) -> Result<(Hello, &[u8]), BlobError> {
        if blob.len() > MAX_BLOB {
            return Err(BlobError::Oversized {
                len: blob.len(),
                max: MAX_BLOB,
            });
        }
        let mut r = Reader { b: blob };
        let magic: [u8; 4] = r.take("magic", 4)?.try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(BlobError::BadMagic { found: magic });
        }
        let protocol = r.u8("protocol")?;
        if protocol != PROTOCOL {
            // Another layout: nothing after this byte can be read.
            return Err(BlobError::OtherProtocol { found: protocol });
        }
        let vlen = r.u8("library version length")? as usize;
        if vlen == 0 || vlen > MAX_VERSION_LEN {
            return Err(BlobError::BadField {
                field: "library version length",
                value: vlen as u64,
                allowed: "1..=64",
            });
        }
        let v = r.take("library version", vlen)?;
        if !v.iter().all(|c| (0x20..0x7f).contains(c)) {
            return Err(BlobError::BadVersion);
        }
        let library = String::from_utf8(v.to_vec()).map_err(|_| BlobError::BadVersion)?;
        let kernels = r.u64("kernel fingerprint")?;
        let mut counts = [0usize; 5];
        for (slot, field) in counts.iter_mut().zip([
            "num_ranks",
            "num_experts",
            "max_tokens_per_rank",
            "hidden",
            "top_k",
        ]) {
            let n = r.u64(field)?;
            if n == 0 || n > MAX_COUNT {
                return Err(BlobError::BadField {
                    field,
                    value: n,
                    allowed: "1..=2^40",
                });
            }
            *slot = n as usize;
        }
        let mode_byte = r.u8("mode")?;
        let flags = r.u8("mode flags")?;
        let mode = match (mode_byte, flags) {
            (0, 0) => Mode::Bf16,
            (0, f) => {
                return Err(BlobError::BadField {
                    field: "mode flags",
                    value: f as u64,
                    allowed: "0 for bf16",
                })
            }
            (1, f) if f <= 3 => Mode::Fp8 {
                round_scale: f & 1 != 0,
                ue8m0: f & 2 != 0,
            },
            (1, f) => {
                return Err(BlobError::BadField {
                    field: "mode flags",
                    value: f as u64,
                    allowed: "0..=3 for fp8",
                })
            }
            (m, _) => {
                return Err(BlobError::BadField {
                    field: "mode",
                    value: m as u64,
                    allowed: "0 (bf16) or 1 (fp8)",
                })
            }
        };
        let transport = match r.u8("transport")? {
            0 => Transport::Auto,
            1 => Transport::Nccl,
            2 => Transport::TwoTier,
            t => {
                return Err(BlobError::BadField {
                    field: "transport",
                    value: t as u64,
                    allowed: "0 (auto), 1 (nccl) or 2 (two-tier)",
                })
            }
        };
        let zero_copy_local = match r.u8("zero_copy_local")? {
            0 => false,
            1 => true,
            z => {
                return Err(BlobError::BadField {
                    field: "zero_copy_local",
                    value: z as u64,
                    allowed: "0 or 1",
                })
            }
        };
        let nccl_sizes = match r.u8("nccl_sizes")? {
            0 => NcclSizes::Exact,
            1 => NcclSizes::Capacity,
            z => {
                return Err(BlobError::BadField {
                    field: "nccl_sizes",
                    value: z as u64,
                    allowed: "0 (exact) or 1 (capacity)",
                })
            }
        };
        let shrink = match r.u8("shrink")? {
            0 => false,
            1 => true,
            z => {
                return Err(BlobError::BadField {
                    field: "shrink",
                    value: z as u64,
                    allowed: "0 or 1",
                })
            }
        };
        let timeout_ns = r.u64("timeout_ns")?;
        let rank = r.u64("rank")?;
        if rank >= counts[0] as u64 {
            return Err(BlobError::BadField {
                field: "rank",
                value: rank,
                allowed: "below num_ranks",
            });
        }
        let alloc_bytes = r.u64("allocation bytes")?;
        if alloc_bytes == 0 || alloc_bytes > MAX_ALLOC {
            return Err(BlobError::BadField {
                field: "allocation bytes",
                value: alloc_bytes,
                allowed: "1..=2^50",
            });
        }
        let src = r.u8("node id source")?;
        let source = NodeSource::from_wire(src).ok_or(BlobError::BadField {
            field: "node id source",
            value: src as u64,
            allowed: "0 (EP_NODE_ID), 1 (GROUP_RANK) or 2 (hostname)",
        })?;
        let nlen = r.u8("node id length")? as usize;
        if nlen == 0 || nlen > MAX_NODE_ID_LEN {
            return Err(BlobError::BadField {
                field: "node id length",
                value: nlen as u64,
                allowed: "1..=64",
            });
        }
        let n = r.take("node id", nlen)?;
        if !n.iter().all(|c| (0x21..0x7f).contains(c)) {
            return Err(BlobError::BadNode);
        }
        let node = NodeId {
            source,
            id: String::from_utf8(n.to_vec()).map_err(|_| BlobError::BadNode)?,
        };
        let plen = r.u16("payload length")? as usize;
        if plen > MAX_PAYLOAD {
            return Err(BlobError::BadField {
                field: "payload length",
                value: plen as u64,
                allowed: "0..=1024",
            });
        }
        let payload = r.take("payload", plen)?;
        if !r.b.is_empty() {
            return Err(BlobError::Trailing { extra: r.b.len() });
        }
        let config = Config {
            num_ranks: counts[0],
            num_experts: counts[1],
            max_tokens_per_rank: counts[2],
            hidden: counts[3],
            top_k: counts[4],
            mode,
        };
        Ok((
            Hello {
                protocol,
                library,
                kernels,
                config,
                transport,
                nccl_sizes,
                shrink,
                zero_copy_local,
                timeout_ns,
                rank: rank as usize,
                alloc_bytes,
                node,
            },
            payload,
        ))
    }

    /// Compares `theirs` (the record at position `peer` of the exchange) with this rank's own:
    /// the first difference, in wire order, is [`GpuError::PeerMismatch`].
    pub fn compare(&self, theirs: &Hello, peer: usize) -> Result<(), GpuError> {
        let mismatch = |field: &'static str, ours: String, theirs: String| {
            Err(GpuError::PeerMismatch {
                field,
                ours,
                theirs,
                rank: self.rank,
                peer,
            })
        };
        macro_rules! same {
            ($field:expr, $a:expr, $b:expr) => {
                if $a != $b {
                    return mismatch($field, format!("{:?}", $a), format!("{:?}", $b));
                }
            };
        }
        same!("protocol version", self.protocol, theirs.protocol);
        same!("library version", self.library, theirs.library);
        if self.kernels != theirs.kernels {
            return mismatch(
                "kernel sources (fingerprint)",
                format!("{:016x}", self.kernels),
                format!("{:016x}", theirs.kernels),
            );
        }
        let (a, b) = (&self.config, &theirs.config);
        same!("num_ranks (world size)", a.num_ranks, b.num_ranks);
        same!("num_experts", a.num_experts, b.num_experts);
        same!(
            "max_tokens_per_rank",
            a.max_tokens_per_rank,
            b.max_tokens_per_rank
        );
        same!("hidden", a.hidden, b.hidden);
        same!("top_k", a.top_k, b.top_k);
        let kind = |m: Mode| if m.is_fp8() { "fp8" } else { "bf16" };
        if kind(a.mode) != kind(b.mode) {
            return mismatch("mode", kind(a.mode).into(), kind(b.mode).into());
        }
        let flags = |m: Mode| match m {
            Mode::Bf16 => (false, false),
            Mode::Fp8 { round_scale, ue8m0 } => (round_scale, ue8m0),
        };
        let (fa, fb) = (flags(a.mode), flags(b.mode));
        same!("round_scale", fa.0, fb.0);
        same!("ue8m0", fa.1, fb.1);
        same!("transport", self.transport, theirs.transport);
        same!(
            "zero_copy_local",
            self.zero_copy_local,
            theirs.zero_copy_local
        );
        same!("nccl_sizes", self.nccl_sizes, theirs.nccl_sizes);
        same!("shrink", self.shrink, theirs.shrink);
        same!("timeout_ns", self.timeout_ns, theirs.timeout_ns);
        if theirs.rank != peer {
            return mismatch(
                "rank (position in the exchange)",
                peer.to_string(),
                theirs.rank.to_string(),
            );
        }
        same!("allocation bytes", self.alloc_bytes, theirs.alloc_bytes);
        // The node ids themselves may differ (that is what they are for); their kinds may not.
        same!(
            "node id source",
            self.node.source.name(),
            theirs.node.source.name()
        );
        Ok(())
    }
}

/// FNV-1a (64 bit) over every CUDA source the kernels are compiled from, in a fixed order: two
/// builds whose kernels could lay out or signal differently get different fingerprints.
pub fn kernel_fingerprint() -> u64 {
    use crate::compile::{BATCHED, COMMON_CUH, FP8, FP8_CUH, PER_EXPERT};
    fingerprint(&[
        COMMON_CUH,
        FP8_CUH,
        FP8.source,
        PER_EXPERT.source,
        BATCHED.source,
    ])
}

/// FNV-1a (64 bit) over `sources`, each followed by a NUL (so bytes cannot move between them).
fn fingerprint(sources: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for src in sources {
        for &byte in src.as_bytes().iter().chain(&[0u8]) {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, field: &'static str, n: usize) -> Result<&'a [u8], BlobError> {
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
    fn u8(&mut self, field: &'static str) -> Result<u8, BlobError> {
        Ok(self.take(field, 1)?[0])
    }
    fn u16(&mut self, field: &'static str) -> Result<u16, BlobError> {
        Ok(u16::from_le_bytes(
            self.take(field, 2)?.try_into().expect("2 bytes"),
        ))
    }
    fn u64(&mut self, field: &'static str) -> Result<u64, BlobError> {
        Ok(u64::from_le_bytes(
            self.take(field, 8)?.try_into().expect("8 bytes"),
        ))
    }
}

/// Checks every rank's blob of one all-gather round against `ours` and returns the payloads in
/// rank order. `all` must hold exactly one blob per rank of `ours.config`.
pub fn verify_all(ours: &Hello, all: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, GpuError> {
    Ok(verify_records(ours, all)?
        .into_iter()
        .map(|(_, p)| p)
        .collect())
}

/// [`verify_all`], with every rank's checked record beside its payload.
pub fn verify_records(ours: &Hello, all: &[Vec<u8>]) -> Result<Vec<(Hello, Vec<u8>)>, GpuError> {
    let world = ours.config.num_ranks;
    if all.len() != world {
        return Err(GpuError::Process(format!(
            "rank {}: the handshake exchange returned {} blobs, want one per rank ({world})",
            ours.rank,
            all.len()
        )));
    }
    let mut payloads = Vec::with_capacity(world);
    for (peer, blob) in all.iter().enumerate() {
        let (theirs, payload) = match Hello::decode(blob) {
            Ok(x) => x,
            Err(BlobError::OtherProtocol { found }) => {
                return Err(GpuError::PeerMismatch {
                    field: "protocol version",
                    ours: ours.protocol.to_string(),
                    theirs: found.to_string(),
                    rank: ours.rank,
                    peer,
                })
            }
            Err(error) => {
                return Err(GpuError::PeerBlob {
                    rank: ours.rank,
                    peer,
                    error,
                })
            }
        };
        ours.compare(&theirs, peer)?;
        payloads.push((theirs, payload.to_vec()));
    }
    Ok(payloads)
}

/// One all-gather round carrying `ours` and `payload`: every peer's record is checked (see
/// [`verify_all`]) and the payloads come back in rank order.
pub fn exchange(
    all_gather: &mut AllGather<'_>,
    ours: &Hello,
    payload: &[u8],
) -> Result<Vec<Vec<u8>>, GpuError> {
    Ok(exchange_records(all_gather, ours, payload)?
        .into_iter()
        .map(|(_, p)| p)
        .collect())
}

/// [`exchange`], with every rank's checked record (its node, above all) beside its payload.
pub fn exchange_records(
    all_gather: &mut AllGather<'_>,
    ours: &Hello,
    payload: &[u8],
) -> Result<Vec<(Hello, Vec<u8>)>, GpuError> {
    let blob = ours.encode(payload)?;
    let all = all_gather(&blob).map_err(GpuError::Process)?;
    verify_records(ours, &all)
}

/// After rank `rank` opened `peer`'s IPC handle at `p`: the mapped allocation must start at `p`
/// and hold at least `need` bytes (this rank's layout of the peer's buffers). On failure the
/// mapping is closed here and the error names both ranks and both sizes.
pub(crate) fn check_mapping(
    rank: usize,
    peer: usize,
    p: cudarc::driver::sys::CUdeviceptr,
    need: usize,
) -> Result<(), GpuError> {
    use cudarc::driver::sys;
    let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
    // SAFETY: `p` is a live mapping opened by cuIpcOpenMemHandle on the bound context; the
    // driver writes the two out-parameters only.
    let rc = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, p) };
    let err = if rc != sys::CUresult::CUDA_SUCCESS {
        Some(GpuError::Cuda(format!(
            "cuMemGetAddressRange on rank {peer}'s mapped buffer (rank {rank}): {rc:?}"
        )))
    } else if base != p || size < need {
        Some(GpuError::PeerMismatch {
            field: "mapped allocation bytes",
            ours: format!("{need} bytes at the handle's address"),
            theirs: format!("{size} bytes, {} bytes in", p.wrapping_sub(base)),
            rank,
            peer,
        })
    } else {
        None
    };
    match err {
        None => Ok(()),
        Some(e) => {
            // SAFETY: `p` was opened with cuIpcOpenMemHandle and is not used after this.
            let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(mode: Mode) -> Config {
        Config::new(4, 16, 64, 1024, 4, mode).unwrap()
    }

    fn node(id: &str) -> NodeId {
        NodeId::named(id).unwrap()
    }

    fn hello(rank: usize) -> Hello {
        Hello::new(
            &cfg(Mode::FP8_ROUND),
            &GpuOptions::default(),
            rank,
            1 << 20,
            node("n0"),
        )
    }

    #[test]
    fn a_record_round_trips_with_its_payload() {
        for mode in [Mode::Bf16, Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0] {
            for (transport, nccl_sizes) in [
                (Transport::Auto, NcclSizes::Exact),
                (Transport::Nccl, NcclSizes::Capacity),
                (Transport::TwoTier, NcclSizes::Exact),
            ] {
                let opts = GpuOptions {
                    transport,
                    nccl_sizes,
                    timeout_ns: u64::MAX,
                    zero_copy_local: false,
                    ..Default::default()
                };
                let n = NodeId {
                    source: NodeSource::Hostname,
                    id: "gpu-host-7.example".into(),
                };
                let h = Hello::new(&cfg(mode), &opts, 3, 123_456, n);
                let payload: Vec<u8> = (0..192u8).collect();
                let blob = h.encode(&payload).unwrap();
                let (back, p) = Hello::decode(&blob).unwrap();
                assert_eq!(back, h);
                assert_eq!(p, &payload[..]);
                assert!(h.compare(&back, 3).is_ok());
            }
        }
    }

    #[test]
    fn the_kernel_fingerprint_sees_every_byte_and_boundary() {
        let base = fingerprint(&["__global__ void f() {}", "int x;"]);
        assert_eq!(base, fingerprint(&["__global__ void f() {}", "int x;"]));
        assert_ne!(base, fingerprint(&["__global__ void f() {}", "int y;"]));
        assert_ne!(base, fingerprint(&["__global__ void f() {} ", "int x;"]));
        assert_ne!(base, fingerprint(&["__global__ void f() {}int x;", ""]));
        assert_eq!(kernel_fingerprint(), hello(0).kernels);
        assert_ne!(kernel_fingerprint(), fingerprint(&[]));
    }

    #[test]
    fn every_truncation_is_a_typed_error() {
        let blob = hello(1).encode(&[7u8; 64]).unwrap();
        for len in 0..blob.len() {
            match Hello::decode(&blob[..len]) {
                Err(BlobError::Truncated { need, have, .. }) => assert!(have < need),
                other => panic!("{len} of {} bytes: {other:?}", blob.len()),
            }
        }
    }

    #[test]
    fn oversized_and_trailing_bytes_are_refused() {
        let mut blob = hello(0).encode(&[1u8; 64]).unwrap();
        blob.push(0);
        assert_eq!(Hello::decode(&blob), Err(BlobError::Trailing { extra: 1 }));
        let big = vec![0u8; MAX_BLOB + 1];
        assert_eq!(
            Hello::decode(&big),
            Err(BlobError::Oversized {
                len: MAX_BLOB + 1,
                max: MAX_BLOB
            })
        );
        // A payload length past the bound is refused before anything is read for it.
        let blob = hello(0).encode(&[]).unwrap();
        let mut b = blob.clone();
        let at = b.len() - 2;
        b[at..].copy_from_slice(&(MAX_PAYLOAD as u16 + 1).to_le_bytes());
        assert!(matches!(
            Hello::decode(&b),
            Err(BlobError::BadField {
                field: "payload length",
                ..
            })
        ));
        // Encoding refuses what decoding would refuse.
        assert!(hello(0).encode(&vec![0u8; MAX_PAYLOAD + 1]).is_err());
    }

    #[test]
    fn the_old_bare_handle_blob_is_not_a_record() {
        // What new_process sent before the handshake: 64 handle bytes (+ a 128-byte NCCL id).
        assert!(matches!(
            Hello::decode(&[0u8; 64]),
            Err(BlobError::BadMagic { .. })
        ));
        assert!(matches!(
            Hello::decode(&[0xabu8; 192]),
            Err(BlobError::BadMagic { .. })
        ));
    }

    /// Offsets of the fixed fields in a record whose version string has `v` bytes.
    fn offsets(v: usize) -> (usize, usize) {
        let counts = 4 + 1 + 1 + v + 8;
        (counts, counts + 5 * 8) // (R, mode byte)
    }

    #[test]
    fn every_field_is_bounded() {
        let h = hello(2);
        let blob = h.encode(&[]).unwrap();
        let v = h.library.len();
        let (counts, mode) = offsets(v);
        let patch = |at: usize, bytes: &[u8]| {
            let mut b = blob.clone();
            b[at..at + bytes.len()].copy_from_slice(bytes);
            Hello::decode(&b).map(|(h, _)| h)
        };
        let field_of = |r: Result<Hello, BlobError>| match r {
            Err(BlobError::BadField { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        // Version length 0 and 65, and a non-printable version.
        assert_eq!(field_of(patch(5, &[0])), "library version length");
        assert_eq!(field_of(patch(5, &[65])), "library version length");
        assert_eq!(patch(6, &[0x07]), Err(BlobError::BadVersion));
        // Each count: 0 and 2^40 + 1.
        for (i, name) in [
            "num_ranks",
            "num_experts",
            "max_tokens_per_rank",
            "hidden",
            "top_k",
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(field_of(patch(counts + 8 * i, &0u64.to_le_bytes())), name);
            assert_eq!(
                field_of(patch(counts + 8 * i, &(MAX_COUNT + 1).to_le_bytes())),
                name
            );
        }
        assert_eq!(field_of(patch(mode, &[2])), "mode");
        assert_eq!(field_of(patch(mode, &[0, 1])), "mode flags");
        assert_eq!(field_of(patch(mode, &[1, 4])), "mode flags");
        assert_eq!(field_of(patch(mode + 2, &[3])), "transport");
        assert_eq!(field_of(patch(mode + 3, &[2])), "zero_copy_local");
        assert_eq!(field_of(patch(mode + 4, &[2])), "nccl_sizes");
        assert_eq!(field_of(patch(mode + 5, &[2])), "shrink");
        // rank >= R (R = 4), allocation 0 and > 2^50.
        let rank_at = mode + 6 + 8;
        assert_eq!(field_of(patch(rank_at, &4u64.to_le_bytes())), "rank");
        assert_eq!(
            field_of(patch(rank_at + 8, &0u64.to_le_bytes())),
            "allocation bytes"
        );
        assert_eq!(
            field_of(patch(rank_at + 8, &(MAX_ALLOC + 1).to_le_bytes())),
            "allocation bytes"
        );
        // The node id: its source, its length (0, 65, past the record) and its bytes.
        let node_at = rank_at + 16;
        assert_eq!(field_of(patch(node_at, &[3])), "node id source");
        assert_eq!(field_of(patch(node_at + 1, &[0])), "node id length");
        assert_eq!(field_of(patch(node_at + 1, &[65])), "node id length");
        assert!(matches!(
            patch(node_at + 1, &[40]),
            Err(BlobError::Truncated {
                field: "node id",
                ..
            })
        ));
        assert_eq!(patch(node_at + 2, b" "), Err(BlobError::BadNode));
        assert_eq!(patch(node_at + 2, &[0x7f]), Err(BlobError::BadNode));
        let back = patch(node_at, &[1, 2, b'1', b'7']).unwrap();
        assert_eq!(
            back.node,
            NodeId {
                source: NodeSource::GroupRank,
                id: "17".into()
            }
        );
        // Any timeout is meaningful: u64::MAX decodes.
        let back = patch(mode + 6, &u64::MAX.to_le_bytes()).unwrap();
        assert_eq!(back.timeout_ns, u64::MAX);
        // Bad magic.
        assert!(matches!(patch(0, b"EPhX"), Err(BlobError::BadMagic { .. })));
    }

    fn mismatch(ours: &Hello, theirs: &Hello, peer: usize) -> (&'static str, String, String) {
        let blob = theirs.encode(&[0u8; 64]).unwrap();
        let all: Vec<Vec<u8>> = (0..ours.config.num_ranks)
            .map(|p| {
                if p == peer {
                    blob.clone()
                } else {
                    let mut h = ours.clone();
                    h.rank = p;
                    h.encode(&[0u8; 64]).unwrap()
                }
            })
            .collect();
        match verify_all(ours, &all) {
            Err(GpuError::PeerMismatch {
                field,
                ours: a,
                theirs: b,
                rank,
                peer: p,
            }) => {
                assert_eq!((rank, p), (ours.rank, peer));
                (field, a, b)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_differing_field_is_named_with_both_values() {
        let ours = hello(0);
        let peer = 2;
        let base = hello(peer);
        let with = |f: &dyn Fn(&mut Hello)| {
            let mut h = base.clone();
            f(&mut h);
            h
        };
        let cases: Vec<(Hello, &str, &str, &str)> = vec![
            (
                with(&|h| h.library = "9.9.9".into()),
                "library version",
                "",
                "\"9.9.9\"",
            ),
            (
                with(&|h| h.kernels ^= 1),
                "kernel sources (fingerprint)",
                "",
                "",
            ),
            (
                with(&|h| h.config.num_experts = 32),
                "num_experts",
                "16",
                "32",
            ),
            (
                with(&|h| h.config.max_tokens_per_rank = 128),
                "max_tokens_per_rank",
                "64",
                "128",
            ),
            (with(&|h| h.config.hidden = 2048), "hidden", "1024", "2048"),
            (with(&|h| h.config.top_k = 8), "top_k", "4", "8"),
            (with(&|h| h.config.mode = Mode::Bf16), "mode", "fp8", "bf16"),
            (
                with(&|h| h.config.mode = Mode::FP8),
                "round_scale",
                "true",
                "false",
            ),
            (
                with(&|h| h.config.mode = Mode::FP8_UE8M0),
                "ue8m0",
                "false",
                "true",
            ),
            (
                with(&|h| h.transport = Transport::Nccl),
                "transport",
                "Auto",
                "Nccl",
            ),
            (
                with(&|h| h.nccl_sizes = NcclSizes::Capacity),
                "nccl_sizes",
                "Exact",
                "Capacity",
            ),
            (with(&|h| h.shrink = true), "shrink", "false", "true"),
            (
                with(&|h| h.zero_copy_local = false),
                "zero_copy_local",
                "true",
                "false",
            ),
            (with(&|h| h.timeout_ns = 5), "timeout_ns", "2000000000", "5"),
            (
                with(&|h| h.rank = 1),
                "rank (position in the exchange)",
                "2",
                "1",
            ),
            (
                with(&|h| h.alloc_bytes = 4096),
                "allocation bytes",
                "1048576",
                "4096",
            ),
            (
                with(&|h| {
                    h.node = NodeId {
                        source: NodeSource::Hostname,
                        id: "n0".into(),
                    }
                }),
                "node id source",
                "\"EP_NODE_ID\"",
                "\"hostname\"",
            ),
            (
                with(&|h| h.transport = Transport::TwoTier),
                "transport",
                "Auto",
                "TwoTier",
            ),
        ];
        for (theirs, field, a, b) in cases {
            let (f, got_a, got_b) = mismatch(&ours, &theirs, peer);
            assert_eq!(f, field);
            if !a.is_empty() {
                assert_eq!(got_a, a, "{field}");
            }
            if !b.is_empty() {
                assert_eq!(got_b, b, "{field}");
            }
            assert_ne!(got_a, got_b, "{field}");
        }
        // R differs: a peer with R = 8 is named (its rank 2 < 8 still decodes).
        let theirs = with(&|h| {
            h.config.num_ranks = 8;
            h.config.num_experts = 32
        });
        let (f, a, b) = mismatch(&ours, &theirs, peer);
        assert_eq!(
            (f, a.as_str(), b.as_str()),
            ("num_ranks (world size)", "4", "8")
        );
    }

    #[test]
    fn peers_on_other_nodes_are_accepted_and_their_nodes_come_back() {
        let ours = hello(1);
        let all: Vec<Vec<u8>> = (0..4)
            .map(|r| {
                let mut h = hello(r);
                h.node = node(&format!("n{}", r / 2));
                h.encode(&[r as u8]).unwrap()
            })
            .collect();
        let recs = verify_records(&ours, &all).unwrap();
        let nodes: Vec<&str> = recs.iter().map(|(h, _)| h.node.id.as_str()).collect();
        assert_eq!(nodes, ["n0", "n0", "n1", "n1"]);
        let payloads: Vec<Vec<u8>> = recs.into_iter().map(|(_, p)| p).collect();
        assert_eq!(payloads, vec![vec![0], vec![1], vec![2], vec![3]]);
        // A node id too long to encode is this rank's error, before anything is sent.
        let mut h = hello(0);
        h.node.id = "n".repeat(65);
        assert!(matches!(h.encode(&[]), Err(GpuError::Process(_))));
    }

    #[test]
    fn another_protocol_is_a_mismatch_not_garbage() {
        let ours = hello(0);
        let mut blob = hello(1).encode(&[]).unwrap();
        blob[4] = PROTOCOL + 1;
        assert_eq!(
            Hello::decode(&blob),
            Err(BlobError::OtherProtocol {
                found: PROTOCOL + 1
            })
        );
        let mut all: Vec<Vec<u8>> = (0..4).map(|r| hello(r).encode(&[]).unwrap()).collect();
        all[1] = blob;
        match verify_all(&ours, &all) {
            Err(GpuError::PeerMismatch {
                field,
                ours,
                theirs,
                rank,
                peer,
            }) => {
                assert_eq!((field, rank, peer), ("protocol version", 0, 1));
                assert_eq!(
                    (ours, theirs),
                    (PROTOCOL.to_string(), (PROTOCOL + 1).to_string())
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_malformed_blob_names_the_peer_and_a_short_exchange_is_refused() {
        let ours = hello(0);
        let good = |r: usize| hello(r).encode(&[0u8; 64]).unwrap();
        let all = vec![good(0), good(1), vec![0u8; 10], good(3)];
        match verify_all(&ours, &all) {
            Err(GpuError::PeerBlob { rank, peer, error }) => {
                assert_eq!((rank, peer), (0, 2));
                assert!(matches!(error, BlobError::BadMagic { .. }), "{error}");
            }
            other => panic!("{other:?}"),
        }
        let all = vec![good(0), good(1), good(2)];
        assert!(matches!(verify_all(&ours, &all), Err(GpuError::Process(_))));
        let all: Vec<Vec<u8>> = (0..4).map(good).collect();
        let payloads = verify_all(&ours, &all).unwrap();
        assert_eq!(payloads, vec![vec![0u8; 64]; 4]);
    }

    #[test]
    fn exchange_sends_the_record_and_strips_it() {
        let ours = hello(1);
        let mut seen = Vec::new();
        let mut ag = |b: &[u8]| -> Result<Vec<Vec<u8>>, String> {
            seen = b.to_vec();
            Ok((0..4)
                .map(|r| {
                    if r == 1 {
                        b.to_vec()
                    } else {
                        hello(r).encode(&[r as u8; 3]).unwrap()
                    }
                })
                .collect())
        };
        let payloads = exchange(&mut ag, &ours, &[9, 9]).unwrap();
        assert_eq!(
            payloads,
            vec![vec![0; 3], vec![9, 9], vec![2; 3], vec![3; 3]]
        );
        assert_eq!(Hello::decode(&seen).unwrap().0, ours);
        let mut failing = |_: &[u8]| -> Result<Vec<Vec<u8>>, String> { Err("peer gone".into()) };
        assert_eq!(
            exchange(&mut failing, &ours, &[]),
            Err(GpuError::Process("peer gone".into()))
        );
    }
}
