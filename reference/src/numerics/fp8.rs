//! FP8 e4m3 quantization exactly as docs/contract.md fixes it.
//!
//! e4m3: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities; 0x7F/0xFF are NaN; the
//! largest finite magnitude is 448 (0x7E); the smallest subnormal is 2^-9.

/// Channels per scale group.
pub const GROUP: usize = 128;
/// Largest finite e4m3 magnitude.
pub const E4M3_MAX: f32 = 448.0;

/// f32 -> e4m3, round to nearest even, saturate finite overflow (and infinities) to +-448,
/// as `cvt.rn.satfinite.e4m3x2.f32`; every NaN -> the canonical 0x7F.
///
/// Why the sign of a NaN is dropped: the value converted is `x * scale`, and the sign of a NaN
/// that an f32 multiply returns is not portable. x86 returns a negative "default NaN" for
/// `inf * 0` and keeps an input NaN's sign, Arm and the GPU return the positive canonical NaN.
/// A reference that kept the sign would differ between CPUs, and from the kernels, whose
/// multiply gives the canonical NaN. bf16 rounding canonicalises NaN the same way (0x7FFF).
#[inline(always)]
pub fn e4m3_rn_satfinite(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign: u8 = if x.is_sign_negative() { 0x80 } else { 0 };
    let a = x.abs();
    // Smallest normal is 2^-6; below it the step is 2^-9 (subnormals). Scaling by a power of
    // two is exact in f32, and round_ties_even is the IEEE rounding.
    let code: u32 = if a < 2f32.powi(-6) {
        // 0..=8 units of 2^-9; 8 units is 2^-6, whose code 0x08 is the smallest normal.
        (a * 512.0).round_ties_even() as u32
    } else if a >= 512.0 {
        0x7E + 1 // beyond anything that rounds into range: saturate below
    } else {
        let e = ((a.to_bits() >> 23) as i32) - 127; // floor(log2 a), a is a normal f32 here
        let m = (a * pow2i(3 - e)).round_ties_even() as u32; // 8..=16, 16 carries upward
        (((e + 7) as u32) << 3) + m - 8
    };
    sign | code.min(0x7E) as u8
}

/// e4m3 -> f32 (exact).
pub fn e4m3_to_f32(q: u8) -> f32 {
    let sign = if q & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((q >> 3) & 0xF) as i32;
    let man = (q & 7) as f32;
    if q & 0x7F == 0x7F {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man * pow2i(-9)
    } else {
        sign * (1.0 + man / 8.0) * pow2i(exp - 7)
    }
}

/// 2^e as f32, built from bits, exact for every e: subnormal below -126, infinity above 127.
/// The GPU code builds it the same way.
pub fn pow2i(e: i32) -> f32 {
    if e > 127 {
        f32::INFINITY
    } else if e >= -126 {
        f32::from_bits(((e + 127) as u32) << 23)
    } else if e >= -149 {
        f32::from_bits(1u32 << (e + 149))
    } else {
        0.0
    }
}

/// ceil(log2(v)) for a positive, non-NaN f32 taken from its bits: the unbiased exponent, plus
/// one when the mantissa is not zero. (`v` here is `amax / 448` >= 1e-4/448, always normal or
/// infinite; infinity gives 128.)
pub fn ceil_log2(v: f32) -> i32 {
    let bits = v.to_bits();
    let exp = ((bits >> 23) & 0xFF) as i32 - 127;
    exp + i32::from(bits & 0x7F_FFFF != 0)
}

/// The scale pair of one group: `scale` multiplies the input, `scale_inv` is stored.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GroupScale {
    pub scale: f32,
    pub scale_inv: f32,
}

/// The scales for a group whose largest magnitude is `amax_raw` (before the 1e-4 floor).
pub fn group_scale(amax_raw: f32, round_scale: bool) -> GroupScale {
    // f32::max is IEEE maxNum: a NaN operand is ignored, like CUDA's fmaxf.
    let amax = 1e-4f32.max(amax_raw);
    if round_scale {
        let e = ceil_log2(amax * (1.0f32 / 448.0f32));
        GroupScale {
            scale_inv: pow2i(e),
            scale: pow2i(-e),
        }
    } else {
        GroupScale {
            scale_inv: amax * (1.0f32 / 448.0f32),
            scale: 448.0f32 / amax,
        }
    }
}

/// The UE8M0 byte of a power-of-two scale: its biased exponent.
pub fn ue8m0_byte(scale_inv: f32) -> u8 {
    ((scale_inv.to_bits() >> 23) & 0xFF) as u8
}

/// Quantizes one token row. `q` gets `x.len()` e4m3 bytes, `scale_inv` one f32 per group.
pub fn quantize_row(x: &[half::bf16], round_scale: bool, q: &mut [u8], scale_inv: &mut [f32]) {
    // `round_ties_even` is one instruction with SSE4.1 and a library call without it: where the
    // CPU has it, run the same code compiled for it (IEEE results do not change).
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("sse4.1") {
            // SAFETY: the CPU has SSE4.1 (checked just above), the target feature's only
            // requirement; the function itself is safe code.
            unsafe { quantize_row_sse41(x, round_scale, q, scale_inv) };
            return;
        }
    }
    quantize_row_generic(x, round_scale, q, scale_inv)
}

/// [`quantize_row_generic`] compiled for SSE4.1.
///
/// # Safety
/// The CPU running it has SSE4.1 (the caller checks `is_x86_feature_detected!`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "sse4.1")]
unsafe fn quantize_row_sse41(
    x: &[half::bf16],
    round_scale: bool,
    q: &mut [u8],
    scale_inv: &mut [f32],
) {
    quantize_row_generic(x, round_scale, q, scale_inv)
}

#[inline(always)]
fn quantize_row_generic(x: &[half::bf16], round_scale: bool, q: &mut [u8], scale_inv: &mut [f32]) {
    debug_assert_eq!(x.len() % GROUP, 0);
    debug_assert_eq!(q.len(), x.len());
    debug_assert_eq!(scale_inv.len(), x.len() / GROUP);
    for ((xg, qg), si) in x
        .chunks_exact(GROUP)
        .zip(q.chunks_exact_mut(GROUP))
        .zip(scale_inv.iter_mut())
    {
        let amax = xg
            .iter()
            .map(|v| super::bf16::to_f32(*v).abs())
            .fold(0.0f32, f32::max);
        let s = group_scale(amax, round_scale);
        for (v, out) in xg.iter().zip(qg.iter_mut()) {
            *out = e4m3_rn_satfinite(super::bf16::to_f32(*v) * s.scale);
        }
        *si = s.scale_inv;
    }
}

/// Packs UE8M0 bytes four to an i32, group 4j in the lowest byte.
pub fn pack_ue8m0(scale_inv: &[f32], out: &mut [i32]) {
    debug_assert_eq!(scale_inv.len(), 4 * out.len());
    for (four, o) in scale_inv.chunks_exact(4).zip(out.iter_mut()) {
        let b = [
            ue8m0_byte(four[0]),
            ue8m0_byte(four[1]),
            ue8m0_byte(four[2]),
            ue8m0_byte(four[3]),
        ];
        *o = i32::from_le_bytes(b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(e4m3_rn_satfinite(0.0), 0x00);
        assert_eq!(e4m3_rn_satfinite(-0.0), 0x80);
        assert_eq!(e4m3_rn_satfinite(1.0), 0x38);
        assert_eq!(e4m3_rn_satfinite(-1.0), 0xB8);
        assert_eq!(e4m3_rn_satfinite(448.0), 0x7E);
        assert_eq!(e4m3_rn_satfinite(-448.0), 0xFE);
        assert_eq!(e4m3_rn_satfinite(2f32.powi(-6)), 0x08); // smallest normal
        assert_eq!(e4m3_rn_satfinite(1.75 * 2f32.powi(-7)), 0x07); // largest subnormal (7 * 2^-9)
        assert_eq!(e4m3_rn_satfinite(2f32.powi(-9)), 0x01); // smallest subnormal
        assert_eq!(e4m3_rn_satfinite(1.125), 0x39);
    }

    #[test]
    fn ties_go_to_even() {
        // 1 + 1/16 lies halfway between 1 (0x38, even) and 1.125 (0x39).
        assert_eq!(e4m3_rn_satfinite(1.0625), 0x38);
        // 1.1875 lies halfway between 1.125 (0x39) and 1.25 (0x3A, even).
        assert_eq!(e4m3_rn_satfinite(1.1875), 0x3A);
        // Subnormal ties: 2^-10 is halfway between 0 and 2^-9 -> 0; 3*2^-10 -> 2*2^-9.
        assert_eq!(e4m3_rn_satfinite(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_rn_satfinite(3.0 * 2f32.powi(-10)), 0x02);
        // Halfway between the largest subnormal and the smallest normal goes to 0x08 (even).
        assert_eq!(e4m3_rn_satfinite(7.5 * 2f32.powi(-9)), 0x08);
        // 15 * 2^-4 * 2 = 1.875 * 2^... : 1.9375 is halfway between 1.875 (0x3F) and 2 (0x40).
        assert_eq!(e4m3_rn_satfinite(1.9375), 0x40);
    }

    #[test]
    fn saturation_and_nan() {
        assert_eq!(e4m3_rn_satfinite(464.0), 0x7E); // the tie above 448 saturates
        assert_eq!(e4m3_rn_satfinite(1.0e6), 0x7E);
        assert_eq!(e4m3_rn_satfinite(-1.0e6), 0xFE);
        assert_eq!(e4m3_rn_satfinite(f32::INFINITY), 0x7E);
        assert_eq!(e4m3_rn_satfinite(f32::NEG_INFINITY), 0xFE);
        assert_eq!(e4m3_rn_satfinite(f32::NAN), 0x7F);
        assert_eq!(e4m3_rn_satfinite(-f32::NAN), 0x7F); // canonical: the sign is dropped
        assert_eq!(e4m3_rn_satfinite(f32::INFINITY * 0.0), 0x7F); // x86's negative default NaN
        assert_eq!(e4m3_rn_satfinite(f32::from_bits(1)), 0x00); // f32 subnormal
    }

    #[test]
    fn round_trip_every_finite_code() {
        for q in 0u8..=255 {
            if q & 0x7F == 0x7F {
                assert!(e4m3_to_f32(q).is_nan());
                continue;
            }
            let v = e4m3_to_f32(q);
            assert_eq!(e4m3_rn_satfinite(v), q, "code {q:#04x} value {v}");
        }
    }

    #[test]
    fn nearest_is_chosen_for_every_value_between_codes() {
        // Exhaustive over a dense sweep: the chosen code is never farther than another code.
        let finite: Vec<(u8, f32)> = (0u8..=0x7E).map(|q| (q, e4m3_to_f32(q))).collect();
        let mut bits = 0u32;
        while bits < 0x43E0_0000 {
            // up to 448
            let x = f32::from_bits(bits);
            let got = e4m3_to_f32(e4m3_rn_satfinite(x));
            let best = finite
                .iter()
                .map(|(_, v)| (v - x).abs())
                .fold(f32::INFINITY, f32::min);
            assert_eq!((got - x).abs(), best, "x = {x}");
            bits += 0x1_0003;
        }
    }

    #[test]
    fn round_scale_gives_powers_of_two() {
        // amax = 448 -> amax/448 = 1 -> e = 0.
        let s = group_scale(448.0, true);
        assert_eq!((s.scale_inv, s.scale), (1.0, 1.0));
        // amax = 449 -> slightly above 1 -> e = 1.
        let s = group_scale(449.0, true);
        assert_eq!((s.scale_inv, s.scale), (2.0, 0.5));
        // amax = 1 -> 1/448 -> between 2^-9 and 2^-8 -> e = -8.
        let s = group_scale(1.0, true);
        assert_eq!((s.scale_inv, s.scale), (2f32.powi(-8), 256.0));
        assert_eq!(ue8m0_byte(s.scale_inv), 127 - 8);
        // The 1e-4 floor applies to all-zero groups.
        let s = group_scale(0.0, false);
        assert_eq!(s.scale_inv, 1e-4f32 * (1.0 / 448.0));
        assert_eq!(s.scale, 448.0f32 / 1e-4);
        // NaN channels are ignored by the max, infinity saturates the scale.
        assert_eq!(
            group_scale(f32::NAN, false).scale_inv,
            1e-4f32 * (1.0 / 448.0)
        );
        assert_eq!(group_scale(f32::INFINITY, true).scale_inv, f32::INFINITY);
    }

    #[test]
    fn ue8m0_packing_is_little_endian_by_group() {
        let si = [1.0f32, 2.0, 0.5, 4.0];
        let mut out = [0i32];
        pack_ue8m0(&si, &mut out);
        assert_eq!(out[0].to_le_bytes(), [127, 128, 126, 129]);
    }

    #[test]
    fn pow2i_is_exact_everywhere() {
        assert_eq!(pow2i(0), 1.0);
        assert_eq!(pow2i(-149), f32::from_bits(1));
        assert_eq!(pow2i(-127), f32::from_bits(1 << 22));
        assert_eq!(pow2i(127), 2f32.powi(127));
        assert_eq!(pow2i(128), f32::INFINITY);
        for e in -149..=127 {
            assert_eq!(pow2i(e), 2f64.powi(e) as f32, "e = {e}");
        }
    }
}
