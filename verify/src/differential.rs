//! The differential run: thousands of small random configs, both CPU paths (ep_fast's batched
//! path and ep_reference's per-expert path) bitwise against `ep_reference::oracle`; in about a
//! quarter of the cases with two ranks or more, 1..R-1 ranks masked (DeepEP's shrink mode),
//! against `oracle::dispatch_masked` / `combine_masked` on the unmasked ranks.
//!
//! Every case comes from one seed ([`Case::from_seed`]), so a failing case is replayed exactly
//! by its seed (`tests/differential.rs` reads `EP_DIFF_SEED`). Inputs come from
//! `ep_reference::workload`, the project's one generator of test inputs.

use ep_reference::workload::{Routing, Values, Workload};
use ep_reference::{per_expert, CombineFormat, Config, CpuOptions, Mode, Path, RankMask};
use rand::rngs::StdRng;
use rand::seq::index::sample;
use rand::{Rng, SeedableRng};

use crate::check::{check_against_oracle_format, logfmt_packable};

/// One random config, its inputs' shape and kind, from a seed.
#[derive(Debug, Clone)]
pub struct Case {
    pub seed: u64,
    pub cfg: Config,
    /// Tokens per rank (0: an empty rank).
    pub tokens: Vec<usize>,
    pub routing: Routing,
    /// Values of x and of the expert outputs.
    pub values: Values,
    /// Staging workers of the batched path.
    pub workers: usize,
    /// The masked ranks (never all of them).
    pub mask: RankMask,
    /// The combine's format: LogFMT in about a third of the cases whose H is a multiple of
    /// 128, with the expert outputs scaled so that most groups pack (`logfmt_packable`).
    pub format: CombineFormat,
}

/// The four dispatch modes.
pub const MODES: [Mode; 4] = [Mode::Bf16, Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0];

impl Case {
    /// R in 1..=16, L in 1..=6, T in 1..=48, K in 1..=min(16, E), every mode, H a small
    /// multiple of what the mode needs, every routing kind, empty and full ranks, special
    /// values in half the cases.
    pub fn from_seed(seed: u64) -> Case {
        let mut rng = StdRng::seed_from_u64(seed);
        let r = rng.random_range(1..=16usize);
        let l = rng.random_range(1..=6usize);
        let e = r * l;
        let t = rng.random_range(1..=48usize);
        let k = rng.random_range(1..=e.min(16));
        let mode = MODES[rng.random_range(0..4)];
        let h = match mode {
            Mode::Bf16 => [8, 128, 200, 256][rng.random_range(0..4)],
            Mode::Fp8 { ue8m0: false, .. } => [128, 256, 384][rng.random_range(0..3)],
            Mode::Fp8 { ue8m0: true, .. } => 512,
        };
        let cfg = Config::new(r, e, t, h, k, mode).expect("the generated config is valid");
        let tokens = (0..r)
            .map(|_| match rng.random_range(0..10) {
                0 => 0,
                1 | 2 => t,
                _ => rng.random_range(0..=t),
            })
            .collect();
        let routing = match rng.random_range(0..10) {
            0 | 1 => Routing::Random { masked: 0.0 },
            2 | 3 => Routing::Random {
                masked: rng.random_range(0.0..0.6),
            },
            4 | 5 => Routing::Skewed {
                hot: rng.random_range(1..=e.min(3)),
                share: rng.random_range(0.5..1.0),
                masked: if rng.random_bool(0.5) {
                    0.0
                } else {
                    rng.random_range(0.0..0.4)
                },
            },
            6 => Routing::OneExpert,
            7 => Routing::OneRank {
                rank: rng.random_range(0..r),
            },
            _ => Routing::EveryRank,
        };
        let values = if rng.random_bool(0.5) {
            Values::Normal
        } else {
            Values::Special {
                share: [0.01, 0.05, 0.3][rng.random_range(0..3)],
            }
        };
        let workers = rng.random_range(1..=3);
        Case {
            seed,
            cfg,
            tokens,
            routing,
            values,
            workers,
            mask: Case::mask_from_seed(seed, r),
            format: Case::format_from_seed(seed, h),
        }
    }

    /// Drawn from a generator of its own, as the mask is.
    fn format_from_seed(seed: u64, h: usize) -> CombineFormat {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x6C6F_6766_6D74_0001);
        if h.is_multiple_of(128) && rng.random_range(0..3) == 0 {
            CombineFormat::LogFmt
        } else {
            CombineFormat::Bf16
        }
    }

    /// A quarter of the cases with R >= 2 mask 1..R-1 ranks. Drawn from a generator of its
    /// own, so that every other choice of a seed is what it was before masks existed.
    fn mask_from_seed(seed: u64, r: usize) -> RankMask {
        let mut rng = StdRng::seed_from_u64(seed ^ 0x6D61_736B_6564_0001);
        if r < 2 || rng.random_range(0..4) != 0 {
            return RankMask::none(r);
        }
        let n = rng.random_range(1..r);
        let ranks = sample(&mut rng, r, n).into_vec();
        RankMask::from_ranks(r, &ranks).expect("ranks below r")
    }

    /// One line naming everything the seed chose.
    pub fn describe(&self) -> String {
        format!(
            "seed {}: {} tokens {:?} routing {:?} values {:?} workers {} masked ranks {:?} combine {}",
            self.seed,
            self.cfg.describe(),
            self.tokens,
            self.routing,
            self.values,
            self.workers,
            self.mask.masked().collect::<Vec<_>>(),
            self.format.name()
        )
    }

    /// Both paths, dispatch then combine, against the oracle (under the case's mask); `Err`
    /// names the first difference.
    pub fn run(&self) -> Result<(), String> {
        let w = Workload::generate_with(
            &self.cfg,
            &self.tokens,
            self.routing,
            self.values,
            self.seed,
        );
        let mut ys = w.expert_outputs_with(self.seed, self.values);
        if self.format == CombineFormat::LogFmt {
            logfmt_packable(&mut ys, self.cfg.hidden);
        }
        let opts = CpuOptions {
            staging_workers: self.workers,
            ..CpuOptions::default()
        };
        let mut reference = per_expert::group(&self.cfg, opts).map_err(|e| e.to_string())?;
        let (mask, format) = (&self.mask, self.format);
        check_against_oracle_format(
            Path::PerExpert.name(),
            &mut reference,
            &w,
            &ys,
            mask,
            format,
        )?;
        let mut fast = ep_fast::group(&self.cfg, opts).map_err(|e| e.to_string())?;
        check_against_oracle_format(Path::Batched.name(), &mut fast, &w, &ys, mask, format)
    }
}
