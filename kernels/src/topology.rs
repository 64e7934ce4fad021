//! Which ranks of a process-mode group share a node, and so which peers a rank reaches through
//! CUDA IPC (NVLink) and which through NCCL.
//!
//! **The node id** of a process is, first found:
//! 1. `EP_NODE_ID`: any 1..=64 printable ASCII bytes without spaces. Set it to group ranks by
//!    hand (e.g. to emulate several nodes on one machine, or where hostnames are not unique);
//! 2. torchrun's `GROUP_RANK`: a decimal integer, the node's index in the job;
//! 3. the hostname (`/proc/sys/kernel/hostname`).
//!
//! A variable that is set but invalid (empty, too long, spaces or control bytes, a `GROUP_RANK`
//! that is no integer) is a [`NodeIdError`] naming the variable and the value, never skipped in
//! favour of the next source. Every rank sends its node id, and which of the three it came from,
//! in its handshake record (`crate::handshake`); ranks whose ids come from different sources are
//! refused there (a job where some nodes set `EP_NODE_ID` and others do not), so ids of
//! different kinds are never compared.
//!
//! **The plan** ([`plan`]) is a pure function of the transport, every rank's node id and this
//! rank: which peers' buffers it maps through CUDA IPC and which peers the kernels reach through
//! NCCL staging (the kernels' `nccl_mask`, bit d = peer d).
//! - `Transport::Auto`: one node only, every peer through IPC; ranks on another node are refused
//!   with a [`GpuError::PeerMismatch`] naming both nodes (IPC cannot reach another machine).
//! - `Transport::Nccl`: every rank, this one included, through NCCL; no IPC.
//! - `Transport::TwoTier`: peers of this rank's node through IPC, the others through NCCL (on one
//!   node that is `Auto`).
//!
//! **One machine as several nodes** ([`emulation_env`]): a launcher gives rank i of N the node
//! `i / (N / nodes)` in `EP_NODE_ID`, and `NCCL_HOSTID` set per node. NCCL hashes the hostname
//! (and boot id) into a host hash unless `NCCL_HOSTID` replaces that string (`getHostHash` in
//! NCCL's `src/misc/utils.cc`); ranks with equal host hashes and one GPU are refused ("Duplicate
//! GPU detected", `src/init.cc`), ranks with different host hashes count as different nodes and
//! talk over NCCL's network transport (sockets here), as across real nodes.

use crate::error::GpuError;
use crate::runtime::Transport;

/// The variable that names this process's node (first choice).
pub const EP_NODE_ID: &str = "EP_NODE_ID";
/// torchrun's node index (second choice).
pub const GROUP_RANK: &str = "GROUP_RANK";
/// NCCL's override of its host identity (set per emulated node by the launchers).
pub const NCCL_HOSTID: &str = "NCCL_HOSTID";
/// Longest node id (Linux hostnames are at most 64 bytes too).
pub const MAX_NODE_ID_LEN: usize = 64;

/// Where a node id came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NodeSource {
    EpNodeId,
    GroupRank,
    Hostname,
}

impl NodeSource {
    /// The variable (or "hostname") the id was read from.
    pub fn name(self) -> &'static str {
        match self {
            NodeSource::EpNodeId => EP_NODE_ID,
            NodeSource::GroupRank => GROUP_RANK,
            NodeSource::Hostname => "hostname",
        }
    }

    /// Its byte in the handshake record.
    pub fn wire(self) -> u8 {
        match self {
            NodeSource::EpNodeId => 0,
            NodeSource::GroupRank => 1,
            NodeSource::Hostname => 2,
        }
    }

    pub fn from_wire(b: u8) -> Option<NodeSource> {
        match b {
            0 => Some(NodeSource::EpNodeId),
            1 => Some(NodeSource::GroupRank),
            2 => Some(NodeSource::Hostname),
            _ => None,
        }
    }
}

/// A process's node: a validated id and where it came from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeId {
    pub source: NodeSource,
    pub id: String,
}

impl NodeId {
    /// A node named by `EP_NODE_ID=id`, validated as if read from the environment.
    pub fn named(id: &str) -> Result<NodeId, NodeIdError> {
        Ok(NodeId {
            source: NodeSource::EpNodeId,
            id: check_id(EP_NODE_ID, id)?,
        })
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}={}", self.source.name(), self.id)
    }
}

/// Why this process has no node id.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NodeIdError {
    #[error("{var}={value:?} is not a valid node id: {why}")]
    Invalid {
        var: &'static str,
        value: String,
        why: &'static str,
    },
    #[error("{var} is not valid unicode ({value:?})")]
    NotUnicode { var: &'static str, value: String },
    #[error(
        "no node id: {EP_NODE_ID} and {GROUP_RANK} are unset and the hostname cannot be read ({cause})"
    )]
    NoHostname { cause: String },
}

/// `value` as a node id read from `var`: 1..=64 bytes of printable ASCII without spaces.
pub fn check_id(var: &'static str, value: &str) -> Result<String, NodeIdError> {
    let bad = |why| NodeIdError::Invalid {
        var,
        value: value.to_string(),
        why,
    };
    if value.is_empty() {
        return Err(bad("empty"));
    }
    if value.len() > MAX_NODE_ID_LEN {
        return Err(bad("longer than 64 bytes"));
    }
    if !value.bytes().all(|b| (0x21..0x7f).contains(&b)) {
        return Err(bad("only printable ASCII without spaces is allowed"));
    }
    Ok(value.to_string())
}

/// The node id from `lookup` (a variable to `Ok(Some(value))`, `Ok(None)` when unset, or
/// `Err(lossy value)` when not unicode) and `hostname` (asked only when both variables are
/// unset), in the order of the module docs.
pub fn node_id_from(
    lookup: impl Fn(&str) -> Result<Option<String>, String>,
    hostname: impl FnOnce() -> Result<String, String>,
) -> Result<NodeId, NodeIdError> {
    let get =
        |var: &'static str| lookup(var).map_err(|value| NodeIdError::NotUnicode { var, value });
    if let Some(v) = get(EP_NODE_ID)? {
        return Ok(NodeId {
            source: NodeSource::EpNodeId,
            id: check_id(EP_NODE_ID, &v)?,
        });
    }
    if let Some(v) = get(GROUP_RANK)? {
        let n: u32 = v.parse().map_err(|_| NodeIdError::Invalid {
            var: GROUP_RANK,
            value: v.clone(),
            why: "not a non-negative decimal integer",
        })?;
        return Ok(NodeId {
            source: NodeSource::GroupRank,
            // Canonical: "01" and "1" are one node.
            id: n.to_string(),
        });
    }
    let h = hostname().map_err(|cause| NodeIdError::NoHostname { cause })?;
    Ok(NodeId {
        source: NodeSource::Hostname,
        id: check_id("hostname", h.trim_end_matches(['\n', '\r']))?,
    })
}

/// This process's node id (its environment, then its hostname).
pub fn node_id() -> Result<NodeId, NodeIdError> {
    node_id_from(
        |var| match std::env::var(var) {
            Ok(v) => Ok(Some(v)),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(os)) => Err(os.to_string_lossy().into_owned()),
        },
        || std::fs::read_to_string("/proc/sys/kernel/hostname").map_err(|e| e.to_string()),
    )
}

/// How one rank reaches its peers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Bit d: peer d is reached through NCCL staging (the kernels' `nccl_mask`).
    pub nccl_mask: u32,
    /// Peers whose buffers this rank maps through CUDA IPC (this rank excluded), ascending.
    pub ipc_peers: Vec<usize>,
    /// Distinct nodes in the group.
    pub nodes: usize,
}

impl Plan {
    /// Whether this rank needs NCCL communicators.
    pub fn uses_nccl(&self) -> bool {
        self.nccl_mask != 0
    }

    /// Peers reached through NCCL, ascending.
    pub fn nccl_peers(&self) -> Vec<usize> {
        (0..32).filter(|d| (self.nccl_mask >> d) & 1 == 1).collect()
    }
}

/// The plan of rank `rank` in a group whose rank i runs on node `nodes[i]` (see the module
/// docs). Fails for more than 32 ranks (the mask's width), a rank outside the group, or, under
/// `Transport::Auto`, a peer on another node.
pub fn plan(transport: Transport, nodes: &[NodeId], rank: usize) -> Result<Plan, GpuError> {
    let r = nodes.len();
    if r > 32 || rank >= r {
        return Err(GpuError::Unsupported(format!(
            "rank {rank} of {r} ranks (a plan covers at most 32)"
        )));
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
        Transport::Nccl => (crate::runtime::all_peers(r), Vec::new()),
        Transport::Auto => {
            if let Some(p) = others().find(|&p| nodes[p] != *me) {
                return Err(GpuError::PeerMismatch {
                    field: "node (transport auto maps every peer through CUDA IPC, which reaches \
                            one node only: use the two-tier transport across nodes)",
                    ours: me.to_string(),
                    theirs: nodes[p].to_string(),
                    rank,
                    peer: p,
                });
            }
            (0, others().collect())
        }
        Transport::TwoTier => {
            let mask = others()
                .filter(|&p| nodes[p] != *me)
                .fold(0u32, |m, p| m | 1 << p);
            (mask, others().filter(|&p| nodes[p] == *me).collect())
        }
    };
    Ok(Plan {
        nccl_mask,
        ipc_peers,
        nodes: distinct.len(),
    })
}

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
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Result<Option<String>, String> {
        let m: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| Ok(m.get(k).cloned())
    }

    fn host(h: &str) -> impl FnOnce() -> Result<String, String> + '_ {
        move || Ok(h.to_string())
    }

    #[test]
    fn the_node_id_comes_from_ep_node_id_then_group_rank_then_the_hostname() {
        let id = |vars: &[(&str, &str)]| node_id_from(env(vars), host("gpu-a\n")).unwrap();
        assert_eq!(
            id(&[("EP_NODE_ID", "rack3/n7"), ("GROUP_RANK", "2")]),
            NodeId {
                source: NodeSource::EpNodeId,
                id: "rack3/n7".into()
            }
        );
        assert_eq!(
            id(&[("GROUP_RANK", "02")]),
            NodeId {
                source: NodeSource::GroupRank,
                id: "2".into()
            }
        );
        assert_eq!(
            id(&[]),
            NodeId {
                source: NodeSource::Hostname,
                id: "gpu-a".into()
            }
        );
        // The hostname is not read when a variable names the node.
        let never = || -> Result<String, String> { panic!("hostname read") };
        assert!(node_id_from(env(&[("GROUP_RANK", "0")]), never).is_ok());
    }

    #[test]
    fn a_bad_node_id_names_the_variable_and_the_value() {
        let err = |vars: &[(&str, &str)], h: &str| node_id_from(env(vars), host(h)).unwrap_err();
        let long = "n".repeat(65);
        for (value, why) in [
            ("", "empty"),
            ("node 1", "only printable ASCII without spaces is allowed"),
            ("n\u{e9}", "only printable ASCII without spaces is allowed"),
            ("a\tb", "only printable ASCII without spaces is allowed"),
            (long.as_str(), "longer than 64 bytes"),
        ] {
            assert_eq!(
                err(&[("EP_NODE_ID", value), ("GROUP_RANK", "1")], "h"),
                NodeIdError::Invalid {
                    var: "EP_NODE_ID",
                    value: value.into(),
                    why
                }
            );
        }
        // 64 bytes is the limit, not past it.
        assert!(node_id_from(env(&[("EP_NODE_ID", &"n".repeat(64))]), host("h")).is_ok());
        for v in ["-1", "one", "", "1.0", "99999999999"] {
            let e = err(&[("GROUP_RANK", v)], "h");
            assert!(
                matches!(&e, NodeIdError::Invalid { var: "GROUP_RANK", value, .. } if value == v),
                "{e:?}"
            );
            assert!(e.to_string().contains("GROUP_RANK"), "{e}");
        }
        assert!(matches!(
            err(&[], ""),
            NodeIdError::Invalid {
                var: "hostname",
                ..
            }
        ));
        let no_host = node_id_from(env(&[]), || Err("no /proc".into())).unwrap_err();
        assert_eq!(
            no_host,
            NodeIdError::NoHostname {
                cause: "no /proc".into()
            }
        );
        let not_unicode = node_id_from(|_| Err("\u{fffd}x".into()), host("h")).unwrap_err();
        assert_eq!(
            not_unicode,
            NodeIdError::NotUnicode {
                var: "EP_NODE_ID",
                value: "\u{fffd}x".into()
            }
        );
        assert!(NodeId::named("a b").is_err());
    }

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
                (p.nccl_mask, &p.ipc_peers, p.nodes),
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
            (p.nccl_mask, p.ipc_peers, p.nodes),
            (0b01010, vec![0, 4], 3)
        );
        let p = plan(Transport::TwoTier, &n, 3).unwrap();
        assert_eq!((p.nccl_mask, p.ipc_peers), (0b10111, vec![]));
        // One node: exactly Auto (no NCCL at all).
        let one = nodes(&["x"; 4]);
        for rank in 0..4 {
            assert_eq!(
                plan(Transport::TwoTier, &one, rank),
                plan(Transport::Auto, &one, rank)
            );
        }
        let p = plan(Transport::Auto, &one, 2).unwrap();
        assert_eq!((p.nccl_mask, &p.ipc_peers, p.nodes), (0, &vec![0, 1, 3], 1));
        assert!(!p.uses_nccl());
    }

    #[test]
    fn nccl_reaches_everyone_and_auto_refuses_a_second_node() {
        let n = nodes(&["0", "0", "1", "1"]);
        let p = plan(Transport::Nccl, &n, 1).unwrap();
        assert_eq!((p.nccl_mask, p.ipc_peers.len()), (0b1111, 0));
        match plan(Transport::Auto, &n, 1) {
            Err(GpuError::PeerMismatch {
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
        assert_eq!(plan(Transport::TwoTier, &mixed, 0).unwrap().nccl_mask, 0b10);
        // Bounds: 32 ranks fit the mask, 33 do not; the rank must be in the group.
        let many = nodes(
            &(0..32)
                .map(|i| if i < 16 { "a" } else { "b" })
                .collect::<Vec<_>>(),
        );
        let p = plan(Transport::TwoTier, &many, 0).unwrap();
        assert_eq!(p.nccl_mask, 0xffff_0000);
        assert_eq!(
            plan(Transport::Nccl, &many, 31).unwrap().nccl_mask,
            u32::MAX
        );
        let too_many = nodes(&["a"; 33]);
        assert!(matches!(
            plan(Transport::TwoTier, &too_many, 0),
            Err(GpuError::Unsupported(_))
        ));
        assert!(matches!(
            plan(Transport::TwoTier, &n, 4),
            Err(GpuError::Unsupported(_))
        ));
    }

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
