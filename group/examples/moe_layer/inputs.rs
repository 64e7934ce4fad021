//! The layer's inputs: every rank's tokens and router scores, drawn from the seed, so every
//! process holds the same (each uploads its own rank's, and the check needs all of them).

use ep_kernels::testing::Rng;
use ep_reference::{bf16, Config};

/// One rank's host inputs: its token count, tokens `[n, H]` and router scores `[n, E]`.
pub struct HostRank {
    pub n: usize,
    pub x: Vec<bf16>,
    pub scores: Vec<f32>,
}

/// Every rank's inputs for `cfg`, from `seed`.
pub fn host_inputs(cfg: &Config, seed: u64) -> Vec<HostRank> {
    let mut rng = Rng::new(seed);
    (0..cfg.num_ranks)
        .map(|_| {
            let n = 1 + rng.below(cfg.max_tokens_per_rank);
            let x = (0..n * cfg.hidden)
                .map(|_| bf16::from_f32(rng.unit() * 4.0))
                .collect();
            // Scores in (0, 2]: positive, so the weights' sum is never zero.
            let scores = (0..n * cfg.num_experts)
                .map(|_| rng.unit() + 1.0 + f32::EPSILON)
                .collect();
            HostRank { n, x, scores }
        })
        .collect()
}
