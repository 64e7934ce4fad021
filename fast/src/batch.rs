//! The batch a source sends one destination in dispatch: each token once, with its source index
//! and its list of local experts on that destination, then its payload.
//!
//! Entry layout (little-endian): `[0..4)` source token index (i32), `[4..6)` number of local
//! experts n (u16), `[6..8)` zero, `[8..8 + 2n)` the local expert ids (u16, in slot order),
//! zero-padded to [`meta_bytes`], then the payload of `ep_reference::payload` (bf16 row, or
//! e4m3 row and scales).

use ep_reference::Config;

/// Metadata bytes per entry: 8 + 2K rounded up to 16, so payloads stay 16-byte aligned.
pub fn meta_bytes(cfg: &Config) -> usize {
    (8 + 2 * cfg.top_k).next_multiple_of(16)
}

/// Bytes of one entry.
pub fn entry_bytes(cfg: &Config) -> usize {
    meta_bytes(cfg) + cfg.payload_bytes()
}

/// Writes an entry's metadata.
pub fn write_meta(meta: &mut [u8], token: usize, local_experts: &[u16]) {
    meta.fill(0);
    meta[..4].copy_from_slice(&(token as i32).to_le_bytes());
    meta[4..6].copy_from_slice(&(local_experts.len() as u16).to_le_bytes());
    for (i, l) in local_experts.iter().enumerate() {
        meta[8 + 2 * i..10 + 2 * i].copy_from_slice(&l.to_le_bytes());
    }
}

/// Reads an entry's metadata: (source token, local experts).
pub fn read_meta(meta: &[u8]) -> (usize, impl Iterator<Item = usize> + '_) {
    let token = i32::from_le_bytes([meta[0], meta[1], meta[2], meta[3]]) as usize;
    let n = u16::from_le_bytes([meta[4], meta[5]]) as usize;
    let ids = (0..n).map(move |i| u16::from_le_bytes([meta[8 + 2 * i], meta[9 + 2 * i]]) as usize);
    (token, ids)
}

/// Where one source's tokens go: for every token, its destinations with its position in each
/// destination's batch (token order) and its local experts there.
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// Per token: (destination, position in that batch, local experts on it).
    pub routes: Vec<Vec<(usize, usize, Vec<u16>)>>,
    /// Per destination: tokens in its batch.
    pub counts: Vec<usize>,
}

impl Plan {
    pub fn build(cfg: &Config, topk_idx: &[i64]) -> Plan {
        let (r, l_n, k) = (cfg.num_ranks, cfg.num_local_experts(), cfg.top_k);
        let mut counts = vec![0usize; r];
        let routes = topk_idx
            .chunks_exact(k)
            .map(|row| {
                let mut dests: Vec<(usize, usize, Vec<u16>)> = Vec::new();
                for &e in row.iter().filter(|&&e| e >= 0) {
                    let (d, l) = (e as usize / l_n, (e as usize % l_n) as u16);
                    match dests.iter_mut().find(|(dd, _, _)| *dd == d) {
                        Some((_, _, ls)) => ls.push(l),
                        None => dests.push((d, 0, vec![l])),
                    }
                }
                for (d, pos, _) in dests.iter_mut() {
                    *pos = counts[*d];
                    counts[*d] += 1;
                }
                dests
            })
            .collect();
        Plan { routes, counts }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    #[test]
    fn meta_round_trips_and_plan_dedups() {
        let cfg = Config::new(2, 8, 4, 128, 3, Mode::Bf16).unwrap();
        let mut m = vec![0xAAu8; meta_bytes(&cfg)];
        write_meta(&mut m, 7, &[3, 1]);
        let (t, ids) = read_meta(&m);
        assert_eq!((t, ids.collect::<Vec<_>>()), (7, vec![3, 1]));
        // token 0 -> experts 1, 3 (both on rank 0) and 5 (rank 1); token 1 -> 6 only.
        let plan = Plan::build(&cfg, &[1, 3, 5, -1, 6, -1]);
        assert_eq!(plan.counts, vec![1, 2]);
        assert_eq!(plan.routes[0], vec![(0, 0, vec![1, 3]), (1, 0, vec![1])]);
        assert_eq!(plan.routes[1], vec![(1, 1, vec![2])]);
    }
}
