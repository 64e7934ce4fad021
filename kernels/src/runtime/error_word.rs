//! The device error word: what a kernel reports (a timed-out wait, bad routing in the caller's
//! `topk_idx`, a bad token count, a peer-supplied field out of bounds) and its typed host form.
//! Layout and codes: common.cuh (`report_error`). The first error of a device wins; the group
//! then refuses later calls (`GpuGroup::check_usable`): the ranks' epochs may disagree after a
//! call that stopped half-way, so a new group is the way back. The kernels also write the
//! error into a host mirror (mapped pinned memory), which every call reads at its entry
//! without synchronising: an error reaches the caller at the next call at the latest.
//! `GpuGroup::sync` waits for every device (over NCCL with the bounded host wait) and then
//! reads the word.

use crate::error::GpuError;
use crate::runtime::group::{kind, GpuGroup};
use crate::runtime::layout::ERR_WORDS;
use cudarc::driver::result;
use ep_reference::{Config, Error, Op, Path, Phase, Side};

/// Codes of err[0] (ERR_* in common.cuh).
const ERR_TIMEOUT: u32 = 1;
const ERR_EXPERT_RANGE: u32 = 2;
const ERR_DUP_EXPERT: u32 = 3;
const ERR_TOKENS: u32 = 4;
const ERR_PEER_DATA: u32 = 5;
const ERR_PEER_FAILED: u32 = 6;

/// Names of the peer-supplied fields (PF_* in common.cuh).
const PEER_FIELDS: [&str; 10] = [
    "batch token count",
    "rows per local expert",
    "batch header local expert",
    "batch header index within the expert",
    "batch header token",
    "batch header selection offset",
    "selections to send back",
    "per-expert message count",
    "per-expert header token",
    "per-expert header slot",
];

/// The typed error of an error word, or None when it is clear.
pub(crate) fn decode(w: &[u32; ERR_WORDS], cfg: &Config) -> Option<GpuError> {
    let (a, b, c) = (w[1] as usize, w[2] as usize, w[3] as usize);
    let call = (w[4] as u64) | ((w[6] as u64) << 32);
    Some(match w[0] {
        0 => return None,
        ERR_TIMEOUT => Error::Timeout {
            rank: a,
            peer: b,
            phase: phase(w[3]),
            call,
            waited_ms: w[5] as u64 / 1000,
        }
        .into(),
        ERR_PEER_FAILED => GpuError::PeerFailed {
            rank: a,
            peer: b,
            phase: phase(w[3]),
            call,
        },
        ERR_EXPERT_RANGE => Error::ExpertOutOfRange {
            rank: a,
            token: b,
            slot: c,
            expert: ((w[4] as u64) | ((w[5] as u64) << 32)) as i64,
            num_experts: cfg.num_experts,
        }
        .into(),
        ERR_DUP_EXPERT => Error::DuplicateExpert {
            rank: a,
            token: b,
            expert: w[4] as i64,
            first_slot: w[6] as usize,
            second_slot: c,
        }
        .into(),
        ERR_TOKENS => Error::TooManyTokens {
            rank: a,
            tokens: w[2] as i32 as i64 as usize,
            max: cfg.max_tokens_per_rank,
        }
        .into(),
        ERR_PEER_DATA => GpuError::PeerData {
            rank: a,
            peer: b,
            field: PEER_FIELDS.get(c).copied().unwrap_or("unknown field"),
            value: w[4] as i32 as i64,
            limit: w[6] as u64,
        },
        code => GpuError::Cuda(format!("unknown device error code {code}")),
    })
}

/// The phase of an error word (PH_* in common.cuh).
fn phase(word: u32) -> Phase {
    let (op, side) = match word {
        0 => (Op::Dispatch, Side::Send),
        1 => (Op::Dispatch, Side::Recv),
        2 => (Op::Combine, Side::Send),
        _ => (Op::Combine, Side::Recv),
    };
    Phase { op, side }
}

/// Ranks the errors of several devices: bad input is the cause; bad peer data next; then
/// timeouts (a wait for a rank that stopped); a peer's published failure (`PeerFailed`, the
/// poison of a rank whose group failed or whose input was bad) last: it is always the
/// consequence of an error recorded elsewhere.
fn cause_first(e: &GpuError) -> u8 {
    match e {
        GpuError::PeerFailed { .. } => 3,
        GpuError::Contract(Error::Timeout { .. }) => 2,
        GpuError::PeerData { .. } => 1,
        _ => 0,
    }
}

impl GpuGroup {
    /// The first error the kernels recorded on any device (without waiting for running work),
    /// in its typed form: input errors of the device API (`ExpertOutOfRange`,
    /// `DuplicateExpert`, `TooManyTokens`, naming rank, token, slot and value), a bounded wait
    /// that ran out (`Timeout`), or a peer's out-of-bounds field (`PeerData`). After an error the
    /// group refuses later calls. Call after synchronising the stream the calls went on, to
    /// include their errors. Read from the error words' host mirrors ([`GpuGroup::poll`]'s
    /// read): every error the kernels record goes through `report_error_at`, which writes the
    /// mirror after the device word, so no device copy is needed.
    pub fn check(&mut self) -> Result<(), GpuError> {
        let r = self.check_usable();
        if let Err(e) = &r {
            self.broken.get_or_insert_with(|| e.clone());
        }
        r
    }

    /// The first error (by [`cause_first`]) the kernels recorded on any device, read from the
    /// error words' host mirrors: host memory only, no stream synchronised, no driver call.
    pub(crate) fn recorded_error(&self) -> Option<GpuError> {
        let mut found: Vec<GpuError> = self
            .devs
            .iter()
            .filter_map(|d| d.err_host.read())
            .filter_map(|w| decode(&w, &self.cfg))
            .collect();
        found.sort_by_key(cause_first);
        found.into_iter().next()
    }

    /// Every device's error word read from the device (not its mirror), decoded (None: that
    /// device reported nothing), in device order: the tests' look at each device's own word.
    /// Does not wait for running work and does not change the group's state. Behind `testing`
    /// with its one caller, the hook `GpuGroup::device_errors_for_test`.
    #[cfg(feature = "testing")]
    pub(crate) fn device_errors(&self) -> Result<Vec<Option<GpuError>>, GpuError> {
        use crate::error::cuda;
        use cudarc::driver::result;
        let mut v = Vec::with_capacity(self.devs.len());
        for dev in &self.devs {
            dev.bind()?;
            let mut w = [0u32; ERR_WORDS];
            // SAFETY: `err` holds ERR_WORDS u32 on the bound context; a synchronous copy of a
            // word the kernels only ever set once (claim word first, code last).
            cuda("read error word", unsafe {
                result::memcpy_dtoh_sync(&mut w, dev.err)
            })?;
            v.push(decode(&w, &self.cfg));
        }
        Ok(v)
    }

    /// Test hook (feature `testing`): every device's decoded error word (None: clear), read
    /// without changing the group's state (so a test sees what each device reported, not only
    /// the first error).
    #[cfg(feature = "testing")]
    pub fn device_errors_for_test(&self) -> Result<Vec<Option<GpuError>>, GpuError> {
        self.device_errors()
    }

    /// Waits for every device and turns a timed-out wait into [`Error::Timeout`].
    pub fn sync(&mut self) -> Result<(), GpuError> {
        self.check_usable()?;
        if self.nccl.is_some() {
            // NCCL receives are not bounded on the device: poll with the timeout.
            let op = self.last_op.unwrap_or(Op::Dispatch);
            let call = self.calls[kind(op, Path::Batched)];
            self.wait_nccl_streams(op, call)?;
        }
        for dev in &self.devs {
            dev.bind()?;
            // SAFETY: the stream belongs to this device's bound context.
            if let Err(e) = unsafe { result::stream::synchronize(dev.stream) } {
                // A kernel that trapped (GpuOptions::trap_on_error) recorded its cause first:
                // the mirror still names it after the context is lost.
                let err = self
                    .recorded_error()
                    .unwrap_or_else(|| GpuError::Cuda(format!("kernel failed: {e:?}")));
                self.broken = Some(err.clone());
                return Err(err);
            }
        }
        self.check()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    fn word(code: u32, rest: [u32; 6]) -> [u32; ERR_WORDS] {
        let mut w = [0u32; ERR_WORDS];
        w[0] = code;
        w[1..7].copy_from_slice(&rest);
        w[7] = 1;
        w
    }

    #[test]
    fn every_code_decodes_to_its_typed_error() {
        let cfg = Config::new(4, 16, 8, 256, 4, Mode::Bf16).unwrap();
        assert_eq!(decode(&[0; ERR_WORDS], &cfg), None);
        let neg = (-2i64) as u64;
        assert_eq!(
            decode(
                &word(
                    ERR_EXPERT_RANGE,
                    [3, 5, 2, neg as u32, (neg >> 32) as u32, 16]
                ),
                &cfg
            ),
            Some(GpuError::Contract(Error::ExpertOutOfRange {
                rank: 3,
                token: 5,
                slot: 2,
                expert: -2,
                num_experts: 16
            }))
        );
        assert_eq!(
            decode(&word(ERR_DUP_EXPERT, [1, 7, 3, 9, 0, 0]), &cfg),
            Some(GpuError::Contract(Error::DuplicateExpert {
                rank: 1,
                token: 7,
                expert: 9,
                first_slot: 0,
                second_slot: 3
            }))
        );
        assert_eq!(
            decode(&word(ERR_TOKENS, [2, 9, 0, 0, 0, 8]), &cfg),
            Some(GpuError::Contract(Error::TooManyTokens {
                rank: 2,
                tokens: 9,
                max: 8
            }))
        );
        // A call number past 2^32 survives the round trip (u64 epochs).
        match decode(&word(ERR_TIMEOUT, [0, 1, 1, 5, 2000, 1]), &cfg) {
            Some(GpuError::Contract(Error::Timeout {
                rank: 0,
                peer: 1,
                call,
                waited_ms: 2,
                ..
            })) => assert_eq!(call, (1 << 32) + 5),
            other => panic!("{other:?}"),
        }
        assert_eq!(
            decode(&word(ERR_PEER_FAILED, [2, 0, 3, 7, 0, 1]), &cfg),
            Some(GpuError::PeerFailed {
                rank: 2,
                peer: 0,
                phase: Phase {
                    op: Op::Combine,
                    side: Side::Recv
                },
                call: (1 << 32) + 7,
            })
        );
        assert!(matches!(
            decode(&word(ERR_PEER_DATA, [0, 3, 1, 99, 0, 8]), &cfg),
            Some(GpuError::PeerData {
                rank: 0,
                peer: 3,
                field: "rows per local expert",
                value: 99,
                limit: 8
            })
        ));
    }

    #[test]
    fn input_errors_rank_before_the_timeouts_they_cause() {
        let mut v = [
            GpuError::from(Error::Timeout {
                rank: 0,
                peer: 1,
                phase: Phase {
                    op: Op::Dispatch,
                    side: Side::Recv,
                },
                call: 1,
                waited_ms: 1,
            }),
            GpuError::from(Error::TooManyTokens {
                rank: 1,
                tokens: 9,
                max: 8,
            }),
        ];
        v.sort_by_key(cause_first);
        assert!(matches!(
            v[0],
            GpuError::Contract(Error::TooManyTokens { .. })
        ));
    }

    #[test]
    fn a_peers_published_failure_ranks_after_the_timeout_that_caused_it() {
        let ph = Phase {
            op: Op::Dispatch,
            side: Side::Recv,
        };
        let mut v = [
            GpuError::PeerFailed {
                rank: 1,
                peer: 0,
                phase: ph,
                call: 3,
            },
            GpuError::from(Error::Timeout {
                rank: 0,
                peer: 1,
                phase: ph,
                call: 3,
                waited_ms: 2000,
            }),
        ];
        v.sort_by_key(cause_first);
        assert!(matches!(v[0], GpuError::Contract(Error::Timeout { .. })));
        assert!(matches!(v[1], GpuError::PeerFailed { .. }));
    }
}
