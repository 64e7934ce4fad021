//! Inputs for tests and benchmarks: every rank's tokens, routing and weights, from a seed.

use half::bf16;
use rand::rngs::StdRng;
use rand::seq::{IndexedRandom, SliceRandom};
use rand::{Rng, SeedableRng};

use crate::config::Config;
use crate::oracle::{CombineInput, RankInput};

/// How tokens choose experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// K distinct experts uniformly at random; each slot is -1 with probability `masked`.
    Random { masked: f64 },
    /// Every token selects expert 0 (and -1 in its other slots).
    OneExpert,
    /// Every token selects only experts of rank `rank` (as many as fit in K).
    OneRank { rank: usize },
    /// Every token selects one expert on every rank (up to K ranks).
    EveryRank,
    /// K distinct experts per token, each slot drawn from the `hot` first experts with
    /// probability `share` (else uniformly), then -1 with probability `masked`: a few experts
    /// (and their ranks) get most of the rows.
    Skewed { hot: usize, share: f64, masked: f64 },
}

/// What values `x` and the expert outputs hold.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Values {
    /// Uniform in [-4, 4) (x: a sprinkling 300 times larger, so FP8 scales vary).
    Normal,
    /// As `Normal`, then each element is replaced with probability `share` by a special value
    /// ([`SPECIAL_BF16`]: ±inf, NaN of both signs, ±0, subnormals, the largest finite values,
    /// values beyond e4m3's 448), and each 128-channel block is filled with one special value
    /// with probability `share` (so a block's amax, hence its FP8 scale, is special too).
    Special { share: f64 },
}

/// The special bf16 bit patterns of [`Values::Special`].
pub const SPECIAL_BF16: [u16; 20] = [
    0x7F80, // +inf
    0xFF80, // -inf
    0x7FC0, // NaN
    0xFFC0, // -NaN
    0x7F81, // NaN with a low payload (signalling in f32)
    0x8000, // -0
    0x0000, // +0
    0x0001, // smallest subnormal
    0x8001, // -smallest subnormal
    0x007F, // largest subnormal
    0x0080, // smallest normal
    0x7F7F, // largest finite
    0xFF7F, // -largest finite
    0x43E1, // 450: beyond e4m3's 448
    0xC3E8, // -464
    0x4480, // 1024
    0x477F, // 65280
    0x3A80, // 2^-10: below e4m3's smallest subnormal at scale 1
    0x43E0, // 448: e4m3's largest
    0x3B00, // 2^-9: e4m3's smallest subnormal
];

impl Values {
    /// Replaces elements of `rows` (rows of `h` channels) as `self` says. `Normal` draws
    /// nothing, so it leaves the generator's stream as it was.
    fn apply(self, rows: &mut [bf16], h: usize, rng: &mut StdRng) {
        let Values::Special { share } = self else {
            return;
        };
        let pick =
            |rng: &mut StdRng| bf16::from_bits(*SPECIAL_BF16.choose(rng).expect("non-empty"));
        for v in rows.iter_mut() {
            if rng.random_bool(share) {
                *v = pick(rng);
            }
        }
        for row in rows.chunks_mut(h.max(1)) {
            for block in row.chunks_mut(128) {
                if rng.random_bool(share) {
                    block.fill(pick(rng));
                }
            }
        }
    }
}

/// Every rank's inputs.
#[derive(Debug, Clone)]
pub struct Workload {
    pub config: Config,
    pub x: Vec<Vec<bf16>>,
    pub topk_idx: Vec<Vec<i64>>,
    pub topk_weights: Vec<Vec<f32>>,
}

impl Workload {
    /// `tokens[r]` tokens on rank r, values uniform in [-4, 4) as bf16 (with a sprinkling of
    /// larger magnitudes so FP8 scales vary), routing as asked.
    pub fn generate(cfg: &Config, tokens: &[usize], routing: Routing, seed: u64) -> Workload {
        Workload::generate_with(cfg, tokens, routing, Values::Normal, seed)
    }

    /// As [`Workload::generate`] (the same draws for `Values::Normal`), with `values` in `x`.
    pub fn generate_with(
        cfg: &Config,
        tokens: &[usize],
        routing: Routing,
        values: Values,
        seed: u64,
    ) -> Workload {
        let mut rng = StdRng::seed_from_u64(seed);
        let (e_n, l_n, h, k) = (
            cfg.num_experts,
            cfg.num_local_experts(),
            cfg.hidden,
            cfg.top_k,
        );
        let mut w = Workload {
            config: *cfg,
            x: Vec::new(),
            topk_idx: Vec::new(),
            topk_weights: Vec::new(),
        };
        let all: Vec<i64> = (0..e_n as i64).collect();
        for &n in tokens {
            let mut x: Vec<bf16> = (0..n * h)
                .map(|_| {
                    let v: f32 = rng.random_range(-4.0..4.0);
                    let big = rng.random_bool(0.01);
                    bf16::from_f32(if big { v * 300.0 } else { v })
                })
                .collect();
            values.apply(&mut x, h, &mut rng);
            let mut idx = vec![-1i64; n * k];
            for t in 0..n {
                let row = &mut idx[t * k..(t + 1) * k];
                match routing {
                    Routing::Random { masked } => {
                        let picks: Vec<i64> =
                            all.choose_multiple(&mut rng, k.min(e_n)).copied().collect();
                        for (slot, p) in row.iter_mut().zip(picks) {
                            *slot = if rng.random_bool(masked) { -1 } else { p };
                        }
                    }
                    Routing::OneExpert => row[rng.random_range(0..k)] = 0,
                    Routing::OneRank { rank } => {
                        let base = (rank * l_n) as i64;
                        let mut local: Vec<i64> = (base..base + l_n as i64).collect();
                        local.shuffle(&mut rng);
                        for (slot, p) in row.iter_mut().zip(local) {
                            *slot = p;
                        }
                    }
                    Routing::EveryRank => {
                        for (slot, d) in row.iter_mut().zip(0..cfg.num_ranks) {
                            *slot = (d * l_n + rng.random_range(0..l_n)) as i64;
                        }
                        row.shuffle(&mut rng);
                    }
                    Routing::Skewed { hot, share, masked } => {
                        let hot = hot.clamp(1, e_n) as i64;
                        let mut picks: Vec<i64> = Vec::with_capacity(k);
                        while picks.len() < k.min(e_n) {
                            let e = if rng.random_bool(share) {
                                rng.random_range(0..hot)
                            } else {
                                rng.random_range(0..e_n as i64)
                            };
                            if !picks.contains(&e) {
                                picks.push(e);
                            }
                        }
                        for (slot, p) in row.iter_mut().zip(picks) {
                            *slot = if rng.random_bool(masked) { -1 } else { p };
                        }
                    }
                }
            }
            let weights: Vec<f32> = (0..n * k).map(|_| rng.random_range(-1.0..1.0)).collect();
            w.x.push(x);
            w.topk_idx.push(idx);
            w.topk_weights.push(weights);
        }
        w
    }

    /// The same number of tokens on every rank.
    pub fn uniform(cfg: &Config, tokens: usize, routing: Routing, seed: u64) -> Workload {
        Workload::generate(cfg, &vec![tokens; cfg.num_ranks], routing, seed)
    }

    pub fn num_tokens(&self, rank: usize) -> usize {
        self.topk_idx[rank].len() / self.config.top_k
    }

    /// Selections (valid slots) over all ranks.
    pub fn selections(&self) -> usize {
        self.topk_idx.iter().flatten().filter(|&&e| e >= 0).count()
    }

    /// [`received_counts`] of this workload's routing.
    pub fn received_counts(&self) -> Vec<Vec<i32>> {
        received_counts(&self.config, &self.topk_idx)
    }

    pub fn dispatch_inputs(&self) -> Vec<RankInput<'_>> {
        (0..self.x.len())
            .map(|r| RankInput {
                x: &self.x[r],
                topk_idx: &self.topk_idx[r],
            })
            .collect()
    }

    /// Expert outputs that differ per expert and per row: `y[l][row]` = x-like values scaled by an
    /// expert-specific factor, for every rank, in the dispatch layout.
    pub fn expert_outputs(&self, seed: u64) -> Vec<Vec<bf16>> {
        self.expert_outputs_with(seed, Values::Normal)
    }

    /// As [`Workload::expert_outputs`] (the same draws for `Values::Normal`), with `values`.
    pub fn expert_outputs_with(&self, seed: u64, values: Values) -> Vec<Vec<bf16>> {
        let cfg = &self.config;
        let mut rng = StdRng::seed_from_u64(seed ^ 0x9E37_79B9_7F4A_7C15);
        let len = cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden;
        (0..cfg.num_ranks)
            .map(|_| {
                let mut y: Vec<bf16> = (0..len)
                    .map(|_| bf16::from_f32(rng.random_range(-8.0f32..8.0)))
                    .collect();
                values.apply(&mut y, cfg.hidden, &mut rng);
                y
            })
            .collect()
    }

    /// As [`Workload::expert_outputs`], drawn only for the rows a dispatch filled: rows
    /// `0..recv_counts[r][l]` of local expert l on rank r (a count is clamped to 0..R*T), every
    /// other row zero on pages never written (rows past a count carry no meaning; combine never
    /// reads them). The L x R*T capacity is E x T rows per rank (470 MB at E = 256, T = 128,
    /// H = 7168, whatever R); the received rows are at most R*T*K over all ranks, and only their
    /// pages cost memory.
    pub fn expert_outputs_received(&self, seed: u64, recv_counts: &[Vec<i32>]) -> Vec<Vec<bf16>> {
        let cfg = &self.config;
        let mut rng = StdRng::seed_from_u64(seed ^ 0x9E37_79B9_7F4A_7C15);
        let (h, rows) = (cfg.hidden, cfg.rows_per_expert());
        let len = cfg.num_local_experts() * rows * h;
        recv_counts
            .iter()
            .map(|counts| {
                let mut y = crate::numerics::bf16::zeroed(len);
                for (l, &n) in counts.iter().enumerate() {
                    let n = usize::try_from(n).unwrap_or(0).min(rows);
                    for v in &mut y[l * rows * h..(l * rows + n) * h] {
                        *v = bf16::from_f32(rng.random_range(-8.0f32..8.0));
                    }
                }
                y
            })
            .collect()
    }

    pub fn combine_inputs<'a>(&'a self, ys: &'a [Vec<bf16>]) -> Vec<CombineInput<'a>> {
        (0..self.x.len())
            .map(|r| CombineInput {
                y: &ys[r],
                topk_idx: &self.topk_idx[r],
                topk_weights: &self.topk_weights[r],
            })
            .collect()
    }
}

/// The rows each local expert of each rank receives from `topk_idx` (every rank's routing),
/// without a mask: every rank's `recv_count`, from the routing alone (what
/// [`Workload::expert_outputs_received`] takes). Ids outside `[0, E)` count nowhere.
pub fn received_counts<T: AsRef<[i64]>>(cfg: &Config, topk_idx: &[T]) -> Vec<Vec<i32>> {
    let l = cfg.num_local_experts();
    let mut counts = vec![vec![0i32; l]; cfg.num_ranks];
    for &e in topk_idx.iter().flat_map(|t| t.as_ref()) {
        let Ok(e) = usize::try_from(e) else { continue };
        if let Some(c) = counts.get_mut(e / l).and_then(|v| v.get_mut(e % l)) {
            *c = c.saturating_add(1);
        }
    }
    counts
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;

    /// The counts from the routing are the oracle's recv_count, for every routing kind (ranks
    /// without tokens included).
    #[test]
    fn received_counts_are_the_oracles_recv_count() {
        let cfg = Config::new(4, 16, 8, 128, 4, Mode::Bf16).unwrap();
        for routing in [
            Routing::Random { masked: 0.2 },
            Routing::OneExpert,
            Routing::EveryRank,
        ] {
            let w = Workload::generate(&cfg, &[8, 3, 0, 8], routing, 5);
            let want: Vec<Vec<i32>> = crate::oracle::dispatch(&cfg, &w.dispatch_inputs())
                .unwrap()
                .into_iter()
                .map(|o| o.recv_count)
                .collect();
            assert_eq!(w.received_counts(), want, "{routing:?}");
            assert!(want.iter().flatten().any(|&c| c > 0));
        }
    }

    /// Drawn for the received rows only: every row below its expert's count has values, every
    /// row past it is zero.
    #[test]
    fn expert_outputs_received_fill_the_received_rows_only() {
        let cfg = Config::new(2, 4, 3, 16, 2, Mode::Bf16).unwrap(); // L = 2, R*T = 6 rows
        let w = Workload::uniform(&cfg, 3, Routing::Random { masked: 0.0 }, 1);
        let counts = w.received_counts();
        let ys = w.expert_outputs_received(9, &counts);
        let (h, rows) = (cfg.hidden, cfg.rows_per_expert());
        for (r, y) in ys.iter().enumerate() {
            assert_eq!(y.len(), 2 * rows * h);
            for (l, &n) in counts[r].iter().enumerate() {
                for row in 0..rows {
                    let v = &y[(l * rows + row) * h..(l * rows + row + 1) * h];
                    let drawn = v.iter().any(|b| b.to_bits() != 0);
                    assert_eq!(drawn, row < n as usize, "rank {r} expert {l} row {row}");
                }
            }
        }
    }
}
