//! The oracle: every rank's outputs computed straight from the contract, with no messages and no
//! threads. It is the simplest code that is obviously right, and every path is tested against it.

use crate::config::{CombineFormat, Config, Mode};
use crate::error::{Error, Result};
use crate::input::{check_combine_inputs, check_dispatch_inputs};
use crate::mask::RankMask;
use crate::numerics::bf16::{from_f32_rne, to_f32};
use crate::numerics::{fp8, logfmt};
use crate::output::{DispatchOutput, RecvScales, RecvX};
use half::bf16;

/// One rank's dispatch inputs: `x` (n x H) and `topk_idx` (n x K).
#[derive(Debug, Clone, Copy)]
pub struct RankInput<'a> {
    pub x: &'a [bf16],
    pub topk_idx: &'a [i64],
}

/// The rows that token `t` of rank `s` occupies in expert `e`'s layout, for every (s, e).
struct Positions {
    /// For every source s, token t, slot k: the row in expert topk[s][t][k]'s layout (or None).
    row: Vec<Vec<Option<usize>>>,
    /// counts[e][s]: tokens of rank s that selected expert e.
    counts: Vec<Vec<usize>>,
}

fn positions(cfg: &Config, topk: &[&[i64]]) -> Positions {
    let (r, e_n, k) = (cfg.num_ranks, cfg.num_experts, cfg.top_k);
    let mut counts = vec![vec![0usize; r]; e_n];
    for (s, idx) in topk.iter().enumerate() {
        for &e in idx.iter().filter(|&&e| e >= 0) {
            counts[e as usize][s] += 1;
        }
    }
    let mut row = Vec::with_capacity(r);
    for (s, idx) in topk.iter().enumerate() {
        // Rows of expert e from source s start after all rows from sources before s, and
        // follow token order.
        let mut next: Vec<usize> = (0..e_n).map(|e| counts[e][..s].iter().sum()).collect();
        let mut rows = vec![None; idx.len()];
        for t in 0..idx.len() / k {
            for slot in 0..k {
                let e = idx[t * k + slot];
                if e >= 0 {
                    rows[t * k + slot] = Some(next[e as usize]);
                    next[e as usize] += 1;
                }
            }
        }
        row.push(rows);
    }
    Positions { row, counts }
}

fn check_rank_count(cfg: &Config, got: usize) -> Result<()> {
    if got != cfg.num_ranks {
        return Err(Error::WrongRankCount {
            expected: cfg.num_ranks,
            got,
        });
    }
    Ok(())
}

/// Every rank's dispatch output.
pub fn dispatch(cfg: &Config, inputs: &[RankInput<'_>]) -> Result<Vec<DispatchOutput>> {
    cfg.validate()?;
    check_rank_count(cfg, inputs.len())?;
    for (s, inp) in inputs.iter().enumerate() {
        check_dispatch_inputs(cfg, s, inp.x.len(), inp.topk_idx)?;
    }
    let topk: Vec<&[i64]> = inputs.iter().map(|i| i.topk_idx).collect();
    let pos = positions(cfg, &topk);
    let (r, l_n, h, k) = (
        cfg.num_ranks,
        cfg.num_local_experts(),
        cfg.hidden,
        cfg.top_k,
    );
    let per = cfg.rows_per_expert();
    let mut outs: Vec<DispatchOutput> = (0..r).map(|_| DispatchOutput::zeroed(cfg)).collect();
    for (d, out) in outs.iter_mut().enumerate() {
        let counts: Vec<usize> = (0..l_n)
            .flat_map(|l| pos.counts[d * l_n + l].clone())
            .collect();
        out.set_layout(&counts);
    }
    let groups = h / fp8::GROUP;
    for (s, inp) in inputs.iter().enumerate() {
        for t in 0..inp.topk_idx.len() / k {
            let x = &inp.x[t * h..(t + 1) * h];
            for slot in 0..k {
                let e = inp.topk_idx[t * k + slot];
                if e < 0 {
                    continue;
                }
                let (d, l) = (e as usize / l_n, e as usize % l_n);
                let i = l * per + pos.row[s][t * k + slot].unwrap();
                let out = &mut outs[d];
                out.src_info[i] = t as i32;
                match (&mut out.recv_x, cfg.mode) {
                    (RecvX::Bf16(v), _) => v[i * h..(i + 1) * h].copy_from_slice(x),
                    (RecvX::Fp8(v), Mode::Fp8 { round_scale, ue8m0 }) => {
                        let mut si = vec![0f32; groups];
                        fp8::quantize_row(x, round_scale, &mut v[i * h..(i + 1) * h], &mut si);
                        match out.recv_scales.as_mut().unwrap() {
                            RecvScales::F32(sv) => {
                                sv[i * groups..(i + 1) * groups].copy_from_slice(&si)
                            }
                            RecvScales::Ue8m0(sv) => {
                                assert!(ue8m0);
                                let g4 = groups / 4;
                                fp8::pack_ue8m0(&si, &mut sv[i * g4..(i + 1) * g4]);
                            }
                        }
                    }
                    (RecvX::Fp8(_), Mode::Bf16) => unreachable!("fp8 buffers in bf16 mode"),
                }
            }
        }
    }
    Ok(outs)
}

/// Fails unless `mask` is of a group of `cfg.num_ranks` ranks ([`Error::WrongRankCount`]).
fn check_mask(cfg: &Config, mask: &RankMask) -> Result<()> {
    if mask.num_ranks() != cfg.num_ranks {
        return Err(Error::WrongRankCount {
            expected: cfg.num_ranks,
            got: mask.num_ranks(),
        });
    }
    Ok(())
}

/// Every rank's routing under `mask` ([`RankMask::apply`]).
fn masked_routing(cfg: &Config, mask: &RankMask, topk: &[&[i64]]) -> Vec<Vec<i64>> {
    topk.iter()
        .enumerate()
        .map(|(r, idx)| mask.apply(cfg, r, idx))
        .collect()
}

/// Every rank's dispatch output under `mask` (DeepEP's shrink mode, docs/contract.md "Masked
/// ranks"): [`dispatch`] of the same inputs with every slot that names an expert of a masked
/// rank set to -1, and every slot of a masked rank set to -1 (a masked rank sends nothing).
///
/// The inputs are checked as given, before the mask is applied, so bad input is an error
/// whatever the mask; a mask of another group size is [`Error::WrongRankCount`]. The outputs
/// of masked ranks carry no meaning (the contract leaves them undefined and the tests never
/// compare them; here they are simply empty). With an empty mask this is [`dispatch`].
pub fn dispatch_masked(
    cfg: &Config,
    inputs: &[RankInput<'_>],
    mask: &RankMask,
) -> Result<Vec<DispatchOutput>> {
    cfg.validate()?;
    check_rank_count(cfg, inputs.len())?;
    for (s, inp) in inputs.iter().enumerate() {
        check_dispatch_inputs(cfg, s, inp.x.len(), inp.topk_idx)?;
    }
    check_mask(cfg, mask)?;
    let topk: Vec<&[i64]> = inputs.iter().map(|i| i.topk_idx).collect();
    let routing = masked_routing(cfg, mask, &topk);
    let masked: Vec<RankInput<'_>> = inputs
        .iter()
        .zip(&routing)
        .map(|(inp, idx)| RankInput {
            x: inp.x,
            topk_idx: idx,
        })
        .collect();
    dispatch(cfg, &masked)
}

/// One rank's combine inputs: `y` (L x (R*T) x H, this rank's expert outputs), and the routing
/// of this rank's own tokens.
#[derive(Debug, Clone, Copy)]
pub struct CombineInput<'a> {
    pub y: &'a [bf16],
    pub topk_idx: &'a [i64],
    pub topk_weights: &'a [f32],
}

/// Every rank's combine output (n_r x H), the rows as bf16.
pub fn combine(cfg: &Config, inputs: &[CombineInput<'_>]) -> Result<Vec<Vec<bf16>>> {
    combine_with(cfg, inputs, CombineFormat::Bf16)
}

/// Every rank's combine output (n_r x H) with the rows in `format`: for each token, channel by
/// channel, `acc = fma(w, v, acc)` over the slots in k order and bf16 rounding, where `v` is
/// the channel of the expert row as bf16 gives it, or as LogFMT's round trip gives it
/// ([`logfmt::round_trip`]).
pub fn combine_with(
    cfg: &Config,
    inputs: &[CombineInput<'_>],
    format: CombineFormat,
) -> Result<Vec<Vec<bf16>>> {
    cfg.validate()?;
    format.check(cfg)?;
    check_rank_count(cfg, inputs.len())?;
    for (s, inp) in inputs.iter().enumerate() {
        check_combine_inputs(cfg, s, inp.y.len(), inp.topk_idx, inp.topk_weights.len())?;
    }
    let topk: Vec<&[i64]> = inputs.iter().map(|i| i.topk_idx).collect();
    let pos = positions(cfg, &topk);
    let (l_n, h, k) = (cfg.num_local_experts(), cfg.hidden, cfg.top_k);
    let per = cfg.rows_per_expert();
    let mut outs = Vec::with_capacity(inputs.len());
    let mut v = vec![0f32; h];
    for (s, inp) in inputs.iter().enumerate() {
        let n = inp.topk_idx.len() / k;
        let mut out = vec![bf16::ZERO; n * h];
        for t in 0..n {
            let mut acc = vec![0f32; h];
            for slot in 0..k {
                let e = inp.topk_idx[t * k + slot];
                if e < 0 {
                    continue;
                }
                let (d, l) = (e as usize / l_n, e as usize % l_n);
                let row = l * per + pos.row[s][t * k + slot].unwrap();
                let y = &inputs[d].y[row * h..(row + 1) * h];
                match format {
                    CombineFormat::Bf16 => {
                        for (v, y) in v.iter_mut().zip(y) {
                            *v = to_f32(*y);
                        }
                    }
                    CombineFormat::LogFmt => logfmt::round_trip(y, &mut v),
                }
                let w = inp.topk_weights[t * k + slot];
                for (a, v) in acc.iter_mut().zip(&v) {
                    *a = w.mul_add(*v, *a);
                }
            }
            for (o, a) in out[t * h..(t + 1) * h].iter_mut().zip(&acc) {
                *o = from_f32_rne(*a);
            }
        }
        outs.push(out);
    }
    Ok(outs)
}

/// Every rank's combine output under `mask`: [`combine`] with the routing of
/// [`dispatch_masked`] (slots of masked ranks' experts, and every slot of a masked rank, set to
/// -1), the expert outputs `y` read in the layout that [`dispatch_masked`] gives.
///
/// The inputs are checked as given, before the mask is applied; a mask of another group size is
/// [`Error::WrongRankCount`]. The outputs of masked ranks carry no meaning (here: zeros). With
/// an empty mask this is [`combine`].
pub fn combine_masked(
    cfg: &Config,
    inputs: &[CombineInput<'_>],
    mask: &RankMask,
) -> Result<Vec<Vec<bf16>>> {
    combine_masked_with(cfg, inputs, mask, CombineFormat::Bf16)
}

/// [`combine_masked`] with the rows in `format` ([`combine_with`]).
pub fn combine_masked_with(
    cfg: &Config,
    inputs: &[CombineInput<'_>],
    mask: &RankMask,
    format: CombineFormat,
) -> Result<Vec<Vec<bf16>>> {
    cfg.validate()?;
    format.check(cfg)?;
    check_rank_count(cfg, inputs.len())?;
    for (s, inp) in inputs.iter().enumerate() {
        check_combine_inputs(cfg, s, inp.y.len(), inp.topk_idx, inp.topk_weights.len())?;
    }
    check_mask(cfg, mask)?;
    let topk: Vec<&[i64]> = inputs.iter().map(|i| i.topk_idx).collect();
    let routing = masked_routing(cfg, mask, &topk);
    let masked: Vec<CombineInput<'_>> = inputs
        .iter()
        .zip(&routing)
        .map(|(inp, idx)| CombineInput {
            y: inp.y,
            topk_idx: idx,
            topk_weights: inp.topk_weights,
        })
        .collect();
    combine_with(cfg, &masked, format)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Routing, Workload};
    use crate::Mode;

    fn workload() -> Workload {
        let cfg = Config::new(4, 8, 6, 128, 3, Mode::FP8).unwrap();
        Workload::generate(&cfg, &[6, 0, 4, 5], Routing::Random { masked: 0.1 }, 11)
    }

    #[test]
    fn an_empty_mask_is_the_plain_oracle() {
        let w = workload();
        let cfg = w.config;
        let none = RankMask::none(4);
        assert_eq!(
            dispatch_masked(&cfg, &w.dispatch_inputs(), &none).unwrap(),
            dispatch(&cfg, &w.dispatch_inputs()).unwrap()
        );
        let ys = w.expert_outputs(3);
        assert_eq!(
            combine_masked(&cfg, &w.combine_inputs(&ys), &none).unwrap(),
            combine(&cfg, &w.combine_inputs(&ys)).unwrap()
        );
    }

    #[test]
    fn a_mask_drops_the_masked_ranks_rows_both_ways() {
        let w = workload();
        let cfg = w.config;
        let mask = RankMask::from_ranks(4, &[2]).unwrap();
        let plain = dispatch(&cfg, &w.dispatch_inputs()).unwrap();
        let got = dispatch_masked(&cfg, &w.dispatch_inputs(), &mask).unwrap();
        // Nothing comes from rank 2, nothing goes to it; the rows from the others are the
        // plain oracle's, packed without rank 2's.
        for (d, out) in got.iter().enumerate() {
            for l in 0..cfg.num_local_experts() {
                let (_, c2) = out.range(l, 2);
                assert_eq!(c2, 0, "rank {d} expert {l}");
                for s in [0, 1, 3] {
                    let want = if d == 2 { 0 } else { plain[d].range(l, s).1 };
                    assert_eq!(out.range(l, s).1, want, "rank {d} expert {l} source {s}");
                }
            }
        }
        assert!(got[2].recv_count.iter().all(|&c| c == 0));
        // It is the plain oracle of the masked routing, which differs from the plain one here.
        let idx: Vec<Vec<i64>> = (0..4)
            .map(|r| mask.apply(&cfg, r, &w.topk_idx[r]))
            .collect();
        let inputs: Vec<RankInput<'_>> = (0..4)
            .map(|r| RankInput {
                x: &w.x[r],
                topk_idx: &idx[r],
            })
            .collect();
        assert_eq!(got, dispatch(&cfg, &inputs).unwrap());
        assert_ne!(got, plain);
        // Combine: a token's slots on rank 2's experts no longer count.
        let ys = w.expert_outputs(5);
        let got = combine_masked(&cfg, &w.combine_inputs(&ys), &mask).unwrap();
        assert_ne!(got, combine(&cfg, &w.combine_inputs(&ys)).unwrap());
        let masked_inputs: Vec<CombineInput<'_>> = (0..4)
            .map(|r| CombineInput {
                y: &ys[r],
                topk_idx: &idx[r],
                topk_weights: &w.topk_weights[r],
            })
            .collect();
        assert_eq!(got, combine(&cfg, &masked_inputs).unwrap());
    }

    #[test]
    fn inputs_are_checked_before_the_mask() {
        let w = workload();
        let cfg = w.config;
        // Rank 2 is masked, and its bad routing is still an error.
        let mask = RankMask::from_ranks(4, &[2]).unwrap();
        let mut bad = w.topk_idx.clone();
        bad[2][1] = 99;
        let inputs: Vec<RankInput<'_>> = (0..4)
            .map(|r| RankInput {
                x: &w.x[r],
                topk_idx: &bad[r],
            })
            .collect();
        assert!(matches!(
            dispatch_masked(&cfg, &inputs, &mask),
            Err(Error::ExpertOutOfRange {
                rank: 2,
                expert: 99,
                ..
            })
        ));
        let ys = w.expert_outputs(1);
        let cin: Vec<CombineInput<'_>> = (0..4)
            .map(|r| CombineInput {
                y: &ys[r],
                topk_idx: &bad[r],
                topk_weights: &w.topk_weights[r],
            })
            .collect();
        assert!(matches!(
            combine_masked(&cfg, &cin, &mask),
            Err(Error::ExpertOutOfRange { rank: 2, .. })
        ));
        assert_eq!(
            dispatch_masked(&cfg, &w.dispatch_inputs(), &RankMask::none(3)),
            Err(Error::WrongRankCount {
                expected: 4,
                got: 3
            })
        );
    }
}
