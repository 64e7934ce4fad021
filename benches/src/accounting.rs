//! docs/contract.md's bandwidth accounting, as DeepEP and UCCL count it: bytes = selections x bytes
//! per message (dispatch: `H + H/128*4 + 16` in FP8, `2H` in BF16; combine: `2H`), divided by
//! the mean time of the call. The bytes actually written ("wire bytes") come from the paths'
//! own counters ([`ep_reference::CallStats`]) and are reported beside it.

use ep_reference::Config;

/// Selections (valid `topk_idx` slots) of one rank.
pub fn selections(topk_idx: &[i64]) -> u64 {
    topk_idx.iter().filter(|&&e| e >= 0).count() as u64
}

/// Logical dispatch bytes of a rank with `selections` selections.
pub fn dispatch_logical_bytes(cfg: &Config, selections: u64) -> u64 {
    selections * cfg.logical_dispatch_message_bytes() as u64
}

/// Logical combine bytes of a rank with `selections` selections.
pub fn combine_logical_bytes(cfg: &Config, selections: u64) -> u64 {
    selections * cfg.logical_combine_message_bytes() as u64
}

/// Bandwidth in GB/s (1 GB = 1e9 bytes, as DeepEP prints it) of `bytes` moved in `us`
/// microseconds. 0 for a zero or negative time.
pub fn gb_per_s(bytes: u64, us: f64) -> f64 {
    if us > 0.0 {
        bytes as f64 / (us * 1e-6) / 1e9
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ep_reference::Mode;

    #[test]
    fn standard_setting_message_bytes() {
        let fp8 = Config::new(8, 256, 128, 7168, 8, Mode::FP8).unwrap();
        // 7168 e4m3 bytes + 56 f32 scales + 16 bytes of metadata.
        assert_eq!(dispatch_logical_bytes(&fp8, 1), 7168 + 224 + 16);
        assert_eq!(dispatch_logical_bytes(&fp8, 10), 74_080);
        assert_eq!(combine_logical_bytes(&fp8, 10), 143_360);
        let bf = Config::new(8, 256, 128, 7168, 8, Mode::Bf16).unwrap();
        assert_eq!(dispatch_logical_bytes(&bf, 3), 3 * 14_336);
        // UE8M0 packs scales on the wire, but DeepEP's accounting still counts H/128 f32 scales.
        let ue = Config::new(8, 256, 128, 7168, 8, Mode::FP8_UE8M0).unwrap();
        assert_eq!(dispatch_logical_bytes(&ue, 1), 7408);
    }

    #[test]
    fn selections_skip_masked_slots() {
        assert_eq!(selections(&[0, -1, 5, 7, -1, -1]), 3);
        assert_eq!(selections(&[]), 0);
        assert_eq!(selections(&[-1, -1]), 0);
    }

    #[test]
    fn bandwidth_units() {
        // 1e9 bytes in one second is 1 GB/s; 7408 bytes in 1 us is 7.408 GB/s.
        assert!((gb_per_s(1_000_000_000, 1e6) - 1.0).abs() < 1e-12);
        assert!((gb_per_s(7408, 1.0) - 7.408).abs() < 1e-12);
        assert_eq!(gb_per_s(100, 0.0), 0.0);
    }
}
