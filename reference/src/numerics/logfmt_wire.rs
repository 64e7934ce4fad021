//! LogFMT-10 rows as bytes (docs/contract.md "4.1 LogFMT"): a row of H = 128 x G channels is
//! G meta words (4 bytes each, [`Meta::to_bytes`]), then the G group bodies in channel order:
//! a packed group is 160 bytes, field i (10 bits: sign << 9 | code) at bits 10i..10i+9 of
//! the body read as one little-endian bit string (bit j is bit j % 8 of byte j / 8); a raw
//! group is its 128 bf16 values, little-endian. The receiver finds each body's size from the
//! meta words, which is why they come first.

use crate::numerics::logfmt::{Grid, Meta, GROUP, META_BYTES, PACKED_BYTES, RAW_BYTES};
use half::bf16;

/// The largest encoded row of `hidden` channels (every group raw): 2H + H/32 bytes.
/// `hidden` is a multiple of 128 and at most `config::MAX_HIDDEN`, so this cannot overflow.
pub fn max_row_bytes(hidden: usize) -> usize {
    hidden / GROUP * (META_BYTES + RAW_BYTES)
}

/// The bytes a combine row slot needs for `hidden` channels in either format: a LogFMT row's
/// largest where LogFMT applies (H a multiple of 128), else a bf16 row's 2H.
pub fn slot_bytes(hidden: usize) -> usize {
    if hidden.is_multiple_of(GROUP) {
        max_row_bytes(hidden)
    } else {
        2 * hidden
    }
}

/// The encoded size of `row` (no encoding done: only the groups' meta words are computed).
pub fn row_bytes(row: &[bf16]) -> usize {
    row.chunks_exact(GROUP)
        .map(|g| {
            let packed = Meta::of(g.iter().map(|v| v.to_bits())).is_packed();
            META_BYTES + if packed { PACKED_BYTES } else { RAW_BYTES }
        })
        .sum()
}

/// Encodes `row` (H = 128 x G bf16 values) into the front of `dst` (at least
/// [`max_row_bytes`] long) and returns the bytes written.
pub fn encode_row(row: &[bf16], dst: &mut [u8]) -> usize {
    assert!(row.len().is_multiple_of(GROUP) && dst.len() >= max_row_bytes(row.len()));
    let groups = row.len() / GROUP;
    let mut at = groups * META_BYTES;
    for (gi, g) in row.chunks_exact(GROUP).enumerate() {
        let meta = Meta::of(g.iter().map(|v| v.to_bits()));
        dst[gi * META_BYTES..(gi + 1) * META_BYTES].copy_from_slice(&meta.to_bytes());
        match meta.grid() {
            Some(grid) => {
                let body = &mut dst[at..at + PACKED_BYTES];
                for (four, out) in g.chunks_exact(4).zip(body.chunks_exact_mut(5)) {
                    let mut bits = 0u64;
                    for (i, v) in four.iter().enumerate() {
                        bits |= u64::from(grid.field(v.to_bits())) << (10 * i);
                    }
                    out.copy_from_slice(&bits.to_le_bytes()[..5]);
                }
                at += PACKED_BYTES;
            }
            None => {
                for (v, out) in g.iter().zip(dst[at..at + RAW_BYTES].chunks_exact_mut(2)) {
                    out.copy_from_slice(&v.to_bits().to_le_bytes());
                }
                at += RAW_BYTES;
            }
        }
    }
    at
}

/// Calls `f(channel, value)` for every channel of the encoded row `wire` of `hidden` channels,
/// in channel order, with the value the receiver uses.
#[inline(always)]
fn for_each_value(wire: &[u8], hidden: usize, mut f: impl FnMut(usize, f32)) {
    let groups = hidden / GROUP;
    let mut at = groups * META_BYTES;
    for gi in 0..groups {
        let m = &wire[gi * META_BYTES..(gi + 1) * META_BYTES];
        let meta = Meta::from_bytes([m[0], m[1], m[2], m[3]]);
        let base = gi * GROUP;
        match meta.grid() {
            Some(grid) => {
                decode_packed(&grid, &wire[at..at + PACKED_BYTES], |i, v| f(base + i, v));
                at += PACKED_BYTES;
            }
            None => {
                for (i, c) in wire[at..at + RAW_BYTES].chunks_exact(2).enumerate() {
                    let b = u16::from_le_bytes([c[0], c[1]]);
                    f(base + i, f32::from_bits(u32::from(b) << 16));
                }
                at += RAW_BYTES;
            }
        }
    }
}

#[inline(always)]
fn decode_packed(grid: &Grid, body: &[u8], mut f: impl FnMut(usize, f32)) {
    for (j, five) in body.chunks_exact(5).enumerate() {
        let mut b = [0u8; 8];
        b[..5].copy_from_slice(five);
        let bits = u64::from_le_bytes(b);
        for i in 0..4 {
            // A 10-bit field (masked): fits u32.
            f(4 * j + i, grid.decode(((bits >> (10 * i)) & 0x3FF) as u32));
        }
    }
}

/// Decodes the encoded row `wire` into `out` (H values).
pub fn decode_row(wire: &[u8], out: &mut [f32]) {
    for_each_value(wire, out.len(), |c, v| out[c] = v);
}

/// `acc[c] = fma(w, value(c), acc[c])` for every channel of the encoded row `wire`, the
/// combine's step for one slot (value: what [`decode_row`] gives). Compiled with the `fma`
/// target feature where the CPU has it, as `reduce::fma_bf16_row` is: the same bits, faster.
pub fn fma_row(acc: &mut [f32], w: f32, wire: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has FMA (checked just above), the only requirement of the
            // target feature; the function itself is safe code.
            unsafe { fma_row_fma(acc, w, wire) };
            return;
        }
    }
    fma_row_generic(acc, w, wire)
}

#[inline(always)]
fn fma_row_generic(acc: &mut [f32], w: f32, wire: &[u8]) {
    let h = acc.len();
    for_each_value(wire, h, |c, v| acc[c] = w.mul_add(v, acc[c]));
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn fma_row_fma(acc: &mut [f32], w: f32, wire: &[u8]) {
    fma_row_generic(acc, w, wire)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::logfmt::round_trip;

    fn row(seed: u32, h: usize) -> Vec<bf16> {
        let mut s = seed | 1;
        (0..h)
            .map(|c| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                // Group 1 of 4 is raw (values up to 4), the rest packed, a few specials.
                let scale = if c / GROUP % 4 == 1 { 4.0 } else { 0.9 };
                let v = ((s >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 2.0 * scale;
                match s % 97 {
                    0 => bf16::ZERO,
                    1 => bf16::from_bits(0x8000),
                    2 if c / GROUP % 4 == 3 => bf16::NAN,
                    _ => bf16::from_f32(v),
                }
            })
            .collect()
    }

    #[test]
    fn bytes_decode_to_the_round_trip_and_sizes_agree() {
        for (seed, h) in [(1, 128), (7, 512), (99, 1024), (5, 7168)] {
            let r = row(seed, h);
            let mut wire = vec![0xAAu8; max_row_bytes(h)];
            let n = encode_row(&r, &mut wire);
            assert_eq!(n, row_bytes(&r));
            assert!(n < max_row_bytes(h) || h == 128);
            let (mut got, mut want) = (vec![0f32; h], vec![0f32; h]);
            decode_row(&wire, &mut got);
            round_trip(&r, &mut want);
            for c in 0..h {
                assert_eq!(got[c].to_bits(), want[c].to_bits(), "h {h} channel {c}");
            }
            let init: Vec<f32> = (0..h).map(|c| c as f32 * 0.001).collect();
            let mut acc = init.clone();
            fma_row(&mut acc, 0.375, &wire);
            for c in 0..h {
                let w = 0.375f32.mul_add(want[c], init[c]);
                assert!(w.to_bits() == acc[c].to_bits() || (w.is_nan() && acc[c].is_nan()));
            }
        }
    }

    #[test]
    fn the_layout_is_metas_then_bodies_with_little_endian_fields() {
        let r = row(3, 512);
        let mut wire = vec![0u8; max_row_bytes(512)];
        encode_row(&r, &mut wire);
        let mut at = 4 * META_BYTES;
        for g in 0..4 {
            let group = &r[g * GROUP..(g + 1) * GROUP];
            let meta = Meta::of(group.iter().map(|v| v.to_bits()));
            assert_eq!(wire[g * 4..g * 4 + 4], meta.to_bytes());
            assert_eq!(meta.is_packed(), g == 0 || g == 2, "group {g}");
            if let Some(grid) = meta.grid() {
                for (i, v) in group.iter().enumerate() {
                    let mut f = 0u32;
                    for b in 0..10 {
                        let j = 10 * i + b;
                        f |= u32::from(wire[at + j / 8] >> (j % 8) & 1) << b;
                    }
                    assert_eq!(f, grid.field(v.to_bits()), "group {g} channel {i}");
                }
                at += PACKED_BYTES;
            } else {
                for (i, v) in group.iter().enumerate() {
                    let b = [wire[at + 2 * i], wire[at + 2 * i + 1]];
                    assert_eq!(u16::from_le_bytes(b), v.to_bits());
                }
                at += RAW_BYTES;
            }
        }
        assert_eq!(at, 16 + 2 * 160 + 2 * 256);
        assert_eq!(slot_bytes(7168), 7168 * 2 + 7168 / 32);
        assert_eq!(slot_bytes(100), 200);
    }
}
