//! The LogFMT-10 combine (docs/contract.md 4.1) on the GPU: both paths bit-identical to
//! `oracle::combine_with(.., CombineFormat::LogFmt)`, the fused call and the receive-hook halves,
//! one GPU (R = 1 and virtual R = 2/4/8, rows read in place or put) and two; expert outputs
//! scaled so that most groups pack and some travel raw, with special values; LogFMT and bf16
//! calls alternating on one group; the refusals (H % 128, NCCL) as typed errors.

use crate::common::*;
use crate::device::*;
use cudarc::driver::CudaStream;
use ep_kernels::testing::{logfmt_packable, random_inputs, random_y, verify_case, Rng, Routing};
use ep_kernels::{GpuError, GpuGroup, NcclSizes, Path};
use ep_reference::numerics::logfmt::Meta;
use ep_reference::{CombineFormat, Config, Error, Mode};
use ep_test_runner::{gpu_test, GpuTest};
use half::bf16;
use std::sync::Arc;

/// The tests of this module, in the order they run, and what each needs.
pub(crate) const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_logfmt_r1_both_paths_equal_oracle, gpus: 1),
    gpu_test!(gpu_logfmt_virtual_r2_r4_r8_both_paths_equal_oracle, gpus: 1),
    gpu_test!(gpu_logfmt_device_api_whole_and_halves_equal_oracle, gpus: 1),
    gpu_test!(gpu_logfmt_alternates_with_bf16_on_one_group, gpus: 1),
    gpu_test!(gpu_logfmt_standard_setting_r1_r4_equal_oracle, gpus: 1),
    gpu_test!(gpu_logfmt_two_gpus_r2_r4_equal_oracle, gpus: 2),
    gpu_test!(gpu_logfmt_refused_where_h_is_not_a_multiple_of_128, gpus: 1),
    gpu_test!(gpu_logfmt_refused_over_nccl, gpus: 1, nccl),
];

/// Expert outputs for a LogFMT combine: random values, most groups scaled to pack
/// (`logfmt_packable`), then special values in a few of the first rows of each expert (the
/// rows a dispatch fills first): -0, subnormals and values far below the grid inside packed
/// groups, an all-equal group and an all-zero group (raw), a NaN and an infinity (their groups
/// raw), the largest magnitude that packs. Counts the groups that pack and that travel raw
/// among each rank's first 8192 groups.
fn logfmt_y(cfg: &Config, rng: &mut Rng) -> (Vec<Vec<bf16>>, usize, usize) {
    let (h, rt, l) = (cfg.hidden, cfg.rows_per_expert(), cfg.num_local_experts());
    let mut ys = random_y(cfg, rng);
    logfmt_packable(&mut ys, h);
    for y in ys.iter_mut() {
        for _ in 0..6 {
            let row = rng.below(l) * rt + rng.below(rt.min(3));
            let r = &mut y[row * h..(row + 1) * h];
            let g = rng.below(h / 128);
            let grp = &mut r[g * 128..(g + 1) * 128];
            match rng.below(6) {
                0 => {
                    grp[rng.below(128)] = bf16::from_bits(0x8000);
                    grp[rng.below(128)] = bf16::from_bits(0x0001);
                    grp[rng.below(128)] = bf16::from_bits(0x8040);
                    grp[rng.below(128)] = bf16::from_f32(1e-30);
                }
                1 => grp.fill(bf16::from_f32(-0.25)),
                2 => grp.fill(bf16::ZERO),
                3 => grp[rng.below(128)] = bf16::from_bits(0x7FC1),
                4 => grp[rng.below(128)] = bf16::NEG_INFINITY,
                _ => {
                    // The largest magnitude that packs, and its neighbour that does not.
                    grp[0] = bf16::from_bits(0x3F7F);
                    if rng.below(2) == 0 {
                        grp[1] = bf16::from_bits(0xBF80);
                    }
                }
            }
        }
    }
    let (mut packed, mut raw) = (0, 0);
    for g in ys.iter().flat_map(|y| y.chunks_exact(128).take(8192)) {
        if Meta::of(g.iter().map(|v| v.to_bits())).is_packed() {
            packed += 1;
        } else {
            raw += 1;
        }
    }
    (ys, packed, raw)
}

/// H values LogFMT takes in `mode` (multiples of 128; of 512 with UE8M0).
fn logfmt_hidden(mode: Mode, i: usize) -> usize {
    match mode {
        Mode::Bf16 => [128, 384, 7168][i % 3],
        _ if mode == Mode::FP8_UE8M0 => [512, 1536][i % 2],
        _ => [128, 640, 1024][i % 3],
    }
}

/// Random LogFMT configs at R ranks on `gpus` GPUs, every mode, 3 rounds each on one group
/// (uneven and empty ranks, masked slots), both paths through the host harness. The inputs
/// cover packed and raw groups over the configs together (a small config may draw only one
/// kind: one token of 384 channels is 3 groups).
fn logfmt_configs(r: usize, gpus: usize, seed: u64, zero_copy_local: bool) -> usize {
    let mut rng = Rng::new(seed);
    let mut checks = 0;
    let (mut packed_all, mut raw_all) = (0, 0);
    for (i, mode) in MODES.iter().enumerate() {
        let l = [1, 2, 3, 5][i];
        let e = r * l;
        let k = (1 + rng.below(8)).min(e);
        let t = [1, 7, 16, 33][i];
        let h = logfmt_hidden(*mode, i + r);
        let cfg = Config::new(r, e, t, h, k, *mode).unwrap();
        let mut g = group_with(&cfg, gpus, zero_copy_local);
        g.set_combine_format(CombineFormat::LogFmt)
            .unwrap_or_else(|e| panic!("{}: {e}", cfg.describe()));
        let (mut packed, mut raw) = (0, 0);
        for round in 0..3 {
            let tokens = round_tokens(r, t, round, &mut rng);
            let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.15 }, &mut rng);
            let (y, p, w) = logfmt_y(&cfg, &mut rng);
            packed += p;
            raw += w;
            checks += verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}"));
        }
        packed_all += packed;
        raw_all += raw;
        println!(
            "ok: LogFMT {} 3 rounds, both paths, zero_copy_local={zero_copy_local} \
             ({packed} groups packed, {raw} raw)",
            cfg.describe()
        );
    }
    assert!(
        packed_all > raw_all && raw_all > 0,
        "R = {r}: {packed_all} packed groups, {raw_all} raw: the inputs do not cover both"
    );
    checks
}

fn gpu_logfmt_r1_both_paths_equal_oracle() {
    for zc in [true, false] {
        assert_eq!(logfmt_configs(1, 1, 321, zc), 4 * 3 * 4);
    }
}

fn gpu_logfmt_virtual_r2_r4_r8_both_paths_equal_oracle() {
    for (r, seed) in [(2, 322), (4, 324), (8, 328)] {
        for zc in [true, false] {
            assert_eq!(logfmt_configs(r, 1, seed, zc), 4 * 3 * 4);
        }
    }
}

fn gpu_logfmt_two_gpus_r2_r4_equal_oracle() {
    assert_eq!(logfmt_configs(2, 2, 422, true), 4 * 3 * 4);
    assert_eq!(logfmt_configs(4, 2, 444, true), 4 * 3 * 4);
}

fn gpu_logfmt_standard_setting_r1_r4_equal_oracle() {
    let mut rng = Rng::new(7168);
    for r in [1, 4] {
        let cfg = Config::new(r, 256, 128, 7168, 8, Mode::FP8).unwrap();
        let mut g = group(&cfg, 1);
        g.set_combine_format(CombineFormat::LogFmt).unwrap();
        let data = random_inputs(
            &cfg,
            &vec![128; r],
            Routing::Random { masked: 0.05 },
            &mut rng,
        );
        let (y, _, _) = logfmt_y(&cfg, &mut rng);
        assert_eq!(
            verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}")),
            4
        );
        println!("ok: LogFMT standard setting {}", cfg.describe());
    }
}

/// [`device_case_with`] on stream `s`: the dispatch into the group's buffers, the combine in
/// `format`, whole or as its halves.
fn device_combine(
    g: &mut GpuGroup,
    s: &Arc<CudaStream>,
    path: Path,
    data: &[ep_kernels::testing::RankData],
    y: &[Vec<bf16>],
    format: CombineFormat,
    halves: bool,
) -> Result<(), GpuError> {
    let case = Case {
        owned: true,
        format,
        halves,
    };
    device_case_with(g, std::slice::from_ref(s), path, data, y, case)
}

fn gpu_logfmt_device_api_whole_and_halves_equal_oracle() {
    let (_ctx, s) = context(0);
    let mut rng = Rng::new(55);
    for r in [1, 2, 4, 8] {
        for (mode, h) in [(Mode::Bf16, 256), (Mode::FP8, 1024)] {
            let cfg = Config::new(r, 2 * r, 9, h, 3.min(2 * r), mode).unwrap();
            for zc in [true, false] {
                let mut g = group_with(&cfg, 1, zc);
                for round in 0..2 {
                    let tokens: Vec<usize> = (0..r).map(|q| (q + round) % 10).collect();
                    let data =
                        random_inputs(&cfg, &tokens, Routing::Random { masked: 0.1 }, &mut rng);
                    let (y, _, _) = logfmt_y(&cfg, &mut rng);
                    for path in Path::ALL {
                        for halves in [false, true] {
                            device_combine(
                                &mut g,
                                &s,
                                path,
                                &data,
                                &y,
                                CombineFormat::LogFmt,
                                halves,
                            )
                            .unwrap();
                        }
                    }
                }
            }
            println!(
                "ok: LogFMT device API {}, whole and halves, both paths",
                cfg.describe()
            );
        }
    }
}

/// LogFMT and bf16 combines interleaved on one group (the receive slots, signals and
/// acknowledgements shared between them; zero_copy on: bf16 reads in place, LogFMT puts).
fn gpu_logfmt_alternates_with_bf16_on_one_group() {
    let (_ctx, s) = context(0);
    let mut rng = Rng::new(77);
    let cfg = Config::new(4, 8, 16, 512, 4, Mode::FP8_UE8M0).unwrap();
    let mut g = group(&cfg, 1);
    let mut checks = 0;
    for call in 0..40 {
        let tokens: Vec<usize> = (0..4).map(|_| rng.below(17)).collect();
        let data = random_inputs(&cfg, &tokens, Routing::Random { masked: 0.2 }, &mut rng);
        let (y, _, _) = logfmt_y(&cfg, &mut rng);
        let format = [CombineFormat::LogFmt, CombineFormat::Bf16][(call / 3) % 2];
        if call % 2 == 0 {
            g.set_combine_format(format).unwrap();
            checks += verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("call {call}: {e}"));
        } else {
            let path = Path::ALL[call / 2 % 2];
            device_combine(&mut g, &s, path, &data, &y, format, call % 4 == 1).unwrap();
            checks += 1;
        }
    }
    assert_eq!(checks, 20 * 4 + 20);
}

fn gpu_logfmt_refused_where_h_is_not_a_multiple_of_128() {
    let cfg = Config::new(2, 4, 4, 200, 2, Mode::Bf16).unwrap();
    let mut g = group(&cfg, 1);
    let is_hidden = |e: &GpuError| {
        matches!(
            e,
            GpuError::Contract(Error::HiddenNotMultiple {
                hidden: 200,
                multiple: 128,
                mode: "logfmt"
            })
        )
    };
    let e = g.set_combine_format(CombineFormat::LogFmt).unwrap_err();
    assert!(is_hidden(&e), "{e:?}");
    assert_eq!(g.combine_format(), CombineFormat::Bf16, "nothing changed");
    // The device API refuses it before anything is enqueued; the group stays usable.
    let (_ctx, s) = context(0);
    let mut rng = Rng::new(3);
    let data = random_inputs(&cfg, &[4, 3], Routing::Random { masked: 0.0 }, &mut rng);
    let y = random_y(&cfg, &mut rng);
    for halves in [false, true] {
        let e = device_combine(
            &mut g,
            &s,
            Path::Batched,
            &data,
            &y,
            CombineFormat::LogFmt,
            halves,
        )
        .unwrap_err();
        assert!(is_hidden(&e), "halves {halves}: {e:?}");
    }
    g.check().unwrap();
    device_combine(
        &mut g,
        &s,
        Path::Batched,
        &data,
        &y,
        CombineFormat::Bf16,
        false,
    )
    .unwrap();
    println!("ok: LogFMT refused with H = 200 (HiddenNotMultiple), bf16 runs after");
}

fn gpu_logfmt_refused_over_nccl() {
    let cfg = Config::new(1, 4, 8, 256, 2, Mode::Bf16).unwrap();
    let mut g = GpuGroup::new(&cfg, nccl_opts(1, NcclSizes::Exact)).unwrap();
    let e = g.set_combine_format(CombineFormat::LogFmt).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, GpuError::Unsupported(_)), "{e:?}");
    assert!(m.contains("LogFMT") && m.contains("NCCL"), "{m}");
    assert_eq!(g.combine_format(), CombineFormat::Bf16);
    // A bf16 combine over NCCL still runs.
    let mut rng = Rng::new(4);
    let data = random_inputs(&cfg, &[8], Routing::Random { masked: 0.0 }, &mut rng);
    let y = random_y(&cfg, &mut rng);
    assert_eq!(
        verify_case(&mut g, &data, &y).unwrap_or_else(|e| panic!("{e}")),
        4
    );
    println!("ok: LogFMT over NCCL refused: {m}");
}
