//! One process per rank, torchrun style: the rank's side of a multi-process run (what
//! `ep-bench --nprocs` runs in each rank, and the process-mode tests).
//!
//! Each rank rendezvouses (`ep_launch`), opens GPU `LOCAL_RANK % gpus`, forms the group (CUDA IPC
//! handles, or the NCCL unique id, exchanged through the rendezvous; under `Transport::TwoTier`
//! IPC to the ranks of its node and NCCL to the others, the node from `EP_NODE_ID`, `GROUP_RANK`
//! or the hostname: `crate::topology`), checks every path against the oracle for `rounds` random
//! inputs (all ranks generate the same inputs from the seed and compare their own outputs bit for
//! bit), then hands the group to its caller ([`run_rank_with`]: ep-bench times `iters`
//! back-to-back calls per path there, `ep_benches::multiproc`) before the final barrier. A path
//! the transport does not support (the group answers `Unsupported` before
//! anything is launched, on every rank alike) is reported as such and left out, not failed.
//!
//! Test machinery (feature `testing`, off by default): a harness of the process-mode tests and
//! ep-bench, with their fault injection (`die_rank`, `stall_rank`), not the library's API (a
//! user forms a group with [`crate::new_process`]).

use crate::error::GroupError;
use crate::form::new_process;
use ep_kernels::runtime::{GpuGroup, GpuOptions, NcclSizes, Path, Transport};
use ep_kernels::testing::{
    random_inputs, random_y_received, rank_inputs, received_counts, RankData, Rng, Routing,
};
use ep_kernels::GpuError;
use ep_launch::Rendezvous;
use ep_reference::oracle::{self, CombineInput};
use ep_reference::{bf16, Config, Error, Mode};
use std::time::{Duration, Instant};

/// What one rank runs.
#[derive(Debug, Clone)]
pub struct MpOptions {
    pub experts: usize,
    pub tokens: usize,
    pub hidden: usize,
    pub top_k: usize,
    pub mode: Mode,
    pub transport: Transport,
    /// NCCL transport: the batched path's sizing (per-expert always runs exact sizes).
    pub nccl_sizes: NcclSizes,
    /// GPUs on this node; rank i uses GPU `LOCAL_RANK % gpus`.
    pub gpus: usize,
    pub rounds: usize,
    /// Timed calls per path and operation (0: verify only), for the caller that times them
    /// ([`run_rank_with`]: `ep-bench --nprocs`); [`run_rank`] itself times nothing.
    pub iters: usize,
    pub seed: u64,
    /// Probability that a top-k slot is -1.
    pub masked: f64,
    pub timeout: Duration,
    /// Test hooks: this rank exits (code 3) before round 1's dispatch ...
    pub die_rank: Option<usize>,
    /// ... or stays alive but silent for three timeouts, then exits.
    pub stall_rank: Option<usize>,
}

/// What one rank did.
#[derive(Debug, Clone)]
pub struct MpReport {
    pub rank: usize,
    pub world: usize,
    pub config: Config,
    pub transport: Transport,
    pub device: String,
    /// Outputs compared bit for bit with the oracle.
    pub checks: usize,
    /// This rank's selections in the inputs of the timed calls ([`RankRun::inputs`]).
    pub selections: usize,
    /// Every rank's routing of the timed calls (all ranks draw the same inputs from the seed).
    pub timed_topk_idx: Vec<Vec<i64>>,
    /// This rank's node (`crate::topology`), e.g. "EP_NODE_ID=1".
    pub node: String,
    /// Peers reached through CUDA IPC and through NCCL.
    pub ipc_peers: Vec<usize>,
    pub nccl_peers: Vec<usize>,
    /// Paths the group refused (and why): not checked, not timed.
    pub unsupported: Vec<(Path, String)>,
}

/// Why a rank failed; `caused_by_peer` when another rank's failure is the cause (the process
/// should then exit with `ep_launch::EXIT_PEER_FAILURE`, so the launcher blames the right rank).
#[derive(Debug, Clone)]
pub struct MpFailure {
    pub message: String,
    pub caused_by_peer: bool,
}

impl std::fmt::Display for MpFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

fn fail(message: String, caused_by_peer: bool) -> MpFailure {
    MpFailure {
        message,
        caused_by_peer,
    }
}

fn gpu_err(rank: usize, what: &str, e: GpuError) -> MpFailure {
    // A wait on another rank that ran out, or an NCCL set-up that a peer never completed.
    let by_peer = match &e {
        GpuError::Contract(Error::Timeout { peer, .. }) => *peer != rank,
        GpuError::NcclTimeout { .. } => true,
        _ => false,
    };
    fail(format!("rank {rank}: {what}: {e}"), by_peer)
}

/// [`gpu_err`] of forming the group: the GPU library's errors as above; the handshake's and the
/// node id's are this rank's own findings.
fn group_err(rank: usize, what: &str, e: GroupError) -> MpFailure {
    match e {
        GroupError::Gpu(e) => gpu_err(rank, what, e),
        e => fail(format!("rank {rank}: {what}: {e}"), false),
    }
}

/// The GPU wait bound of `timeout`, in nanoseconds, saturating at `u64::MAX` (about 584 years;
/// the kernels compare elapsed times, so no sum can overflow there).
pub fn timeout_ns(timeout: Duration) -> u64 {
    u64::try_from(timeout.as_nanos()).unwrap_or(u64::MAX)
}

/// The longest host wait a rank hands on (30 days): beyond any real bound, and small enough
/// that `Instant::now() + wait` cannot overflow in the rendezvous or in a sleep.
pub const MAX_HOST_WAIT: Duration = Duration::from_secs(30 * 24 * 3600);

/// Progress lines on stderr when `EP_MP_TRACE` is set (`[rank R +S s] step`), so that a rank
/// stopped from outside (the fault runs) shows where it was. Off by default: the normal output
/// is the report only.
struct Trace {
    on: bool,
    rank: std::cell::Cell<Option<usize>>,
    t0: Instant,
}

impl Trace {
    fn new() -> Trace {
        Trace {
            on: std::env::var_os("EP_MP_TRACE").is_some_and(|v| !v.is_empty() && v != "0"),
            rank: std::cell::Cell::new(None),
            t0: Instant::now(),
        }
    }

    fn step(&self, what: &str) {
        if self.on {
            let r = self.rank.get().map_or("?".into(), |r| r.to_string());
            eprintln!(
                "[rank {r} +{:.3} s] {what}",
                self.t0.elapsed().as_secs_f64()
            );
        }
    }
}

/// Traces `what` when dropped (guards declared around the group trace its release on every
/// path, errors included).
struct TraceOnDrop<'a>(&'a Trace, &'static str);

impl Drop for TraceOnDrop<'_> {
    fn drop(&mut self) {
        self.0.step(self.1);
    }
}

/// This rank between its checks and its final barrier, handed to the caller of
/// [`run_rank_with`] (ep-bench times its calls there): the formed group, the rendezvous, the
/// paths the group accepted, and every rank's inputs of the timed calls (drawn from the shared
/// seed after the checks).
pub struct RankRun<'a> {
    pub rank: usize,
    pub world: usize,
    pub config: Config,
    pub group: &'a mut GpuGroup,
    pub rdzv: &'a mut Rendezvous,
    pub paths: &'a [Path],
    pub inputs: &'a [RankData],
    /// Every rank's expert outputs (combine inputs) for the timed calls.
    pub y: &'a [Vec<bf16>],
    trace: &'a Trace,
}

impl RankRun<'_> {
    /// A progress line (stderr, with `EP_MP_TRACE` set).
    pub fn step(&self, what: &str) {
        self.trace.step(what)
    }

    /// The failure of a GPU call of this rank, blaming a peer where a peer is the cause.
    pub fn gpu_failure(&self, what: &str, e: GpuError) -> MpFailure {
        gpu_err(self.rank, what, e)
    }
}

/// The NCCL sizing every rank switches to before `path`'s calls (both sides size each message
/// alike): per-expert runs exact sizes only, batched `o.nccl_sizes`.
pub fn sizes_for(o: &MpOptions, path: Path) -> NcclSizes {
    match path {
        Path::PerExpert => NcclSizes::Exact,
        Path::Batched => o.nccl_sizes,
    }
}

/// Runs this process's rank (the environment names it: `RANK`, `WORLD_SIZE`, ...): joins the
/// rendezvous, forms the group, checks every path against the oracle for `o.rounds` rounds,
/// then the final sync and barrier. Times nothing.
pub fn run_rank(o: &MpOptions) -> Result<MpReport, MpFailure> {
    run_rank_with(o, |_| Ok(())).map(|(report, ())| report)
}

/// [`run_rank`], with `between` run after the checks and before the final barrier (ep-bench
/// times `o.iters` calls per path there); its result comes back beside the report.
pub fn run_rank_with<T>(
    o: &MpOptions,
    between: impl FnOnce(&mut RankRun<'_>) -> Result<T, MpFailure>,
) -> Result<(MpReport, T), MpFailure> {
    let trace = Trace::new();
    trace.step("joining the rendezvous");
    let host_wait = o.timeout.min(MAX_HOST_WAIT);
    let mut rdzv = Rendezvous::from_env(
        Duration::from_secs(60),
        host_wait.max(Duration::from_secs(30)),
    )
    .map_err(|e| fail(format!("rendezvous: {e}"), false))?;
    let (rank, world) = (rdzv.rank(), rdzv.world_size());
    trace.rank.set(Some(rank));
    trace.step("rendezvous joined");
    let local_rank = ep_launch::ProcessConfig::from_env()
        .map(|p| p.local_rank)
        .unwrap_or(rank);
    let gpus = o.gpus.max(1);
    let ordinal = local_rank % gpus;
    let cfg = Config::new(world, o.experts, o.tokens, o.hidden, o.top_k, o.mode)
        .map_err(|e| fail(format!("config: {e}"), false))?;
    let opts = GpuOptions {
        transport: o.transport,
        nccl_sizes: o.nccl_sizes,
        timeout_ns: timeout_ns(o.timeout),
        ..Default::default()
    };
    let node = crate::node::node_id()
        .map(|n| n.to_string())
        .map_err(|e| fail(format!("rank {rank}: {e}"), false))?;
    trace.step("forming the group");
    // Dropped after `g` (declared before it): the group's release, on every path, is traced.
    let _released = TraceOnDrop(&trace, "leaving: the group, if formed, is released");
    let mut g = new_process(&cfg, opts, rank, ordinal, &mut |b| {
        rdzv.all_gather(b).map_err(|e| e.to_string())
    })
    .map_err(|e| group_err(rank, "group", e))?;
    let _releasing = TraceOnDrop(&trace, "releasing the group");
    trace.step("group formed");
    // From here every host wait is bounded by the job's own wait bound (the
    // set-up above may take longer: kernels compile, NCCL connects): a peer stopped while this
    // rank is at a barrier is reported within it, as a peer stopped mid-call is by the kernels.
    rdzv.set_op_timeout(host_wait.max(Duration::from_millis(1)))
        .map_err(|e| fail(format!("rank {rank}: {e}"), false))?;
    let device = format!("GPU {ordinal} ({})", g.describe_devices());
    let mask = g.nccl_mask();
    let nccl_peers: Vec<usize> = (0..world).filter(|&d| mask.contains(d)).collect();
    let ipc_peers: Vec<usize> = (0..world)
        .filter(|&d| d != rank && !mask.contains(d))
        .collect();
    let mut paths: Vec<Path> = Path::ALL.to_vec();
    let mut unsupported = Vec::new();
    // Every rank switches together before each path's calls (both sides size each message
    // alike): per-expert runs exact sizes only.
    let sizes_for = |path: Path| sizes_for(o, path);
    let masked = Routing::Random {
        masked: o.masked as f32,
    };
    let mut rng = Rng::new(o.seed);
    let mut checks = 0;
    for round in 0..o.rounds {
        let tokens: Vec<usize> = (0..world)
            .map(|s| {
                if round == 1 && s == 1 {
                    o.tokens / 2
                } else {
                    o.tokens
                }
            })
            .collect();
        let data = random_inputs(&cfg, &tokens, masked, &mut rng);
        // Every rank draws every rank's y, for the received rows only (the whole L x R*T
        // capacity of every rank grows as R^3 here).
        let y = random_y_received(&cfg, &received_counts(&cfg, &data), &mut rng);
        let inputs = rank_inputs(&data);
        let want =
            oracle::dispatch(&cfg, &inputs).map_err(|e| fail(format!("oracle: {e}"), false))?;
        let cin: Vec<CombineInput> = data
            .iter()
            .zip(&y)
            .map(|(d, y)| CombineInput {
                y,
                topk_idx: &d.topk_idx,
                topk_weights: &d.topk_weights,
            })
            .collect();
        let want_c =
            oracle::combine(&cfg, &cin).map_err(|e| fail(format!("oracle: {e}"), false))?;
        let me = &data[rank];
        trace.step(&format!("round {round}: checking every path"));
        for path in paths.clone() {
            if o.die_rank == Some(rank) && round == 1 {
                eprintln!("rank {rank}: exiting on purpose (die_rank) before the round-1 dispatch");
                std::process::exit(3);
            }
            if o.stall_rank == Some(rank) && round == 1 {
                // Alive but silent (its buffers stay mapped): the peers' waits must time out.
                eprintln!(
                    "rank {rank}: stalling on purpose (stall_rank) before the round-1 dispatch"
                );
                std::thread::sleep(host_wait.saturating_mul(3));
                std::process::exit(3);
            }
            g.set_nccl_sizes(sizes_for(path));
            let t0 = Instant::now();
            let got = match g.dispatch_rank(path, &me.x, &me.topk_idx) {
                // Refused before anything was launched (every rank alike: the refusal depends
                // on the transport only): report it, go on with the other path.
                Err(GpuError::Unsupported(why)) => {
                    unsupported.push((path, why));
                    paths.retain(|&p| p != path);
                    continue;
                }
                r => r,
            };
            let got = got.map_err(|e| {
                let f = gpu_err(rank, &format!("{} dispatch", path.name()), e);
                fail(
                    format!("{} (after {} ms)", f.message, t0.elapsed().as_millis()),
                    f.caused_by_peer,
                )
            })?;
            if let Some(d) = got.diff(&want[rank]) {
                return Err(fail(
                    format!(
                        "rank {rank}: {} dispatch differs from the oracle: {d}",
                        path.name()
                    ),
                    false,
                ));
            }
            let out = g
                .combine_rank(path, &y[rank], &me.topk_weights)
                .map_err(|e| gpu_err(rank, &format!("{} combine", path.name()), e))?;
            if let Some(i) = (0..out.len()).find(|&i| out[i].to_bits() != want_c[rank][i].to_bits())
            {
                return Err(fail(
                    format!(
                        "rank {rank}: {} combine differs from the oracle at element {i}",
                        path.name()
                    ),
                    false,
                ));
            }
            checks += 2;
        }
    }
    let data = random_inputs(&cfg, &vec![o.tokens; world], masked, &mut rng);
    let y = random_y_received(&cfg, &received_counts(&cfg, &data), &mut rng);
    let me = &data[rank];
    let selections = me.topk_idx.iter().filter(|&&e| e >= 0).count();
    let between = between(&mut RankRun {
        rank,
        world,
        config: cfg,
        group: &mut g,
        rdzv: &mut rdzv,
        paths: &paths,
        inputs: &data,
        y: &y,
        trace: &trace,
    })?;
    // No rank frees its buffers while a peer may still touch them through its IPC mapping: all
    // of this rank's work is done, then every rank meets once more before `g` drops (with
    // `--iters 0` a fast rank used to free memory a slower peer was still writing).
    trace.step("final sync and barrier");
    g.sync().map_err(|e| gpu_err(rank, "final sync", e))?;
    rdzv.barrier("done")
        .map_err(|e| fail(format!("rank {rank}: final barrier: {e}"), true))?;
    let report = MpReport {
        rank,
        world,
        config: cfg,
        transport: o.transport,
        device,
        checks,
        selections,
        // Over NCCL the wire figures of one call, all ranks, follow from these (every rank holds
        // every rank's inputs: they come from the shared seed).
        timed_topk_idx: data.iter().map(|d| d.topk_idx.clone()).collect(),
        node,
        ipc_peers,
        nccl_peers,
        unsupported,
    };
    Ok((report, between))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_wait_bound_saturates() {
        assert_eq!(timeout_ns(Duration::from_millis(10_000)), 10_000_000_000);
        assert_eq!(timeout_ns(Duration::from_nanos(1_500)), 1_500);
        // 2^64 ms wrapped to a small bound (or 0: no wait at all) before.
        assert_eq!(timeout_ns(Duration::from_secs(u64::MAX / 1000)), u64::MAX);
        assert_eq!(timeout_ns(Duration::MAX), u64::MAX);
        assert_eq!(timeout_ns(Duration::from_nanos(u64::MAX)), u64::MAX);
    }

    #[test]
    fn an_nccl_set_up_timeout_blames_a_peer() {
        let e = GpuError::NcclTimeout {
            rank: 1,
            what: "ncclCommInitRankConfig (communicator set-up)",
            waited_ms: 20_000,
        };
        let f = gpu_err(1, "group", e);
        assert!(f.caused_by_peer);
        assert!(f.message.contains("20000 ms"), "{}", f.message);
        let e = GroupError::PeerMismatch {
            field: "hidden",
            ours: "1024".into(),
            theirs: "2048".into(),
            rank: 1,
            peer: 0,
        };
        let f = group_err(1, "group", e);
        assert!(!f.caused_by_peer);
        assert!(
            f.message.contains("rank 1 has 1024, rank 0 has 2048"),
            "{}",
            f.message
        );
    }

    #[test]
    fn the_host_wait_cap_cannot_overflow_an_instant() {
        let now = Instant::now();
        assert!(now.checked_add(MAX_HOST_WAIT.saturating_mul(3)).is_some());
        assert_eq!(Duration::MAX.min(MAX_HOST_WAIT), MAX_HOST_WAIT);
    }
}
