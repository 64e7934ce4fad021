//! The NCCL transport's plan: which point-to-point messages a rank posts, and how large, for
//! every step of a call. Pure (the layout, the rank's addresses, the checked batch headers in,
//! the operation lists out), so that the sizing of both modes and the header checks run in CI
//! without a GPU: the tests below pair every rank's plan on a CPU network (`nccl::mock`, a
//! `Network` under the same abort logic as NCCL) as NCCL pairs them (in order, per (sender,
//! receiver)), and a size that differs on the two sides of a message is an error there, as it
//! would be a hang or a corruption on the wire.
//!
//! - Dispatch, first group: every (me, peer) header both ways; under `Capacity` also the whole
//!   T-entry batch, in the same group ([`dispatch_headers`]).
//! - Dispatch, `Exact`, after the headers were read back and checked ([`check_pair`]): the
//!   batches (batched: one per peer; per-expert: one per (peer, local expert) with rows), each
//!   of exactly the rows there are ([`dispatch_payload`]).
//! - Combine: the rows back to their sources, sized from the dispatch's headers (`Exact`) or by
//!   T x min(K, L) rows per peer (`Capacity`) ([`combine_ops`]).
//!
//! Zero-byte operations stay in the lists; the network's post leaves them out on both sides.

use crate::error::GpuError;
use crate::runtime::layout::{pe_messages, prod, RankPtrs};
use crate::runtime::nccl::header::check_pair;
use crate::runtime::nccl::net::P2p;
use crate::runtime::options::NcclSizes;
use ep_reference::Path;

/// What capacity mode writes into every send header word before the pack stage (i32::MAX: a
/// token count no peer accepts, see `GpuGroup::poison_send_headers`).
pub(crate) const POISON_HDR: u32 = i32::MAX as u32;
/// The sizes every plan is made of (the group's config and layout).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Sizing {
    /// T: tokens per rank.
    pub(crate) t: usize,
    /// K: selections per token.
    pub(crate) k: usize,
    /// L: local experts per rank.
    pub(crate) l: usize,
    /// R: ranks of the group.
    pub(crate) r_all: usize,
    /// Bytes of a batched dispatch entry and of a per-expert one.
    pub(crate) eb: usize,
    pub(crate) peb: usize,
    /// Bytes of a combine row (2H).
    pub(crate) rowb: usize,
    /// Combine rows per peer under `Capacity`: T x min(K, L).
    pub(crate) cap_rows: usize,
}

impl Sizing {
    /// Words of one batch header: tokens, selections, rows per local expert.
    pub(crate) fn header_words(&self) -> usize {
        2 + self.l
    }
}

/// A plan's operations, each tagged with the local expert whose group it belongs to (0 where
/// there is one group): `nccl_rounds` runs them `experts_per_group` experts at a time.
pub(crate) type Tagged = Vec<(usize, P2p)>;

/// Per peer of an exact-size dispatch: (peer, selections sent to it, selections received from
/// it).
pub(crate) type PeerSelections = Vec<(usize, usize, usize)>;

/// Dispatch, first group, of the rank at `p` with its NCCL `peers`: the headers both ways and,
/// under `capacity` (batched path only), the whole T-entry batch of every pair.
pub(crate) fn dispatch_headers(
    s: &Sizing,
    p: &RankPtrs,
    peers: &[usize],
    capacity: bool,
) -> Result<Vec<P2p>, GpuError> {
    let (t, eb) = (s.t, s.eb);
    let hb = s.header_words() * 4;
    let mut v = Vec::new();
    for &d in peers {
        v.push(P2p::Send {
            buf: p.snd_hdr + (d * hb) as u64,
            bytes: hb,
            peer: d,
        });
        v.push(P2p::Recv {
            buf: p.rcv_hdr + (d * hb) as u64,
            bytes: hb,
            peer: d,
        });
        if capacity {
            // Batched only (`check_sizes`): the whole region, T entries.
            let region = prod("a batch region", &[d, t, eb])? as u64;
            let bytes = prod("a capacity batch", &[t, eb])?;
            v.push(P2p::Send {
                buf: p.snd_buf + region,
                bytes,
                peer: d,
            });
            v.push(P2p::Recv {
                buf: p.bat_buf + region,
                bytes,
                peer: d,
            });
        }
    }
    Ok(v)
}

/// Dispatch, `Exact`, of rank `r` at `p`: every header word of every pair, this rank's (`sh`,
/// R x (2 + L) words) and the received ones (`rh`), is bounded before it sizes a transfer
/// ([`check_pair`], and the per-expert messages by `pe_messages`); then the batches. Also
/// returns, per peer, the selections sent to it and received from it (the rows that come back
/// in combine, and go back).
pub(crate) fn dispatch_payload(
    s: &Sizing,
    path: Path,
    r: usize,
    p: &RankPtrs,
    peers: &[usize],
    sh: &[i32],
    rh: &[i32],
) -> Result<(Tagged, PeerSelections), GpuError> {
    let (t, k, eb, peb, r_all) = (s.t, s.k, s.eb, s.peb, s.r_all);
    let hw = s.header_words();
    let mut v = Vec::new();
    let mut sels = Vec::new();
    for &d in peers {
        // Every header word, ours and the peer's, is bounded (tokens <= T,
        // selections within tokens..=tokens*K, per-expert rows summing to the selections)
        // before it sizes a transfer.
        let (sw, rw) = (&sh[d * hw..][..hw], &rh[d * hw..][..hw]);
        let (mine, theirs) = check_pair(r, d, sw, rw, t, k)?;
        sels.push((d, mine.selections, theirs.selections));
        match path {
            Path::Batched => {
                v.push((
                    0,
                    P2p::Send {
                        buf: p.snd_buf + (d * t * eb) as u64,
                        bytes: mine.tokens * eb,
                        peer: d,
                    },
                ));
                v.push((
                    0,
                    P2p::Recv {
                        buf: p.bat_buf + (d * t * eb) as u64,
                        bytes: theirs.tokens * eb,
                        peer: d,
                    },
                ));
            }
            Path::PerExpert => {
                // One message per local expert of d (staged packed in expert order from
                // d*T*K), one per local expert of mine from d, each into its (l, d) region of
                // pe_buf.
                let out = pe_messages(&sw[2..], t, k)?;
                for (le, (at, n)) in out.into_iter().enumerate() {
                    v.push((
                        le,
                        P2p::Send {
                            buf: p.snd_buf + ((d * t * k + at) * peb) as u64,
                            bytes: n * peb,
                            peer: d,
                        },
                    ));
                }
                let inn = pe_messages(&rw[2..], t, k)?;
                for (le, (_, n)) in inn.into_iter().enumerate() {
                    v.push((
                        le,
                        P2p::Recv {
                            buf: p.pe_buf + (((le * r_all + d) * t) * peb) as u64,
                            bytes: n * peb,
                            peer: d,
                        },
                    ));
                }
            }
        }
    }
    Ok((v, sels))
}

/// Combine of the rank at `p`: rows for source d go back to d's receive region for me.
/// `Exact` sizes come from the last dispatch (`sels`: per peer, the selections sent to it and
/// received from it; `hdrs`: the dispatch's send and receive headers, for per-expert);
/// `Capacity` sends T x min(K, L) rows per peer (batched only).
pub(crate) fn combine_ops(
    s: &Sizing,
    sizes: NcclSizes,
    path: Path,
    p: &RankPtrs,
    peers: &[usize],
    sels: &(Vec<usize>, Vec<usize>),
    hdrs: &(Vec<i32>, Vec<i32>),
) -> Result<Tagged, GpuError> {
    let (t, k, rowb, cap) = (s.t, s.k, s.rowb, s.cap_rows);
    let hw = s.header_words();
    let mut v = Vec::new();
    // Per-expert: rows from NCCL owners sit in cmb_buf from row T*K on, packed in
    // (owner, local expert) order (the dispatch pack kernel's comb_pos says where).
    let mut nbase = t * k;
    // Batched: peer d's rows land at T*K + d*T*K (the first T*K rows are the NVLink puts' t*K+k).
    let nccl_rows = (t * k * rowb) as u64;
    for &d in peers {
        let region = (d * t * k * rowb) as u64;
        match (sizes, path) {
            (NcclSizes::Capacity, _) => {
                let bytes = prod("a capacity combine message", &[cap, rowb])?;
                v.push((
                    0,
                    P2p::Send {
                        buf: p.snd_buf + region,
                        bytes,
                        peer: d,
                    },
                ));
                v.push((
                    0,
                    P2p::Recv {
                        buf: p.cmb_buf + nccl_rows + region,
                        bytes,
                        peer: d,
                    },
                ));
            }
            (NcclSizes::Exact, Path::Batched) => {
                v.push((
                    0,
                    P2p::Send {
                        buf: p.snd_buf + region,
                        bytes: sels.1[d] * rowb,
                        peer: d,
                    },
                ));
                v.push((
                    0,
                    P2p::Recv {
                        buf: p.cmb_buf + nccl_rows + region,
                        bytes: sels.0[d] * rowb,
                        peer: d,
                    },
                ));
            }
            (NcclSizes::Exact, Path::PerExpert) => {
                let (sh, rh) = hdrs;
                if sh.len() < (d + 1) * hw || rh.len() < (d + 1) * hw {
                    return Err(GpuError::Unsupported(
                        "per-expert combine over NCCL before an exact-size dispatch".into(),
                    ));
                }
                // Rows of (l, d) back to source d, staged packed from d*T*K.
                let out = pe_messages(&rh[d * hw + 2..][..hw - 2], t, k)?;
                for (le, (at, n)) in out.into_iter().enumerate() {
                    v.push((
                        le,
                        P2p::Send {
                            buf: p.snd_buf + ((d * t * k + at) * rowb) as u64,
                            bytes: n * rowb,
                            peer: d,
                        },
                    ));
                }
                let inn = pe_messages(&sh[d * hw + 2..][..hw - 2], t, k)?;
                let mut sum = 0usize;
                for (le, (at, n)) in inn.into_iter().enumerate() {
                    v.push((
                        le,
                        P2p::Recv {
                            buf: p.cmb_buf + ((nbase + at) * rowb) as u64,
                            bytes: n * rowb,
                            peer: d,
                        },
                    ));
                    sum += n;
                }
                nbase += sum;
                if nbase > 2 * t * k {
                    return Err(GpuError::Unsupported(format!(
                        "per-expert combine rows {nbase} past the region of 2*T*K"
                    )));
                }
            }
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::layout::{carve_rank, rank_sizes, total_bytes};
    use crate::runtime::nccl::check_header;
    use crate::runtime::nccl::mock::{CpuComms, CpuNet};
    use ep_reference::{Config, Mode};
    use std::time::Duration;

    /// The sizes of `cfg`'s NCCL plans (the group's, `GpuGroup::nccl_*_exchange`).
    fn sizing(cfg: &Config) -> Sizing {
        Sizing {
            t: cfg.max_tokens_per_rank,
            k: cfg.top_k,
            l: cfg.num_local_experts(),
            r_all: cfg.num_ranks,
            eb: crate::runtime::layout::entry_bytes_checked(cfg).unwrap(),
            peb: crate::runtime::layout::pe_entry_bytes_checked(cfg).unwrap(),
            rowb: 2 * cfg.hidden,
            cap_rows: crate::runtime::layout::combine_capacity_rows(cfg).unwrap(),
        }
    }

    /// R ranks of `cfg`, each with its allocation (NCCL staging included) at base (r+1) << 40,
    /// every rank's NCCL peers every rank (Transport::Nccl).
    fn net(cfg: &Config) -> (CpuComms, Vec<RankPtrs>) {
        let sizes = rank_sizes(cfg, true).unwrap();
        let net = CpuNet::new(cfg.num_ranks, total_bytes(&sizes).unwrap());
        let ptrs = net.base.iter().map(|&b| carve_rank(b, &sizes)).collect();
        (CpuComms::cpu(net, Duration::from_secs(5)), ptrs)
    }

    /// Writes the batch headers every rank's pack stage would write for `topk[s]` (the expert
    /// of every selection of every token of source s) into its `snd_hdr`.
    fn write_headers(m: &mut CpuComms, s: &Sizing, ptrs: &[RankPtrs], topk: &[Vec<Vec<usize>>]) {
        let hw = s.header_words();
        for (src, toks) in topk.iter().enumerate() {
            for d in 0..s.r_all {
                let mut w = vec![0i32; hw];
                for tok in toks {
                    let here: Vec<usize> = tok.iter().filter(|&&e| e / s.l == d).copied().collect();
                    if !here.is_empty() {
                        w[0] += 1;
                        w[1] += here.len() as i32;
                        for e in here {
                            w[2 + e % s.l] += 1;
                        }
                    }
                }
                let bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
                m.addr(ptrs[src].snd_hdr + (d * hw * 4) as u64, hw * 4)
                    .copy_from_slice(&bytes);
            }
        }
    }

    fn words(m: &mut CpuComms, a: u64, n: usize) -> Vec<i32> {
        m.addr(a, n * 4)
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    /// A routing of R ranks: T tokens each, K distinct experts per token (some tokens none).
    fn routing(cfg: &Config, seed: u64) -> Vec<Vec<Vec<usize>>> {
        let mut rng = crate::testing::Rng::new(seed);
        let e = cfg.num_experts;
        (0..cfg.num_ranks)
            .map(|_| {
                (0..cfg.max_tokens_per_rank - rng.below(2))
                    .map(|_| {
                        let mut sel: Vec<usize> = Vec::new();
                        while sel.len() < cfg.top_k.min(e) && rng.below(8) != 0 {
                            let x = rng.below(e);
                            if !sel.contains(&x) {
                                sel.push(x);
                            }
                        }
                        sel
                    })
                    .collect()
            })
            .collect()
    }

    /// Dispatch then combine over the CPU network, both sizings, both paths where the sizing
    /// allows it: the headers cross, are read back and checked, the payload plans of every
    /// rank pair up message for message, and exact sizes carry exactly the rows the headers
    /// count.
    #[test]
    fn every_plan_pairs_up_and_exact_sizes_are_the_headers_counts() {
        for (r, e, t, k) in [(2, 4, 8, 2), (3, 9, 5, 3), (4, 8, 16, 4), (1, 3, 4, 2)] {
            let cfg = Config::new(r, e, t, 256, k, Mode::FP8).unwrap();
            let s = sizing(&cfg);
            let hw = s.header_words();
            let peers: Vec<usize> = (0..r).collect();
            for (sizes, path) in [
                (NcclSizes::Exact, Path::Batched),
                (NcclSizes::Exact, Path::PerExpert),
                (NcclSizes::Capacity, Path::Batched),
            ] {
                let (mut m, ptrs) = net(&cfg);
                let topk = routing(&cfg, (r * 131 + e) as u64);
                write_headers(&mut m, &s, &ptrs, &topk);
                let capacity = sizes == NcclSizes::Capacity;
                let first: Vec<Vec<P2p>> = ptrs
                    .iter()
                    .map(|p| dispatch_headers(&s, p, &peers, capacity).unwrap())
                    .collect();
                m.exchange(&first).unwrap();
                let mut sels = vec![(vec![0; r], vec![0; r]); r];
                let mut hdrs = vec![(Vec::new(), Vec::new()); r];
                if !capacity {
                    let mut payload = Vec::new();
                    for (me, p) in ptrs.iter().enumerate() {
                        let sh = words(&mut m, p.snd_hdr, r * hw);
                        let rh = words(&mut m, p.rcv_hdr, r * hw);
                        // The received headers are the peers' sent ones.
                        for d in 0..r {
                            let theirs = words(&mut m, ptrs[d].snd_hdr + (me * hw * 4) as u64, hw);
                            assert_eq!(&rh[d * hw..][..hw], &theirs[..]);
                        }
                        let (ops, got) =
                            dispatch_payload(&s, path, me, p, &peers, &sh, &rh).unwrap();
                        for (d, mine, theirs) in got {
                            sels[me].0[d] = mine;
                            sels[me].1[d] = theirs;
                        }
                        // Exact: the bytes sent to d are the rows the header to d counts.
                        for d in 0..r {
                            let sent: usize = ops
                                .iter()
                                .filter_map(|(_, o)| match *o {
                                    P2p::Send { bytes, peer, .. } if peer == d => Some(bytes),
                                    _ => None,
                                })
                                .sum();
                            let c = check_header(me, me, &sh[d * hw..][..hw], t, k).unwrap();
                            let want = match path {
                                Path::Batched => c.tokens * s.eb,
                                Path::PerExpert => c.selections * s.peb,
                            };
                            assert_eq!(sent, want, "r={r} rank {me} -> {d} {path:?}");
                        }
                        hdrs[me] = (sh, rh);
                        payload.push(ops.into_iter().map(|(_, o)| o).collect::<Vec<_>>());
                    }
                    m.exchange(&payload).unwrap();
                }
                let back: Vec<Vec<P2p>> = ptrs
                    .iter()
                    .enumerate()
                    .map(|(me, p)| {
                        combine_ops(&s, sizes, path, p, &peers, &sels[me], &hdrs[me])
                            .unwrap()
                            .into_iter()
                            .map(|(_, o)| o)
                            .collect()
                    })
                    .collect();
                m.exchange(&back).unwrap();
                // Combine sends back exactly the selections received (exact), or the capacity.
                for (me, ops) in back.iter().enumerate() {
                    for d in 0..r {
                        let sent: usize = ops
                            .iter()
                            .filter_map(|o| match *o {
                                P2p::Send { bytes, peer, .. } if peer == d => Some(bytes),
                                _ => None,
                            })
                            .sum();
                        let want = if capacity {
                            s.cap_rows * s.rowb
                        } else {
                            sels[me].1[d] * s.rowb
                        };
                        assert_eq!(sent, want, "combine r={r} rank {me} -> {d} {path:?}");
                    }
                }
            }
        }
    }

    /// A rank whose group failed (or whose input was bad) runs a capacity call's pack stage as
    /// poison: it writes no header, so the host's poison (`POISON_HDR`, written before the pack
    /// in stream order) is what crosses the network, in every word; the peer's unpack reads word
    /// 0 as that rank's failure (common.cuh `HDR_POISON`, `ERR_PEER_FAILED`). The healthy rank's
    /// header reaches the failed one unchanged.
    #[test]
    fn a_failed_ranks_capacity_header_arrives_as_the_poison() {
        use crate::compile::COMMON_CUH;
        assert!(
            COMMON_CUH.contains(&format!("#define HDR_POISON 0x{POISON_HDR:08X}")),
            "the kernels' header poison is nccl/plan.rs POISON_HDR"
        );
        let cfg = Config::new(2, 4, 8, 256, 2, Mode::FP8).unwrap();
        let s = sizing(&cfg);
        let hw = s.header_words();
        let (mut m, ptrs) = net(&cfg);
        write_headers(&mut m, &s, &ptrs, &routing(&cfg, 5));
        let good = words(&mut m, ptrs[0].snd_hdr + (hw * 4) as u64, hw);
        // Rank 1 failed: call.rs poison_send_headers, then a pack stage that writes nothing.
        let poison: Vec<u8> = (0..2 * hw).flat_map(|_| POISON_HDR.to_le_bytes()).collect();
        m.addr(ptrs[1].snd_hdr, 2 * hw * 4).copy_from_slice(&poison);
        let ops: Vec<Vec<P2p>> = ptrs
            .iter()
            .map(|p| dispatch_headers(&s, p, &[0, 1], true).unwrap())
            .collect();
        m.exchange(&ops).unwrap();
        let from_failed = words(&mut m, ptrs[0].rcv_hdr + (hw * 4) as u64, hw);
        assert!(
            from_failed.iter().all(|&w| w as u32 == POISON_HDR),
            "{from_failed:?}"
        );
        assert_eq!(words(&mut m, ptrs[1].rcv_hdr, hw), good);
    }

    /// A peer's header that is out of bounds stops the plan before any payload is sized by
    /// it (the error names the peer and the field); a plan whose two sides disagree on a size
    /// is caught by the network, which is then aborted and refuses the next exchange.
    #[test]
    fn a_bad_header_stops_the_plan_and_a_size_mismatch_is_caught() {
        let cfg = Config::new(2, 4, 8, 256, 2, Mode::Bf16).unwrap();
        let s = sizing(&cfg);
        let hw = s.header_words();
        let (mut m, ptrs) = net(&cfg);
        let topk = routing(&cfg, 5);
        write_headers(&mut m, &s, &ptrs, &topk);
        let first: Vec<Vec<P2p>> = ptrs
            .iter()
            .map(|p| dispatch_headers(&s, p, &[0, 1], false).unwrap())
            .collect();
        m.exchange(&first).unwrap();
        let sh = words(&mut m, ptrs[0].snd_hdr, 2 * hw);
        let mut rh = words(&mut m, ptrs[0].rcv_hdr, 2 * hw);
        rh[hw] = 9; // rank 1 claims 9 tokens for rank 0, T = 8
        for path in [Path::Batched, Path::PerExpert] {
            match dispatch_payload(&s, path, 0, &ptrs[0], &[0, 1], &sh, &rh) {
                Err(GpuError::PeerCount {
                    rank: 0,
                    peer: 1,
                    field: "batch tokens",
                    value: 9,
                    ..
                }) => {}
                other => panic!("{path:?}: {:?}", other.map(|_| ())),
            }
        }
        // Rank 0 expects one row more from rank 1 than rank 1 sends.
        let a = vec![P2p::Recv {
            buf: ptrs[0].bat_buf,
            bytes: s.eb * 2,
            peer: 1,
        }];
        let b = vec![P2p::Send {
            buf: ptrs[1].snd_buf,
            bytes: s.eb,
            peer: 0,
        }];
        let e = m.exchange(&[a, b]).unwrap_err();
        assert!(e.to_string().contains("bytes sent"), "{e}");
        assert!(m.is_aborted());
        let e = m.exchange(&first).unwrap_err().to_string();
        assert!(
            e.contains("aborted after an earlier error") && e.contains("bytes sent"),
            "{e}"
        );
        // Per-expert combine before an exact-size dispatch: refused, nothing sized.
        let e = combine_ops(
            &s,
            NcclSizes::Exact,
            Path::PerExpert,
            &ptrs[0],
            &[1],
            &(vec![0; 2], vec![0; 2]),
            &(Vec::new(), Vec::new()),
        )
        .unwrap_err();
        assert!(matches!(e, GpuError::Unsupported(_)), "{e}");
    }
}
