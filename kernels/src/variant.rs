//! Which build of the kernels a group loads, and the rank limits that choose it. Below both the
//! compiler (`compile`, which prepends a build's defines) and the runtime (which picks the build
//! for its group): neither imports the other for it.

/// The most ranks a GPU group takes (`MAX_RANKS` in common.cuh); past it a group is refused with
/// `GpuError::TooManyRanks` (`runtime::check_ranks`). The specification allows more
/// (`ep_reference::config::MAX_RANKS`).
pub const MAX_RANKS: usize = 256;
/// Groups of at most this many ranks load the narrow build of the kernels (one-word peer sets, a
/// T x R position table); larger ones the wide build ([`Variant`]).
pub const NARROW_RANKS: usize = 32;
/// u32 words of a set of ranks: the NCCL peer mask in the kernel parameters (`NCCL_WORDS` in
/// common.cuh).
pub const MASK_WORDS: usize = MAX_RANKS / 32;
/// Entries of the narrow build's IoTable (`EP_MAX_LOCAL` in common.cuh): ranks of one launch;
/// past it the wide-IO build takes [`MAX_RANKS`] ([`Variant::io_capacity`]).
pub(crate) const MAX_LOCAL: usize = 32;

/// Which build of the kernels a device loads: the defines common.cuh reads (`EP_MASK_WORDS`,
/// `EP_MAX_LOCAL`, `EP_MIN_BLOCKS`, `EP_PLAIN`), and for the batched family the stage its
/// module holds (`EP_STAGE`). A group of at most [`NARROW_RANKS`] ranks with 2 to 32
/// of them on each GPU, shrink mode on or a peer through NCCL, loads the narrow build: the
/// source as it is, no define.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Variant {
    /// R > 32: peer sets of [`MASK_WORDS`] words, per-slot batch positions.
    pub wide: bool,
    /// More than 32 ranks on this GPU: an IoTable of [`MAX_RANKS`] entries.
    pub wide_io: bool,
    /// Exactly one rank on this GPU (one rank per process, as engines run, or a one-rank group):
    /// an IoTable of one entry, so that every launch passes 288 parameter bytes, not 3512.
    pub one_io: bool,
    /// More ranks on this GPU than it has SMs: two blocks per SM (`__launch_bounds__`).
    pub two_blocks: bool,
    /// No peer of this GPU's ranks through NCCL and shrink mode off (`EP_PLAIN`): the NCCL
    /// staging and shrink-mode code is compiled out, a smaller machine code for every kernel.
    /// The launch refuses it for a group with either ([`Variant::check_plain`]).
    pub plain: bool,
    /// The stage whose code the batched module holds (`EP_STAGE`): 0 the whole call, 1 the send
    /// half, 2 the receive half. A device loads the batched family once per stage
    /// ([`Variant::at_stage`]); the other families hold every stage and take 0.
    pub stage: u8,
}

impl Variant {
    /// The build for a group of `ranks` ranks, `ranks_here` of them on a GPU of `sms` SMs;
    /// `plain`: none of them reaches a peer through NCCL and shrink mode is off.
    pub fn for_group(ranks: usize, ranks_here: usize, sms: usize, plain: bool) -> Variant {
        Variant {
            wide: ranks > NARROW_RANKS,
            wide_io: ranks_here > MAX_LOCAL,
            one_io: ranks_here == 1,
            two_blocks: ranks_here > sms.max(1),
            plain,
            stage: 0,
        }
    }

    /// This build with the batched module of `stage` (0, 1 or 2; [`Variant::stage`]).
    pub fn at_stage(self, stage: u8) -> Variant {
        Variant { stage, ..self }
    }

    /// The plain build has no NCCL or shrink-mode code: a launch of it with an NCCL peer
    /// (`nccl_peers`) or shrink mode would ignore them, so it is refused.
    pub fn check_plain(&self, nccl_peers: bool, shrink: bool) -> Result<(), &'static str> {
        match (self.plain, nccl_peers, shrink) {
            (true, true, _) => Err("the plain build of the kernels with a peer through NCCL"),
            (true, _, true) => Err("the plain build of the kernels in shrink mode"),
            _ => Ok(()),
        }
    }

    /// The defines prepended to the source ("" for the narrow build: its source, and so its
    /// cache key, is the file as it is).
    pub fn defines(&self) -> String {
        let mut d = String::new();
        if self.wide {
            d += &format!("#define EP_MASK_WORDS {MASK_WORDS}\n");
        }
        if self.wide_io {
            d += &format!("#define EP_MAX_LOCAL {MAX_RANKS}\n");
        }
        if self.one_io {
            d += "#define EP_MAX_LOCAL 1\n";
        }
        if self.two_blocks {
            d += "#define EP_MIN_BLOCKS 2\n";
        }
        if self.plain {
            d += "#define EP_PLAIN 1\n";
        }
        if self.stage != 0 {
            d += &format!("#define EP_STAGE {}\n", self.stage);
        }
        d
    }

    /// Entries of the IoTable this build's kernels take.
    pub fn io_capacity(&self) -> usize {
        if self.wide_io {
            MAX_RANKS
        } else if self.one_io {
            1
        } else {
            MAX_LOCAL
        }
    }

    /// Every build the runtime may load, at stage 0 (the compile check builds them all, and the
    /// batched family of each at every stage): each size build, general and plain.
    pub fn all() -> [Variant; 12] {
        // (wide, wide_io, one_io, two_blocks) of each size build: the six general, then the six plain.
        const SIZES: [(bool, bool, bool, bool); 6] = [
            (false, false, false, false),
            (false, false, true, false),
            (true, false, false, false),
            (true, false, true, false),
            (true, true, false, false),
            (true, true, false, true),
        ];
        std::array::from_fn(|i| {
            let (wide, wide_io, one_io, two_blocks) = SIZES[i % SIZES.len()];
            Variant {
                wide,
                wide_io,
                one_io,
                two_blocks,
                plain: i >= SIZES.len(),
                stage: 0,
            }
        })
    }
}
