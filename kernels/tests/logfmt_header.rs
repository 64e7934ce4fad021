//! The LogFMT header's constants are the reference's (no GPU needed): the kernels' table of
//! log2(1 + m/128) and their exp2 polynomial, read from the text of kernels/src/cu/logfmt.cuh,
//! equal `ep_reference::numerics::logfmt::{LOG2_MANTISSA, EXP2_POLY}` bit for bit, and the
//! header's byte sizes equal `logfmt`'s. A header edited apart from the reference fails here.

use ep_kernels::compile::{HEADERS, LOGFMT_CUH};
use ep_reference::numerics::logfmt::{
    EXP2_POLY, GROUP, LOG2_MANTISSA, META_BYTES, PACKED_BYTES, RAW_BYTES, TOP_CODE,
};

/// The `0x...u` literals between `start` and the next `end` of `text`.
fn hex_words(text: &str, start: &str, end: &str) -> Vec<u32> {
    let from = text
        .find(start)
        .unwrap_or_else(|| panic!("{start:?} not in logfmt.cuh"));
    let body = &text[from + start.len()..];
    let body = &body[..body
        .find(end)
        .unwrap_or_else(|| panic!("no {end:?} after {start:?}"))];
    body.split(|c: char| !c.is_ascii_alphanumeric())
        .filter_map(|w| w.strip_prefix("0x"))
        .map(|w| {
            let w = w.strip_suffix('u').unwrap_or(w);
            u32::from_str_radix(w, 16).unwrap_or_else(|e| panic!("{w}: {e}"))
        })
        .collect()
}

/// The value of `#define name value` in the header.
fn define(name: &str) -> String {
    let key = format!("#define {name} ");
    let line = LOGFMT_CUH
        .lines()
        .find(|l| l.starts_with(&key))
        .unwrap_or_else(|| panic!("no {key:?} in logfmt.cuh"));
    line[key.len()..].trim().to_string()
}

#[test]
fn the_log2_table_is_the_references() {
    let got = hex_words(LOGFMT_CUH, "LF_LOG2_MANTISSA[128] = {", "};");
    assert_eq!(got.len(), 128, "entries of LF_LOG2_MANTISSA");
    for (m, (g, w)) in got.iter().zip(LOG2_MANTISSA.iter()).enumerate() {
        assert_eq!(
            g, w,
            "LF_LOG2_MANTISSA[{m}]: {g:#010X}, the reference {w:#010X}"
        );
    }
}

#[test]
fn the_exp2_polynomial_is_the_references() {
    for (i, want) in EXP2_POLY.iter().enumerate() {
        let name = format!("LF_EXP2_A{}", i + 1);
        let v = define(&name);
        let got = v
            .strip_prefix("0x")
            .and_then(|w| w.strip_suffix('u'))
            .and_then(|w| u32::from_str_radix(w, 16).ok())
            .unwrap_or_else(|| panic!("{name} = {v}: not a 0x...u literal"));
        assert_eq!(got, *want, "{name}: {v}, the reference {want:#010X}");
    }
}

#[test]
fn the_sizes_are_the_references() {
    for (name, want) in [
        ("LF_GROUP", GROUP),
        ("LF_META_BYTES", META_BYTES),
        ("LF_PACKED_BYTES", PACKED_BYTES),
        ("LF_RAW_BYTES", RAW_BYTES),
        ("LF_TOP_CODE", TOP_CODE as usize),
    ] {
        assert_eq!(define(name), want.to_string(), "{name}");
    }
    // Every module is compiled with the header.
    assert!(HEADERS.contains(&LOGFMT_CUH));
}

#[test]
fn the_parser_sees_a_changed_entry() {
    // The check above can fail: one digit changed in a copy of the header is found.
    let changed = LOGFMT_CUH.replacen("0x3C37F286u", "0x3C37F287u", 1);
    assert!(
        changed != LOGFMT_CUH,
        "entry 1 (0x3C37F286u) is not in the header"
    );
    let got = hex_words(&changed, "LF_LOG2_MANTISSA[128] = {", "};");
    assert_ne!(got[1], LOG2_MANTISSA[1]);
}
