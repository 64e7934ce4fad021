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
            let x: Vec<bf16> = (0..n * h)
                .map(|_| {
                    let v: f32 = rng.random_range(-4.0..4.0);
                    let big = rng.random_bool(0.01);
                    bf16::from_f32(if big { v * 300.0 } else { v })
                })
                .collect();
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

    pub fn dispatch_inputs(&self) -> Vec<RankInput<'_>> {
        (0..self.x.len())
            .map(|r| RankInput {
                x: &self.x[r],
                topk_idx: &self.topk_idx[r],
            })
            .collect()
    }

    /// Expert outputs that differ per expert and per row: y[l][row] = x-like values scaled by an
    /// expert-specific factor, for every rank, in the dispatch layout.
    pub fn expert_outputs(&self, seed: u64) -> Vec<Vec<bf16>> {
        let cfg = &self.config;
        let mut rng = StdRng::seed_from_u64(seed ^ 0x9E37_79B9_7F4A_7C15);
        let len = cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden;
        (0..cfg.num_ranks)
            .map(|_| {
                (0..len)
                    .map(|_| bf16::from_f32(rng.random_range(-8.0f32..8.0)))
                    .collect()
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
