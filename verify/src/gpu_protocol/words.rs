//! The words' formats and codes that every role shares: the size of a payload entry, the
//! phases and error codes of the error word, the peer-supplied fields the receivers bound, and
//! the signal word (common.cuh `sig_tag`, `signal_word`: the call's tag and a count).

/// Bytes of one payload entry: a 16-byte header (four u32) and an 8-byte payload word.
pub const ROW_BYTES: usize = 24;

/// Phases reported in the error word (common.cuh `PH_DISPATCH_SEND`, `PH_DISPATCH_RECV`).
pub const PH_DISPATCH_SEND: u32 = 0;
pub const PH_DISPATCH_RECV: u32 = 1;

/// Error codes of `err[0]` (common.cuh `#define ERR_*`) that the model raises.
pub const ERR_TIMEOUT: u32 = 1;
pub const ERR_EXPERT_RANGE: u32 = 2;
pub const ERR_PEER_DATA: u32 = 5;
/// common.cuh `ERR_PEER_FAILED`: a receiver found a peer's poison (the peer's group failed).
pub const ERR_PEER_FAILED: u32 = 6;
/// common.cuh `PF_BATCH_TOKENS`, `PF_PE_COUNT`: the peer-supplied counts the receivers bound.
pub const PF_BATCH_TOKENS: u32 = 0;
pub(crate) const PF_PE_COUNT: u32 = 7;

/// common.cuh `EXIT_FAILED`: the exit counter's unit of blocks that saw the group failed (bit
/// 16 up; the blocks out count below it, `last_block_out`).
pub(crate) const EXIT_FAILED: u64 = 1 << 16;

/// common.cuh `SIG_COUNT_BITS`: a signal word is `tag << 24 | count`.
pub const SIG_COUNT_BITS: u32 = 24;
pub(crate) const SIG_COUNT_MASK: u64 = (1 << SIG_COUNT_BITS) - 1;

/// common.cuh `sig_tag`: `epoch mod (2^40 - 1) + 1`, never 0.
pub fn sig_tag(epoch: u64) -> u64 {
    epoch % ((1 << 40) - 1) + 1
}

/// common.cuh `signal_word`: `tag << 24 | count`.
pub fn signal_word(epoch: u64, count: u32) -> u64 {
    (sig_tag(epoch) << SIG_COUNT_BITS) | (count as u64 & SIG_COUNT_MASK)
}

/// common.cuh `SIG_POISON`: the count field all ones, never a count (T*K < 2^24 - 1).
pub const SIG_POISON: u32 = SIG_COUNT_MASK as u32;

/// common.cuh `is_poison`: "`(v & SIG_COUNT_MASK) == SIG_POISON && (v >> SIG_COUNT_BITS) !=
/// 0ull`": a poison of any call (the words start at 0; only a failed group stores one).
pub fn is_poison(v: u64) -> bool {
    (v & SIG_COUNT_MASK) == SIG_POISON as u64 && (v >> SIG_COUNT_BITS) != 0
}
