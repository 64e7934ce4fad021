//! Inputs for the GPU tests, the check binary and the benchmark (the project's one generator,
//! `ep_reference::workload`, behind the signatures they use) and the oracle comparison.

use ep_reference::workload::{self, Workload};
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
    /// Every token selects expert 0 (in one slot), the other slots -1.
    AllToOne,
    /// Every token selects one expert on each of K ranks (`workload::Routing::EveryRank`).
    EveryRank,
}

/// One rank's inputs.
#[derive(Debug, Clone)]
pub struct RankData {
    pub x: Vec<bf16>,
    pub topk_idx: Vec<i64>,
    pub topk_weights: Vec<f32>,
}

/// Every rank's dispatch inputs (x and topk_idx) as the oracle takes them.
pub fn rank_inputs(data: &[RankData]) -> Vec<RankInput<'_>> {
    data.iter()
        .map(|d| RankInput {
            x: &d.x,
            topk_idx: &d.topk_idx,
        })
        .collect()
}

/// Random inputs for every rank, from the project's one generator
/// (`ep_reference::workload::Workload`, seeded from `rng`): `tokens[r]` tokens on rank r.
pub fn random_inputs(
    cfg: &Config,
    tokens: &[usize],
    routing: Routing,
    rng: &mut Rng,
) -> Vec<RankData> {
    let routing = match routing {
        Routing::Random { masked } => workload::Routing::Random {
            masked: masked as f64,
        },
        Routing::AllToOne => workload::Routing::OneExpert,
        Routing::EveryRank => workload::Routing::EveryRank,
    };
    let w = Workload::generate(cfg, tokens, routing, rng.next_u64());
    w.x.into_iter()
        .zip(w.topk_idx)
        .zip(w.topk_weights)
        .map(|((x, topk_idx), topk_weights)| RankData {
            x,
            topk_idx,
            topk_weights,
        })
        .collect()
}

/// Random expert outputs y (L x R*T x H) for every rank (`Workload::expert_outputs`).
pub fn random_y(cfg: &Config, rng: &mut Rng) -> Vec<Vec<bf16>> {
    no_inputs(cfg).expert_outputs(rng.next_u64())
}

/// A workload of `cfg` without token inputs: what drawing expert outputs needs.
fn no_inputs(cfg: &Config) -> Workload {
    Workload {
        config: *cfg,
        x: Vec::new(),
        topk_idx: Vec::new(),
        topk_weights: Vec::new(),
    }
}

/// The rows the dispatch of `data` (every rank's inputs) gives each local expert of each rank:
/// `recv_count` of every rank's dispatch output, from the routing alone (valid slots per
/// expert, summed over the sources).
pub fn received_counts(cfg: &Config, data: &[RankData]) -> Vec<Vec<i32>> {
    let topk: Vec<&[i64]> = data.iter().map(|d| d.topk_idx.as_slice()).collect();
    workload::received_counts(cfg, &topk)
}

/// [`random_y`] for the rows a dispatch filled only (`Workload::expert_outputs_received`):
/// drawing the whole L x R*T capacity grows as R^2 per rank.
pub fn random_y_received(cfg: &Config, recv_counts: &[Vec<i32>], rng: &mut Rng) -> Vec<Vec<bf16>> {
    no_inputs(cfg).expert_outputs_received(rng.next_u64(), recv_counts)
}

use crate::runtime::{GpuGroup, Path};
use ep_reference::oracle::{self, CombineInput, RankInput};
use ep_reference::RankMask;

/// Scales expert outputs so that LogFMT packs most groups (as `ep_verify::logfmt_packable`
/// does for the CPU paths): every group of 128 channels whose (row + group) is
/// not a multiple of 4 is multiplied by 2^-4 (values in [-8, 8] become [-0.5, 0.5], which pack);
/// the others keep their values, amax >= 1 mostly, and travel raw.
pub fn logfmt_packable(ys: &mut [Vec<bf16>], hidden: usize) {
    for y in ys {
        for (row, r) in y.chunks_exact_mut(hidden).enumerate() {
            for (g, group) in r.chunks_mut(128).enumerate() {
                if (row + g) % 4 != 0 {
                    for v in group {
                        *v = bf16::from_f32(v.to_f32() * 0.0625);
                    }
                }
            }
        }
    }
}

/// One verification case: dispatch and combine on both paths, compared bit for bit with the
/// oracle (the combine in the group's `combine_format`, the oracle's `combine_with` of it).
/// Returns how many (path, op) comparisons passed.
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
    let inputs = rank_inputs(data);
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
    let format = g.combine_format();
    let want_c = oracle::combine_with(&cfg, &cin, format).map_err(|e| format!("oracle: {e}"))?;
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
            if let Some(d) = ep_reference::output::combine_diff(&got_c[r], &want_c[r], cfg.hidden) {
                return Err(format!(
                    "{} combine ({}), {}, rank {r}: {d}",
                    path.name(),
                    format.name(),
                    cfg.describe()
                ));
            }
        }
        passed += 1;
    }
    Ok(passed)
}

/// One dispatch + combine on `path` through the host harness, every unmasked rank's outputs
/// compared bit for bit with the oracle run on the masked routing (a masked rank's outputs
/// carry no meaning and are not compared). Returns the number of ranks checked.
pub fn verify_masked(
    g: &mut crate::runtime::GpuGroup,
    path: crate::runtime::Path,
    data: &[RankData],
    y: &[Vec<bf16>],
    masked: &[bool],
) -> Result<usize, String> {
    let cfg = *g.config();
    let x: Vec<Vec<bf16>> = data.iter().map(|d| d.x.clone()).collect();
    let idx: Vec<Vec<i64>> = data.iter().map(|d| d.topk_idx.clone()).collect();
    let w: Vec<Vec<f32>> = data.iter().map(|d| d.topk_weights.clone()).collect();
    let ranks: Vec<usize> = (0..cfg.num_ranks).filter(|&r| masked[r]).collect();
    let mask = RankMask::from_ranks(cfg.num_ranks, &ranks).map_err(|e| format!("mask: {e}"))?;
    let inputs = rank_inputs(data);
    let want = oracle::dispatch_masked(&cfg, &inputs, &mask).map_err(|e| format!("oracle: {e}"))?;
    let cin: Vec<CombineInput> = data
        .iter()
        .zip(y)
        .map(|(d, y)| CombineInput {
            y,
            topk_idx: &d.topk_idx,
            topk_weights: &d.topk_weights,
        })
        .collect();
    let want_c = oracle::combine_masked(&cfg, &cin, &mask).map_err(|e| format!("oracle: {e}"))?;
    let got = g
        .dispatch(path, &x, &idx)
        .map_err(|e| format!("{} dispatch: {e}", path.name()))?;
    let got_c = g
        .combine(path, y, &w)
        .map_err(|e| format!("{} combine: {e}", path.name()))?;
    let mut checked = 0;
    for r in (0..cfg.num_ranks).filter(|&r| !masked[r]) {
        if let Some(d) = got[r].diff(&want[r]) {
            return Err(format!(
                "{} dispatch, rank {r}, mask {masked:?}: {d}",
                path.name()
            ));
        }
        if let Some(d) = ep_reference::output::combine_diff(&got_c[r], &want_c[r], cfg.hidden) {
            return Err(format!(
                "{} combine, rank {r}, mask {masked:?}: {d}",
                path.name()
            ));
        }
        checked += 1;
    }
    Ok(checked)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    /// Only the received rows are drawn: every row below its expert's count has values, every
    /// row at or past it is zero; a negative count draws nothing, one past R*T is clamped.
    #[test]
    fn received_counts_are_the_oracles_recv_count() {
        let cfg = Config::new(4, 16, 8, 128, 4, Mode::Bf16).unwrap();
        let data = random_inputs(
            &cfg,
            &[8, 3, 0, 8],
            Routing::Random { masked: 0.2 },
            &mut Rng::new(9),
        );
        let inputs = rank_inputs(&data);
        let want: Vec<Vec<i32>> = oracle::dispatch(&cfg, &inputs)
            .unwrap()
            .into_iter()
            .map(|o| o.recv_count)
            .collect();
        assert_eq!(received_counts(&cfg, &data), want);
        assert!(want.iter().flatten().any(|&c| c > 0));
    }

    #[test]
    fn random_y_received_fills_exactly_the_received_rows() {
        let cfg = Config::new(2, 4, 3, 16, 2, Mode::Bf16).unwrap(); // L = 2, R*T = 6 rows
        let (h, rows) = (cfg.hidden, cfg.rows_per_expert());
        let counts = vec![vec![2, 0], vec![-1, 9]];
        let y = random_y_received(&cfg, &counts, &mut Rng::new(3));
        assert_eq!(y.len(), 2);
        for (r, yr) in y.iter().enumerate() {
            assert_eq!(yr.len(), 2 * rows * h);
            for l in 0..2 {
                let n = counts[r][l].clamp(0, rows as i32) as usize;
                for row in 0..rows {
                    let vals = &yr[(l * rows + row) * h..(l * rows + row + 1) * h];
                    let drawn = vals.iter().any(|v| *v != bf16::ZERO);
                    assert_eq!(drawn, row < n, "rank {r} expert {l} row {row} (count {n})");
                }
            }
        }
    }
}
