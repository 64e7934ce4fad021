//! bf16 conversions.
//!
//! `half::bf16` is the storage type of every bf16 tensor in the API. The rounding from f32 is
//! written here rather than taken from `half`, because the contract fixes the NaN result to the
//! one the GPU produces (`cvt.rn.bf16.f32` returns the canonical NaN 0x7FFF), while `half`
//! keeps the payload.

pub use half::bf16;

/// The canonical NaN `cvt.rn.bf16.f32` produces.
pub const CANONICAL_NAN_BITS: u16 = 0x7FFF;

/// f32 -> bf16, round to nearest, ties to even; NaN becomes the canonical NaN.
pub fn from_f32_rne(x: f32) -> bf16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return bf16::from_bits(CANONICAL_NAN_BITS);
    }
    // Add 0x7FFF plus the lowest kept bit, then truncate: ties go to the even neighbour.
    // Overflow past the largest finite value carries into the exponent and yields infinity,
    // which is what round-to-nearest requires.
    let lsb = (bits >> 16) & 1;
    let rounded = bits.wrapping_add(0x7FFF + lsb);
    bf16::from_bits((rounded >> 16) as u16)
}

/// `len` zero bf16 values on the allocator's zeroed pages (`vec![0u16; len]`, reinterpreted
/// without a copy): unlike `vec![bf16::ZERO; len]`, which writes every element, pages never
/// written cost no physical memory. The capacity-sized layouts (L x R*T rows per rank) are
/// mostly rows no call fills.
pub fn zeroed(len: usize) -> Vec<bf16> {
    use half::vec::HalfBitsVecExt;
    vec![0u16; len].reinterpret_into()
}

/// bf16 -> f32 is exact.
pub fn to_f32(x: bf16) -> f32 {
    f32::from_bits((x.to_bits() as u32) << 16)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_values_pass_unchanged() {
        for v in [
            0.0f32,
            -0.0,
            1.0,
            -2.5,
            65280.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
        ] {
            assert_eq!(to_f32(from_f32_rne(v)).to_bits(), v.to_bits(), "{v}");
        }
    }

    #[test]
    fn ties_round_to_even() {
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: the even neighbour is 1.
        assert_eq!(from_f32_rne(1.0 + 2f32.powi(-8)).to_bits(), 0x3F80);
        // 1 + 3*2^-8 is halfway between 1+2^-7 (odd) and 1+2^-6 (even).
        assert_eq!(from_f32_rne(1.0 + 3.0 * 2f32.powi(-8)).to_bits(), 0x3F82);
        // Just above the tie rounds up.
        assert_eq!(from_f32_rne(f32::from_bits(0x3F80_8001)).to_bits(), 0x3F81);
    }

    #[test]
    fn nan_is_canonical_and_overflow_is_infinite() {
        assert_eq!(from_f32_rne(f32::NAN).to_bits(), CANONICAL_NAN_BITS);
        assert_eq!(from_f32_rne(f32::from_bits(0xFFC0_1234)).to_bits(), 0x7FFF);
        assert_eq!(from_f32_rne(f32::MAX).to_bits(), 0x7F80);
        assert_eq!(from_f32_rne(-f32::MAX).to_bits(), 0xFF80);
    }

    #[test]
    fn subnormals_round_like_normals() {
        // Smallest f32 subnormal is far below bf16's lowest bit: rounds to zero.
        assert_eq!(from_f32_rne(f32::from_bits(1)).to_bits(), 0);
        assert_eq!(from_f32_rne(f32::from_bits(0x0000_8000)).to_bits(), 0);
        assert_eq!(from_f32_rne(f32::from_bits(0x0001_8000)).to_bits(), 0x0002);
    }

    #[test]
    fn agrees_with_half_on_non_nan() {
        let mut s = 0x1234_5678u32;
        for _ in 0..100_000 {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            let x = f32::from_bits(s);
            if !x.is_nan() {
                assert_eq!(
                    from_f32_rne(x).to_bits(),
                    bf16::from_f32(x).to_bits(),
                    "{s:#x}"
                );
            }
        }
    }
}
