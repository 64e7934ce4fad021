//! What a group allocates is what its plan says (`runtime::footprint`, the Python
//! Buffer's size hint), read with cuMemGetInfo around forming the groups; and groups that leave
//! buffers out (`GpuOptions::buffers`) still give the oracle's bytes through the device API,
//! while what needs a left-out buffer is refused.

use crate::common::*;
use crate::device::{context, device_case};
use cudarc::driver::result;
use ep_kernels::runtime::{footprint, hint_bytes};
use ep_kernels::testing::{random_inputs, random_y, Rng, Routing};
use ep_kernels::{Buffers, GpuError, GpuGroup, GpuOptions, Path};
use ep_reference::{Config, Mode};
use ep_test_runner::{gpu_test, GpuTest};

/// The tests of this module, in the order they run, and what each needs.
pub(crate) const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_memory_of_formed_groups_is_the_hint, gpus: 1),
    gpu_test!(gpu_groups_without_left_out_buffers_equal_oracle, gpus: 1),
];

fn lean(path: Path) -> Buffers {
    Buffers {
        path: Some(path),
        own_tensors: false,
    }
}

fn free_bytes() -> usize {
    result::mem_get_info().expect("cuMemGetInfo").0
}

/// Forms `sets` groups of `cfg` (R virtual ranks on GPU 0) with `buffers`, and compares the
/// device memory they took (cuMemGetInfo before and after) with R x the hint's bytes: within 1%.
/// A first group of the same config, dropped before the measure, loads the kernels: the process
/// keeps its modules, so the groups measured load none.
fn measure(cfg: &Config, buffers: Buffers, sets: usize) {
    let (_c, _s) = context(0); // binds GPU 0's primary context to this thread
    let opts = GpuOptions {
        buffers,
        ..test_opts()
    };
    drop(GpuGroup::new(cfg, opts).expect("warm-up group"));
    let before = free_bytes();
    let groups: Vec<GpuGroup> = (0..sets)
        .map(|_| GpuGroup::new(cfg, opts).unwrap_or_else(|e| panic!("{}: {e}", cfg.describe())))
        .collect();
    let _ = &groups;
    let after = free_bytes();
    let took = before.saturating_sub(after) as f64;
    let want = (hint_bytes(cfg, &opts, false, sets).unwrap() * cfg.num_ranks) as f64;
    let rel = (took - want).abs() / want;
    println!(
        "memory: {} {buffers:?}, {sets} set(s): cuMemGetInfo {:.1} MiB, hint x R {:.1} MiB ({:+.2}%)",
        cfg.describe(),
        took / (1 << 20) as f64,
        want / (1 << 20) as f64,
        100.0 * (took - want) / want
    );
    assert!(
        rel <= 0.01,
        "{}: the groups took {took} bytes, the hint says {want}",
        cfg.describe()
    );
}

fn gpu_memory_of_formed_groups_is_the_hint() {
    // The standard setting (FP8 dispatch), R = 8 and 64 virtual ranks.
    let c8 = Config::new(8, 256, 128, 7168, 8, Mode::FP8).unwrap();
    for sets in [1, 2] {
        measure(&c8, Buffers::default(), sets);
        measure(&c8, lean(Path::Batched), sets);
    }
    measure(&c8, lean(Path::PerExpert), 1);
    let c64 = Config::new(64, 256, 128, 7168, 8, Mode::FP8).unwrap();
    measure(&c64, lean(Path::Batched), 2);
    // A lean group's plan is smaller than the whole layout by exactly what it left out.
    let o = GpuOptions {
        buffers: lean(Path::Batched),
        ..GpuOptions::default()
    };
    assert!(
        footprint(&c8, &o, false).unwrap()
            < footprint(&c8, &GpuOptions::default(), false).unwrap() / 4
    );
}

fn gpu_groups_without_left_out_buffers_equal_oracle() {
    let (_c, s) = context(0);
    let streams = std::slice::from_ref(&s);
    let mut rng = Rng::new(31);
    for (r, e, t, h, k, mode) in [
        (8, 256, 128, 7168, 8, Mode::FP8),
        (4, 12, 33, 1024, 3, Mode::Bf16),
        (40, 80, 16, 512, 4, Mode::FP8_ROUND),
    ] {
        let cfg = Config::new(r, e, t, h, k, mode).unwrap();
        for path in [Path::Batched, Path::PerExpert] {
            let mut g = GpuGroup::new(
                &cfg,
                GpuOptions {
                    buffers: lean(path),
                    ..test_opts()
                },
            )
            .unwrap_or_else(|e| panic!("{}: {e}", cfg.describe()));
            for round in 0..3 {
                let tokens = round_tokens(r, t, round, &mut rng);
                let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, &mut rng);
                let y = random_y(&cfg, &mut rng);
                // The caller's outputs (guarded): never the group's own.
                device_case(&mut g, streams, path, &data, &y, false);
            }
            // The other path and the host harness's own tensors are refused before any launch.
            let other = if path == Path::Batched {
                Path::PerExpert
            } else {
                Path::Batched
            };
            let x: Vec<Vec<half::bf16>> = vec![Vec::new(); r];
            let tk: Vec<Vec<i64>> = vec![Vec::new(); r];
            assert!(matches!(
                g.dispatch(other, &x, &tk),
                Err(GpuError::Unsupported(_))
            ));
            assert!(matches!(
                g.dispatch(path, &x, &tk),
                Err(GpuError::Unsupported(_))
            ));
            assert!(matches!(
                g.read_dispatch_output(0),
                Err(GpuError::Unsupported(_))
            ));
            g.check()
                .expect("a refused call records nothing on the device");
            println!(
                "ok: {} lean {}-only group, 3 rounds",
                cfg.describe(),
                path.name()
            );
        }
    }
}
