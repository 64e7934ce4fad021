//! The bytes one token row occupies on the wire, shared by every CPU path so that what is sent is
//! what the contract says: BF16 rows as little-endian bf16 bits; FP8 rows as H e4m3 bytes followed
//! by the row's scales (H/128 f32, or H/512 packed UE8M0 i32), little-endian.

use crate::config::{Config, Mode};
use crate::numerics::fp8;
use half::bf16;

/// Encodes token rows into payload bytes; holds the scratch the FP8 cast needs.
pub struct Encoder {
    cfg: Config,
    scale_inv: Vec<f32>,
    packed: Vec<i32>,
}

impl Encoder {
    pub fn new(cfg: &Config) -> Encoder {
        let groups = if cfg.mode.is_fp8() {
            cfg.hidden / fp8::GROUP
        } else {
            0
        };
        Encoder {
            cfg: *cfg,
            scale_inv: vec![0.0; groups],
            packed: vec![0; groups / 4],
        }
    }

    /// Writes the payload of `x_row` (H values) into `out` (`cfg.payload_bytes()` bytes).
    pub fn encode(&mut self, x_row: &[bf16], out: &mut [u8]) {
        let h = self.cfg.hidden;
        debug_assert_eq!(x_row.len(), h);
        debug_assert_eq!(out.len(), self.cfg.payload_bytes());
        match self.cfg.mode {
            Mode::Bf16 => out.copy_from_slice(bf16_bytes(x_row)),
            Mode::Fp8 { round_scale, ue8m0 } => {
                let (q, scales) = out.split_at_mut(h);
                fp8::quantize_row(x_row, round_scale, q, &mut self.scale_inv);
                if ue8m0 {
                    fp8::pack_ue8m0(&self.scale_inv, &mut self.packed);
                    for (o, w) in scales.chunks_exact_mut(4).zip(&self.packed) {
                        o.copy_from_slice(&w.to_le_bytes());
                    }
                } else {
                    for (o, s) in scales.chunks_exact_mut(4).zip(&self.scale_inv) {
                        o.copy_from_slice(&s.to_le_bytes());
                    }
                }
            }
        }
    }
}

/// The bytes of a bf16 slice as they lie in memory (the wire format of bf16 rows on this
/// little-endian backend).
pub fn bf16_bytes(v: &[bf16]) -> &[u8] {
    // SAFETY: bf16 is a 2-byte plain-old-data type with no padding; any byte pattern is a valid
    // u8, the length covers exactly the slice, and u8 has alignment 1.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

/// The bytes of a mutable bf16 slice (see [`bf16_bytes`]).
pub fn bf16_bytes_mut(v: &mut [bf16]) -> &mut [u8] {
    // SAFETY: as in `bf16_bytes`; every byte pattern is also a valid bf16, so writes through the
    // byte view cannot create an invalid value.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}
