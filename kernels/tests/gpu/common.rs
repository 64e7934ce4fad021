//! What every GPU test starts from: the modes, the options, a group, random configs.

use ep_kernels::testing::{random_inputs, random_y, verify_case, Rng, Routing};
use ep_kernels::{GpuGroup, GpuOptions, NcclSizes, Transport};
use ep_reference::{Config, Mode};
use ep_test_runner as runner;

pub(crate) const MODES: [Mode; 4] = [Mode::Bf16, Mode::FP8, Mode::FP8_ROUND, Mode::FP8_UE8M0];

/// The options every test starts from: the library's defaults, with the wait bound raised by
/// `EP_GPU_TEST_TIMEOUT_MS` where set (compute-sanitizer slows the kernels many times over; the
/// timeout tests set their own bound and are not affected).
pub(crate) fn test_opts() -> GpuOptions {
    let mut o = GpuOptions::default();
    match runner::env_num::<u64>("EP_GPU_TEST_TIMEOUT_MS") {
        Ok(Some(ms)) => o.timeout_ns = ms.saturating_mul(1_000_000),
        Ok(None) => {}
        Err(e) => panic!("{e} (milliseconds)"),
    }
    o
}

/// Shrink mode with a short wait bound (50 ms: a lost peer is masked quickly) and the owners' rows
/// put rather than read in place, as the shrink tests run it.
pub(crate) fn shrink_opts() -> GpuOptions {
    GpuOptions {
        enable_shrink: true,
        zero_copy_local: false,
        timeout_ns: 50_000_000,
        ..test_opts()
    }
}

pub(crate) fn group(cfg: &Config, gpus: usize) -> GpuGroup {
    group_with(cfg, gpus, true)
}

pub(crate) fn group_with(cfg: &Config, gpus: usize, zero_copy_local: bool) -> GpuGroup {
    GpuGroup::new(
        cfg,
        GpuOptions {
            num_gpus: gpus,
            zero_copy_local,
            ..test_opts()
        },
    )
    .unwrap_or_else(|e| panic!("{}: {e}", cfg.describe()))
}

/// Round `round`'s token counts of R ranks: every third rank (shifted by the round) sends none,
/// the others a random count in 0..=max, so each rank is empty in one round of three.
pub(crate) fn round_tokens(r: usize, max: usize, round: usize, rng: &mut Rng) -> Vec<usize> {
    (0..r)
        .map(|s| {
            if (s + round) % 3 == 2 {
                0
            } else {
                rng.below(max + 1)
            }
        })
        .collect()
}

/// Random configs at R ranks on `gpus` GPUs, every mode, with masked slots, empty ranks and
/// uneven token counts.
pub(crate) fn random_configs(r: usize, gpus: usize, seed: u64, zero_copy_local: bool) -> usize {
    let mut rng = Rng::new(seed);
    let mut checks = 0;
    for (i, mode) in MODES.iter().enumerate() {
        let l = [1, 2, 3, 5][i];
        let e = r * l;
        let k = (1 + rng.below(8)).min(e);
        let t = [1, 7, 16, 33][i];
        let h = if mode.is_fp8() {
            512 * (1 + rng.below(3)) + if *mode == Mode::FP8 { 128 } else { 0 }
        } else {
            [72, 256, 1001, 7168][i]
        };
        let cfg = Config::new(r, e, t, h, k, *mode).unwrap();
        let mut g = group_with(&cfg, gpus, zero_copy_local);
        for round in 0..3 {
            let tokens = round_tokens(r, t, round, &mut rng);
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.15 }, &mut rng);
            let y = random_y(&cfg, &mut rng);
            checks += verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}"));
        }
        println!(
            "ok: {} tokens per rank varied, 3 rounds, both paths, zero_copy_local={zero_copy_local}",
            cfg.describe()
        );
    }
    checks
}

pub(crate) fn nccl_opts(r: usize, sizes: NcclSizes) -> GpuOptions {
    GpuOptions {
        num_gpus: r,
        transport: Transport::Nccl,
        nccl_sizes: sizes,
        ..test_opts()
    }
}
