//! The plan of one rank: which peers' buffers it maps through CUDA IPC and which peers the
//! kernels reach through NCCL (see [`crate::topology`]).

use crate::error::GroupError;
use crate::node::NodeId;
use ep_kernels::runtime::{all_peers, check_ranks, PeerMask, PeerPlan, Transport};
use ep_kernels::GpuError;

/// The plan of rank `rank` (the GPU library's [`PeerPlan`]) in a group whose rank i runs on node `nodes[i]` (see the module
/// docs). Fails for more than the kernels' [`MAX_RANKS`](ep_kernels::runtime::MAX_RANKS) ranks
/// ([`GpuError::TooManyRanks`]), a rank outside the group, or, under `Transport::Auto`, a peer on
/// another node.
pub fn plan(transport: Transport, nodes: &[NodeId], rank: usize) -> Result<PeerPlan, GroupError> {
    let r = nodes.len();
    check_ranks(r)?;
    if rank >= r {
        return Err(GpuError::Unsupported(format!("rank {rank} of {r} ranks")).into());
    }
    let mut distinct: Vec<&NodeId> = Vec::new();
    for n in nodes {
        if !distinct.contains(&n) {
            distinct.push(n);
        }
    }
    let me = &nodes[rank];
    let others = || (0..r).filter(move |&p| p != rank);
    let (nccl_mask, ipc_peers) = match transport {
        Transport::Nccl => (all_peers(r), Vec::new()),
        Transport::Auto => {
            if let Some(p) = others().find(|&p| nodes[p] != *me) {
                return Err(GroupError::PeerMismatch {
                    field: "node (transport auto maps every peer through CUDA IPC, which reaches \
                            one node only: use the two-tier transport across nodes)",
                    ours: me.to_string(),
                    theirs: nodes[p].to_string(),
                    rank,
                    peer: p,
                });
            }
            (PeerMask::EMPTY, others().collect())
        }
        Transport::TwoTier => {
            let mask = PeerMask::of(others().filter(|&p| nodes[p] != *me));
            (mask, others().filter(|&p| nodes[p] == *me).collect())
        }
    };
    Ok(PeerPlan {
        nccl_mask,
        ipc_peers,
        nodes: distinct.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::NodeSource;

    fn nodes(ids: &[&str]) -> Vec<NodeId> {
        ids.iter().map(|i| NodeId::named(i).unwrap()).collect()
    }

    #[test]
    fn two_tier_maps_its_node_over_ipc_and_reaches_the_others_over_nccl() {
        // The emulation of the GPU test: 4 ranks, node = rank / 2.
        let n = nodes(&["0", "0", "1", "1"]);
        let want = [
            (0b1100, vec![1]),
            (0b1100, vec![0]),
            (0b0011, vec![3]),
            (0b0011, vec![2]),
        ];
        for (rank, (mask, ipc)) in want.into_iter().enumerate() {
            let p = plan(Transport::TwoTier, &n, rank).unwrap();
            assert_eq!(
                (p.nccl_mask.low_word(), &p.ipc_peers, p.nodes),
                (mask, &ipc, 2),
                "rank {rank}"
            );
            assert!(p.uses_nccl());
        }
        assert_eq!(
            plan(Transport::TwoTier, &n, 1).unwrap().nccl_peers(),
            vec![2, 3]
        );
        // Interleaved nodes and an uneven split.
        let n = nodes(&["a", "b", "a", "c", "a"]);
        let p = plan(Transport::TwoTier, &n, 2).unwrap();
        assert_eq!(
            (p.nccl_mask.low_word(), p.ipc_peers, p.nodes),
            (0b01010, vec![0, 4], 3)
        );
        let p = plan(Transport::TwoTier, &n, 3).unwrap();
        assert_eq!((p.nccl_mask.low_word(), p.ipc_peers), (0b10111, vec![]));
        // One node: exactly Auto (no NCCL at all).
        let one = nodes(&["x"; 4]);
        for rank in 0..4 {
            assert_eq!(
                plan(Transport::TwoTier, &one, rank),
                plan(Transport::Auto, &one, rank)
            );
        }
        let p = plan(Transport::Auto, &one, 2).unwrap();
        assert_eq!(
            (p.nccl_mask, &p.ipc_peers, p.nodes),
            (PeerMask::EMPTY, &vec![0, 1, 3], 1)
        );
        assert!(!p.uses_nccl());
    }

    #[test]
    fn nccl_reaches_everyone_and_auto_refuses_a_second_node() {
        let n = nodes(&["0", "0", "1", "1"]);
        let p = plan(Transport::Nccl, &n, 1).unwrap();
        assert_eq!((p.nccl_mask.low_word(), p.ipc_peers.len()), (0b1111, 0));
        match plan(Transport::Auto, &n, 1) {
            Err(GroupError::PeerMismatch {
                field,
                ours,
                theirs,
                rank: 1,
                peer: 2,
            }) => {
                assert!(field.starts_with("node"), "{field}");
                assert_eq!(
                    (ours.as_str(), theirs.as_str()),
                    ("EP_NODE_ID=0", "EP_NODE_ID=1")
                );
            }
            other => panic!("{other:?}"),
        }
        // Same text, different source: not the same node.
        let mixed = vec![
            NodeId::named("1").unwrap(),
            NodeId {
                source: NodeSource::GroupRank,
                id: "1".into(),
            },
        ];
        assert_eq!(
            plan(Transport::TwoTier, &mixed, 0)
                .unwrap()
                .nccl_mask
                .low_word(),
            0b10
        );
        // Bounds: 32 ranks fill the first word, 256 fit the mask, 257 do not; the rank must be
        // in the group.
        let many = nodes(
            &(0..32)
                .map(|i| if i < 16 { "a" } else { "b" })
                .collect::<Vec<_>>(),
        );
        let p = plan(Transport::TwoTier, &many, 0).unwrap();
        assert_eq!(p.nccl_mask.low_word(), 0xffff_0000);
        assert_eq!(
            plan(Transport::Nccl, &many, 31)
                .unwrap()
                .nccl_mask
                .low_word(),
            u32::MAX
        );
        // 40 ranks on 5 emulated nodes of 8: rank 33 (node 4) reaches 0..32 over NCCL and its
        // node's other 7 over IPC; 256 over NCCL reach every rank.
        let forty = nodes(
            &(0..40)
                .map(|i| ["0", "1", "2", "3", "4"][i / 8])
                .collect::<Vec<_>>(),
        );
        let p = plan(Transport::TwoTier, &forty, 33).unwrap();
        assert_eq!(p.nccl_mask.ranks(), (0..32).collect::<Vec<_>>());
        assert_eq!(p.ipc_peers, vec![32, 34, 35, 36, 37, 38, 39]);
        assert_eq!(p.nodes, 5);
        let p = plan(Transport::TwoTier, &forty, 2).unwrap();
        assert_eq!(p.nccl_mask.ranks(), (8..40).collect::<Vec<_>>());
        let all = nodes(&["a"; 256]);
        assert_eq!(
            plan(Transport::Nccl, &all, 255).unwrap().nccl_mask.ranks(),
            (0..256).collect::<Vec<_>>()
        );
        let too_many = nodes(&["a"; 257]);
        assert!(matches!(
            plan(Transport::TwoTier, &too_many, 0),
            Err(GroupError::Gpu(GpuError::TooManyRanks {
                ranks: 257,
                max: 256
            }))
        ));
        assert!(matches!(
            plan(Transport::TwoTier, &n, 4),
            Err(GroupError::Gpu(GpuError::Unsupported(_)))
        ));
    }
}
