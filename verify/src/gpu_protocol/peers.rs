//! Sets of peers (shrink.cuh `PeerSet`, `is_gone`) and the kernel build that decides their
//! shape (runtime::Variant; common.cuh `EP_MASK_WORDS`, `WIDE`): the narrow build's one u32
//! (R <= 32: bit d is peer d), the wide build's words (R > 32: bit d % 32 of word d / 32).
//!
//! The model's groups have two or three ranks, so that loom stays quick. A wide model scales
//! the word down instead of scaling the group up: [`Build::Wide`]'s `word_bits` (2 in the
//! `shrink_wide_*` models) puts rank 2 of 3 in bit 0 of word 1, where rank 32 of 33 sits in
//! the kernel's 32-bit words. Only the word size changes: the index arithmetic (`d / bits`,
//! `d % bits`), the number of words past the first and the block's copies of them are the
//! kernel's.

/// The most words a model's set has (common.cuh `EP_MASK_WORDS` of the wide build: 256 / 32).
pub const MASK_WORDS: usize = 8;

/// The kernel's word: 32 peers (shrink.cuh, bit d % 32 of word d / 32).
pub const WORD_BITS: u32 = 32;

/// A runtime mutant of the wide build's copy of its gone set (the model's own; the cfg
/// mutants of `.ci/loom.sh` weaken orderings). The `shrink_wide_*_mutant_*` models run the model
/// under each and require it to fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WideMutant {
    /// `GONE_SNAPSHOT` copies only word 0 (`if (threadIdx.x < 1)`): a peer past the first word
    /// lost in this call is missing from every later snapshot.
    FirstWordOnly,
    /// `GONE_SNAPSHOT` without its `__syncthreads()`: a thread reads a word of the snapshot
    /// while the thread that copies it may not have yet (loom: a causality violation).
    NoSnapshotBarrier,
}

/// Which build of the kernels a model runs (runtime::Variant).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Build {
    /// The files as they are (R <= 32): the gone set is one u32 word, `s_gone`, that every
    /// thread copies into its register (`gone = s_gone`); the model's block is one thread.
    Narrow,
    /// `EP_MASK_WORDS > 1` (R > 32): the gone set is words in shared memory, copied by threads
    /// `tid < W` between block barriers (shrink.cuh `GONE_SNAPSHOT`); the model's block is one
    /// thread for everything else and W - 1 more threads for the copies of words 1.. (the
    /// `gone` module). `word_bits`: the model's word size (32 is the kernel's; see the module
    /// docs for the scaling).
    Wide {
        word_bits: u32,
        mutant: Option<WideMutant>,
    },
}

impl Build {
    /// The wide build at the model's scale, without a mutant.
    pub fn wide(word_bits: u32) -> Build {
        Build::Wide {
            word_bits,
            mutant: None,
        }
    }

    /// Bits per word of this build's sets.
    pub fn word_bits(self) -> u32 {
        match self {
            Build::Narrow => WORD_BITS,
            Build::Wide { word_bits, .. } => word_bits,
        }
    }

    /// W: the words of a set of `r_n` peers (the narrow build: 1).
    pub fn words(self, r_n: usize) -> usize {
        match self {
            Build::Narrow => 1,
            Build::Wide { word_bits, .. } => r_n.div_ceil(word_bits as usize).max(1),
        }
    }

    /// The wide build's mutant, if any.
    pub fn mutant(self) -> Option<WideMutant> {
        match self {
            Build::Narrow => None,
            Build::Wide { mutant, .. } => mutant,
        }
    }

    /// Checks that this build takes `r_n` ranks (the host picks the build from R: the narrow one
    /// up to 32, layout.rs `Variant`).
    pub(crate) fn check(self, r_n: usize) {
        let bits = self.word_bits();
        assert!((1..=WORD_BITS).contains(&bits), "word bits {bits}");
        match self {
            Build::Narrow => assert!(r_n <= WORD_BITS as usize, "narrow build: {r_n} ranks"),
            Build::Wide { .. } => assert!(
                self.words(r_n) <= MASK_WORDS,
                "wide build: {r_n} ranks at {bits} bits a word"
            ),
        }
    }
}

/// A set of peers as a kernel build keeps it: bit `d % bits` of word `d / bits`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerSet {
    bits: u32,
    words: [u32; MASK_WORDS],
}

impl Default for PeerSet {
    /// The narrow build's empty set.
    fn default() -> PeerSet {
        PeerSet::empty(WORD_BITS)
    }
}

impl PeerSet {
    /// The empty set of a build whose words hold `bits` peers.
    pub fn empty(bits: u32) -> PeerSet {
        PeerSet {
            bits,
            words: [0; MASK_WORDS],
        }
    }

    /// Bits per word.
    pub fn bits(&self) -> u32 {
        self.bits
    }

    fn at(&self, d: usize) -> (usize, u32) {
        let b = self.bits as usize;
        (d / b, 1 << (d % b))
    }

    /// shrink.cuh `is_gone`: "`(g[d >> 5] >> (d & 31)) & 1u`" (narrow: "`(g >> d) & 1u`").
    pub fn contains(&self, d: usize) -> bool {
        let (w, bit) = self.at(d);
        self.words[w] & bit != 0
    }

    /// Adds peer `d` (`m |= 1u << d`; wide: "`out[d >> 5] |= 1u << (d & 31)`").
    pub fn insert(&mut self, d: usize) {
        let (w, bit) = self.at(d);
        self.words[w] |= bit;
    }

    /// Word `i` (`s_gone[i]`).
    pub fn word(&self, i: usize) -> u32 {
        self.words[i]
    }

    /// Word `i` and peer `d`'s bit in it: where `GONE_ADD(d)`'s `atomicOr` lands.
    pub fn place(&self, d: usize) -> (usize, u32) {
        self.at(d)
    }

    /// Sets word `i` (a copy of a shared word).
    pub fn set_word(&mut self, i: usize, v: u32) {
        self.words[i] = v;
    }

    /// The set as one flat bit set, bit d for peer d (the models' ranks are few): for tests and
    /// messages, whatever the build.
    pub fn flat(&self) -> u64 {
        (0..MASK_WORDS * self.bits as usize)
            .filter(|&d| d < 64 && self.contains(d))
            .fold(0, |m, d| m | 1 << d)
    }
}

/// shrink.cuh `is_gone`: whether peer `d` is in `gone` (both builds).
pub fn is_gone(gone: PeerSet, d: usize) -> bool {
    gone.contains(d)
}
