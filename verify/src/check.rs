//! Runs a path on a workload and compares every output with the oracle's, bit for bit (what the
//! equivalence tests and the differential run share).

use ep_reference::oracle;
use ep_reference::output::combine_diff;
use ep_reference::rank::run_ranks;
use ep_reference::workload::Workload;
use ep_reference::{bf16, CombineFormat, DispatchOutput, EpRank, Handle, RankMask, Result};

/// Every rank's dispatch, run collectively.
pub fn dispatch_all<R: EpRank>(
    ranks: &mut [R],
    w: &Workload,
) -> Vec<Result<(DispatchOutput, Handle)>> {
    run_ranks(ranks, |rk| {
        let r = rk.rank();
        rk.dispatch(&w.x[r], &w.topk_idx[r])
    })
}

/// Every rank's combine of `ys` with the handles of a dispatch, run collectively.
pub fn combine_all<R: EpRank>(
    ranks: &mut [R],
    w: &Workload,
    ys: &[Vec<bf16>],
    handles: &[Handle],
) -> Vec<Result<Vec<bf16>>> {
    combine_all_with(ranks, w, ys, handles, CombineFormat::Bf16)
}

/// [`combine_all`] with the rows in `format`.
pub fn combine_all_with<R: EpRank>(
    ranks: &mut [R],
    w: &Workload,
    ys: &[Vec<bf16>],
    handles: &[Handle],
    format: CombineFormat,
) -> Vec<Result<Vec<bf16>>> {
    run_ranks(ranks, |rk| {
        let r = rk.rank();
        rk.combine_with(
            &ys[r],
            &w.topk_idx[r],
            &w.topk_weights[r],
            &handles[r],
            format,
        )
    })
}

/// Scales the expert outputs so that LogFMT packs most groups: every group of 128 channels
/// whose (row + group) is not a multiple of 4 is multiplied by 2^-4 (the workload's values in
/// [-8, 8] become [-0.5, 0.5]; NaN and infinities stay); the others keep their values, and
/// with them amax >= 1 mostly, so they travel raw.
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

/// Dispatch then combine on `ranks`, compared with the oracle; `Err` describes the first
/// difference (or the error a rank returned).
pub fn check_against_oracle<R: EpRank>(
    name: &str,
    ranks: &mut [R],
    w: &Workload,
    seed: u64,
) -> std::result::Result<(), String> {
    check_against_oracle_with(name, ranks, w, &w.expert_outputs(seed))
}

/// As [`check_against_oracle`], with the expert outputs `ys` given (one per rank).
pub fn check_against_oracle_with<R: EpRank>(
    name: &str,
    ranks: &mut [R],
    w: &Workload,
    ys: &[Vec<bf16>],
) -> std::result::Result<(), String> {
    check_against_oracle_masked(name, ranks, w, ys, &RankMask::none(w.config.num_ranks))
}

/// As [`check_against_oracle_with`], under `mask` (DeepEP's shrink mode).
///
/// With a mask, the group first makes one unchecked dispatch and combine without it, so that
/// the masked ranks' regions hold the rows and signals of an earlier call (a fresh group's are
/// zero, and a zero row read by mistake would add nothing to a combine). Then every endpoint
/// masks the ranks of `mask` (`EpRank::update_mask`, as DeepEP's users do on every rank) and
/// must report exactly `mask`; every rank dispatches then combines, the masked ones too (their
/// calls must succeed; their outputs, undefined, are not compared); every other rank's outputs
/// must equal `oracle::dispatch_masked` / `oracle::combine_masked` bit for bit. Then the mask
/// is cleaned (every rank has made the same calls, so the unmask must be accepted) and every
/// endpoint must report an empty mask.
pub fn check_against_oracle_masked<R: EpRank>(
    name: &str,
    ranks: &mut [R],
    w: &Workload,
    ys: &[Vec<bf16>],
    mask: &RankMask,
) -> std::result::Result<(), String> {
    check_against_oracle_format(name, ranks, w, ys, mask, CombineFormat::Bf16)
}

/// As [`check_against_oracle_masked`], every combine with the rows in `format`, against
/// `oracle::combine_masked_with`.
pub fn check_against_oracle_format<R: EpRank>(
    name: &str,
    ranks: &mut [R],
    w: &Workload,
    ys: &[Vec<bf16>],
    mask: &RankMask,
    format: CombineFormat,
) -> std::result::Result<(), String> {
    let cfg = &w.config;
    let name = &format!("{name} [{}]", format.name());
    let name = if mask.is_empty() {
        name.to_string()
    } else {
        format!("{name} (masked {:?})", mask.masked().collect::<Vec<_>>())
    };
    if !mask.is_empty() {
        let mut handles = Vec::new();
        for (r, g) in dispatch_all(ranks, w).into_iter().enumerate() {
            let (_, h) = g.map_err(|e| format!("{name} warm-up dispatch rank {r}: {e}"))?;
            handles.push(h);
        }
        for (r, g) in combine_all_with(ranks, w, ys, &handles, format)
            .into_iter()
            .enumerate()
        {
            g.map_err(|e| format!("{name} warm-up combine rank {r}: {e}"))?;
        }
    }
    for rk in ranks.iter_mut() {
        for m in mask.masked() {
            rk.update_mask(m, true)
                .map_err(|e| format!("{name}: rank {} update_mask({m}): {e}", rk.rank()))?;
        }
    }
    for rk in ranks.iter() {
        if rk.query_mask() != *mask {
            return Err(format!(
                "{name}: rank {} reports the mask {:?}",
                rk.rank(),
                rk.query_mask()
            ));
        }
    }
    let want = oracle::dispatch_masked(cfg, &w.dispatch_inputs(), mask)
        .map_err(|e| format!("oracle: {e}"))?;
    let got = dispatch_all(ranks, w);
    let mut handles = Vec::new();
    for (r, (g, wo)) in got.into_iter().zip(&want).enumerate() {
        let (out, h) = g.map_err(|e| format!("{name} dispatch rank {r}: {e}"))?;
        if !mask.is_masked(r) {
            if let Some(d) = wo.diff(&out) {
                return Err(format!(
                    "{name} dispatch rank {r} differs from the oracle: {d}"
                ));
            }
        }
        handles.push(h);
    }
    let want = oracle::combine_masked_with(cfg, &w.combine_inputs(ys), mask, format)
        .map_err(|e| format!("oracle: {e}"))?;
    let got = combine_all_with(ranks, w, ys, &handles, format);
    for (r, (g, wo)) in got.into_iter().zip(&want).enumerate() {
        let out = g.map_err(|e| format!("{name} combine rank {r}: {e}"))?;
        if mask.is_masked(r) {
            continue;
        }
        if let Some(d) = combine_diff(wo, &out, cfg.hidden) {
            return Err(format!(
                "{name} combine rank {r} differs from the oracle at {d}"
            ));
        }
    }
    if let Some(rk) = ranks.first_mut() {
        rk.clean_mask()
            .map_err(|e| format!("{name}: clean_mask after the calls: {e}"))?;
    }
    for rk in ranks.iter() {
        if !rk.query_mask().is_empty() {
            return Err(format!(
                "{name}: rank {} still reports a mask after clean_mask",
                rk.rank()
            ));
        }
    }
    Ok(())
}
