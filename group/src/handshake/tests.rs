//! The handshake's tests: every field round trips, is bounded and is compared.

use super::*;
use crate::error::GroupError;
use crate::handshake::record::fingerprint;
use crate::node::{NodeId, NodeSource};
use crate::wire::{BlobError, MAX_ALLOC, MAX_BLOB, MAX_COUNT, MAX_PAYLOAD, PROTOCOL};
use ep_kernels::runtime::{GpuOptions, NcclSizes, Transport};
use ep_reference::{Config, Mode};

fn cfg(mode: Mode) -> Config {
    Config::new(4, 16, 64, 1024, 4, mode).unwrap()
}

fn node(id: &str) -> NodeId {
    NodeId::named(id).unwrap()
}

fn hello(rank: usize) -> Hello {
    Hello::new(
        &cfg(Mode::FP8_ROUND),
        &GpuOptions::default(),
        rank,
        1 << 20,
        node("n0"),
    )
}

#[test]
fn a_record_round_trips_with_its_payload() {
    for mode in [Mode::Bf16, Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0] {
        for (transport, nccl_sizes) in [
            (Transport::Auto, NcclSizes::Exact),
            (Transport::Nccl, NcclSizes::Capacity),
            (Transport::TwoTier, NcclSizes::Exact),
        ] {
            let opts = GpuOptions {
                transport,
                nccl_sizes,
                timeout_ns: u64::MAX,
                zero_copy_local: false,
                ..Default::default()
            };
            let n = NodeId {
                source: NodeSource::Hostname,
                id: "gpu-host-7.example".into(),
            };
            let h = Hello::new(&cfg(mode), &opts, 3, 123_456, n);
            let payload: Vec<u8> = (0..192u8).collect();
            let blob = h.encode(&payload).unwrap();
            let (back, p) = Hello::decode(&blob).unwrap();
            assert_eq!(back, h);
            assert_eq!(p, &payload[..]);
            assert!(h.compare(&back, 3).is_ok());
        }
    }
}

#[test]
fn the_kernel_fingerprint_sees_every_byte_and_boundary() {
    let base = fingerprint(&["__global__ void f() {}", "int x;"]);
    assert_eq!(base, fingerprint(&["__global__ void f() {}", "int x;"]));
    assert_ne!(base, fingerprint(&["__global__ void f() {}", "int y;"]));
    assert_ne!(base, fingerprint(&["__global__ void f() {} ", "int x;"]));
    assert_ne!(base, fingerprint(&["__global__ void f() {}int x;", ""]));
    assert_eq!(kernel_fingerprint(), hello(0).kernels);
    assert_ne!(kernel_fingerprint(), fingerprint(&[]));
}

#[test]
fn every_truncation_is_a_typed_error() {
    let blob = hello(1).encode(&[7u8; 64]).unwrap();
    for len in 0..blob.len() {
        match Hello::decode(&blob[..len]) {
            Err(BlobError::Truncated { need, have, .. }) => assert!(have < need),
            other => panic!("{len} of {} bytes: {other:?}", blob.len()),
        }
    }
}

#[test]
fn oversized_and_trailing_bytes_are_refused() {
    let mut blob = hello(0).encode(&[1u8; 64]).unwrap();
    blob.push(0);
    assert_eq!(Hello::decode(&blob), Err(BlobError::Trailing { extra: 1 }));
    let big = vec![0u8; MAX_BLOB + 1];
    assert_eq!(
        Hello::decode(&big),
        Err(BlobError::Oversized {
            len: MAX_BLOB + 1,
            max: MAX_BLOB
        })
    );
    // A payload length past the bound is refused before anything is read for it.
    let blob = hello(0).encode(&[]).unwrap();
    let mut b = blob.clone();
    let at = b.len() - 2;
    b[at..].copy_from_slice(&(MAX_PAYLOAD as u16 + 1).to_le_bytes());
    assert!(matches!(
        Hello::decode(&b),
        Err(BlobError::BadField {
            field: "payload length",
            ..
        })
    ));
    // Encoding refuses what decoding would refuse.
    assert!(hello(0).encode(&vec![0u8; MAX_PAYLOAD + 1]).is_err());
}

#[test]
fn the_old_bare_handle_blob_is_not_a_record() {
    // What new_process sent before the handshake: 64 handle bytes (+ a 128-byte NCCL id).
    assert!(matches!(
        Hello::decode(&[0u8; 64]),
        Err(BlobError::BadMagic { .. })
    ));
    assert!(matches!(
        Hello::decode(&[0xabu8; 192]),
        Err(BlobError::BadMagic { .. })
    ));
}

/// Offsets of the fixed fields in a record whose version string has `v` bytes.
fn offsets(v: usize) -> (usize, usize) {
    let counts = 4 + 1 + 1 + v + 8;
    (counts, counts + 5 * 8) // (R, mode byte)
}

#[test]
fn every_field_is_bounded() {
    let h = hello(2);
    let blob = h.encode(&[]).unwrap();
    let v = h.library.len();
    let (counts, mode) = offsets(v);
    let patch = |at: usize, bytes: &[u8]| {
        let mut b = blob.clone();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        Hello::decode(&b).map(|(h, _)| h)
    };
    let field_of = |r: Result<Hello, BlobError>| match r {
        Err(BlobError::BadField { field, .. }) => field,
        other => panic!("{other:?}"),
    };
    // Version length 0 and 65, and a non-printable version.
    assert_eq!(field_of(patch(5, &[0])), "library version length");
    assert_eq!(field_of(patch(5, &[65])), "library version length");
    assert_eq!(patch(6, &[0x07]), Err(BlobError::BadVersion));
    // Each count: 0 and 2^40 + 1.
    for (i, name) in [
        "num_ranks",
        "num_experts",
        "max_tokens_per_rank",
        "hidden",
        "top_k",
    ]
    .into_iter()
    .enumerate()
    {
        assert_eq!(field_of(patch(counts + 8 * i, &0u64.to_le_bytes())), name);
        assert_eq!(
            field_of(patch(counts + 8 * i, &(MAX_COUNT + 1).to_le_bytes())),
            name
        );
    }
    assert_eq!(field_of(patch(mode, &[2])), "mode");
    assert_eq!(field_of(patch(mode, &[0, 1])), "mode flags");
    assert_eq!(field_of(patch(mode, &[1, 4])), "mode flags");
    assert_eq!(field_of(patch(mode + 2, &[3])), "transport");
    assert_eq!(field_of(patch(mode + 3, &[2])), "zero_copy_local");
    assert_eq!(field_of(patch(mode + 4, &[2])), "nccl_sizes");
    assert_eq!(field_of(patch(mode + 5, &[2])), "shrink");
    // rank >= R (R = 4), allocation 0 and > 2^50.
    let rank_at = mode + 6 + 8;
    assert_eq!(field_of(patch(rank_at, &4u64.to_le_bytes())), "rank");
    assert_eq!(
        field_of(patch(rank_at + 8, &0u64.to_le_bytes())),
        "allocation bytes"
    );
    assert_eq!(
        field_of(patch(rank_at + 8, &(MAX_ALLOC + 1).to_le_bytes())),
        "allocation bytes"
    );
    // The node id: its source, its length (0, 65, past the record) and its bytes.
    let node_at = rank_at + 16;
    assert_eq!(field_of(patch(node_at, &[3])), "node id source");
    assert_eq!(field_of(patch(node_at + 1, &[0])), "node id length");
    assert_eq!(field_of(patch(node_at + 1, &[65])), "node id length");
    assert!(matches!(
        patch(node_at + 1, &[40]),
        Err(BlobError::Truncated {
            field: "node id",
            ..
        })
    ));
    assert_eq!(patch(node_at + 2, b" "), Err(BlobError::BadNode));
    assert_eq!(patch(node_at + 2, &[0x7f]), Err(BlobError::BadNode));
    let back = patch(node_at, &[1, 2, b'1', b'7']).unwrap();
    assert_eq!(
        back.node,
        NodeId {
            source: NodeSource::GroupRank,
            id: "17".into()
        }
    );
    // Any timeout is meaningful: u64::MAX decodes.
    let back = patch(mode + 6, &u64::MAX.to_le_bytes()).unwrap();
    assert_eq!(back.timeout_ns, u64::MAX);
    // Bad magic.
    assert!(matches!(patch(0, b"EPhX"), Err(BlobError::BadMagic { .. })));
}

fn mismatch(ours: &Hello, theirs: &Hello, peer: usize) -> (&'static str, String, String) {
    let blob = theirs.encode(&[0u8; 64]).unwrap();
    let all: Vec<Vec<u8>> = (0..ours.config.num_ranks)
        .map(|p| {
            if p == peer {
                blob.clone()
            } else {
                let mut h = ours.clone();
                h.rank = p;
                h.encode(&[0u8; 64]).unwrap()
            }
        })
        .collect();
    match verify_all(ours, &all) {
        Err(GroupError::PeerMismatch {
            field,
            ours: a,
            theirs: b,
            rank,
            peer: p,
        }) => {
            assert_eq!((rank, p), (ours.rank, peer));
            (field, a, b)
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn every_differing_field_is_named_with_both_values() {
    let ours = hello(0);
    let peer = 2;
    let base = hello(peer);
    let with = |f: &dyn Fn(&mut Hello)| {
        let mut h = base.clone();
        f(&mut h);
        h
    };
    let cases: Vec<(Hello, &str, &str, &str)> = vec![
        (
            with(&|h| h.library = "9.9.9".into()),
            "library version",
            "",
            "\"9.9.9\"",
        ),
        (
            with(&|h| h.kernels ^= 1),
            "kernel sources (fingerprint)",
            "",
            "",
        ),
        (
            with(&|h| h.config.num_experts = 32),
            "num_experts",
            "16",
            "32",
        ),
        (
            with(&|h| h.config.max_tokens_per_rank = 128),
            "max_tokens_per_rank",
            "64",
            "128",
        ),
        (with(&|h| h.config.hidden = 2048), "hidden", "1024", "2048"),
        (with(&|h| h.config.top_k = 8), "top_k", "4", "8"),
        (with(&|h| h.config.mode = Mode::Bf16), "mode", "fp8", "bf16"),
        (
            with(&|h| h.config.mode = Mode::FP8),
            "round_scale",
            "true",
            "false",
        ),
        (
            with(&|h| h.config.mode = Mode::FP8_UE8M0),
            "ue8m0",
            "false",
            "true",
        ),
        (
            with(&|h| h.transport = Transport::Nccl),
            "transport",
            "Auto",
            "Nccl",
        ),
        (
            with(&|h| h.nccl_sizes = NcclSizes::Capacity),
            "nccl_sizes",
            "Exact",
            "Capacity",
        ),
        (with(&|h| h.shrink = true), "shrink", "false", "true"),
        (
            with(&|h| h.zero_copy_local = false),
            "zero_copy_local",
            "true",
            "false",
        ),
        (with(&|h| h.timeout_ns = 5), "timeout_ns", "2000000000", "5"),
        (
            with(&|h| h.rank = 1),
            "rank (position in the exchange)",
            "2",
            "1",
        ),
        (
            with(&|h| h.alloc_bytes = 4096),
            "allocation bytes",
            "1048576",
            "4096",
        ),
        (
            with(&|h| {
                h.node = NodeId {
                    source: NodeSource::Hostname,
                    id: "n0".into(),
                }
            }),
            "node id source",
            "\"EP_NODE_ID\"",
            "\"hostname\"",
        ),
        (
            with(&|h| h.transport = Transport::TwoTier),
            "transport",
            "Auto",
            "TwoTier",
        ),
    ];
    for (theirs, field, a, b) in cases {
        let (f, got_a, got_b) = mismatch(&ours, &theirs, peer);
        assert_eq!(f, field);
        if !a.is_empty() {
            assert_eq!(got_a, a, "{field}");
        }
        if !b.is_empty() {
            assert_eq!(got_b, b, "{field}");
        }
        assert_ne!(got_a, got_b, "{field}");
    }
    // R differs: a peer with R = 8 is named (its rank 2 < 8 still decodes).
    let theirs = with(&|h| {
        h.config.num_ranks = 8;
        h.config.num_experts = 32
    });
    let (f, a, b) = mismatch(&ours, &theirs, peer);
    assert_eq!(
        (f, a.as_str(), b.as_str()),
        ("num_ranks (world size)", "4", "8")
    );
}

#[test]
fn peers_on_other_nodes_are_accepted_and_their_nodes_come_back() {
    let ours = hello(1);
    let all: Vec<Vec<u8>> = (0..4)
        .map(|r| {
            let mut h = hello(r);
            h.node = node(&format!("n{}", r / 2));
            h.encode(&[r as u8]).unwrap()
        })
        .collect();
    let recs = verify_records(&ours, &all).unwrap();
    let nodes: Vec<&str> = recs.iter().map(|(h, _)| h.node.id.as_str()).collect();
    assert_eq!(nodes, ["n0", "n0", "n1", "n1"]);
    let payloads: Vec<Vec<u8>> = recs.into_iter().map(|(_, p)| p).collect();
    assert_eq!(payloads, vec![vec![0], vec![1], vec![2], vec![3]]);
    // A node id too long to encode is this rank's error, before anything is sent.
    let mut h = hello(0);
    h.node.id = "n".repeat(65);
    assert!(matches!(h.encode(&[]), Err(GroupError::Process(_))));
}

#[test]
fn another_protocol_is_a_mismatch_not_garbage() {
    let ours = hello(0);
    let mut blob = hello(1).encode(&[]).unwrap();
    blob[4] = PROTOCOL + 1;
    assert_eq!(
        Hello::decode(&blob),
        Err(BlobError::OtherProtocol {
            found: PROTOCOL + 1
        })
    );
    let mut all: Vec<Vec<u8>> = (0..4).map(|r| hello(r).encode(&[]).unwrap()).collect();
    all[1] = blob;
    match verify_all(&ours, &all) {
        Err(GroupError::PeerMismatch {
            field,
            ours,
            theirs,
            rank,
            peer,
        }) => {
            assert_eq!((field, rank, peer), ("protocol version", 0, 1));
            assert_eq!(
                (ours, theirs),
                (PROTOCOL.to_string(), (PROTOCOL + 1).to_string())
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_malformed_blob_names_the_peer_and_a_short_exchange_is_refused() {
    let ours = hello(0);
    let good = |r: usize| hello(r).encode(&[0u8; 64]).unwrap();
    let all = vec![good(0), good(1), vec![0u8; 10], good(3)];
    match verify_all(&ours, &all) {
        Err(GroupError::PeerBlob { rank, peer, error }) => {
            assert_eq!((rank, peer), (0, 2));
            assert!(matches!(error, BlobError::BadMagic { .. }), "{error}");
        }
        other => panic!("{other:?}"),
    }
    let all = vec![good(0), good(1), good(2)];
    assert!(matches!(
        verify_all(&ours, &all),
        Err(GroupError::Process(_))
    ));
    let all: Vec<Vec<u8>> = (0..4).map(good).collect();
    let payloads = verify_all(&ours, &all).unwrap();
    assert_eq!(payloads, vec![vec![0u8; 64]; 4]);
}

#[test]
fn exchange_sends_the_record_and_strips_it() {
    let ours = hello(1);
    let mut seen = Vec::new();
    let mut ag = |b: &[u8]| -> Result<Vec<Vec<u8>>, String> {
        seen = b.to_vec();
        Ok((0..4)
            .map(|r| {
                if r == 1 {
                    b.to_vec()
                } else {
                    hello(r).encode(&[r as u8; 3]).unwrap()
                }
            })
            .collect())
    };
    let payloads = exchange(&mut ag, &ours, &[9, 9]).unwrap();
    assert_eq!(
        payloads,
        vec![vec![0; 3], vec![9, 9], vec![2; 3], vec![3; 3]]
    );
    assert_eq!(Hello::decode(&seen).unwrap().0, ours);
    let mut failing = |_: &[u8]| -> Result<Vec<Vec<u8>>, String> { Err("peer gone".into()) };
    assert_eq!(
        exchange(&mut failing, &ours, &[]),
        Err(GroupError::Process("peer gone".into()))
    );
}
