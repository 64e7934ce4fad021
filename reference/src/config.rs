//! The validated configuration every path shares (docs/contract.md "Words").

use crate::error::{Error, Result};

/// How dispatch moves the token payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// bf16 rows, bits unchanged.
    Bf16,
    /// e4m3 rows with one scale per 128 channels.
    Fp8 {
        /// Round each scale up to a power of two.
        round_scale: bool,
        /// Store scales as UE8M0 exponent bytes, four per i32 (requires `round_scale`).
        ue8m0: bool,
    },
}

impl Mode {
    pub const FP8: Mode = Mode::Fp8 {
        round_scale: false,
        ue8m0: false,
    };
    pub const FP8_ROUND: Mode = Mode::Fp8 {
        round_scale: true,
        ue8m0: false,
    };
    pub const FP8_UE8M0: Mode = Mode::Fp8 {
        round_scale: true,
        ue8m0: true,
    };

    pub fn is_fp8(self) -> bool {
        matches!(self, Mode::Fp8 { .. })
    }

    /// The four modes (`ue8m0` needs `round_scale`), in [`Mode::name`]'s order.
    pub const ALL: [Mode; 4] = [Mode::Bf16, Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0];

    /// The mode's name in flags and reports (`bf16`, `fp8`, `fp8-round-scale`, `fp8-ue8m0`),
    /// parsed back by `FromStr`.
    pub fn name(self) -> &'static str {
        match self {
            Mode::Bf16 => "bf16",
            Mode::Fp8 {
                round_scale: false, ..
            } => "fp8",
            Mode::Fp8 { ue8m0: false, .. } => "fp8-round-scale",
            Mode::Fp8 { .. } => "fp8-ue8m0",
        }
    }
}

impl std::str::FromStr for Mode {
    type Err = crate::names::UnknownName;

    /// The mode [`Mode::name`] spells `s` (that spelling only).
    fn from_str(s: &str) -> std::result::Result<Mode, Self::Err> {
        crate::names::parse("mode", s, &Mode::ALL, Mode::name)
    }
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

/// How combine moves the expert outputs back (DeepEP's `use_logfmt`), chosen per call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum CombineFormat {
    /// bf16 rows, bits unchanged.
    #[default]
    Bf16,
    /// LogFMT-10 rows (docs/contract.md "4.1 LogFMT", `numerics::logfmt`): a group of 128
    /// channels in 10 bits a value plus 4 bytes, or raw where it does not qualify.
    LogFmt,
}

impl CombineFormat {
    pub fn name(self) -> &'static str {
        match self {
            CombineFormat::Bf16 => "bf16",
            CombineFormat::LogFmt => "logfmt",
        }
    }

    /// Fails unless `cfg` suits the format: LogFMT needs H a multiple of 128
    /// ([`Error::HiddenNotMultiple`] with mode "logfmt").
    pub fn check(self, cfg: &Config) -> Result<()> {
        if self == CombineFormat::LogFmt && !cfg.hidden.is_multiple_of(128) {
            return Err(Error::HiddenNotMultiple {
                hidden: cfg.hidden,
                multiple: 128,
                mode: self.name(),
            });
        }
        Ok(())
    }
}

/// The largest number of local experts a rank may hold (local ids travel as u16).
pub const MAX_LOCAL_EXPERTS: usize = u16::MAX as usize;

// Upper bounds (docs/contract.md "Errors"). Each is far above any decode setting (DeepEP's largest is
// R = 256, E = 288, T = 512, H = 7168, K = 8), and together they keep every count and byte size
// the paths compute representable: see [`Config::validate`].

/// R: the most ranks a group may have.
pub const MAX_RANKS: usize = 1024;
/// E: the most experts in all.
pub const MAX_EXPERTS: usize = 1 << 16;
/// T (`num_max_dispatch_tokens_per_rank`): the most tokens one rank may dispatch per call.
pub const MAX_TOKENS_PER_RANK: usize = 1 << 16;
/// H: the largest hidden size.
pub const MAX_HIDDEN: usize = 1 << 16;
/// K: the most experts per token.
pub const MAX_TOP_K: usize = 16;
/// The largest count the GPU kernels hold in a 32-bit int: rows of one rank's dispatch layout
/// (L x R x T = E x T), combine entries (R x T x K), and every row's bytes.
pub const MAX_KERNEL_COUNT: usize = i32::MAX as usize;

/// One expert-parallel group's shape. Build it with [`Config::new`], which validates it; the
/// fields are public for reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Config {
    /// R: ranks in the group, 1..=[`MAX_RANKS`].
    pub num_ranks: usize,
    /// E: experts in all, 1..=[`MAX_EXPERTS`], `E % R == 0`, `E x T <= i32::MAX`.
    pub num_experts: usize,
    /// T: `num_max_dispatch_tokens_per_rank`, 1..=[`MAX_TOKENS_PER_RANK`].
    pub max_tokens_per_rank: usize,
    /// H: channels per token, 1..=[`MAX_HIDDEN`] (FP8: a multiple of 128, UE8M0: of 512).
    pub hidden: usize,
    /// K: experts per token, 1..=16.
    pub top_k: usize,
    pub mode: Mode,
}

impl Config {
    pub fn new(
        num_ranks: usize,
        num_experts: usize,
        max_tokens_per_rank: usize,
        hidden: usize,
        top_k: usize,
        mode: Mode,
    ) -> Result<Config> {
        let c = Config {
            num_ranks,
            num_experts,
            max_tokens_per_rank,
            hidden,
            top_k,
            mode,
        };
        c.validate()?;
        Ok(c)
    }

    /// Checks every rule of docs/contract.md that concerns the config alone, including the upper
    /// bounds ([`MAX_RANKS`], [`MAX_EXPERTS`], [`MAX_TOKENS_PER_RANK`], [`MAX_HIDDEN`],
    /// [`MAX_TOP_K`]).
    ///
    /// A valid config guarantees that every size derived from it is representable where it is
    /// used: `2H`, a row's and a message's bytes, `R x T`, `L x R x T` and `R x T x K` fit in an
    /// `i32` (the GPU kernels' ints, [`MAX_KERNEL_COUNT`]), and one rank's dispatch output and
    /// expert outputs (`L x R x T x H` elements, and their bytes) fit in a `usize`. Sizes of a
    /// whole group's buffers are computed with [`checked_product`] where they are needed, and a
    /// product that does not fit fails with [`Error::LimitExceeded`] instead of wrapping.
    pub fn validate(&self) -> Result<()> {
        for (what, v) in [
            ("num_ranks", self.num_ranks),
            ("num_experts", self.num_experts),
            ("max_tokens_per_rank", self.max_tokens_per_rank),
            ("hidden", self.hidden),
        ] {
            if v == 0 {
                return Err(Error::ZeroSize { what });
            }
        }
        self.check_limits()?;
        if !self.num_experts.is_multiple_of(self.num_ranks) {
            return Err(Error::ExpertsNotDivisible {
                experts: self.num_experts,
                ranks: self.num_ranks,
            });
        }
        if self.num_local_experts() > MAX_LOCAL_EXPERTS {
            return Err(Error::TooManyLocalExperts {
                local: self.num_local_experts(),
                max: MAX_LOCAL_EXPERTS,
            });
        }
        if !(1..=MAX_TOP_K).contains(&self.top_k) {
            return Err(Error::TopKOutOfRange { top_k: self.top_k });
        }
        if let Mode::Fp8 { round_scale, ue8m0 } = self.mode {
            if ue8m0 && !round_scale {
                return Err(Error::Ue8m0WithoutRoundScale);
            }
            let multiple = if ue8m0 { 512 } else { 128 };
            if !self.hidden.is_multiple_of(multiple) {
                return Err(Error::HiddenNotMultiple {
                    hidden: self.hidden,
                    multiple,
                    mode: self.mode.name(),
                });
            }
        }
        Ok(())
    }

    /// The upper bounds, each field's and then the derived sizes'.
    fn check_limits(&self) -> Result<()> {
        for (what, v, max) in [
            ("num_ranks", self.num_ranks, MAX_RANKS),
            ("num_experts", self.num_experts, MAX_EXPERTS),
            (
                "max_tokens_per_rank",
                self.max_tokens_per_rank,
                MAX_TOKENS_PER_RANK,
            ),
            ("hidden", self.hidden, MAX_HIDDEN),
        ] {
            if v > max {
                return Err(Error::LimitExceeded {
                    what,
                    value: v as u128,
                    limit: max as u128,
                });
            }
        }
        let (r, e, t, h, k) = (
            self.num_ranks,
            self.num_experts,
            self.max_tokens_per_rank,
            self.hidden,
            self.top_k,
        );
        // What the kernels hold in an i32 (with the bounds above, only E x T can exceed it).
        for (what, factors) in [
            (
                "dispatch layout rows per rank (num_experts x max_tokens_per_rank)",
                &[e, t][..],
            ),
            (
                "combine entries per rank (num_ranks x max_tokens_per_rank x top_k)",
                &[r, t, k],
            ),
            (
                "bytes of one dispatch message (payload_bytes + 128)",
                &[self.payload_bytes() + 128],
            ),
            ("bytes of one combine row (2 x hidden)", &[2, h]),
        ] {
            checked_product_within(what, factors, MAX_KERNEL_COUNT)?;
        }
        // One rank's dispatch output and expert outputs: L x R x T x H elements, up to 2 bytes
        // (plus 4 bytes of scales per 128 channels) each.
        checked_product(
            "bytes of one rank's recv_x / y (num_experts x max_tokens_per_rank x hidden x 2)",
            &[e, t, h, 2],
        )?;
        Ok(())
    }

    /// L x R x T: rows of one rank's dispatch layout (fits in an `i32` for a valid config).
    pub fn layout_rows(&self) -> usize {
        self.num_local_experts() * self.rows_per_expert()
    }

    /// L x R x T x H: elements of one rank's `recv_x` and of its expert outputs `y` (fits in a
    /// `usize` for a valid config).
    pub fn layout_elements(&self) -> usize {
        self.layout_rows() * self.hidden
    }

    /// L = E / R.
    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.num_ranks
    }

    /// R * T: rows per local expert in the dispatch layout.
    pub fn rows_per_expert(&self) -> usize {
        self.num_ranks * self.max_tokens_per_rank
    }

    /// The rank that hosts expert `e`.
    pub fn owner(&self, expert: usize) -> usize {
        expert / self.num_local_experts()
    }

    /// Bytes of one received row of `recv_x` (bf16: 2H, FP8: H).
    pub fn recv_x_row_bytes(&self) -> usize {
        match self.mode {
            Mode::Bf16 => 2 * self.hidden,
            Mode::Fp8 { .. } => self.hidden,
        }
    }

    /// Scale elements (f32 or packed i32) per row, 0 in BF16 mode.
    pub fn scales_per_row(&self) -> usize {
        match self.mode {
            Mode::Bf16 => 0,
            Mode::Fp8 { ue8m0: false, .. } => self.hidden / 128,
            Mode::Fp8 { ue8m0: true, .. } => self.hidden / 512,
        }
    }

    /// Bytes of one token's payload on the wire: the row plus its scales.
    pub fn payload_bytes(&self) -> usize {
        self.recv_x_row_bytes() + 4 * self.scales_per_row()
    }

    /// docs/contract.md's bandwidth accounting: bytes per dispatch message as DeepEP counts them.
    pub fn logical_dispatch_message_bytes(&self) -> usize {
        match self.mode {
            Mode::Bf16 => 2 * self.hidden,
            Mode::Fp8 { .. } => self.hidden + self.hidden / 128 * 4 + 16,
        }
    }

    /// docs/contract.md's bandwidth accounting: bytes per combine message.
    pub fn logical_combine_message_bytes(&self) -> usize {
        2 * self.hidden
    }

    /// A short human description, used in error messages.
    pub fn describe(&self) -> String {
        format!(
            "R={} E={} T={} H={} K={} {}",
            self.num_ranks,
            self.num_experts,
            self.max_tokens_per_rank,
            self.hidden,
            self.top_k,
            self.mode.name()
        )
    }
}

/// The product of `factors` as a `usize`, or [`Error::LimitExceeded`] naming `what` when it does
/// not fit (the value reported is the exact product where it fits in a `u128`, else
/// `u128::MAX`). Every size of a group's buffers is computed with it.
pub fn checked_product(what: &'static str, factors: &[usize]) -> Result<usize> {
    checked_product_within(what, factors, usize::MAX)
}

/// [`checked_product`] with a tighter `limit`.
pub fn checked_product_within(
    what: &'static str,
    factors: &[usize],
    limit: usize,
) -> Result<usize> {
    let wide = factors
        .iter()
        .try_fold(1u128, |acc, &f| acc.checked_mul(f as u128))
        .unwrap_or(u128::MAX);
    if wide > limit as u128 {
        return Err(Error::LimitExceeded {
            what,
            value: wide,
            limit: limit as u128,
        });
    }
    Ok(wide as usize)
}

/// The sum of `terms` as a `usize`, or [`Error::LimitExceeded`] naming `what`.
pub fn checked_sum(what: &'static str, terms: &[usize]) -> Result<usize> {
    let wide: u128 = terms.iter().map(|&t| t as u128).sum();
    if wide > usize::MAX as u128 {
        return Err(Error::LimitExceeded {
            what,
            value: wide,
            limit: usize::MAX as u128,
        });
    }
    Ok(wide as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(r: Result<Config>) -> (&'static str, u128, u128) {
        match r {
            Err(Error::LimitExceeded { what, value, limit }) => (what, value, limit),
            other => panic!("expected LimitExceeded, got {other:?}"),
        }
    }

    #[test]
    fn a_wrapping_token_count_is_refused() {
        // The reproducer: accepted before, and its buffers' sizes wrapped.
        let t = (1usize << 60) + 1;
        assert_eq!(
            limit(Config::new(1, 1, t, 16, 1, Mode::Bf16)),
            (
                "max_tokens_per_rank",
                t as u128,
                MAX_TOKENS_PER_RANK as u128
            )
        );
    }

    #[test]
    fn every_field_has_an_upper_bound() {
        assert_eq!(
            limit(Config::new(
                MAX_RANKS + 1,
                MAX_RANKS + 1,
                1,
                16,
                1,
                Mode::Bf16
            ))
            .0,
            "num_ranks"
        );
        assert_eq!(
            limit(Config::new(1, MAX_EXPERTS * 2, 1, 16, 1, Mode::Bf16)).0,
            "num_experts"
        );
        assert_eq!(
            limit(Config::new(1, 1, 1, MAX_HIDDEN + 128, 1, Mode::FP8)).0,
            "hidden"
        );
        // H >= 2^30 made the kernels' row sizes negative through `as i32`.
        assert_eq!(
            limit(Config::new(1, 1, 1, 1 << 30, 1, Mode::Bf16)),
            ("hidden", 1 << 30, MAX_HIDDEN as u128)
        );
        // The largest of each is fine on its own.
        assert!(Config::new(MAX_RANKS, MAX_RANKS, 1, 16, 1, Mode::Bf16).is_ok());
        assert!(Config::new(1, 1, MAX_TOKENS_PER_RANK, MAX_HIDDEN, 16, Mode::FP8_UE8M0).is_ok());
    }

    #[test]
    fn derived_kernel_counts_fit_in_i32() {
        // E x T = 2^32 rows per rank's layout would not fit the kernels' ints.
        let (what, value, lim) = limit(Config::new(
            2,
            MAX_EXPERTS,
            MAX_TOKENS_PER_RANK,
            16,
            1,
            Mode::Bf16,
        ));
        assert!(what.starts_with("dispatch layout rows"), "{what}");
        assert_eq!((value, lim), (1 << 32, i32::MAX as u128));
        // Every valid config's kernel-facing sizes fit in i32.
        let c = Config::new(
            MAX_RANKS,
            MAX_EXPERTS,
            (1 << 15) - 1,
            MAX_HIDDEN,
            16,
            Mode::FP8,
        )
        .unwrap();
        for v in [
            2 * c.hidden,
            c.rows_per_expert(),
            c.layout_rows(),
            c.rows_per_expert() * c.top_k,
            c.payload_bytes() + 128,
        ] {
            assert!(i32::try_from(v).is_ok(), "{v}");
        }
        assert!(c.layout_elements().checked_mul(2).is_some());
    }

    #[test]
    fn checked_product_reports_instead_of_wrapping() {
        assert_eq!(checked_product("x", &[3, 5, 7]), Ok(105));
        assert_eq!(
            checked_product("x", &[1 << 40, 1 << 40]),
            Err(Error::LimitExceeded {
                what: "x",
                value: 1 << 80,
                limit: usize::MAX as u128
            })
        );
        assert_eq!(
            checked_product("x", &[usize::MAX, usize::MAX, 4]).unwrap_err(),
            Error::LimitExceeded {
                what: "x",
                value: u128::MAX,
                limit: usize::MAX as u128
            }
        );
        assert_eq!(checked_sum("s", &[1, 2]), Ok(3));
        assert!(checked_sum("s", &[usize::MAX, 1]).is_err());
    }
}
