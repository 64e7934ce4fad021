//! The handshake record ([`Hello`]): what one rank says about itself, its encoder and its
//! defensive decoder (the wire format: [`crate::handshake`]), and the fingerprint of the
//! kernels' sources.

use crate::error::GroupError;
use crate::node::{NodeId, NodeSource, MAX_NODE_ID_LEN};
use crate::wire::{
    BlobError, Reader, FIXED, LIBRARY, MAGIC, MAX_ALLOC, MAX_BLOB, MAX_COUNT, MAX_PAYLOAD,
    MAX_VERSION_LEN, PROTOCOL,
};
use ep_kernels::runtime::{GpuOptions, NcclSizes, Transport};
use ep_reference::{Config, Mode};

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
    pub fn encode(&self, payload: &[u8]) -> Result<Vec<u8>, GroupError> {
        let v = self.library.as_bytes();
        let node = self.node.id.as_bytes();
        if v.is_empty()
            || v.len() > MAX_VERSION_LEN
            || payload.len() > MAX_PAYLOAD
            || node.is_empty()
            || node.len() > MAX_NODE_ID_LEN
        {
            return Err(GroupError::Process(format!(
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
    /// protocol is known to be this one ([`verify_all`](crate::handshake::verify_all) reports another protocol as a mismatch).
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
}

/// FNV-1a (64 bit) over every CUDA source the kernels are compiled from, in a fixed order: two
/// builds whose kernels could lay out or signal differently get different fingerprints.
pub fn kernel_fingerprint() -> u64 {
    use ep_kernels::compile::{BATCHED, FP8, HEADERS, PER_EXPERT};
    let families = [FP8.source, PER_EXPERT.source, BATCHED.source];
    fingerprint(&[&HEADERS[..], &families[..]].concat())
}

/// FNV-1a (64 bit) over `sources`, each followed by a NUL (so bytes cannot move between them).
pub(crate) fn fingerprint(sources: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for src in sources {
        for &byte in src.as_bytes().iter().chain(&[0u8]) {
            h ^= byte as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}
