//! Deterministic random inputs for the tests, the check binary and the benchmark.

use ep_reference::Config;
use half::bf16;

/// xorshift64*: small, fast, reproducible.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in 0..n.
    pub fn below(&mut self, n: usize) -> usize {
        ((self.next_u64() >> 11) % n as u64) as usize
    }
    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32) / (1u64 << 23) as f32 - 1.0
    }
}

/// How tokens pick experts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// K distinct random experts, each slot -1 with probability `masked`.
    Random { masked: f32 },
    /// Every token selects expert 0 in slot 0, the other slots -1.
    AllToOne,
}

/// One rank's inputs.
#[derive(Debug, Clone)]
pub struct RankData {
    pub x: Vec<bf16>,
    pub topk_idx: Vec<i64>,
    pub topk_weights: Vec<f32>,
}

/// Random inputs for every rank: `tokens[r]` tokens on rank r, values with a spread of
/// magnitudes (so FP8 groups get different scales), a few exact zeros and large values.
pub fn random_inputs(
    cfg: &Config,
    tokens: &[usize],
    routing: Routing,
    rng: &mut Rng,
) -> Vec<RankData> {
    let (h, k, e) = (cfg.hidden, cfg.top_k, cfg.num_experts);
    tokens
        .iter()
        .map(|&n| {
            let mut x = Vec::with_capacity(n * h);
            for t in 0..n {
                for c in 0..h {
                    let group_scale = [1e-3f32, 0.05, 1.0, 30.0, 900.0][(t + c / 128) % 5];
                    let v = match rng.below(97) {
                        0 => 0.0,
                        1 => 3.0e4,
                        _ => rng.unit() * group_scale,
                    };
                    x.push(bf16::from_f32(v));
                }
            }
            let mut topk_idx = vec![-1i64; n * k];
            for t in 0..n {
                match routing {
                    Routing::AllToOne => topk_idx[t * k] = 0,
                    Routing::Random { masked } => {
                        let mut chosen: Vec<i64> = Vec::with_capacity(k);
                        while chosen.len() < k.min(e) {
                            let c = rng.below(e) as i64;
                            if !chosen.contains(&c) {
                                chosen.push(c);
                            }
                        }
                        for (slot, &c) in chosen.iter().enumerate() {
                            let drop = (rng.below(1 << 20) as f32) < masked * (1 << 20) as f32;
                            topk_idx[t * k + slot] = if drop { -1 } else { c };
                        }
                    }
                }
            }
            let topk_weights = (0..n * k).map(|_| rng.unit()).collect();
            RankData {
                x,
                topk_idx,
                topk_weights,
            }
        })
        .collect()
}

/// Random expert outputs y (L x R*T x H) for every rank.
pub fn random_y(cfg: &Config, rng: &mut Rng) -> Vec<Vec<bf16>> {
    let len = cfg.num_local_experts() * cfg.rows_per_expert() * cfg.hidden;
    (0..cfg.num_ranks)
        .map(|_| (0..len).map(|_| bf16::from_f32(rng.unit() * 4.0)).collect())
        .collect()
}

use crate::runtime::{GpuGroup, Path};
use ep_reference::oracle::{self, CombineInput, RankInput};

/// One verification case: dispatch and combine on both paths, compared bit for bit with the
/// oracle. Returns how many (path, op) comparisons passed.
pub fn verify_case(g: &mut GpuGroup, data: &[RankData], y: &[Vec<bf16>]) -> Result<usize, String> {
    verify_paths(g, data, y, &[Path::PerExpert, Path::Batched])
}

/// [`verify_case`] on the given paths only (the NCCL transport runs the batched path alone).
pub fn verify_paths(
    g: &mut GpuGroup,
    data: &[RankData],
    y: &[Vec<bf16>],
    paths: &[Path],
) -> Result<usize, String> {
    let cfg = *g.config();
    let x: Vec<Vec<bf16>> = data.iter().map(|d| d.x.clone()).collect();
    let idx: Vec<Vec<i64>> = data.iter().map(|d| d.topk_idx.clone()).collect();
    let w: Vec<Vec<f32>> = data.iter().map(|d| d.topk_weights.clone()).collect();
    let inputs: Vec<RankInput> = data
        .iter()
        .map(|d| RankInput {
            x: &d.x,
            topk_idx: &d.topk_idx,
        })
        .collect();
    let want = oracle::dispatch(&cfg, &inputs).map_err(|e| format!("oracle: {e}"))?;
    let cin: Vec<CombineInput> = data
        .iter()
        .zip(y)
        .map(|(d, y)| CombineInput {
            y,
            topk_idx: &d.topk_idx,
            topk_weights: &d.topk_weights,
        })
        .collect();
    let want_c = oracle::combine(&cfg, &cin).map_err(|e| format!("oracle: {e}"))?;
    let mut passed = 0;
    for &path in paths {
        let got = g
            .dispatch(path, &x, &idx)
            .map_err(|e| format!("{} dispatch: {e}", path.name()))?;
        for (r, (a, b)) in got.iter().zip(&want).enumerate() {
            if let Some(d) = a.diff(b) {
                return Err(format!(
                    "{} dispatch, {}, rank {r}: {d}",
                    path.name(),
                    cfg.describe()
                ));
            }
        }
        passed += 1;
        let got_c = g
            .combine(path, y, &w)
            .map_err(|e| format!("{} combine: {e}", path.name()))?;
        for r in 0..cfg.num_ranks {
            if let Some(i) =
                (0..want_c[r].len()).find(|&i| got_c[r][i].to_bits() != want_c[r][i].to_bits())
            {
                return Err(format!(
                    "{} combine, {}, rank {r}: element {i} (token {}, channel {}): got {:#06x}, want {:#06x}",
                    path.name(),
                    cfg.describe(),
                    i / cfg.hidden,
                    i % cfg.hidden,
                    got_c[r][i].to_bits(),
                    want_c[r][i].to_bits()
                ));
            }
        }
        passed += 1;
    }
    Ok(passed)
}
