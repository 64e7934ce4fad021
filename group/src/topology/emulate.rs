//! One machine as several nodes: the node of each rank, and the variables a launcher sets for
//! it (`EP_NODE_ID`, `NCCL_HOSTID`; see [`crate::topology`]).

use crate::node::{EP_NODE_ID, NCCL_HOSTID};

/// Emulated nodes on one machine: rank `rank` of `nprocs` is on node `rank / (nprocs / nodes)`.
/// Fails unless `nodes` is in 1..=nprocs and divides `nprocs`.
pub fn emulated_node(rank: usize, nprocs: usize, nodes: usize) -> Result<usize, String> {
    if nodes == 0 || nodes > nprocs || !nprocs.is_multiple_of(nodes) {
        return Err(format!(
            "{nodes} nodes for {nprocs} processes: the nodes must divide the processes evenly (1..={nprocs})"
        ));
    }
    if rank >= nprocs {
        return Err(format!("rank {rank} of {nprocs} processes"));
    }
    Ok(rank / (nprocs / nodes))
}

/// The variables a launcher sets for rank `rank` of `nprocs` on `nodes` emulated nodes:
/// `EP_NODE_ID=<node>` and `NCCL_HOSTID=ep-node-<node>` (see the module docs).
pub fn emulation_env(
    rank: usize,
    nprocs: usize,
    nodes: usize,
) -> Result<Vec<(String, String)>, String> {
    let node = emulated_node(rank, nprocs, nodes)?;
    Ok(vec![
        (EP_NODE_ID.to_string(), node.to_string()),
        (NCCL_HOSTID.to_string(), format!("ep-node-{node}")),
    ])
}

/// [`emulation_env`] of every rank, in rank order (what `LaunchOptions::rank_env` takes).
pub fn emulation_envs(nprocs: usize, nodes: usize) -> Result<Vec<Vec<(String, String)>>, String> {
    (0..nprocs)
        .map(|rank| emulation_env(rank, nprocs, nodes))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::NodeId;

    #[test]
    fn emulated_nodes_split_the_ranks_in_blocks() {
        let node = |r, n, k| emulated_node(r, n, k).unwrap();
        assert_eq!(
            (0..4).map(|r| node(r, 4, 2)).collect::<Vec<_>>(),
            [0, 0, 1, 1]
        );
        assert_eq!(
            (0..6).map(|r| node(r, 6, 3)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 2, 2]
        );
        assert_eq!((0..4).map(|r| node(r, 4, 1)).collect::<Vec<_>>(), [0; 4]);
        assert_eq!(
            (0..4).map(|r| node(r, 4, 4)).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        for (n, k) in [(4, 0), (4, 3), (4, 8), (6, 4)] {
            let e = emulated_node(0, n, k).unwrap_err();
            assert!(e.contains(&format!("{k} nodes for {n} processes")), "{e}");
        }
        assert!(emulated_node(4, 4, 2).is_err());
        assert_eq!(
            emulation_env(3, 4, 2).unwrap(),
            vec![
                ("EP_NODE_ID".to_string(), "1".to_string()),
                ("NCCL_HOSTID".to_string(), "ep-node-1".to_string())
            ]
        );
        // What the launcher sets is a valid node id.
        let (_, v) = &emulation_env(0, 4, 2).unwrap()[0];
        assert!(NodeId::named(v).is_ok());
        // Every rank's, in rank order; a split that does not fit is refused as a whole.
        let all = emulation_envs(4, 2).unwrap();
        let nodes: Vec<&str> = all.iter().map(|v| v[0].1.as_str()).collect();
        assert_eq!(nodes, ["0", "0", "1", "1"]);
        assert!(emulation_envs(4, 3).is_err());
    }
}
