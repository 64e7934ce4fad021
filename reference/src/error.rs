//! Every error a path can return. Each bad input of docs/contract.md has its own variant carrying the
//! offending values, so a caller can tell exactly what was wrong without parsing a message.

use std::fmt;

/// Which operation a wait belonged to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    Dispatch,
    Combine,
}

/// Which side of the exchange a wait was on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// Waiting before or while sending: for the peer to free its buffer, or for local staging.
    Send,
    /// Waiting for the peer's data signal.
    Recv,
}

/// Where a stalled wait was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Phase {
    pub op: Op,
    pub side: Side,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Dispatch => "dispatch",
            Op::Combine => "combine",
        })
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let op = match self.op {
            Op::Dispatch => "dispatch",
            Op::Combine => "combine",
        };
        let side = match self.side {
            Side::Send => "send",
            Side::Recv => "recv",
        };
        write!(f, "{op}/{side}")
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    #[error("config: {what} must be at least 1, got 0")]
    ZeroSize { what: &'static str },
    #[error("config: num_experts = {experts} is not a multiple of num_ranks = {ranks}")]
    ExpertsNotDivisible { experts: usize, ranks: usize },
    #[error("config: {local} local experts per rank exceed the supported {max}")]
    TooManyLocalExperts { local: usize, max: usize },
    #[error("config: hidden = {hidden} is not a multiple of {multiple} ({mode})")]
    HiddenNotMultiple {
        hidden: usize,
        multiple: usize,
        mode: &'static str,
    },
    #[error("config: top_k = {top_k} is outside 1..=16")]
    TopKOutOfRange { top_k: usize },
    /// A size above its limit: a field of the config (`what` is the field's name), or a size
    /// derived from it (`what` says which product) that would not fit where it is used.
    #[error("config: {what} = {value} exceeds the limit {limit}")]
    LimitExceeded {
        what: &'static str,
        value: u128,
        limit: u128,
    },
    #[error("config: UE8M0 scales require round_scale")]
    Ue8m0WithoutRoundScale,
    #[error("config: rank {rank} does not exist in a group of {ranks} ranks")]
    RankOutOfRange { rank: usize, ranks: usize },
    #[error("expected inputs for {expected} ranks, got {got}")]
    WrongRankCount { expected: usize, got: usize },
    #[error("rank {rank}: {tokens} tokens exceed num_max_dispatch_tokens_per_rank = {max}")]
    TooManyTokens {
        rank: usize,
        tokens: usize,
        max: usize,
    },
    #[error("rank {rank}: topk_idx[{token}][{slot}] = {expert} is outside [-1, {num_experts})")]
    ExpertOutOfRange {
        rank: usize,
        token: usize,
        slot: usize,
        expert: i64,
        num_experts: usize,
    },
    #[error(
        "rank {rank}: token {token} selects expert {expert} twice (slots {first_slot} and {second_slot})"
    )]
    DuplicateExpert {
        rank: usize,
        token: usize,
        expert: i64,
        first_slot: usize,
        second_slot: usize,
    },
    #[error("rank {rank}: {tensor} has {got} elements, expected {expected} ({shape})")]
    ShapeMismatch {
        rank: usize,
        tensor: &'static str,
        expected: usize,
        got: usize,
        shape: String,
    },
    #[error("rank {rank}: combine got a handle from {got}, but this communicator is {expected}")]
    HandleMismatch {
        rank: usize,
        expected: String,
        got: String,
    },
    #[error(
        "rank {rank}: combine's topk_idx[{token}][{slot}] = {got} differs from the dispatched {expected}"
    )]
    TopkMismatch {
        rank: usize,
        token: usize,
        slot: usize,
        expected: i64,
        got: i64,
    },
    #[error(
        "rank {rank}: rank {peer} announced {got} items in {phase} of call {call}, expected {expected}"
    )]
    PeerMismatch {
        rank: usize,
        peer: usize,
        phase: Phase,
        call: u64,
        expected: usize,
        got: usize,
    },
    #[error("config needs {needed} bytes of communication memory, only {available} are available")]
    OutOfMemory { needed: u64, available: u64 },
    /// A thread of this rank's call panicked (a bug, reported rather than propagated): the call
    /// is given up like one that timed out, and the rank's next call starts clean.
    #[error("rank {rank}: a worker panicked in {op} (call {call}): {message}")]
    WorkerPanicked {
        rank: usize,
        op: Op,
        call: u64,
        message: String,
    },
    /// Unmasking a rank ([`crate::EpRank::update_mask`] with `false`, or
    /// [`crate::EpRank::clean_mask`]) is valid only while every rank of the group is between
    /// calls and all have made the same calls; rank `other` has made `other_calls` calls of `op`,
    /// the unmasking rank `calls`. Nothing was unmasked.
    #[error(
        "rank {rank}: cannot unmask rank {peer}: rank {other} has made {other_calls} {op} calls, this rank {calls} (unmask only when every rank has made the same calls and none is in one)"
    )]
    UnmaskOutOfStep {
        rank: usize,
        peer: usize,
        other: usize,
        op: Op,
        calls: u64,
        other_calls: u64,
    },
    #[error(
        "rank {rank} timed out after {waited_ms} ms waiting for rank {peer} in {phase} (call {call})"
    )]
    Timeout {
        rank: usize,
        peer: usize,
        phase: Phase,
        call: u64,
        waited_ms: u64,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The error of a wait that ran out: who waited, for whom, where, in which call.
    pub fn timeout(
        rank: usize,
        peer: usize,
        op: Op,
        side: Side,
        call: u64,
        deadline: &crate::sync::Deadline,
    ) -> Error {
        Error::Timeout {
            rank,
            peer,
            phase: Phase { op, side },
            call,
            waited_ms: deadline.waited_ms(),
        }
    }
}
