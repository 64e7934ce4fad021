//! combine's inner loop, shared by both CPU paths: one fused multiply-add per channel, in the
//! contract's order (the caller walks the slots in ascending k).
//!
//! `f32::mul_add` is a correctly rounded fma everywhere, but on a baseline x86-64 build it is a
//! library call per element. Where the CPU has FMA, the same loop is compiled with the `fma`
//! target feature, so LLVM emits (and vectorizes) `vfmadd`: the same correctly rounded result,
//! bit for bit, many times faster.

/// `acc[c] = fma(w, float(row[c]), acc[c])` for every channel; `row` holds little-endian bf16
/// bits (2 bytes a channel).
pub fn fma_bf16_row(acc: &mut [f32], w: f32, row: &[u8]) {
    debug_assert_eq!(row.len(), 2 * acc.len());
    #[cfg(target_arch = "x86_64")]
    {
        if std::is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has FMA (checked just above), the only requirement of the
            // target feature; the function itself is safe code.
            unsafe { fma_bf16_row_fma(acc, w, row) };
            return;
        }
    }
    fma_bf16_row_generic(acc, w, row)
}

#[inline(always)]
fn fma_bf16_row_generic(acc: &mut [f32], w: f32, row: &[u8]) {
    for (a, c) in acc.iter_mut().zip(row.chunks_exact(2)) {
        let v = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
        *a = w.mul_add(v, *a);
    }
}

/// [`fma_bf16_row_generic`] compiled for FMA.
///
/// # Safety
/// The CPU running it has FMA (the caller checks `is_x86_feature_detected!`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn fma_bf16_row_fma(acc: &mut [f32], w: f32, row: &[u8]) {
    fma_bf16_row_generic(acc, w, row)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_scalar_fma_bit_for_bit() {
        let mut s = 0x9E37_79B9u32;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            s
        };
        for _ in 0..50 {
            let n = 1 + (next() % 300) as usize;
            let row: Vec<u8> = (0..2 * n).map(|_| next() as u8).collect();
            let w = f32::from_bits(next() & 0xBFFF_FFFF);
            let init: Vec<f32> = (0..n)
                .map(|_| f32::from_bits(next() & 0x7F7F_FFFF))
                .collect();
            let mut fast = init.clone();
            fma_bf16_row(&mut fast, w, &row);
            for c in 0..n {
                let v =
                    f32::from_bits((u16::from_le_bytes([row[2 * c], row[2 * c + 1]]) as u32) << 16);
                let want = w.mul_add(v, init[c]);
                assert!(
                    want.to_bits() == fast[c].to_bits() || (want.is_nan() && fast[c].is_nan()),
                    "channel {c}: {want} vs {}",
                    fast[c]
                );
            }
        }
    }
}
