//! One device call does everything: probe, then at the standard decode setting (T=128, H=7168,
//! K=8, E=256, FP8 dispatch / BF16 combine, random routing with 5% -1 slots) for EP1 and virtual
//! EP2/EP8 on one GPU (and EP2/EP8 over two GPUs when there are two): verify both paths bit for
//! bit against the oracle, then time them with CUDA events and print latency, DeepEP-format
//! bandwidth, wire bytes and the byte floor.
//!
//! Usage: ep-gpu-check [--iters N] [--warmup N] [--ranks 1,2,8] [--experts 256]

use ep_kernels::bench::{self, GpuTimings};
use ep_kernels::testing::{random_inputs, Rng, Routing};
use ep_reference::{Config, Mode};

const HBM: f64 = 3.93e12;
const NVLINK: f64 = 367e9;

fn pct(v: &[f64], p: f64) -> f64 {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let i = ((p * s.len() as f64).ceil() as usize).clamp(1, s.len()) - 1;
    s[i]
}
fn mean(v: &[f64]) -> f64 {
    v.iter().sum::<f64>() / v.len() as f64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let get = |name: &str, d: &str| -> String {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1).cloned())
            .unwrap_or_else(|| d.to_string())
    };
    let iters: usize = get("--iters", "300").parse().expect("--iters");
    let warmup: usize = get("--warmup", "20").parse().expect("--warmup");
    let experts: usize = get("--experts", "256").parse().expect("--experts");
    let ranks: Vec<usize> = get("--ranks", "1,2,8")
        .split(',')
        .map(|s| s.parse().expect("--ranks"))
        .collect();
    if args.iter().any(|a| a == "--accounting") {
        // The wire accounting of the standard inputs (same seeds as below); needs no GPU.
        for (r, g) in [(1, 1), (2, 1), (8, 1), (2, 2), (8, 2)] {
            let cfg = Config::new(r, experts, 128, 7168, 8, Mode::FP8).unwrap();
            let mut rng = Rng::new(2024 + r as u64);
            let data = random_inputs(
                &cfg,
                &vec![128; r],
                Routing::Random { masked: 0.05 },
                &mut rng,
            );
            let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
            let sel: usize = idx
                .iter()
                .map(|t| t.iter().filter(|&&v| v >= 0).count())
                .sum();
            for path in [ep_kernels::Path::PerExpert, ep_kernels::Path::Batched] {
                let (dw, cw, dm, cm, sig) = bench::accounting(&cfg, &idx, path, g);
                println!(
                    "EP{r} on {g} GPU(s) {:<10} selections {sel}: dispatch {:.3} MB in {dm} messages, combine {:.3} MB in {cm} puts, {sig} signals",
                    path.name(),
                    dw as f64 / 1e6,
                    cw as f64 / 1e6
                );
            }
        }
        return;
    }
    let device = match bench::probe() {
        Ok(d) => d,
        Err(why) => {
            println!("SKIPPED: ep-gpu-check: {why}");
            return;
        }
    };
    let gpus = ep_kernels::runtime::probe_devices(1).unwrap_or(1);
    println!("device: {device}");
    let mut runs: Vec<(usize, usize)> = ranks.iter().map(|&r| (r, 1)).collect();
    if gpus >= 2 {
        runs.push((2, 2));
        runs.push((8, 2));
    }
    let mut table = Vec::new();
    let mut failed = false;
    for (r, g, graph) in runs.iter().flat_map(|&(r, g)| {
        let modes = if g == 1 {
            vec![false, true]
        } else {
            vec![false]
        };
        modes.into_iter().map(move |m| (r, g, m))
    }) {
        let timing = if graph { "graph" } else { "stream" };
        let cfg = Config::new(r, experts, 128, 7168, 8, Mode::FP8).unwrap();
        let mut rng = Rng::new(2024 + r as u64);
        let data = random_inputs(
            &cfg,
            &vec![128; r],
            Routing::Random { masked: 0.05 },
            &mut rng,
        );
        let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
        let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
        let w: Vec<_> = data.iter().map(|d| d.topk_weights.clone()).collect();
        let t0 = std::time::Instant::now();
        let rep = match bench::run_timed(&cfg, &x, &idx, &w, iters, warmup, g, graph) {
            Ok(rep) => rep,
            Err(e) => {
                println!("FAIL: EP{r} on {g} GPU(s): {e}");
                failed = true;
                continue;
            }
        };
        println!(
            "EP{r} on {g} GPU(s), {timing} timing [{}]: both paths verified bit-exact against the oracle ({:.1} s)",
            rep.device,
            t0.elapsed().as_secs_f64()
        );
        let sel: u64 = idx
            .iter()
            .map(|t| t.iter().filter(|&&v| v >= 0).count() as u64)
            .sum();
        let h = cfg.hidden as f64;
        let disp_msg = cfg.logical_dispatch_message_bytes() as f64;
        let comb_msg = cfg.logical_combine_message_bytes() as f64;
        // Byte floors: HBM traffic per GPU (read x, write each received row; read each y row,
        // write out), and for 2 GPUs the NVLink bytes that must cross.
        let tokens = (128 * r) as f64;
        let per_gpu = |b: f64| b / g as f64;
        let disp_hbm = per_gpu(tokens * 2.0 * h + sel as f64 * (h + h / 128.0 * 4.0)) / HBM;
        let comb_hbm = per_gpu(sel as f64 * 2.0 * h + tokens * 2.0 * h) / HBM;
        let (mut cross_tok, mut cross_sel) = (0f64, 0f64);
        if g > 1 {
            let l = cfg.num_local_experts();
            let per = r / g;
            for (s, t) in idx.iter().enumerate() {
                for row in t.chunks_exact(cfg.top_k) {
                    let mut gm = 0u32;
                    for &e in row.iter().filter(|&&e| e >= 0) {
                        let gd = (e as usize / l) / per;
                        if gd != s / per {
                            cross_sel += 1.0;
                            gm |= 1 << gd;
                        }
                    }
                    cross_tok += gm.count_ones() as f64;
                }
            }
        }
        let disp_floor =
            disp_hbm.max(per_gpu(cross_tok * cfg.payload_bytes() as f64) / NVLINK) * 1e6;
        let comb_floor = comb_hbm.max(per_gpu(cross_sel * 2.0 * h) / NVLINK) * 1e6;
        for t in &rep.paths {
            print_path(r, g, t, sel, disp_msg, comb_msg, disp_floor, comb_floor);
            table.push((
                r,
                g,
                timing,
                t.clone(),
                sel,
                disp_floor,
                comb_floor,
                disp_msg,
                comb_msg,
            ));
        }
        if let [pe, b] = &rep.paths[..] {
            println!(
                "  EP{r}/{g}GPU batched vs per-expert: dispatch {:.2}x faster, combine {:.2}x faster (medians)",
                pct(&pe.dispatch_us, 0.5) / pct(&b.dispatch_us, 0.5),
                pct(&pe.combine_us, 0.5) / pct(&b.combine_us, 0.5)
            );
        }
    }
    if !args.iter().any(|a| a == "--no-profile") {
        for &r in &ranks {
            if let Err(e) = profile(r, experts) {
                println!("profile EP{r}: {e}");
            }
        }
    }
    println!("\nsummary (us; bandwidth DeepEP-format GB/s = selections x message bytes / mean time; floor = byte floor)");
    println!("| EP | GPUs | timing | path | dispatch p50 | p99 | GB/s | floor | combine p50 | p99 | GB/s | floor | dispatch wire MB | combine wire MB | signals |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for (r, g, timing, t, sel, df, cf, dm, cm) in &table {
        println!(
            "| {r} | {g} | {timing} | {} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} | {:.0} | {:.2} | {:.2} | {:.2} | {} |",
            t.path,
            pct(&t.dispatch_us, 0.5),
            pct(&t.dispatch_us, 0.99),
            *sel as f64 * dm / mean(&t.dispatch_us) / 1e3,
            df,
            pct(&t.combine_us, 0.5),
            pct(&t.combine_us, 0.99),
            *sel as f64 * cm / mean(&t.combine_us) / 1e3,
            cf,
            t.dispatch_wire_bytes as f64 / 1e6,
            t.combine_wire_bytes as f64 / 1e6,
            t.signals
        );
    }
    if failed {
        std::process::exit(1);
    }
}

#[allow(clippy::too_many_arguments)]
fn print_path(r: usize, g: usize, t: &GpuTimings, sel: u64, dm: f64, cm: f64, df: f64, cf: f64) {
    println!(
        "  EP{r}/{g}GPU {:<10} dispatch p50 {:>7.2} us p99 {:>7.2} mean {:>7.2} ({:>5.0} GB/s, floor {:.2} us) | combine p50 {:>7.2} us p99 {:>7.2} mean {:>7.2} ({:>5.0} GB/s, floor {:.2} us) | wire {:.2}/{:.2} MB, msgs {}/{}, signals {} | {} samples",
        t.path,
        pct(&t.dispatch_us, 0.5),
        pct(&t.dispatch_us, 0.99),
        mean(&t.dispatch_us),
        sel as f64 * dm / mean(&t.dispatch_us) / 1e3,
        df,
        pct(&t.combine_us, 0.5),
        pct(&t.combine_us, 0.99),
        mean(&t.combine_us),
        sel as f64 * cm / mean(&t.combine_us) / 1e3,
        cf,
        t.dispatch_wire_bytes as f64 / 1e6,
        t.combine_wire_bytes as f64 / 1e6,
        t.dispatch_messages,
        t.combine_messages,
        t.signals,
        t.dispatch_us.len()
    );
}

/// Phase breakdown of one call of each kernel from `%globaltimer` stamps (phase i: median and
/// max over blocks of stamp_i - earliest stamp_0, in us), and the empty kernel's launch time.
fn profile(r: usize, experts: usize) -> Result<(), ep_kernels::GpuError> {
    use ep_kernels::{GpuGroup, GpuOptions, Path};
    use ep_reference::Op;
    let cfg = Config::new(r, experts, 128, 7168, 8, Mode::FP8).unwrap();
    let mut rng = Rng::new(2024 + r as u64);
    let data = random_inputs(
        &cfg,
        &vec![128; r],
        Routing::Random { masked: 0.05 },
        &mut rng,
    );
    let x: Vec<_> = data.iter().map(|d| d.x.clone()).collect();
    let idx: Vec<_> = data.iter().map(|d| d.topk_idx.clone()).collect();
    let mut g = GpuGroup::new(&cfg, GpuOptions::default())?;
    let empty = bench::time_empty(&mut g, 200)?;
    println!(
        "profile EP{r}: empty kernel ({} blocks x 512), stream launches: p50 {:.2} us",
        g.blocks_per_rank() * r,
        pct(&empty, 0.5)
    );
    let w: Vec<_> = data.iter().map(|d| d.topk_weights.clone()).collect();
    let y = ep_kernels::testing::random_y(&cfg, &mut rng);
    g.upload_dispatch_inputs(&x, &idx)?;
    g.upload_combine_inputs(&y, &w)?;
    for path in [Path::PerExpert, Path::Batched] {
        for op in [Op::Dispatch, Op::Combine] {
            let mut stamps = Vec::new();
            for _ in 0..3 {
                if op == Op::Combine {
                    g.launch(Op::Dispatch, path)?;
                }
                stamps = g.profile(op, path)?;
            }
            let t0 = stamps
                .iter()
                .map(|s| s[0])
                .filter(|&v| v > 0)
                .min()
                .unwrap_or(0);
            let mut line = format!("profile EP{r} {:<10} {:?}:", path.name(), op);
            for ph in 0..6 {
                let v: Vec<f64> = stamps
                    .iter()
                    .filter(|s| s[ph] > 0)
                    .map(|s| (s[ph] - t0) as f64 / 1e3)
                    .collect();
                if !v.is_empty() {
                    line += &format!(" p{ph} {:.1}/{:.1}", pct(&v, 0.5), pct(&v, 1.0));
                }
            }
            println!("{line}  (us since first block start: median/max over blocks)");
        }
    }
    Ok(())
}
