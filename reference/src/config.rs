//! The validated configuration every path shares (DESIGN.md "Words").

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

    pub fn name(self) -> &'static str {
        match self {
            Mode::Bf16 => "bf16",
            Mode::Fp8 {
                round_scale: false, ..
            } => "fp8",
            Mode::Fp8 { ue8m0: false, .. } => "fp8+round_scale",
            Mode::Fp8 { .. } => "fp8+ue8m0",
        }
    }
}

/// The largest number of local experts a rank may hold (local ids travel as u16).
pub const MAX_LOCAL_EXPERTS: usize = u16::MAX as usize;

/// One expert-parallel group's shape. Build it with [`Config::new`], which validates it; the
/// fields are public for reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Config {
    /// R: ranks in the group.
    pub num_ranks: usize,
    /// E: experts in all, `E % R == 0`.
    pub num_experts: usize,
    /// T: `num_max_dispatch_tokens_per_rank`.
    pub max_tokens_per_rank: usize,
    /// H: channels per token.
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

    /// Checks every rule of DESIGN.md that concerns the config alone.
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
        if self.num_experts % self.num_ranks != 0 {
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
        if !(1..=16).contains(&self.top_k) {
            return Err(Error::TopKOutOfRange { top_k: self.top_k });
        }
        if let Mode::Fp8 { round_scale, ue8m0 } = self.mode {
            if ue8m0 && !round_scale {
                return Err(Error::Ue8m0WithoutRoundScale);
            }
            let multiple = if ue8m0 { 512 } else { 128 };
            if self.hidden % multiple != 0 {
                return Err(Error::HiddenNotMultiple {
                    hidden: self.hidden,
                    multiple,
                    mode: self.mode.name(),
                });
            }
        }
        Ok(())
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

    /// DESIGN.md's bandwidth accounting: bytes per dispatch message as DeepEP counts them.
    pub fn logical_dispatch_message_bytes(&self) -> usize {
        match self.mode {
            Mode::Bf16 => 2 * self.hidden,
            Mode::Fp8 { .. } => self.hidden + self.hidden / 128 * 4 + 16,
        }
    }

    /// DESIGN.md's bandwidth accounting: bytes per combine message.
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
