//! The `ep-bench` program as a user meets it: bad flags and sizes it cannot hold fail at once
//! with exit code 2 and a message naming the flag; flags that do not apply are refused; the
//! summary ends the output. CPU backend only (no GPU is assumed).

use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// A tiny point that runs in well under a second on the CPU backend.
const TINY: &[&str] = &[
    "--backend",
    "cpu",
    "--ranks",
    "2",
    "--experts",
    "4",
    "--tokens",
    "2",
    "--hidden",
    "128",
    "--top-k",
    "2",
    "--iters",
    "2",
    "--warmup",
    "0",
];

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    took: Duration,
}

fn ep_bench(args: &[&str]) -> Run {
    let t0 = Instant::now();
    let Output {
        status,
        stdout,
        stderr,
    } = Command::new(env!("CARGO_BIN_EXE_ep-bench"))
        .args(args)
        // Not a rank of someone else's multi-process job.
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .expect("ep-bench starts");
    Run {
        code: status.code(),
        stdout: String::from_utf8_lossy(&stdout).into_owned(),
        stderr: String::from_utf8_lossy(&stderr).into_owned(),
        took: t0.elapsed(),
    }
}

/// Runs ep-bench with `args`, expects exit code `code` and every one of `needles` in stderr.
fn refused(args: &[&str], code: i32, needles: &[&str]) -> Run {
    let r = ep_bench(args);
    assert_eq!(
        r.code,
        Some(code),
        "ep-bench {args:?}: exit {:?}\nstdout:\n{}\nstderr:\n{}",
        r.code,
        r.stdout,
        r.stderr
    );
    for n in needles {
        assert!(
            r.stderr.contains(n),
            "ep-bench {args:?}: stderr lacks {n:?}:\n{}",
            r.stderr
        );
    }
    assert!(
        !r.stderr.contains("panicked") && !r.stderr.contains("RUST_BACKTRACE"),
        "ep-bench {args:?} panicked:\n{}",
        r.stderr
    );
    // Refused before anything ran: no point was printed.
    assert!(!r.stdout.contains("speed-up"), "{}", r.stdout);
    r
}

#[test]
fn sizes_it_cannot_hold_fail_fast_with_exit_2() {
    // Took 50 s and 11 GB, then aborted in the allocator (exit 134).
    let r = refused(
        &["--tokens", "100000"],
        2,
        &["--tokens 100000", "maximum 65536"],
    );
    assert!(r.took < Duration::from_secs(20), "took {:?}", r.took);
    // A valid config too big for any machine: the memory check, before any input is made.
    let r = refused(
        &["--backend", "cpu", "--tokens", "60000"],
        2,
        &["GB", "available", "Lower --tokens (now 60000)", "--hidden"],
    );
    assert!(r.took < Duration::from_secs(20), "took {:?}", r.took);
    // Same through --max-tokens and --sweep-tokens, naming those flags.
    refused(
        &["--backend", "cpu", "--tokens", "1", "--max-tokens", "60000"],
        2,
        &["Lower --max-tokens (now 60000)"],
    );
    refused(
        &["--backend", "cpu", "--sweep-tokens", "1,60000"],
        2,
        &["(point T=60000)", "Lower --sweep-tokens"],
    );
}

#[test]
fn config_errors_name_the_flag_and_what_would_work() {
    refused(
        &["--experts", "100"],
        2,
        &[
            "--experts 100 is not a multiple of --ranks 8",
            "--experts 96",
        ],
    );
    refused(
        &["--hidden", "100"],
        2,
        &["--hidden 100", "--hidden 128", "--dispatch bf16"],
    );
    refused(&["--top-k", "17"], 2, &["--top-k 17", "1..=16"]);
    refused(&["--top-k", "0"], 2, &["--top-k 0"]);
    refused(&["--ue8m0"], 2, &["--ue8m0 needs --round-scale"]);
    refused(
        &["--dispatch", "bf16", "--round-scale"],
        2,
        &["--round-scale", "--dispatch fp8"],
    );
    refused(&["--ranks", "0"], 2, &["--ranks must be at least 1"]);
    refused(
        &["--ranks", "2048", "--experts", "2048"],
        2,
        &["--ranks 2048"],
    );
    refused(
        &["--tokens", "10", "--max-tokens", "8"],
        2,
        &["--tokens 10 exceeds --max-tokens 8"],
    );
}

#[test]
fn negative_numbers_get_a_clear_message() {
    // clap said "unexpected argument '-0' found" before.
    refused(&["--masked", "-0.1"], 2, &["'--masked", "-0.1", "[0, 1]"]);
    refused(
        &["--timeout-secs", "-5"],
        2,
        &["'--timeout-secs", "-5 is not a positive number of seconds"],
    );
    refused(&["--tokens", "-5"], 2, &["'--tokens", "-5 is negative"]);
}

#[test]
fn a_huge_timeout_is_saturated_not_a_panic() {
    // Duration::from_secs_f64(1e300) panicked (exit 101).
    let mut args = TINY.to_vec();
    args.extend(["--timeout-secs", "1e300"]);
    let r = ep_bench(&args);
    assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
}

/// `args` appended to the tiny point.
fn tiny(args: &[&'static str]) -> Vec<&'static str> {
    let mut a = TINY.to_vec();
    a.extend(args);
    a
}

#[test]
fn absurd_worker_counts_are_refused_naming_the_flag() {
    // usize::MAX panicked (exit 101), 10^6 failed spawning threads (101), 10^8 aborted (134).
    for n in ["18446744073709551615", "100000000", "1000000", "257"] {
        refused(
            &tiny(&["--workers", n]),
            2,
            &["--workers", n, "at most 256"],
        );
    }
    // The maximum itself runs.
    let r = ep_bench(&tiny(&["--workers", "256"]));
    assert_eq!(r.code, Some(0), "{}\n{}", r.stdout, r.stderr);
}

#[test]
fn absurd_iteration_counts_are_refused_naming_the_flag() {
    // `--iters 2^64-1 --warmup 1` wrapped to 0 rounds: exit 0 with NaN latencies, 0 samples.
    let max = "18446744073709551615";
    refused(
        &["--backend", "cpu", "--iters", max, "--warmup", "1"],
        2,
        &["--iters", max, "1..=100000"],
    );
    refused(
        &["--backend", "cpu", "--iters", "1", "--warmup", max],
        2,
        &["--warmup", max, "at most 100000"],
    );
    refused(
        &["--backend", "cpu", "--iters", "100001"],
        2,
        &["--iters", "100001"],
    );
    refused(
        &["--backend", "cpu", "--warmup", "100001"],
        2,
        &["--warmup", "100001"],
    );
    refused(&["--backend", "cpu", "--iters", "0"], 2, &["--iters", "0"]);
    // Multi-process mode takes --iters too, bounded alike.
    refused(&["--nprocs", "2", "--iters", max], 2, &["--iters", max]);
}

/// Process mode's own numbers (the flags of `ep-bench --nprocs`): a bad one names its flag and exits 2, never a panic; the check rounds and
/// the fault hooks apply to multi-process runs only. Needs no GPU: every case is refused before a
/// device is touched.
#[test]
fn process_mode_numbers_name_their_flag_and_need_nprocs() {
    let huge = "18446744073709551615";
    for args in [
        &["--nprocs", "abc"][..],
        &["--nprocs", "-3"],
        &["--nprocs", "0"],
        &["--nprocs", huge],
        &["--nprocs", huge, "--nodes", "2"],
        &["--nprocs", "2", "--nodes", "two"],
        &["--nprocs", "2", "--rounds", "many"],
        &["--nprocs", "2", "--rounds", "0"],
        &["--nprocs", "2", "--rounds", "-1"],
        &["--nprocs", "2", "--die-rank", "x"],
        &["--nprocs", "2", "--stall-rank", huge],
        &["--nprocs", "2", "--iters", "many"],
        &["--nprocs", "2", "--timeout-secs", "soon"],
    ] {
        let (flag, value) = args
            .chunks(2)
            .rev()
            .find(|p| p[1].parse::<u64>().map_or(true, |n| n == 0 || n > 1024))
            .map(|p| (p[0], p[1]))
            .unwrap();
        refused(args, 2, &[flag, value]);
    }
    for f in ["--rounds", "--die-rank", "--stall-rank"] {
        refused(
            &["--backend", "cpu", "--ranks", "2", f, "1"],
            2,
            &[f, "applies with --nprocs"],
        );
    }
}

#[test]
fn timeouts_that_are_no_bound_are_refused_naming_the_flag() {
    // 1e-300 became 0 ns, and the run then blamed a rank for the timeout (exit 1); -inf was
    // refused by clap as an unknown flag, without naming --timeout-secs.
    for v in [
        "1e-300", "-inf", "inf", "+inf", "nan", "-nan", "0", "-0", "0.0009", "-1e-300", "4.9e-324",
    ] {
        refused(
            &tiny(&["--timeout-secs", v]),
            2,
            &["'--timeout-secs", v, "0.001"],
        );
    }
    // The form with '=' too.
    refused(
        &tiny(&["--timeout-secs=-inf"]),
        2,
        &["'--timeout-secs", "-inf"],
    );
    // The minimum itself is a valid bound (not run: 1 ms may be too short on a busy machine).
    let r = refused(
        &["--timeout-secs", "0.001", "--tokens", "-1"],
        2,
        &["--tokens"],
    );
    assert!(!r.stderr.contains("--timeout-secs"), "{}", r.stderr);
}

#[test]
fn flags_that_do_not_apply_are_refused() {
    // `--nprocs 1 --transport nccl` ran the default group and dropped --transport.
    let mut a = TINY.to_vec();
    a.extend(["--nprocs", "1", "--transport", "nccl"]);
    refused(
        &a,
        2,
        &[
            "--transport applies to the GPU backend",
            "uses the CPU backend",
        ],
    );
    let mut a = TINY.to_vec();
    a.extend(["--transport", "auto"]);
    refused(&a, 2, &["--transport"]);
    // --nccl-sizes without the NCCL transport was a flag nothing read.
    for extra in [
        &["--nccl-sizes", "capacity"][..],
        &["--nccl-sizes", "exact", "--transport", "auto"],
        &["--nccl-sizes", "exact", "--nprocs", "2"],
    ] {
        let mut a = TINY.to_vec();
        a.extend(extra);
        refused(
            &a,
            2,
            &[
                "--nccl-sizes applies where NCCL carries traffic only",
                "--transport nccl",
            ],
        );
    }
    // With the NCCL transport, the CPU backend still refuses both (it has no NCCL).
    let mut a = TINY.to_vec();
    a.extend(["--transport", "nccl", "--nccl-sizes", "capacity"]);
    refused(
        &a,
        2,
        &["applies to the GPU backend", "uses the CPU backend"],
    );
    let mut a = TINY.to_vec();
    a.extend(["--nccl-sizes", "huge", "--transport", "nccl"]);
    refused(&a, 2, &["huge"]);
    let mut a = TINY.to_vec();
    a.extend(["--gpus", "2"]);
    refused(
        &a,
        2,
        &["--gpus applies to the GPU backend", "uses the CPU backend"],
    );
    let mut a = TINY.to_vec();
    a.extend(["--json", "--per-rank"]);
    refused(&a, 2, &["--per-rank"]);
    // The phase profile is the GPU kernels' own.
    let mut a = TINY.to_vec();
    a.push("--profile");
    refused(
        &a,
        2,
        &[
            "--profile applies to the GPU backend",
            "uses the CPU backend",
        ],
    );
    let mut a = TINY.to_vec();
    a.extend(["--json", "--profile"]);
    refused(&a, 2, &["--profile prints text lines"]);
    // Every block's stamps add to the profile's lines.
    let mut a = TINY.to_vec();
    a.push("--profile-blocks");
    refused(&a, 2, &["--profile-blocks adds to --profile's lines"]);
    refused(
        &["--nprocs", "2", "--profile-blocks"],
        2,
        &["--profile-blocks does not apply in multi-process mode"],
    );
    let mut a = TINY.to_vec();
    a.extend(["--timing", "stream"]);
    refused(&a, 2, &["--timing applies to the GPU backend"]);
    let mut a = TINY.to_vec();
    a.extend(["--timing", "graph", "--gpus", "2"]);
    refused(&a, 2, &["--timing graph", "--gpus 2"]);
    refused(
        &["--nprocs", "2", "--profile"],
        2,
        &["--profile does not apply in multi-process mode"],
    );
    // Multi-process mode takes R from --nprocs and runs the GPU backend.
    refused(
        &["--nprocs", "2", "--ranks", "2"],
        2,
        &["--ranks does not apply in multi-process mode"],
    );
    refused(
        &["--nprocs", "2", "--backend", "cpu"],
        2,
        &["--backend cpu does not apply in multi-process mode"],
    );
    refused(
        &["--nprocs", "2", "--sweep-tokens", "1,2"],
        2,
        &["--sweep-tokens does not apply"],
    );
    refused(
        &["--nprocs", "2", "--experts", "3"],
        2,
        &["--experts 3 is not a multiple of --nprocs 2"],
    );
}

#[test]
fn scales_column_major_is_refused_where_it_does_not_apply() {
    // The CPU backend lays the scales out row-major only (the flag would be read by nothing).
    let mut a = TINY.to_vec();
    a.push("--scales-column-major");
    refused(
        &a,
        2,
        &[
            "--scales-column-major applies to the GPU backend",
            "uses the CPU backend",
        ],
    );
    // A BF16 dispatch has no scales, on either backend (checked before the backend is chosen).
    for backend in ["cpu", "gpu"] {
        refused(
            &[
                "--backend",
                backend,
                "--dispatch",
                "bf16",
                "--scales-column-major",
            ],
            2,
            &["--scales-column-major with --dispatch bf16", "no scales"],
        );
    }
    // Multi-process mode takes the single-process flags' refusal.
    refused(
        &["--nprocs", "2", "--scales-column-major"],
        2,
        &["--scales-column-major does not apply in multi-process mode"],
    );
}

#[test]
fn nodes_is_refused_where_it_does_not_apply() {
    // One process: nothing to spread over nodes.
    let mut a = TINY.to_vec();
    a.extend(["--nodes", "2"]);
    refused(&a, 2, &["--nodes applies with --nprocs"]);
    // Nodes that do not divide the processes, more nodes than processes, or auto (IPC only)
    // across nodes: refused before any process starts (exit 2, also without a GPU).
    refused(
        &["--nprocs", "4", "--nodes", "3"],
        2,
        &["--nodes 3 does not fit --nprocs 4"],
    );
    refused(
        &["--nprocs", "2", "--nodes", "4"],
        2,
        &["--nodes 4 does not fit --nprocs 2"],
    );
    refused(
        &["--nprocs", "4", "--nodes", "2", "--transport", "auto"],
        2,
        &["--transport auto", "--transport two-tier"],
    );
    refused(&["--nprocs", "4", "--nodes", "0"], 2, &["--nodes"]);
    // Under an external launcher the node comes from the environment.
    let out = Command::new(env!("CARGO_BIN_EXE_ep-bench"))
        .args(["--nodes", "2", "--timeout-secs", "1"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .output()
        .expect("ep-bench starts");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--nodes does not apply under an external launcher"),
        "{err}"
    );
}

#[test]
fn nprocs_without_a_gpu_says_so_before_spawning() {
    if let Ok(d) = ep_kernels::runtime::probe() {
        println!("SKIPPED: a GPU is usable here ({d}); this test needs a machine without one");
        return;
    }
    let r = refused(
        &["--nprocs", "4"],
        1,
        &[
            "--nprocs 4 starts one GPU process per rank",
            "no usable GPU",
        ],
    );
    // No child ran: their output would be prefixed with "[rank i]".
    assert!(
        !r.stderr.contains("[rank") && !r.stdout.contains("[rank"),
        "{}{}",
        r.stdout,
        r.stderr
    );
    assert!(r.took < Duration::from_secs(20), "took {:?}", r.took);
}

#[test]
fn the_summary_ends_the_output() {
    let r = ep_bench(TINY);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let lines: Vec<&str> = r.stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    let last = lines.last().copied().unwrap_or_default();
    assert!(
        last.starts_with("speed-up (per-expert median / batched median): dispatch "),
        "last line: {last}\n{}",
        r.stdout
    );
    assert!(!r.stdout.contains("[rank"), "{}", r.stdout);
    let table = lines
        .iter()
        .position(|l| l.starts_with("path "))
        .expect("a summary table");
    assert!(lines[table + 1].starts_with("per-expert "), "{}", r.stdout);
    assert!(lines[table + 2].starts_with("batched "), "{}", r.stdout);

    // --per-rank: every rank's DeepEP line, before the summary, which still ends the output.
    let mut a = TINY.to_vec();
    a.push("--per-rank");
    let r = ep_bench(&a);
    assert_eq!(r.code, Some(0), "{}", r.stderr);
    let lines: Vec<&str> = r.stdout.lines().filter(|l| !l.trim().is_empty()).collect();
    let ranks: Vec<usize> = (0..lines.len())
        .filter(|&i| lines[i].contains("[rank "))
        .collect();
    assert_eq!(ranks.len(), 4, "2 paths x 2 ranks:\n{}", r.stdout);
    let table = lines.iter().position(|l| l.starts_with("path ")).unwrap();
    assert!(ranks.iter().all(|&i| i < table), "{}", r.stdout);
    assert!(
        lines.last().unwrap().starts_with("speed-up"),
        "{}",
        r.stdout
    );
}

#[test]
fn under_a_launcher_the_config_is_checked_with_world_size() {
    let out = Command::new(env!("CARGO_BIN_EXE_ep-bench"))
        .args(["--experts", "8", "--timeout-secs", "1"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "3")
        .output()
        .expect("ep-bench starts");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--experts 8 is not a multiple of WORLD_SIZE 3"),
        "{err}"
    );
    let out = Command::new(env!("CARGO_BIN_EXE_ep-bench"))
        .args(["--nprocs", "2"])
        .env("RANK", "0")
        .env("WORLD_SIZE", "2")
        .output()
        .expect("ep-bench starts");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("--nprocs does not apply under an external launcher"),
        "{err}"
    );
}

/// The per-expert path's combine wire MB in the summary table.
fn combine_wire_mb(stdout: &str) -> f64 {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("per-expert "))
        .expect("a per-expert line");
    let wire = line.split_whitespace().last().unwrap();
    wire.split('/').nth(1).unwrap().parse().unwrap()
}

#[test]
fn logfmt_runs_the_combine_in_logfmt_and_counts_its_bytes() {
    let args = [
        "--backend",
        "cpu",
        "--ranks",
        "2",
        "--experts",
        "4",
        "--tokens",
        "16",
        "--hidden",
        "7168",
        "--top-k",
        "2",
        "--iters",
        "1",
        "--warmup",
        "0",
    ];
    let bf = ep_bench(&args);
    assert_eq!(bf.code, Some(0), "{}", bf.stderr);
    let mut a = args.to_vec();
    a.push("--logfmt");
    let lf = ep_bench(&a);
    assert_eq!(lf.code, Some(0), "{}", lf.stderr);
    assert!(lf.stdout.contains("combine logfmt"), "{}", lf.stdout);
    assert!(lf.stdout.contains("combine bitwise equal"), "{}", lf.stdout);
    // Every group packs: 7168 x 10 / 8 + 56 x 4 bytes a row instead of 14336, 0.64x.
    let (b, l) = (combine_wire_mb(&bf.stdout), combine_wire_mb(&lf.stdout));
    let ratio = l / b;
    assert!((0.62..0.66).contains(&ratio), "wire MB {l} vs {b}: {ratio}");
    // H not a multiple of 128 is refused naming the flag.
    let mut a = args.to_vec();
    a[9] = "200";
    a.extend(["--logfmt", "--dispatch", "bf16"]);
    refused(&a, 2, &["--hidden 200", "--logfmt"]);
    // Where the GPU kernels do not run it: over NCCL, and in multi-process mode (refused
    // before any GPU is looked at, so this runs without one).
    refused(
        &["--logfmt", "--transport", "nccl", "--backend", "gpu"],
        2,
        &["--logfmt", "--transport nccl", "bf16 rows only"],
    );
    refused(
        &["--logfmt", "--transport", "two-tier", "--backend", "gpu"],
        2,
        &["--logfmt", "--transport two-tier", "bf16 rows only"],
    );
    refused(
        &["--logfmt", "--nprocs", "2"],
        2,
        &["--logfmt", "multi-process mode"],
    );
}
