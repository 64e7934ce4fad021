//! NCCL's limit on one group: a plan's operations, tagged with their local expert, run as
//! consecutive groups of whole experts, each under [`MAX_GROUP_OPS`] calls.
use crate::runtime::nccl::net::P2p;

/// The most point-to-point calls the per-expert path puts in one NCCL group (NCCL documents a
/// limit of 2048 calls between ncclGroupStart and ncclGroupEnd; half of it, to stay clear).
pub(crate) const MAX_GROUP_OPS: usize = 1024;

/// Local experts per NCCL group of the per-expert exchange: every rank of R sends and receives
/// one message per (peer, local expert), `devices` communicators per group call. From the
/// config alone, so every rank (process) splits at the same experts and every group holds
/// both sides of each message it starts (no group waits on another's).
pub(crate) fn experts_per_group(r: usize, devices: usize) -> usize {
    (MAX_GROUP_OPS / (2 * r.max(1) * devices.max(1))).max(1)
}

/// Runs tagged operation lists (tag = local expert) as consecutive groups of `chunk` experts.
pub(crate) fn by_expert_chunks(
    ops: Vec<Vec<(usize, P2p)>>,
    l: usize,
    chunk: usize,
) -> Vec<Vec<Vec<P2p>>> {
    let rounds = l.div_ceil(chunk.max(1)).max(1);
    let mut out: Vec<Vec<Vec<P2p>>> = (0..rounds)
        .map(|_| (0..ops.len()).map(|_| Vec::new()).collect())
        .collect();
    for (di, list) in ops.into_iter().enumerate() {
        for (tag, op) in list {
            out[(tag / chunk.max(1)).min(rounds - 1)][di].push(op);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_expert_groups_stay_under_the_nccl_limit_and_split_alike() {
        // R = 2 on 2 GPUs in one process: 2 comms x 2 peers x 2 ops x 128 experts = 1024.
        assert_eq!(experts_per_group(2, 2), 128);
        assert_eq!(experts_per_group(2, 1), 256);
        // Eight GPUs in one process: 8 comms x 8 peers x 2 = 128 ops per expert.
        assert_eq!(experts_per_group(8, 8), 8);
        assert!(experts_per_group(8, 8) * 2 * 8 * 8 <= MAX_GROUP_OPS);
        // Never 0, even past the limit with one expert.
        assert_eq!(experts_per_group(1024, 64), 1);
        assert_eq!(experts_per_group(0, 0), MAX_GROUP_OPS / 2);
        let op = |peer| P2p::Send {
            buf: 0,
            bytes: 1,
            peer,
        };
        // Tags 0..5 in chunks of 2: rounds {0,1}, {2,3}, {4}; device order kept.
        let ops = vec![
            (0..5).map(|l| (l, op(l))).collect::<Vec<_>>(),
            vec![(4, op(9))],
        ];
        let r = by_expert_chunks(ops, 5, 2);
        let peers = |v: &Vec<P2p>| {
            v.iter()
                .map(|o| match o {
                    P2p::Send { peer, .. } | P2p::Recv { peer, .. } => *peer,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(r.len(), 3);
        assert_eq!(peers(&r[0][0]), vec![0, 1]);
        assert_eq!(peers(&r[1][0]), vec![2, 3]);
        assert_eq!(peers(&r[2][0]), vec![4]);
        assert!(r[0][1].is_empty() && r[1][1].is_empty());
        assert_eq!(peers(&r[2][1]), vec![9]);
        // The batched path tags everything 0: one group.
        assert_eq!(by_expert_chunks(vec![vec![(0, op(1))]], 128, 128).len(), 1);
    }
}
