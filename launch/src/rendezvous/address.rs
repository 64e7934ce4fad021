//! Where rank 0 is: `master_addr` as written (`MASTER_ADDR`), read once into what the resolver
//! and the loopback check need.
//!
//! A host name (`node17`, `localhost`), an IPv4 address, an IPv6 address bare (`::1`) or in the
//! brackets of a URL (`[::1]`, as torchrun and many launchers write it). The brackets are the
//! URL's, not the address's: they are taken off before resolving (`[::1]` passed the loopback
//! check and then could not be resolved). Brackets around anything else (`[127.0.0.1]`,
//! `[node17]`) or unbalanced ones are refused up front, naming the address.

use std::net::{IpAddr, Ipv6Addr};

/// `master_addr`, understood.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Host<'a> {
    /// An IP address (an IPv6 one possibly written in brackets).
    Ip(IpAddr),
    /// Anything the resolver is to look up: a host name, or an IPv6 literal with a zone
    /// (`fe80::1%eth0`), brackets removed.
    Name(&'a str),
}

impl<'a> Host<'a> {
    /// Reads `addr`; `Err` says why it cannot name a host.
    pub(crate) fn parse(addr: &'a str) -> Result<Host<'a>, String> {
        let bad = |why: &str| Err(format!("master address {addr:?}: {why}"));
        let inner = match (addr.strip_prefix('['), addr.ends_with(']')) {
            (Some(rest), true) => &rest[..rest.len() - 1],
            (None, false) => {
                if addr.contains(['[', ']']) {
                    return bad("brackets in the middle of an address");
                }
                return Ok(match addr.parse::<IpAddr>() {
                    Ok(ip) => Host::Ip(ip),
                    Err(_) => Host::Name(addr),
                });
            }
            _ => return bad("unbalanced brackets (an IPv6 address is written [::1])"),
        };
        if let Ok(ip) = inner.parse::<Ipv6Addr>() {
            return Ok(Host::Ip(IpAddr::V6(ip)));
        }
        // An IPv6 literal with a zone (`[fe80::1%eth0]`): the resolver reads the zone.
        match inner.split_once('%') {
            Some((ip, zone)) if ip.parse::<Ipv6Addr>().is_ok() && !zone.is_empty() => {
                Ok(Host::Name(inner))
            }
            _ => bad("brackets enclose an IPv6 address only (e.g. [::1]); write IPv4 addresses and host names without them"),
        }
    }

    /// Whether this names this host only: a loopback IP or `localhost`.
    pub(crate) fn is_loopback(&self) -> bool {
        match self {
            Host::Ip(ip) => ip.is_loopback(),
            Host::Name(n) => n.eq_ignore_ascii_case("localhost"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brackets_are_the_urls_and_enclose_ipv6_only() {
        let v6 = |s: &str| Host::Ip(IpAddr::V6(s.parse().unwrap()));
        assert_eq!(Host::parse("[::1]"), Ok(v6("::1")));
        assert_eq!(Host::parse("::1"), Ok(v6("::1")));
        assert_eq!(Host::parse("[fe80::2]"), Ok(v6("fe80::2")));
        assert_eq!(
            Host::parse("127.0.0.1"),
            Ok(Host::Ip("127.0.0.1".parse().unwrap()))
        );
        assert_eq!(Host::parse("node17"), Ok(Host::Name("node17")));
        assert_eq!(
            Host::parse("[fe80::1%eth0]"),
            Ok(Host::Name("fe80::1%eth0"))
        );
        for bad in [
            "[127.0.0.1]",
            "[localhost]",
            "[::1",
            "::1]",
            "[]",
            "[fe80::1%]",
            "a[b]c",
        ] {
            let e = Host::parse(bad).unwrap_err();
            assert!(e.contains(&format!("{bad:?}")), "{e}");
        }
        assert!(Host::parse("[::1]").unwrap().is_loopback());
        assert!(Host::parse("LocalHost").unwrap().is_loopback());
        assert!(!Host::parse("[::2]").unwrap().is_loopback());
    }
}
