//! Past 32 ranks: the wide build of the kernels (peer sets of 8 words, per-slot batch
//! positions, a 256-entry IoTable, two blocks per SM past the SM count), virtual ranks on one GPU,
//! bit for bit against the oracle: R = 64, 128, 256, both paths, every mode, through the host
//! harness and the device API; the standard H and K at R = 64; shrink mode with peers past 32.

use crate::common::*;
use crate::device::*;
use ep_kernels::runtime::Variant;
use ep_kernels::testing::{random_inputs, random_y, verify_case, verify_masked, Rng, Routing};
use ep_kernels::{GpuGroup, Path};
use ep_reference::{Config, Mode};
use ep_test_runner::{gpu_test, GpuTest};

/// The tests of this module, in the order they run, and what each needs.
pub(crate) const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_virtual_r64_r128_r256_both_paths_all_modes_equal_oracle, gpus: 1),
    gpu_test!(gpu_virtual_r64_standard_h_k_equal_oracle, gpus: 1),
    gpu_test!(gpu_device_api_r64_r256_all_modes_equal_oracle, gpus: 1),
    gpu_test!(gpu_shrink_r64_masks_peers_past_the_first_word, gpus: 1),
];

/// Small shapes at R ranks: every mode, L = 1 or 2, T <= 8, H small, K up to 8; three rounds of
/// varied token counts (empty ranks included) on one group, both paths.
fn wide_configs(r: usize, seed: u64, zero_copy_local: bool) -> usize {
    let mut rng = Rng::new(seed);
    let mut checks = 0;
    for (i, mode) in MODES.iter().enumerate() {
        let l = [1, 2, 1, 2][i];
        let e = r * l;
        let k = 1 + rng.below(8);
        let t = [1, 8, 5, 8][i];
        let h = match i {
            0 => 72,
            1 => 256,
            2 => 128,
            _ => 512,
        };
        let cfg = Config::new(r, e, t, h, k, *mode).unwrap();
        let mut g = group_with(&cfg, 1, zero_copy_local);
        for round in 0..3 {
            let tokens: Vec<usize> = (0..r)
                .map(|s| {
                    if (s + round) % 5 == 4 {
                        0
                    } else {
                        rng.below(t + 1)
                    }
                })
                .collect();
            let masked = [0.0, 0.15, 0.6][round];
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            checks += verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}"));
        }
        println!(
            "ok: {} (build {:?}), 3 rounds, both paths, zero_copy_local={zero_copy_local}",
            cfg.describe(),
            Variant::for_group(r, r, 132, true)
        );
    }
    checks
}

fn gpu_virtual_r64_r128_r256_both_paths_all_modes_equal_oracle() {
    for (r, seed) in [(64, 64), (128, 128), (256, 256)] {
        assert_eq!(wide_configs(r, seed, true), 4 * 3 * 4);
    }
    // Without zero-copy: every combine row goes through a put and a signal.
    assert_eq!(wide_configs(64, 65, false), 4 * 3 * 4);
    // Skewed: every token of every rank to one expert, and each token to K different ranks.
    let mut rng = Rng::new(7);
    for r in [64, 256] {
        let cfg = Config::new(r, 2 * r, 8, 256, 8, Mode::FP8).unwrap();
        let mut g = group(&cfg, 1);
        for routing in [Routing::AllToOne, Routing::EveryRank] {
            let data = random_inputs(&cfg, &vec![8; r], routing, &mut rng);
            let y = random_y(&cfg, &mut rng);
            assert_eq!(
                verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}")),
                4
            );
        }
        println!("ok: R = {r}, all to one expert, each token to K ranks");
    }
}

/// The standard H and K (7168, 8) at R = 64 virtual ranks (E = 128, T = 16, FP8 and BF16).
fn gpu_virtual_r64_standard_h_k_equal_oracle() {
    let mut rng = Rng::new(6464);
    for mode in [Mode::FP8, Mode::Bf16] {
        let cfg = Config::new(64, 128, 16, 7168, 8, mode).unwrap();
        let mut g = group(&cfg, 1);
        let data = random_inputs(&cfg, &[16; 64], Routing::Random { masked: 0.05 }, &mut rng);
        let y = random_y(&cfg, &mut rng);
        assert_eq!(
            verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}")),
            4
        );
        println!("ok: {}", cfg.describe());
    }
}

/// The device API (caller tensors: every IoTable entry of the 256-entry table) at R = 64 and
/// R = 256, both paths, every mode.
fn gpu_device_api_r64_r256_all_modes_equal_oracle() {
    let (_c, s) = context(0);
    for (r, seed) in [(64u64, 640u64), (256, 2560)] {
        let r = r as usize;
        let mut rng = Rng::new(seed);
        for (i, mode) in MODES.iter().enumerate() {
            let l = 1 + i % 2;
            let t = 4 + i;
            let h = if mode.is_fp8() { 512 } else { 200 };
            let k = 1 + rng.below(8);
            let cfg = Config::new(r, r * l, t, h, k, *mode).unwrap();
            let mut g = group(&cfg, 1);
            for round in 0..2 {
                let tokens: Vec<usize> = (0..r)
                    .map(|q| {
                        if (q + round) % 7 == 6 {
                            0
                        } else {
                            rng.below(t + 1)
                        }
                    })
                    .collect();
                let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, &mut rng);
                let y = random_y(&cfg, &mut rng);
                for path in [Path::PerExpert, Path::Batched] {
                    device_case(
                        &mut g,
                        std::slice::from_ref(&s),
                        path,
                        &data,
                        &y,
                        round == 1,
                    );
                }
            }
            println!("ok: device API {}, 2 rounds, both paths", cfg.describe());
        }
    }
}

/// Shrink mode at R = 64: peers past the first mask word (33, 40, 63) masked by hand, then one
/// that stops signalling (rank 45) is masked by its peers, survivors equal the oracle on the
/// masked routing; clean brings everyone back. Both paths, BF16 and FP8.
fn gpu_shrink_r64_masks_peers_past_the_first_word() {
    let r = 64;
    let mut rng = Rng::new(4545);
    for mode in [Mode::Bf16, Mode::FP8] {
        for path in [Path::Batched, Path::PerExpert] {
            let cfg = Config::new(r, 2 * r, 4, 256, 4, mode).unwrap();
            let mut g = GpuGroup::new(&cfg, shrink_opts()).unwrap();
            let what = format!("{} {}", mode.name(), path.name());
            let call = |g: &mut GpuGroup, masked: &[bool], rng: &mut Rng| {
                let tokens: Vec<usize> = (0..r).map(|_| rng.below(5)).collect();
                let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, rng);
                let y = random_y(&cfg, rng);
                verify_masked(g, path, &data, &y, masked).unwrap_or_else(|e| panic!("{what}: {e}"))
            };
            let none = vec![false; r];
            assert_eq!(call(&mut g, &none, &mut rng), r);
            // By hand: 33, 40 and 63 on every rank.
            let mut by_hand = none.clone();
            for p in [33, 40, 63] {
                g.update_mask(None, p, true).unwrap();
                by_hand[p] = true;
            }
            assert_eq!(call(&mut g, &by_hand, &mut rng), r - 3);
            // Lost: rank 45 stops signalling; its peers mask it in the call that loses it.
            g.set_fault_rank(Some(45));
            let mut lost = by_hand.clone();
            lost[45] = true;
            assert_eq!(call(&mut g, &lost, &mut rng), r - 4);
            assert_eq!(call(&mut g, &lost, &mut rng), r - 4);
            g.poll().unwrap();
            for q in [0, 32, 44, 46, 62] {
                assert_eq!(g.mask_status(q).unwrap(), lost, "{what}: rank {q}'s mask");
            }
            g.clean_mask(None).unwrap();
            g.set_fault_rank(None);
            assert_eq!(call(&mut g, &none, &mut rng), r);
            println!("ok: shrink R = 64, {what}: masked 33, 40, 63 by hand, lost 45, cleaned");
        }
    }
}
