//! The oracle: every rank's outputs computed straight from the contract, with no messages and no
//! threads. It is the simplest code that is obviously right, and every path is tested against it.

use crate::config::{Config, Mode};
use crate::error::{Error, Result};
use crate::input::{check_combine_inputs, check_dispatch_inputs};
use crate::numerics::bf16::{from_f32_rne, to_f32};
use crate::numerics::fp8;
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

/// One rank's combine inputs: `y` (L x (R*T) x H, this rank's expert outputs), and the routing
/// of this rank's own tokens.
#[derive(Debug, Clone, Copy)]
pub struct CombineInput<'a> {
    pub y: &'a [bf16],
    pub topk_idx: &'a [i64],
    pub topk_weights: &'a [f32],
}

/// Every rank's combine output (n_r x H).
pub fn combine(cfg: &Config, inputs: &[CombineInput<'_>]) -> Result<Vec<Vec<bf16>>> {
    cfg.validate()?;
    check_rank_count(cfg, inputs.len())?;
    for (s, inp) in inputs.iter().enumerate() {
        check_combine_inputs(cfg, s, inp.y.len(), inp.topk_idx, inp.topk_weights.len())?;
    }
    let topk: Vec<&[i64]> = inputs.iter().map(|i| i.topk_idx).collect();
    let pos = positions(cfg, &topk);
    let (l_n, h, k) = (cfg.num_local_experts(), cfg.hidden, cfg.top_k);
    let per = cfg.rows_per_expert();
    let mut outs = Vec::with_capacity(inputs.len());
    for (s, inp) in inputs.iter().enumerate() {
        let n = inp.topk_idx.len() / k;
        let mut out = vec![bf16::ZERO; n * h];
        for t in 0..n {
            for c in 0..h {
                let mut acc = 0.0f32;
                for slot in 0..k {
                    let e = inp.topk_idx[t * k + slot];
                    if e < 0 {
                        continue;
                    }
                    let (d, l) = (e as usize / l_n, e as usize % l_n);
                    let row = pos.row[s][t * k + slot].unwrap();
                    let y = inputs[d].y[(l * per + row) * h + c];
                    acc = inp.topk_weights[t * k + slot].mul_add(to_f32(y), acc);
                }
                out[t * h + c] = from_f32_rne(acc);
            }
        }
        outs.push(out);
    }
    Ok(outs)
}
