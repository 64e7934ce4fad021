//! This process's node id: `EP_NODE_ID`, else torchrun's `GROUP_RANK`, else the hostname (see
//! [`crate::topology`]), and where it came from. Below the handshake (a record carries the
//! node id), the topology (the plan compares them) and [`GroupError`](crate::GroupError) (which
//! wraps [`NodeIdError`]).

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
}
