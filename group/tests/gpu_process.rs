//! GPU tests of process mode's trust boundary: the handshake refuses a
//! peer with another config before anything is mapped, and NCCL set-up against a peer that never
//! joins or dies ends within its bound. And the two-tier group: 4 processes on
//! 2 GPUs as 2 emulated nodes, CUDA IPC inside a node and NCCL across, bitwise against the
//! oracle. A custom runner (`harness = false`), as in `gpu/main.rs`: each test declares what it
//! needs (`TESTS`, one `gpu_test!` per test function); a test whose GPUs, NVRTC or NCCL are
//! missing prints `SKIPPED: <test>: <reason>` and is counted as skipped, never as passed.
//!
//! Real peer processes are this same binary started again with `EP_GPU_PROCESS_CHILD=<role>`;
//! the all-gather between the two ranks runs over the child's stdin and stdout (one line
//! `BLOB <hex>` each way). The two-tier test starts its 4 ranks with `ep_launch::spawn_local_with`
//! (the rendezvous, as under torchrun) and each runs `ep_group::mp::run_rank_with`.

use ep_group::handshake::Hello;
use ep_group::mp::{run_rank_with, sizes_for, MpFailure, MpOptions, RankRun};
use ep_group::node::{node_id, NodeId};
use ep_group::topology::emulation_envs;
use ep_group::{new_process, GroupError};
use ep_kernels::runtime::bytes_per_rank_with;
use ep_kernels::runtime::nccl::SETUP_FLOOR;
use ep_kernels::testing::{random_inputs, Rng, Routing};
use ep_kernels::{GpuError, GpuGroup, GpuOptions, NcclSizes, Path, Transport};
use ep_reference::{Config, Mode, Op};
use ep_test_runner::{gpu_test, GpuTest, Runner};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "EP_GPU_PROCESS_CHILD";

/// The tests, in the order they run, and what each needs.
const TESTS: &[GpuTest] = &[
    gpu_test!(gpu_process_fabricated_peers_are_refused_before_mapping, gpus: 1),
    gpu_test!(gpu_process_two_processes_with_other_hidden_both_fail, gpus: 1),
    gpu_test!(gpu_nccl_init_with_a_peer_that_never_joins_times_out, gpus: 1, nccl),
    gpu_test!(gpu_nccl_peer_dead_after_init_call_and_drop_are_bounded, gpus: 2, nccl),
    gpu_test!(gpu_two_tier_four_processes_on_two_emulated_nodes_match_the_oracle, gpus: 2, nccl),
    gpu_test!(gpu_process_40_ranks_over_ipc_on_one_gpu_match_the_oracle, gpus: 1),
    gpu_test!(gpu_two_tier_36_ranks_on_4_emulated_nodes_match_the_oracle, gpus: 2, nccl),
];

fn main() {
    if let Ok(role) = std::env::var(CHILD_ENV) {
        std::process::exit(child(&role));
    }
    let mut runner = Runner::new("gpu process tests");
    runner.run_all(&[TESTS]);
    runner.finish()
}

fn cfg(hidden: usize) -> Config {
    Config::new(2, 8, 32, hidden, 4, Mode::Bf16).unwrap()
}

fn opts(transport: Transport) -> GpuOptions {
    GpuOptions {
        transport,
        timeout_ns: 1_000_000_000,
        ..Default::default()
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if !s.len().is_multiple_of(2) {
        return Err(format!("odd hex length {}", s.len()));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).map_err(|e| e.to_string()))
        .collect()
}

/// Reads lines until one `BLOB <hex>` (other output is skipped); EOF is an error.
fn read_blob(r: &mut impl BufRead) -> Result<Vec<u8>, String> {
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            return Err("the peer process closed its pipe (exited)".into());
        }
        if let Some(h) = line.trim_end().strip_prefix("BLOB ") {
            return unhex(h);
        }
    }
}

/// A child rank (rank 1 of 2): `mismatch` runs H = 2048 on GPU 0 over IPC and exits 0 when it
/// is refused with a PeerMismatch naming `hidden`; `nccl-die` joins an NCCL group on GPU 1 and
/// exits (code 3) right after the group is formed, before any transfer.
fn child(role: &str) -> i32 {
    if role == "two-tier" {
        return two_tier_rank();
    }
    if role == "many-ipc" {
        return many_rank(Transport::Auto, MANY_IPC, 1);
    }
    if role == "many-two-tier" {
        return many_rank(Transport::TwoTier, MANY_TWO_TIER, 2);
    }
    let (cfg, opts, ordinal) = match role {
        "mismatch" => (cfg(2048), opts(Transport::Auto), 0),
        "nccl-die" => (cfg(1024), opts(Transport::Nccl), 1),
        _ => {
            eprintln!("child: unknown role {role}");
            return 2;
        }
    };
    let stdin = std::io::stdin();
    let mut input = stdin.lock();
    let mut ag = |b: &[u8]| -> Result<Vec<Vec<u8>>, String> {
        let mut out = std::io::stdout().lock();
        writeln!(out, "BLOB {}", hex(b)).map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
        let theirs = read_blob(&mut input)?;
        Ok(vec![theirs, b.to_vec()])
    };
    let r = new_process(&cfg, opts, 1, ordinal, &mut ag);
    match (role, r) {
        (
            "mismatch",
            Err(GroupError::PeerMismatch {
                field: "hidden",
                rank: 1,
                peer: 0,
                ..
            }),
        ) => 0,
        ("nccl-die", Ok(g)) => {
            eprintln!("child: group formed, exiting without a word");
            std::mem::forget(g); // no orderly teardown: a dead peer
            std::process::exit(3)
        }
        (_, r) => {
            eprintln!("child {role}: unexpected result: {:?}", r.err());
            1
        }
    }
}

/// Starts a child rank and returns it with the all-gather that talks to it (this is rank 0).
struct Peer {
    child: std::process::Child,
    out: BufReader<std::process::ChildStdout>,
}

impl Peer {
    fn start(role: &str) -> Peer {
        let exe = std::env::current_exe().expect("test binary path");
        let mut child = Command::new(exe)
            .env(CHILD_ENV, role)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the child rank");
        let out = BufReader::new(child.stdout.take().expect("child stdout"));
        Peer { child, out }
    }

    fn all_gather(&mut self, b: &[u8]) -> Result<Vec<Vec<u8>>, String> {
        let stdin = self.child.stdin.as_mut().ok_or("child stdin closed")?;
        writeln!(stdin, "BLOB {}", hex(b)).map_err(|e| e.to_string())?;
        stdin.flush().map_err(|e| e.to_string())?;
        let theirs = read_blob(&mut self.out)?;
        Ok(vec![b.to_vec(), theirs])
    }

    /// The child's exit code, waiting at most `limit`.
    fn wait(mut self, limit: Duration) -> Option<i32> {
        drop(self.child.stdin.take());
        let t0 = Instant::now();
        loop {
            if let Ok(Some(s)) = self.child.try_wait() {
                return s.code();
            }
            if t0.elapsed() > limit {
                let _ = self.child.kill();
                let _ = self.child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// This process's node (the fabricated peers claim the same one, so only the field under test
/// differs).
fn here() -> NodeId {
    node_id().expect("this process's node id")
}

fn mismatch_field(r: Result<GpuGroup, GroupError>) -> (&'static str, String, String, usize) {
    match r {
        Err(GroupError::PeerMismatch {
            field,
            ours,
            theirs,
            rank: 0,
            peer,
        }) => (field, ours, theirs, peer),
        Err(e) => panic!("want a PeerMismatch, got: {e}"),
        Ok(_) => panic!("want a PeerMismatch, the group formed"),
    }
}

/// Rank 0 of 2 over IPC, the peer's blob fabricated: its handle is 64 zero bytes, so a group
/// that opened it before checking would fail with a CUDA error, not a PeerMismatch.
fn gpu_process_fabricated_peers_are_refused_before_mapping() {
    let ours = cfg(1024);
    let o = opts(Transport::Auto);
    let alloc = bytes_per_rank_with(&ours, false).expect("layout of a valid config");
    let run = |peer_blob: Vec<u8>| {
        let mut ag =
            |b: &[u8]| -> Result<Vec<Vec<u8>>, String> { Ok(vec![b.to_vec(), peer_blob.clone()]) };
        new_process(&ours, o, 0, 0, &mut ag)
    };
    // Another hidden size.
    let theirs = Hello::new(&cfg(2048), &o, 1, alloc, here())
        .encode(&[0; 64])
        .unwrap();
    let (field, a, b, peer) = mismatch_field(run(theirs));
    assert_eq!(
        (field, a.as_str(), b.as_str(), peer),
        ("hidden", "1024", "2048", 1)
    );
    // Another mode (fp8 with round_scale).
    let fp8 = Config::new(2, 8, 32, 1024, 4, Mode::FP8_ROUND).unwrap();
    let theirs = Hello::new(&fp8, &o, 1, alloc, here())
        .encode(&[0; 64])
        .unwrap();
    assert_eq!(mismatch_field(run(theirs)).0, "mode");
    // Same config, a smaller allocation than this rank's layout of it.
    let theirs = Hello::new(&ours, &o, 1, alloc - 256, here())
        .encode(&[0; 64])
        .unwrap();
    let (field, a, b, _) = mismatch_field(run(theirs));
    assert_eq!(field, "allocation bytes");
    assert_eq!((a, b), (alloc.to_string(), (alloc - 256).to_string()));
    // The pre-handshake blob (a bare handle) and garbage: malformed, naming the peer.
    for blob in [vec![0u8; 64], vec![0xff; 5000]] {
        match run(blob) {
            Err(GroupError::PeerBlob {
                rank: 0,
                peer: 1,
                error,
            }) => println!("refused: {error}"),
            Err(e) => panic!("want a PeerBlob, got: {e}"),
            Ok(_) => panic!("want a PeerBlob, the group formed"),
        }
    }
    // The GPU is usable afterwards.
    let g = GpuGroup::new(
        &Config::new(1, 4, 16, 256, 2, Mode::Bf16).unwrap(),
        Default::default(),
    );
    assert!(g.is_ok(), "{:?}", g.err());
}

/// Two processes on GPU 0, H = 1024 here and 2048 in the child: both refuse, naming `hidden`
/// and both values, before any handle is opened.
fn gpu_process_two_processes_with_other_hidden_both_fail() {
    let mut peer = Peer::start("mismatch");
    let r = new_process(&cfg(1024), opts(Transport::Auto), 0, 0, &mut |b| {
        peer.all_gather(b)
    });
    let (field, a, b, p) = mismatch_field(r);
    assert_eq!(
        (field, a.as_str(), b.as_str(), p),
        ("hidden", "1024", "2048", 1)
    );
    assert_eq!(
        peer.wait(Duration::from_secs(60)),
        Some(0),
        "the child's verdict"
    );
}

/// Rank 0 of 2 over NCCL; rank 1 never exists. Before, ncclCommInitRank waited forever; now
/// the set-up ends at its bound (the floor, as the group's timeout is 1 s) with NcclTimeout,
/// the communicator aborted, and the GPU usable afterwards.
fn gpu_nccl_init_with_a_peer_that_never_joins_times_out() {
    let ours = cfg(1024);
    let o = opts(Transport::Nccl);
    let alloc = bytes_per_rank_with(&ours, true).expect("layout of a valid config");
    let theirs = Hello::new(&ours, &o, 1, alloc, here())
        .encode(&[0; 64])
        .unwrap();
    let mut ag =
        |b: &[u8]| -> Result<Vec<Vec<u8>>, String> { Ok(vec![b.to_vec(), theirs.clone()]) };
    let t0 = Instant::now();
    let r = new_process(&ours, o, 0, 0, &mut ag);
    let waited = t0.elapsed();
    match r {
        Err(GroupError::Gpu(e @ GpuError::NcclTimeout { rank: 0, .. })) => {
            println!("after {waited:?}: {e}")
        }
        Err(e) => panic!("want NcclTimeout, got: {e}"),
        Ok(_) => panic!("want NcclTimeout, the group formed without its peer"),
    }
    assert!(waited >= SETUP_FLOOR, "{waited:?}");
    assert!(waited < SETUP_FLOOR + Duration::from_secs(15), "{waited:?}");
    let g = GpuGroup::new(
        &Config::new(1, 4, 16, 256, 2, Mode::Bf16).unwrap(),
        Default::default(),
    );
    assert!(g.is_ok(), "{:?}", g.err());
}

/// Rank 0 on GPU 0, rank 1 (a child) on GPU 1 over NCCL; the child exits right after the
/// group formed. The first call (whose grouped send/receive sets up the connections) must end
/// with an error within the set-up bound plus the wait bound, and dropping the group must not
/// hang either.
fn gpu_nccl_peer_dead_after_init_call_and_drop_are_bounded() {
    let ours = cfg(1024);
    let mut peer = Peer::start("nccl-die");
    let mut g = new_process(&ours, opts(Transport::Nccl), 0, 0, &mut |b| {
        peer.all_gather(b)
    })
    .unwrap_or_else(|e| panic!("group with the child: {e}"));
    assert_eq!(
        peer.wait(Duration::from_secs(60)),
        Some(3),
        "the child exits on purpose"
    );
    let data = random_inputs(
        &ours,
        &[32, 32],
        Routing::Random { masked: 0.0 },
        &mut Rng::new(7),
    );
    let t0 = Instant::now();
    let r = g.dispatch_rank(Path::Batched, &data[0].x, &data[0].topk_idx);
    let waited = t0.elapsed();
    match r {
        Err(e) => println!("dispatch with a dead peer, after {waited:?}: {e}"),
        Ok(_) => panic!("a dispatch with a dead peer succeeded"),
    }
    let bound = SETUP_FLOOR + Duration::from_secs(1) + Duration::from_secs(15);
    assert!(waited < bound, "{waited:?}");
    let t0 = Instant::now();
    drop(g);
    let dropped = t0.elapsed();
    println!("drop after {dropped:?}");
    assert!(dropped < Duration::from_secs(15), "{dropped:?}");
    let g = GpuGroup::new(
        &Config::new(1, 4, 16, 256, 2, Mode::Bf16).unwrap(),
        Default::default(),
    );
    assert!(g.is_ok(), "{:?}", g.err());
}

/// One rank of the two-tier test (started by `spawn_local_with`, node and NCCL host id in its
/// environment): 3 rounds bitwise against the oracle on every path the group supports, then 20
/// back-to-back calls per path and operation (the buffers reused call after call; ep-bench
/// times such calls, `ep_benches::multiproc::time_calls`), and one `TWO-TIER` line.
fn two_tier_rank() -> i32 {
    let o = MpOptions {
        experts: 16,
        tokens: 32,
        hidden: 1024,
        top_k: 4,
        mode: Mode::FP8,
        transport: Transport::TwoTier,
        nccl_sizes: NcclSizes::default(),
        gpus: 2,
        rounds: 3,
        iters: 20,
        seed: 11,
        masked: 0.1,
        timeout: Duration::from_secs(20),
        die_rank: None,
        stall_rank: None,
    };
    match run_rank_with(&o, |run| back_to_back(run, &o)) {
        Ok((rep, called)) => {
            let unsupported: Vec<&str> = rep.unsupported.iter().map(|(p, _)| p.name()).collect();
            println!(
                "TWO-TIER rank={} node={} ipc={:?} nccl={:?} checks={} unsupported={:?} called={:?}",
                rep.rank, rep.node, rep.ipc_peers, rep.nccl_peers, rep.checks, unsupported, called
            );
            for (p, why) in &rep.unsupported {
                println!("rank {}: {p} refused: {why}", rep.rank);
            }
            0
        }
        Err(f) => {
            eprintln!("two-tier rank: {f}");
            if f.caused_by_peer {
                ep_launch::EXIT_PEER_FAILURE
            } else {
                1
            }
        }
    }
}

/// `o.iters` back-to-back calls per path and operation on the group's buffers (after one
/// dispatch and the combine inputs' upload), every rank between two barriers; the paths run.
fn back_to_back(run: &mut RankRun<'_>, o: &MpOptions) -> Result<Vec<&'static str>, MpFailure> {
    let rank = run.rank;
    let me = &run.inputs[rank];
    let mut called = Vec::new();
    for &path in run.paths {
        run.group.set_nccl_sizes(sizes_for(o, path));
        run.group
            .dispatch_rank(path, &me.x, &me.topk_idx)
            .map_err(|e| run.gpu_failure("dispatch", e))?;
        run.group
            .upload_rank_combine(&run.y[rank], &me.topk_weights)
            .map_err(|e| run.gpu_failure("upload", e))?;
        for op in [Op::Dispatch, Op::Combine] {
            run.rdzv.barrier("calls").map_err(|e| MpFailure {
                message: format!("rank {rank}: barrier: {e}"),
                caused_by_peer: true,
            })?;
            for _ in 0..o.iters {
                run.group
                    .launch(op, path)
                    .map_err(|e| run.gpu_failure("calls", e))?;
            }
            run.group.sync().map_err(|e| run.gpu_failure("calls", e))?;
        }
        called.push(path.name());
    }
    Ok(called)
}

/// 4 processes on 2 GPUs, node = rank / 2 (`EP_NODE_ID`, and `NCCL_HOSTID` per node so that NCCL
/// takes the two ranks sharing a GPU for two hosts), GPU = rank % 2: inside a node the pair
/// crosses the GPUs through CUDA IPC, across nodes NCCL (its network transport). Every rank
/// checks its own outputs bit for bit against the oracle; this test checks that every rank
/// did, with the expected peers on each tier, and that both paths were checked and called.
fn gpu_two_tier_four_processes_on_two_emulated_nodes_match_the_oracle() {
    let lines = run_ranks("two-tier", 4, 2, "TWO-TIER", Duration::from_secs(180));
    for (rank, line) in lines.iter().enumerate() {
        println!("{line}");
        let node = rank / 2;
        let (same, other) = if node == 0 {
            (1 - rank, [2, 3])
        } else {
            (5 - rank, [0, 1])
        };
        assert!(
            line.contains(&format!("rank={rank} node=EP_NODE_ID={node} ")),
            "{line}"
        );
        assert!(
            line.contains(&format!("ipc=[{same}] nccl={other:?}")),
            "{line}"
        );
        // Both paths run over both tiers (the per-expert path over NCCL: one message per
        // (peer, local expert)), each checked 3 rounds x (dispatch, combine), then called 20
        // times back to back.
        assert!(
            line.contains("unsupported=[] ")
                && line.contains("called=[\"per-expert\", \"batched\"]"),
            "{line}"
        );
        assert!(line.contains("checks=12 "), "{line}");
    }
}

/// Past 32 ranks in process mode: 40 processes on one GPU over CUDA IPC, and 36 on two
/// GPUs as 4 emulated nodes of 9 (two-tier: IPC inside a node, NCCL across).
const MANY_IPC: usize = 40;
const MANY_TWO_TIER: usize = 36;

/// One rank of a many-rank group (started by `spawn_local_with`): 2 rounds bitwise against the
/// oracle on every path the group supports, one `MANY` line.
fn many_rank(transport: Transport, world: usize, gpus: usize) -> i32 {
    let o = MpOptions {
        experts: 2 * world,
        tokens: 8,
        hidden: 512,
        top_k: 4,
        mode: Mode::FP8,
        transport,
        nccl_sizes: NcclSizes::default(),
        gpus,
        rounds: 2,
        iters: 0,
        seed: 22,
        masked: 0.1,
        // Every GPU time-slices between the processes it hosts: generous bounds.
        timeout: Duration::from_secs(120),
        die_rank: None,
        stall_rank: None,
    };
    match ep_group::mp::run_rank(&o) {
        Ok(rep) => {
            let unsupported: Vec<&str> = rep.unsupported.iter().map(|(p, _)| p.name()).collect();
            println!(
                "MANY rank={} world={} node={} ipc={} nccl={} checks={} unsupported={:?}",
                rep.rank,
                rep.world,
                rep.node,
                rep.ipc_peers.len(),
                rep.nccl_peers.len(),
                rep.checks,
                unsupported
            );
            0
        }
        Err(f) => {
            eprintln!("many-rank rank: {f}");
            if f.caused_by_peer {
                ep_launch::EXIT_PEER_FAILURE
            } else {
                1
            }
        }
    }
}

/// Starts `n` ranks of `role` (on `nodes` emulated nodes) and returns each rank's MANY line.
fn run_many(role: &str, n: usize, nodes: usize) -> Vec<String> {
    run_ranks(role, n, nodes, "MANY", Duration::from_secs(900))
}

/// Starts `n` ranks of `role` on `nodes` emulated nodes, waits for them (at most `wait`) and
/// returns each rank's verdict: its first output line containing `marker`.
fn run_ranks(role: &str, n: usize, nodes: usize, marker: &str, wait: Duration) -> Vec<String> {
    let exe = std::env::current_exe().expect("test binary path");
    let rank_env = emulation_envs(n, nodes).expect("ranks on emulated nodes");
    let opts = ep_launch::LaunchOptions {
        rank_env,
        ..Default::default()
    };
    let t0 = Instant::now();
    let launch = ep_launch::spawn_local_with(
        &opts,
        n,
        exe,
        Vec::<String>::new(),
        &[
            (CHILD_ENV.to_string(), role.to_string()),
            ("NCCL_NVLS_ENABLE".to_string(), "0".to_string()),
        ],
    )
    .unwrap_or_else(|e| panic!("start {n} ranks: {e}"));
    let report = launch
        .wait(wait)
        .unwrap_or_else(|e| panic!("the {n} {role} ranks failed: {e}"));
    println!("{n} ranks done in {:.1} s", t0.elapsed().as_secs_f64());
    (0..n)
        .map(|rank| {
            report.output[rank]
                .iter()
                .find(|l| l.contains(marker))
                .unwrap_or_else(|| {
                    panic!("rank {rank} printed no verdict: {:?}", report.output[rank])
                })
                .clone()
        })
        .collect()
}

/// 40 processes, one rank each, all on GPU 0, one node: every peer over CUDA IPC (the wide build,
/// a 40-rank group); both paths, 2 rounds, each rank bitwise against the oracle.
fn gpu_process_40_ranks_over_ipc_on_one_gpu_match_the_oracle() {
    let lines = run_many("many-ipc", MANY_IPC, 1);
    for (rank, line) in lines.iter().enumerate() {
        println!("{line}");
        assert!(
            line.contains(&format!("rank={rank} world={MANY_IPC} ")),
            "{line}"
        );
        assert!(
            line.contains(&format!("ipc={} nccl=0 ", MANY_IPC - 1)),
            "{line}"
        );
        // 2 rounds x (dispatch, combine) x 2 paths.
        assert!(
            line.contains("checks=8 ") && line.contains("unsupported=[]"),
            "{line}"
        );
    }
}

/// 36 processes on 2 GPUs as 4 emulated nodes of 9 ranks: 8 peers over CUDA IPC, 27 over NCCL
/// (peers past rank 32 in the NCCL mask); both paths, each rank bitwise against the oracle.
fn gpu_two_tier_36_ranks_on_4_emulated_nodes_match_the_oracle() {
    let lines = run_many("many-two-tier", MANY_TWO_TIER, 4);
    for (rank, line) in lines.iter().enumerate() {
        println!("{line}");
        assert!(
            line.contains(&format!("rank={rank} world={MANY_TWO_TIER} ")),
            "{line}"
        );
        assert!(line.contains("ipc=8 nccl=27 "), "{line}");
        assert!(
            line.contains("checks=8 ") && line.contains("unsupported=[]"),
            "{line}"
        );
    }
}
