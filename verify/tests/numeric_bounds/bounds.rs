//! The bounds of the formats and the checkers that hold the paths' outputs to them, in f64,
//! written here independently of `ep_reference::numerics` (see the test's docs).

use std::collections::HashMap;

use approx::{abs_diff_eq, relative_eq};
use ep_reference::workload::Workload;
use ep_reference::{bf16, DispatchOutput, Mode, RecvScales, RecvX};

/// f32's unit roundoff.
pub(crate) const U32: f64 = 1.0 / (1u64 << 24) as f64;
/// f64's unit roundoff.
pub(crate) const U64: f64 = 1.0 / (1u64 << 53) as f64;
/// e4m3 rounding of a normal value: 3 mantissa bits, half a step is at most 2^-4 of the value.
pub(crate) const E4M3_REL: f64 = 1.0 / 16.0;
/// e4m3 rounding below its smallest normal 2^-6: half the subnormal step 2^-9.
pub(crate) const E4M3_SUB_ABS: f64 = 1.0 / 1024.0;
/// What the f32 roundings of a non-power-of-two scale pair add, relative to |x|.
pub(crate) const SCALE_ROUNDING_REL: f64 = 1.0 / (1u64 << 20) as f64;
/// e4m3's largest finite value; the scale maps amax onto it.
pub(crate) const E4M3_MAX: f64 = 448.0;
/// The contract's floor on amax (`1e-4f`, an f32 literal).
pub(crate) const AMAX_FLOOR: f64 = 1e-4f32 as f64;
/// bf16 rounding of a normal value: 8 significant bits, half a step is at most 2^-8 of it.
pub(crate) const BF16_REL: f64 = 1.0 / 256.0;
/// bf16 rounding in its subnormal range: half the smallest subnormal 2^-133.
pub(crate) const BF16_SUB_ABS: f64 = 1.0 / (1u128 << 127) as f64 / 128.0;
/// f32 fma results in the subnormal range: half the smallest f32 subnormal 2^-149, per slot.
pub(crate) const F32_SUB_ABS: f64 = 1.0 / (1u128 << 127) as f64 / (1u64 << 23) as f64;

// ---------------------------------------------------------------------------------------------
// Independent math.

/// The value of an e4m3 code, from its bit fields; `None` for the NaN codes 0x7F / 0xFF.
pub(crate) fn e4m3_value(q: u8) -> Option<f64> {
    if q & 0x7F == 0x7F {
        return None;
    }
    let sign = if q & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((q >> 3) & 0xF);
    let man = f64::from(q & 7);
    Some(if exp == 0 {
        sign * man * 2f64.powi(-9)
    } else {
        sign * (8.0 + man) * 2f64.powi(exp - 10)
    })
}

/// The smallest power of two at or above `v > 0`, in f64.
pub(crate) fn pow2_at_least(v: f64) -> f64 {
    let mut e = v.log2().floor() as i32 - 1;
    while 2f64.powi(e) < v {
        e += 1;
    }
    2f64.powi(e)
}

/// The rows of local expert `l` on rank `d`, in the canonical order: (source rank, token).
pub(crate) fn expected_rows(w: &Workload, d: usize, l: usize) -> Vec<(usize, usize)> {
    let cfg = &w.config;
    let (k, e) = (cfg.top_k, (d * cfg.num_local_experts() + l) as i64);
    let mut rows = Vec::new();
    for (s, idx) in w.topk_idx.iter().enumerate() {
        for (t, sel) in idx.chunks_exact(k).enumerate() {
            if sel.contains(&e) {
                rows.push((s, t));
            }
        }
    }
    rows
}

/// `recv_count`, `layout_range` and `src_info` of rank `d` against [`expected_rows`].
pub(crate) fn check_layout(w: &Workload, d: usize, out: &DispatchOutput) -> Result<(), String> {
    let cfg = &w.config;
    let (r, per) = (cfg.num_ranks, cfg.rows_per_expert());
    for l in 0..cfg.num_local_experts() {
        let rows = expected_rows(w, d, l);
        if out.recv_count[l] as usize != rows.len() {
            return Err(format!(
                "rank {d} expert {l}: recv_count {} but {} selections",
                out.recv_count[l],
                rows.len()
            ));
        }
        let mut begin = 0;
        for s in 0..r {
            let count = rows.iter().filter(|(src, _)| *src == s).count();
            if out.range(l, s) != (begin, count) {
                return Err(format!(
                    "rank {d} expert {l} source {s}: layout_range {:?}, want {:?}",
                    out.range(l, s),
                    (begin, count)
                ));
            }
            begin += count;
        }
        for (i, &(_, t)) in rows.iter().enumerate() {
            if out.src_info[l * per + i] as usize != t {
                return Err(format!(
                    "rank {d} expert {l} row {i}: src_info {}, want {t}",
                    out.src_info[l * per + i]
                ));
            }
        }
    }
    Ok(())
}

/// One 128-channel group: the scale against amax, every dequantized value against its input.
/// Returns the largest error / bound met.
pub(crate) fn check_group(
    x: &[bf16],
    q: &[u8],
    scale_inv: f64,
    round_scale: bool,
) -> Result<f64, String> {
    let xs: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    let amax = xs.iter().fold(0.0f64, |m, v| m.max(v.abs()));
    let ideal = amax.max(AMAX_FLOOR) / E4M3_MAX;
    if round_scale {
        let want = pow2_at_least(ideal);
        if scale_inv != want {
            return Err(format!(
                "amax {amax:e}: scale_inv {scale_inv:e}, want the power of two {want:e}"
            ));
        }
    } else if !relative_eq!(scale_inv, ideal, epsilon = 0.0, max_relative = 4.0 * U32) {
        return Err(format!(
            "amax {amax:e}: scale_inv {scale_inv:e}, want {ideal:e} within 2^-22"
        ));
    }
    let mut worst = 0.0f64;
    for (c, (&xv, &code)) in xs.iter().zip(q).enumerate() {
        let deq = e4m3_value(code)
            .ok_or_else(|| format!("channel {c}: NaN code {code:#04x} for input {xv:e}"))?
            * scale_inv;
        let mut bound = (E4M3_REL * xv.abs()).max(E4M3_SUB_ABS * scale_inv);
        if !round_scale {
            bound += SCALE_ROUNDING_REL * xv.abs();
        }
        if !abs_diff_eq!(deq, xv, epsilon = bound) {
            return Err(format!(
                "channel {c}: input {xv:e} dequantizes to {deq:e} (code {code:#04x}, scale_inv \
                 {scale_inv:e}): error {:e} > bound {bound:e}",
                (deq - xv).abs()
            ));
        }
        worst = worst.max((deq - xv).abs() / bound);
    }
    Ok(worst)
}

/// Every received row of rank `d` (FP8 mode) within e4m3's bound of its input row.
pub(crate) fn check_fp8(w: &Workload, d: usize, out: &DispatchOutput) -> Result<f64, String> {
    let cfg = &w.config;
    let Mode::Fp8 { round_scale, ue8m0 } = cfg.mode else {
        return Err("not an FP8 config".into());
    };
    check_layout(w, d, out)?;
    let (h, per, groups) = (cfg.hidden, cfg.rows_per_expert(), cfg.hidden / 128);
    let RecvX::Fp8(recv) = &out.recv_x else {
        return Err("FP8 mode with bf16 rows".into());
    };
    let mut worst = 0.0f64;
    for l in 0..cfg.num_local_experts() {
        for (i, (s, t)) in expected_rows(w, d, l).into_iter().enumerate() {
            let idx = l * per + i;
            let x = &w.x[s][t * h..(t + 1) * h];
            let q = &recv[idx * h..(idx + 1) * h];
            for g in 0..groups {
                let scale_inv = match &out.recv_scales {
                    Some(RecvScales::F32(v)) if !ue8m0 => f64::from(v[idx * groups + g]),
                    Some(RecvScales::Ue8m0(v)) if ue8m0 => {
                        let byte = v[idx * (groups / 4) + g / 4].to_le_bytes()[g % 4];
                        2f64.powi(i32::from(byte) - 127)
                    }
                    other => return Err(format!("scales {other:?} in {}", cfg.mode.name())),
                };
                let span = g * 128..(g + 1) * 128;
                worst = worst.max(
                    check_group(&x[span.clone()], &q[span], scale_inv, round_scale).map_err(
                        |e| {
                            format!(
                                "rank {d} expert {l} row {i} (source {s} token {t}) group {g}: {e}"
                            )
                        },
                    )?,
                );
            }
        }
    }
    Ok(worst)
}

/// Every received row of rank `d` (BF16 mode) equals its input row bit for bit.
pub(crate) fn check_bf16(w: &Workload, d: usize, out: &DispatchOutput) -> Result<(), String> {
    let cfg = &w.config;
    check_layout(w, d, out)?;
    let (h, per) = (cfg.hidden, cfg.rows_per_expert());
    let RecvX::Bf16(recv) = &out.recv_x else {
        return Err("BF16 mode with fp8 rows".into());
    };
    if out.recv_scales.is_some() {
        return Err("BF16 mode with scales".into());
    }
    for l in 0..cfg.num_local_experts() {
        for (i, (s, t)) in expected_rows(w, d, l).into_iter().enumerate() {
            let idx = l * per + i;
            let (x, y) = (&w.x[s][t * h..(t + 1) * h], &recv[idx * h..(idx + 1) * h]);
            if let Some(c) = (0..h).find(|&c| x[c].to_bits() != y[c].to_bits()) {
                return Err(format!(
                    "rank {d} expert {l} row {i} (source {s} token {t}) channel {c}: {:#06x}, \
                     input {:#06x}",
                    y[c].to_bits(),
                    x[c].to_bits()
                ));
            }
        }
    }
    Ok(())
}

/// Every rank's combine output within bf16's bound of the f64 weighted sum of its expert rows.
pub(crate) fn check_combine(
    w: &Workload,
    ys: &[Vec<bf16>],
    outs: &[Vec<bf16>],
) -> Result<f64, String> {
    let cfg = &w.config;
    let (l_n, h, k, per) = (
        cfg.num_local_experts(),
        cfg.hidden,
        cfg.top_k,
        cfg.rows_per_expert(),
    );
    // Where (source, token) sits among expert e's rows.
    let places: Vec<HashMap<(usize, usize), usize>> = (0..cfg.num_experts)
        .map(|e| {
            expected_rows(w, e / l_n, e % l_n)
                .into_iter()
                .enumerate()
                .map(|(i, st)| (st, i))
                .collect()
        })
        .collect();
    let mut worst = 0.0f64;
    for (s, out) in outs.iter().enumerate() {
        let n = w.topk_idx[s].len() / k;
        if out.len() != n * h {
            return Err(format!("rank {s}: {} elements, want {}", out.len(), n * h));
        }
        for t in 0..n {
            let slots: Vec<(f64, &[bf16])> = (0..k)
                .filter_map(|slot| {
                    let e = w.topk_idx[s][t * k + slot];
                    (e >= 0).then(|| {
                        let e = e as usize;
                        let row = (e % l_n) * per + places[e][&(s, t)];
                        (
                            f64::from(w.topk_weights[s][t * k + slot]),
                            &ys[e / l_n][row * h..(row + 1) * h],
                        )
                    })
                })
                .collect();
            for c in 0..h {
                let got = out[t * h + c];
                if slots.is_empty() {
                    if got.to_bits() != 0 {
                        return Err(format!(
                            "rank {s} token {t} channel {c}: no valid slot but {:#06x}",
                            got.to_bits()
                        ));
                    }
                    continue;
                }
                let (mut sum, mut mag) = (0.0f64, 0.0f64);
                for (wk, y) in &slots {
                    let p = wk * y[c].to_f64(); // exact: 24 + 8 significant bits
                    sum += p;
                    mag += p.abs();
                }
                let nv = slots.len() as f64;
                let acc_err = nv * U32 / (1.0 - nv * U32) * mag + nv * F32_SUB_ABS;
                let sum_err = nv * U64 * mag;
                let bound = BF16_REL * (sum.abs() + acc_err) + acc_err + BF16_SUB_ABS + sum_err;
                let got = got.to_f64();
                if !abs_diff_eq!(got, sum, epsilon = bound) {
                    return Err(format!(
                        "rank {s} token {t} channel {c}: {got:e}, exact sum {sum:e} (sum |w y| \
                         {mag:e}, {} slots): error {:e} > bound {bound:e}",
                        slots.len(),
                        (got - sum).abs()
                    ));
                }
                worst = worst.max((got - sum).abs() / bound);
            }
        }
    }
    Ok(worst)
}

// ---------------------------------------------------------------------------------------------
// Inputs: the workload generator's, spread over bf16's range.
