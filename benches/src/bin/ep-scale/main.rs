//! `ep-scale`: how one rank's memory and a group's set-up time grow with the number of ranks,
//! at the standard setting unless told otherwise.
//!
//! - `ep-scale sizes` (no GPU needed): per R = 8..256 and L local experts (E = R * L), the bytes
//!   one rank allocates (ep-kernels' layout: the size hint of the Python Buffer; CUDA IPC, and
//!   with the NCCL staging), every kernel's dynamic shared memory against sm_90's 227 KB, and
//!   the build of the kernels a rank loads (process mode: one rank per GPU; virtual ranks: all
//!   on one GPU of 132 SMs). A Markdown table.
//! - `ep-scale floor` (no GPU needed): per R (E fixed by `--experts`, 256), FP8
//!   dispatch, one rank's bytes: the floor of the per-destination layout (what it must hold: the
//!   R x T batch entries it receives, the T x K combine rows it gets back, headers and signals),
//!   what one buffer set of ours allocates (the size hint, in whole 2 MiB pages: the whole
//!   layout; a batched-only group without its own tensors, `GpuOptions::buffers`), both sets,
//!   and DeepEP's hint (its two buffers).
//! - `ep-scale bench` (no GPU needed): per R (E fixed by `--experts`, 256), FP8 dispatch, what
//!   `ep-bench --backend gpu --ranks R` holds with every rank on one GPU
//!   (`ep_benches::memory::gpu_device_bytes`: one path's group at a time and the receive-hook
//!   split's buffers; a group of both paths beside it), and the host memory it writes
//!   (`ep_benches::memory::estimate`).
//! - `ep-scale setup` (GPU): `GpuGroup::new` timed for each R (virtual ranks on one GPU; the
//!   first build of each kernel variant compiles, so each R is built twice and both times
//!   printed), or why it cannot (memory, residency).
//!
//! Flags: `--tokens T` (128), `--hidden H` (7168), `--top-k K` (8), `--local L1,L2,..` (1,2,4),
//! `--ranks R1,R2,..` (8,16,32,64,128,256).

use ep_kernels::runtime::{
    bytes_per_rank_with, entry_bytes, hint_bytes, smem_bytes, Variant, MAX_RANKS, SMEM_LIMIT_SM90,
};
use ep_kernels::{Buffers, GpuGroup, GpuOptions};
use ep_reference::{Config, Mode, Path};
use std::process::ExitCode;
use std::time::Instant;

struct Opts {
    what: String,
    tokens: usize,
    hidden: usize,
    top_k: usize,
    local: Vec<usize>,
    ranks: Vec<usize>,
    experts: usize,
}

fn list(v: &str, flag: &str) -> Result<Vec<usize>, String> {
    v.split(',')
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .map_err(|e| format!("{flag} {v}: {e}"))
        })
        .collect()
}

fn parse() -> Result<Opts, String> {
    let mut o = Opts {
        what: String::new(),
        tokens: 128,
        hidden: 7168,
        top_k: 8,
        local: vec![1, 2, 4],
        ranks: vec![8, 16, 32, 64, 128, 256],
        experts: 256,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().ok_or_else(|| format!("{a} needs a value"));
        match a.as_str() {
            "sizes" | "setup" | "floor" | "bench" if o.what.is_empty() => o.what = a.clone(),
            "--tokens" => o.tokens = val()?.parse().map_err(|e| format!("--tokens: {e}"))?,
            "--hidden" => o.hidden = val()?.parse().map_err(|e| format!("--hidden: {e}"))?,
            "--top-k" => o.top_k = val()?.parse().map_err(|e| format!("--top-k: {e}"))?,
            "--local" => o.local = list(&val()?, "--local")?,
            "--ranks" => o.ranks = list(&val()?, "--ranks")?,
            "--experts" => o.experts = val()?.parse().map_err(|e| format!("--experts: {e}"))?,
            "-h" | "--help" => {
                return Err(
                    "usage: ep-scale sizes|setup|floor|bench [--tokens T] [--experts E] [--hidden H] [--top-k K] \
                            [--local L1,L2,..] [--ranks R1,R2,..]"
                        .into(),
                )
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if o.what.is_empty() {
        o.what = "sizes".into();
    }
    Ok(o)
}

fn mib(b: usize) -> String {
    format!("{:.1}", b as f64 / (1 << 20) as f64)
}

fn build(v: Variant) -> &'static str {
    match (v.wide, v.wide_io, v.two_blocks) {
        (false, false, false) if v.one_io => "narrow + 1-entry IoTable",
        (false, false, false) => "narrow",
        (true, false, false) if v.one_io => "wide + 1-entry IoTable",
        (true, false, false) => "wide",
        (true, true, false) => "wide + 256-entry IoTable",
        (true, true, true) => "wide + IoTable + 2 blocks/SM",
        _ => "other",
    }
}

fn sizes(o: &Opts) -> Result<(), String> {
    println!(
        "Per-rank memory and shared memory against R (T = {}, H = {}, K = {}, BF16 payload; \
         `cargo run --release -p ep-benches --bin ep-scale -- sizes`)\n",
        o.tokens, o.hidden, o.top_k
    );
    println!("| R | L | E | MiB per rank (IPC) | MiB per rank (NCCL staging) | smem per block (KB, limit 227) | build, 1 rank/GPU | build, R virtual on 1 GPU |");
    println!("|---|---|---|---|---|---|---|---|");
    for &r in &o.ranks {
        for &l in &o.local {
            let cfg = Config::new(r, r * l, o.tokens, o.hidden, o.top_k, Mode::Bf16)
                .map_err(|e| format!("R = {r}, L = {l}: {e}"))?;
            let ipc = bytes_per_rank_with(&cfg, false).map_err(|e| e.to_string())?;
            let nccl = bytes_per_rank_with(&cfg, true).map_err(|e| e.to_string())?;
            let smem = smem_bytes(&cfg);
            let fits = if smem <= SMEM_LIMIT_SM90 {
                ""
            } else {
                " (too large)"
            };
            println!(
                "| {r} | {l} | {} | {} | {} | {:.1}{fits} | {} | {} |",
                r * l,
                mib(ipc),
                mib(nccl),
                smem as f64 / 1024.0,
                build(Variant::for_group(r, 1, 132, true)),
                build(Variant::for_group(r, r, 132, true)),
            );
        }
    }
    println!("\nGPU limit: {MAX_RANKS} ranks (past it: GpuError::TooManyRanks).");
    Ok(())
}

/// DeepEP v1's `get_low_latency_rdma_size_hint` (both of its buffers), at top-k-free shapes.
fn deepep_hint(t: usize, h: usize, r: usize, e: usize) -> usize {
    let scales = h / 128;
    let dispatch_msg = 16 + (2 * h).max(h + scales * 4);
    let combine_msg = scales * 4 + 2 * h;
    let send = (t * dispatch_msg).max(e * t * combine_msg);
    let recv = (e * t * dispatch_msg).max(e * t * combine_msg);
    let signaling = e * 4; // the receive counts (an int per expert), dispatch's or combine's
    let _ = r; // DeepEP's figure does not grow with R
    2 * (send + recv + signaling)
}

/// What one rank of the per-destination layout must hold for `cfg` (FP8 dispatch, BF16
/// combine), in bytes: the batch entries it receives (each source's tokens once: R x T entries of
/// header + payload), the combine rows it gets back (each of its selections once: T x K rows of
/// 2H), and per peer a signal and an acknowledgement word for each of dispatch and combine.
fn floor_bytes(cfg: &Config) -> usize {
    let (r, t, k, h) = (
        cfg.num_ranks,
        cfg.max_tokens_per_rank,
        cfg.top_k,
        cfg.hidden,
    );
    r * t * entry_bytes(cfg) + t * k * 2 * h + 4 * r * 8
}

fn floor(o: &Opts) -> Result<(), String> {
    let e = o.experts;
    println!(
        "Per-rank GPU memory against R (T = {}, H = {}, K = {}, E = {e}, FP8 dispatch; \
         `ep-scale floor`): MiB\n",
        o.tokens, o.hidden, o.top_k
    );
    println!("| R | floor (1 set) | ours, whole layout (1 set) | ours, batched only, caller's tensors (1 set) | same, 2 sets | DeepEP hint (2 buffers) |");
    // Ours: what a rank allocates, the Python Buffer's size hint (each set one cuMemAlloc in
    // whole 2 MiB pages; `runtime::hint_bytes`).
    println!("|---|---|---|---|---|---|");
    let lean = GpuOptions {
        buffers: Buffers {
            path: Some(Path::Batched),
            own_tensors: false,
        },
        ..GpuOptions::default()
    };
    for &r in &o.ranks {
        if !e.is_multiple_of(r) {
            continue;
        }
        let cfg = Config::new(r, e, o.tokens, o.hidden, o.top_k, Mode::FP8)
            .map_err(|err| format!("R = {r}: {err}"))?;
        let err = |e: ep_kernels::GpuError| e.to_string();
        let full = hint_bytes(&cfg, &GpuOptions::default(), false, 1).map_err(err)?;
        let one = hint_bytes(&cfg, &lean, false, 1).map_err(err)?;
        let two = hint_bytes(&cfg, &lean, false, 2).map_err(err)?;
        println!(
            "| {r} | {} | {} | {} | {} | {} |",
            mib(floor_bytes(&cfg)),
            mib(full),
            mib(one),
            mib(two),
            mib(deepep_hint(o.tokens, o.hidden, r, e)),
        );
    }
    Ok(())
}

fn gib(b: u64) -> String {
    format!("{:.1}", b as f64 / (1u64 << 30) as f64)
}

/// What `ep-bench --backend gpu --ranks R` holds, all ranks on one GPU.
fn bench(o: &Opts) -> Result<(), String> {
    let e = o.experts;
    println!(
        "ep-bench --backend gpu --ranks R on one GPU (T = {}, H = {}, K = {}, E = {e}, FP8 \
         dispatch; `ep-scale bench`)\n",
        o.tokens, o.hidden, o.top_k
    );
    println!("| R | group per rank, MiB (the larger path's) | both paths in one group, MiB | hook split per rank, MiB | GPU, GiB (one path's group + split) | GPU, GiB (both paths in one group + split) | host, GB (ep-bench's estimate) |");
    println!("|---|---|---|---|---|---|---|");
    let gpu = ep_benches::backend::Backend::Gpu(String::new());
    for &r in &o.ranks {
        if !e.is_multiple_of(r) {
            continue;
        }
        let cfg = Config::new(r, e, o.tokens, o.hidden, o.top_k, Mode::FP8)
            .map_err(|err| format!("R = {r}: {err}"))?;
        let b = ep_benches::memory::gpu_device_bytes(&cfg, r, false)
            .ok_or_else(|| format!("R = {r}: the sizes overflow"))?;
        let both = bytes_per_rank_with(&cfg, false)
            .map_err(|e| e.to_string())?
            .next_multiple_of(ep_kernels::runtime::ALLOC_GRANULE) as u64;
        let both_total = (both + b.hook_per_rank) * r as u64 + (1 << 20);
        let host = ep_benches::memory::estimate(&cfg, o.tokens, &gpu).touched;
        println!(
            "| {r} | {} | {} | {:.1} | {} | {} | {:.1} |",
            mib(b.group_per_rank as usize),
            mib(both as usize),
            b.hook_per_rank as f64 / (1 << 20) as f64,
            gib(b.total),
            gib(both_total),
            host as f64 / 1e9,
        );
    }
    Ok(())
}

fn setup(o: &Opts) -> Result<(), String> {
    if let Err(e) = ep_kernels::runtime::probe_devices(1) {
        return Err(format!("setup needs a GPU: {e}"));
    }
    println!(
        "GpuGroup::new, R virtual ranks on one GPU (T = {}, H = {}, K = {}, FP8), two builds each\n",
        o.tokens, o.hidden, o.top_k
    );
    println!("| R | L | MiB per rank | first build (ms) | second build (ms) |");
    println!("|---|---|---|---|---|");
    for &r in &o.ranks {
        for &l in &o.local {
            let cfg = Config::new(r, r * l, o.tokens, o.hidden, o.top_k, Mode::FP8)
                .map_err(|e| format!("R = {r}, L = {l}: {e}"))?;
            let per = bytes_per_rank_with(&cfg, false).map_err(|e| e.to_string())?;
            let mut times = Vec::new();
            let mut why = None;
            for _ in 0..2 {
                let t0 = Instant::now();
                match GpuGroup::new(&cfg, GpuOptions::default()) {
                    Ok(g) => {
                        times.push(t0.elapsed().as_secs_f64() * 1e3);
                        drop(g);
                    }
                    Err(e) => {
                        why = Some(e.to_string());
                        break;
                    }
                }
            }
            match why {
                None => println!(
                    "| {r} | {l} | {} | {:.0} | {:.0} |",
                    mib(per),
                    times[0],
                    times[1]
                ),
                Some(e) => println!("| {r} | {l} | {} | not built: {e} | |", mib(per)),
            }
        }
    }
    Ok(())
}

fn main() -> ExitCode {
    let o = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("ep-scale: {e}");
            return ExitCode::from(2);
        }
    };
    let r = match o.what.as_str() {
        "setup" => setup(&o),
        "floor" => floor(&o),
        "bench" => bench(&o),
        _ => sizes(&o),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("ep-scale: {e}");
            ExitCode::from(1)
        }
    }
}
