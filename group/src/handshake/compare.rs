//! A peer's record against this rank's own: the first difference, in wire order, names the
//! field and both values.

use crate::error::GroupError;
use crate::handshake::record::Hello;
use ep_reference::Mode;

impl Hello {
    /// Compares `theirs` (the record at position `peer` of the exchange) with this rank's own:
    /// the first difference, in wire order, is [`GroupError::PeerMismatch`].
    pub fn compare(&self, theirs: &Hello, peer: usize) -> Result<(), GroupError> {
        let mismatch = |field: &'static str, ours: String, theirs: String| {
            Err(GroupError::PeerMismatch {
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
