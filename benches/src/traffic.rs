//! What the GPU transports put on the wire per call (bytes, messages, signals), counted from the
//! routing: the figures ep-bench prints beside its timings.

use ep_kernels::runtime::{NcclSizes, Path};
use ep_reference::numerics::logfmt_wire;
use ep_reference::{bf16, Config};

/// Wire accounting of one dispatch + combine on `path` with the default options (combine reads
/// rows of owners on the same GPU in place): (dispatch bytes, combine bytes, dispatch messages,
/// combine messages, signals), all ranks, per call pair. Dispatch bytes are the bytes stored into
/// the receive buffers (the own rank's included); combine bytes are the rows actually put (per-
/// expert: every row; batched: rows whose owner sits on another GPU than their source).
pub fn accounting(
    cfg: &Config,
    topk_idx: &[Vec<i64>],
    path: Path,
    num_gpus: usize,
) -> (u64, u64, u64, u64, u64) {
    let (r, l, k, e) = (
        cfg.num_ranks,
        cfg.num_local_experts(),
        cfg.top_k,
        cfg.num_experts,
    );
    let per_gpu = r / num_gpus.max(1);
    let selections: u64 = topk_idx
        .iter()
        .map(|t| t.iter().filter(|&&v| v >= 0).count() as u64)
        .sum();
    let mut dedup = 0u64;
    let mut cross = 0u64;
    for (s, t) in topk_idx.iter().enumerate() {
        for row in t.chunks_exact(k) {
            let mut mask = 0u64;
            for &v in row.iter().filter(|&&v| v >= 0) {
                let d = v as usize / l;
                mask |= 1 << d;
                cross += (d / per_gpu != s / per_gpu) as u64;
            }
            dedup += mask.count_ones() as u64;
        }
    }
    let row = 2 * cfg.hidden as u64;
    let all_local = num_gpus <= 1;
    match path {
        Path::Batched => (
            dedup * ep_kernels::runtime::entry_bytes(cfg) as u64,
            cross * row,
            (r * r) as u64,
            if all_local {
                0
            } else {
                (r * r - r * per_gpu) as u64
            },
            if all_local {
                (r * r) as u64
            } else {
                2 * (r * r) as u64
            },
        ),
        Path::PerExpert => (
            selections * ep_kernels::runtime::pe_entry_bytes(cfg) as u64,
            selections * row,
            selections,
            selections,
            2 * (e * r) as u64,
        ),
    }
}

/// The bytes a LogFMT combine puts, all ranks, per call: every row a dispatch filled (row i
/// of local expert l on rank d for i < `recv_counts[d][l]`, one per selection) goes back to its
/// source encoded, `logfmt_wire::row_bytes` of it (4 bytes a group, then 160 packed or 256
/// raw); none is read in place. Both paths put the same rows.
pub fn logfmt_combine_bytes(cfg: &Config, recv_counts: &[Vec<i32>], y: &[Vec<bf16>]) -> u64 {
    let (h, per) = (cfg.hidden, cfg.rows_per_expert());
    let mut bytes = 0u64;
    for (counts, y) in recv_counts.iter().zip(y) {
        for (l, &n) in counts.iter().enumerate() {
            for i in 0..usize::try_from(n).unwrap_or(0).min(per) {
                let row = (l * per + i) * h;
                if let Some(r) = y.get(row..row + h) {
                    bytes += logfmt_wire::row_bytes(r) as u64;
                }
            }
        }
    }
    bytes
}

/// One NCCL call's wire figures, all ranks: (dispatch bytes, combine bytes, dispatch
/// messages, combine messages).
pub type NcclWire = (u64, u64, u64, u64);

/// Wire accounting of the NCCL transport, every peer (self included) through NCCL: (dispatch
/// bytes, combine bytes, dispatch messages, combine messages), all ranks, per call. A message
/// is one `ncclSend` (zero-byte sends are not issued); bytes are what the sends carry: the
/// (2 + L) x 4-byte header of every pair, and the payload as sized by `sizes` (capacity padding
/// included). Batched: one payload message per pair (exact: tokens x entry bytes; capacity:
/// T entries), combine one per pair (exact: selections x 2H; capacity: T x min(K, L) rows).
/// Per-expert (exact only): one message per (pair, local expert) with rows, both ways.
/// Checked arithmetic: an overflow is an error naming the figure.
pub fn nccl_accounting(
    cfg: &Config,
    topk_idx: &[Vec<i64>],
    path: Path,
    sizes: NcclSizes,
) -> Result<NcclWire, String> {
    let (r, l, k, t) = (
        cfg.num_ranks,
        cfg.num_local_experts(),
        cfg.top_k,
        cfg.max_tokens_per_rank as u64,
    );
    let of = |what: &str| format!("the NCCL {what} overflow u64");
    let mul = |a: u64, b: u64, what: &str| a.checked_mul(b).ok_or_else(|| of(what));
    let add = |a: u64, b: u64, what: &str| a.checked_add(b).ok_or_else(|| of(what));
    let hb = ((2 + l) * 4) as u64;
    let eb = ep_kernels::runtime::entry_bytes(cfg) as u64;
    let peb = ep_kernels::runtime::pe_entry_bytes(cfg) as u64;
    let rowb = 2 * cfg.hidden as u64;
    let cap_rows = mul(t, k.min(l) as u64, "capacity rows")?;
    let (mut dw, mut cw, mut dm, mut cm) = (0u64, 0u64, 0u64, 0u64);
    for rows in topk_idx {
        // rows[d * L + l]: selections of (this source, d, l); tokens[d], sels[d].
        let mut per = vec![0u64; r * l];
        let mut tokens = vec![0u64; r];
        for tok in rows.chunks_exact(k) {
            let mut mask = vec![false; r];
            for &v in tok.iter().filter(|&&v| v >= 0) {
                let e = v as usize;
                if e >= r * l {
                    return Err(format!("expert {e} outside 0..{}", r * l));
                }
                per[e] += 1;
                mask[e / l] = true;
            }
            for (d, m) in mask.into_iter().enumerate() {
                tokens[d] += m as u64;
            }
        }
        for d in 0..r {
            let sel: u64 = per[d * l..(d + 1) * l].iter().sum();
            let with_rows = per[d * l..(d + 1) * l].iter().filter(|&&n| n > 0).count() as u64;
            let (db, dmsg, cb, cmsg) = match (path, sizes) {
                (Path::Batched, NcclSizes::Exact) => (
                    mul(tokens[d], eb, "dispatch bytes")?,
                    (tokens[d] > 0) as u64,
                    mul(sel, rowb, "combine bytes")?,
                    (sel > 0) as u64,
                ),
                (Path::Batched, NcclSizes::Capacity) => (
                    mul(t, eb, "dispatch bytes")?,
                    1,
                    mul(cap_rows, rowb, "combine bytes")?,
                    1,
                ),
                (Path::PerExpert, NcclSizes::Exact) => (
                    mul(sel, peb, "dispatch bytes")?,
                    with_rows,
                    mul(sel, rowb, "combine bytes")?,
                    with_rows,
                ),
                (Path::PerExpert, NcclSizes::Capacity) => {
                    return Err("the per-expert path over NCCL runs exact sizes only".into())
                }
            };
            dw = add(dw, add(hb, db, "dispatch bytes")?, "dispatch bytes")?;
            dm = add(dm, 1 + dmsg, "dispatch messages")?;
            cw = add(cw, cb, "combine bytes")?;
            cm = add(cm, cmsg, "combine messages")?;
        }
    }
    Ok((dw, cw, dm, cm))
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    /// Encoded sizes by hand: H = 256 (2 groups, 8 meta bytes a row), R = 2, one local expert,
    /// T = 2 (R*T = 4 rows per expert); rows past the counts are never counted.
    #[test]
    fn logfmt_combine_bytes_are_the_encoded_rows() {
        let cfg = Config::new(2, 2, 2, 256, 1, Mode::Bf16).unwrap();
        let v = |x: f32| bf16::from_f32(x);
        // A group that packs: amax < 1, not all equal; one that stays raw: amax >= 1.
        let packs: Vec<bf16> = (0..128).map(|i| v(0.5 - i as f32 / 512.0)).collect();
        let raw: Vec<bf16> = (0..128).map(|i| v(1.5 + i as f32)).collect();
        let row = |a: &[bf16], b: &[bf16]| [a, b].concat();
        let pad = vec![v(2.0); 256];
        let y0 = [
            row(&packs, &packs),
            row(&packs, &raw),
            row(&raw, &raw),
            pad.clone(),
        ]
        .concat();
        let y1 = [row(&raw, &raw), pad.clone(), pad.clone(), pad].concat();
        let counts = vec![vec![2], vec![1]];
        let want = (8 + 2 * 160) + (8 + 160 + 256) + (8 + 2 * 256);
        assert_eq!(
            logfmt_combine_bytes(&cfg, &counts, &[y0.clone(), y1.clone()]),
            want as u64
        );
        // A count past R*T reads no row past y; a negative one reads none.
        let counts = vec![vec![9], vec![-3]];
        let all_four = (8 + 2 * 160) + (8 + 160 + 256) + (8 + 2 * 256) + (8 + 2 * 256);
        assert_eq!(
            logfmt_combine_bytes(&cfg, &counts, &[y0, y1]),
            all_four as u64
        );
    }

    /// The NCCL figures by hand for a small case: R = 2, E = 4 (L = 2), T = 2, K = 2, H = 128,
    /// bf16. Rank 0: token 0 -> experts 0, 2; token 1 -> 1, -1. Rank 1: token 0 -> 3, 2.
    #[test]
    fn nccl_accounting_counts_every_send_and_byte() {
        let cfg = Config::new(2, 4, 2, 128, 2, Mode::Bf16).unwrap();
        let topk = vec![vec![0, 2, 1, -1], vec![3, 2]];
        let hb = 4 * 4; // (2 + L) i32
        let eb = ep_kernels::runtime::entry_bytes(&cfg) as u64; // 80 + 256
        let peb = ep_kernels::runtime::pe_entry_bytes(&cfg) as u64; // 16 + 256
        let rowb = 256u64;
        assert_eq!((eb, peb), (336, 272));
        // Pairs (0,0): 2 tokens, sel 2 (experts 0, 1); (0,1): 1 token, sel 1 (expert 2);
        // (1,0): nothing; (1,1): 1 token, sel 2 (experts 2, 3). Four headers.
        let b = nccl_accounting(&cfg, &topk, Path::Batched, NcclSizes::Exact).unwrap();
        assert_eq!(b, (4 * hb + 4 * eb, 5 * rowb, 4 + 3, 3));
        let c = nccl_accounting(&cfg, &topk, Path::Batched, NcclSizes::Capacity).unwrap();
        // Capacity: T = 2 entries and T * min(K, L) = 4 rows on every pair.
        assert_eq!(c, (4 * hb + 4 * 2 * eb, 4 * 4 * rowb, 4 * 2, 4));
        let p = nccl_accounting(&cfg, &topk, Path::PerExpert, NcclSizes::Exact).unwrap();
        // Messages per (pair, expert with rows): (0,0) 2, (0,1) 1, (1,1) 2.
        assert_eq!(p, (4 * hb + 5 * peb, 5 * rowb, 4 + 5, 5));
        assert!(nccl_accounting(&cfg, &topk, Path::PerExpert, NcclSizes::Capacity).is_err());
        assert!(nccl_accounting(&cfg, &[vec![9, -1]], Path::Batched, NcclSizes::Exact).is_err());
    }
}
