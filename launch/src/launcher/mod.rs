//! A local launcher: N processes of one program on this machine, torchrun style.
//!
//! [`spawn_local`] picks a free loopback port, starts the N children with `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR=127.0.0.1`, `MASTER_PORT` and
//! `EP_LAUNCHER=ep-launch` and a fresh random `EP_JOB_TOKEN` (the job's secret, see
//! [`crate::auth`]) set, and copies each child's stdout/stderr lines to its own with a
//! `[rank i] ` prefix. [`Launch::wait`] waits for all of them (bounded); when one exits non-zero
//! or is killed by a signal it reports which rank and how, gives the others a grace period to
//! finish (they usually fail on their own, with a rendezvous error naming the dead rank), then
//! sends them SIGTERM and, if still alive, SIGKILL, and returns an error.
//!
//! Linux/Unix only (signals). Children get `PR_SET_PDEATHSIG=SIGTERM`, so they do not outlive a
//! launcher that is killed; note that Linux delivers it when the *thread* that spawned them
//! exits, so call [`spawn_local`] from the thread that will live as long as the job (as
//! `ep-bench` does, from `main`).

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::io::{BufRead, BufReader, Read};
use std::net::TcpListener;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::auth::JobToken;
use crate::env;
use crate::time::{after, deadline as deadline_at};

/// The most processes [`spawn_local`] starts: ep-dispatch's largest group (1024 ranks). Each
/// costs the launcher three threads (two output readers and a waiter) besides the process, so
/// an absurd count is refused up front ([`LaunchError::InvalidRequest`]) rather than left to
/// fail (or panic) partway through.
pub const MAX_NPROCS: usize = 1024;

/// How the launcher behaves; [`Default`] suits `ep-bench`.
#[derive(Debug, Clone)]
pub struct LaunchOptions {
    /// After the first failure, how long the other ranks may run before SIGTERM.
    pub grace: Duration,
    /// After SIGTERM, how long before SIGKILL.
    pub term_grace: Duration,
    /// Port for rank 0; `None` picks a free one.
    pub master_port: Option<u16>,
    /// Copy children's lines (prefixed) to this process's stdout/stderr.
    pub echo: bool,
    /// How many of each rank's last output lines to keep for the report.
    pub tail_lines: usize,
    /// Variables for one rank each (entry i: rank i), set after `extra_env` (and after the
    /// torchrun variables, so an entry may override `LOCAL_RANK` and the like). Ranks past the
    /// end get none. E.g. `EP_NODE_ID` / `NCCL_HOSTID` to emulate several nodes on one machine.
    pub rank_env: Vec<Vec<(String, String)>>,
}

impl Default for LaunchOptions {
    fn default() -> Self {
        LaunchOptions {
            grace: Duration::from_secs(10),
            term_grace: Duration::from_secs(5),
            master_port: None,
            echo: true,
            tail_lines: 200,
            rank_env: Vec::new(),
        }
    }
}

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitHow {
    Code(i32),
    Signal(i32),
}

impl ExitHow {
    fn of(status: ExitStatus) -> ExitHow {
        match (status.code(), status.signal()) {
            (Some(c), _) => ExitHow::Code(c),
            (None, Some(s)) => ExitHow::Signal(s),
            // Neither code nor signal: report it as an unknown failure code.
            (None, None) => ExitHow::Code(-1),
        }
    }

    pub fn success(self) -> bool {
        self == ExitHow::Code(0)
    }
}

impl std::fmt::Display for ExitHow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            ExitHow::Code(c) => write!(f, "exited with code {c}"),
            ExitHow::Signal(s) => write!(f, "was killed by signal {s}{}", signal_name(s)),
        }
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        1 => " (SIGHUP)",
        2 => " (SIGINT)",
        4 => " (SIGILL)",
        6 => " (SIGABRT)",
        7 => " (SIGBUS)",
        8 => " (SIGFPE)",
        9 => " (SIGKILL)",
        11 => " (SIGSEGV)",
        13 => " (SIGPIPE)",
        15 => " (SIGTERM)",
        _ => "",
    }
}

/// One rank's end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankExit {
    pub rank: usize,
    pub pid: u32,
    pub how: ExitHow,
    /// Time from launch to exit.
    pub after: Duration,
    /// The launcher signalled it (after another rank failed, or at the timeout).
    pub terminated_by_launcher: bool,
}

impl std::fmt::Display for RankExit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} (pid {}) {} after {:.2?}",
            self.rank, self.pid, self.how, self.after
        )?;
        if self.terminated_by_launcher {
            f.write_str(", terminated by the launcher")?;
        }
        Ok(())
    }
}

fn summary(exits: &[RankExit]) -> String {
    exits
        .iter()
        .map(|e| e.to_string())
        .collect::<Vec<_>>()
        .join("; ")
}

/// The exit code a rank uses when it fails *because another rank failed* (its rendezvous error
/// names another rank: [`RendezvousError::is_caused_by_peer`](crate::RendezvousError::is_caused_by_peer)).
/// The launcher then blames the other rank: when a rank dies, the survivors see it within
/// milliseconds and exit too, so the order in which the exits reach the launcher says nothing
/// about which rank failed first.
pub const EXIT_PEER_FAILURE: i32 = 86;

/// The rank to blame: the earliest failure that is not [`EXIT_PEER_FAILURE`], else the earliest.
fn primary_failure(exits: &[RankExit]) -> Option<usize> {
    let failed = || {
        exits
            .iter()
            .filter(|e| !e.how.success() && !e.terminated_by_launcher)
    };
    failed()
        .filter(|e| e.how != ExitHow::Code(EXIT_PEER_FAILURE))
        .min_by_key(|e| e.after)
        .or_else(|| failed().min_by_key(|e| e.after))
        .map(|e| e.rank)
}

/// A launcher failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    #[error("invalid launch request: {detail}")]
    InvalidRequest { detail: String },
    #[error("cannot find a free port on 127.0.0.1: {cause}")]
    NoFreePort { cause: String },
    #[error("cannot make a job token for the ranks: {cause}")]
    NoToken { cause: String },
    #[error("cannot start rank {rank} ({program}): {cause}")]
    Spawn {
        rank: usize,
        program: String,
        cause: String,
    },
    #[error("rank {rank} {how}; all ranks: {}", summary(.exits))]
    RankFailed {
        rank: usize,
        how: ExitHow,
        /// Every rank's end, in rank order.
        exits: Vec<RankExit>,
        /// Every rank's last output lines (see [`LaunchReport::output`]): the failed rank's
        /// last words, and the others' own errors.
        output: Vec<Vec<String>>,
    },
    #[error("ranks {running:?} still running after the launch timeout {timeout:?}; terminated them; all ranks: {}", summary(.exits))]
    Timeout {
        timeout: Duration,
        running: Vec<usize>,
        exits: Vec<RankExit>,
    },
    #[error("rank {rank}: waiting for the process failed: {cause}")]
    Wait { rank: usize, cause: String },
}

/// What a successful launch left: every rank's exit and last output lines.
#[derive(Debug, Clone)]
pub struct LaunchReport {
    pub exits: Vec<RankExit>,
    /// Per rank, its last output lines (stdout and stderr interleaved as read), unprefixed.
    pub output: Vec<Vec<String>>,
}

/// Picks a free TCP port on 127.0.0.1 (bind port 0, read it, release it). Racy: another
/// process may take the port before it is bound again; [`spawn_local`] does not use it (it
/// hands its bound socket to rank 0, see [`crate::env::EP_RDZV_LISTEN_FD`]).
pub fn free_port() -> Result<u16, LaunchError> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| LaunchError::NoFreePort {
        cause: e.to_string(),
    })?;
    l.local_addr()
        .map(|a| a.port())
        .map_err(|e| LaunchError::NoFreePort {
            cause: e.to_string(),
        })
}

type Tails = Arc<Mutex<Vec<VecDeque<String>>>>;

/// N running ranks. Dropping it without [`wait`](Launch::wait) kills them.
pub struct Launch {
    pids: Vec<u32>,
    port: u16,
    started: Instant,
    opts: LaunchOptions,
    exits_rx: mpsc::Receiver<(usize, std::io::Result<ExitStatus>, Instant)>,
    done: Vec<Option<RankExit>>,
    terminated: Vec<bool>,
    waiters: Vec<JoinHandle<()>>,
    readers: Vec<JoinHandle<()>>,
    tails: Tails,
}

impl std::fmt::Debug for Launch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Launch")
            .field("pids", &self.pids)
            .field("port", &self.port)
            .finish_non_exhaustive()
    }
}

/// Starts `nprocs` copies of `program args...` with the torchrun variables set (see the module
/// docs), with [`LaunchOptions::default`]. `extra_env` is set in every child after those
/// variables. `nprocs` outside `1..=MAX_NPROCS` is [`LaunchError::InvalidRequest`].
pub fn spawn_local<I, S>(
    nprocs: usize,
    program: impl AsRef<OsStr>,
    args: I,
    extra_env: &[(String, String)],
) -> Result<Launch, LaunchError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    spawn_local_with(&LaunchOptions::default(), nprocs, program, args, extra_env)
}

/// [`spawn_local`] with explicit options.
pub fn spawn_local_with<I, S>(
    opts: &LaunchOptions,
    nprocs: usize,
    program: impl AsRef<OsStr>,
    args: I,
    extra_env: &[(String, String)],
) -> Result<Launch, LaunchError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<OsStr>,
{
    if nprocs == 0 {
        return Err(LaunchError::InvalidRequest {
            detail: "nprocs must be at least 1".into(),
        });
    }
    if nprocs > MAX_NPROCS {
        return Err(LaunchError::InvalidRequest {
            detail: format!(
                "nprocs {nprocs} exceeds the maximum {MAX_NPROCS} processes one launcher starts"
            ),
        });
    }
    if opts.rank_env.len() > nprocs {
        return Err(LaunchError::InvalidRequest {
            detail: format!(
                "per-rank variables for {} ranks, and {nprocs} processes",
                opts.rank_env.len()
            ),
        });
    }
    if let Some((k, _)) = extra_env
        .iter()
        .chain(opts.rank_env.iter().flatten())
        .find(|(k, _)| k.is_empty() || k.contains('=') || k.contains('\0'))
    {
        return Err(LaunchError::InvalidRequest {
            detail: format!("bad environment variable name {k:?}"),
        });
    }
    // Without a given port, bind one here and hand the bound socket to rank 0: the port is
    // held from now until rank 0's rendezvous listens on it (no window for another process).
    let (port, mut listener) = match opts.master_port {
        Some(0) => {
            return Err(LaunchError::InvalidRequest {
                detail: "master_port 0".into(),
            })
        }
        Some(p) => (p, None),
        None => {
            let no_port = |e: std::io::Error| LaunchError::NoFreePort {
                cause: e.to_string(),
            };
            let l = TcpListener::bind("127.0.0.1:0").map_err(no_port)?;
            (l.local_addr().map_err(no_port)?.port(), Some(l))
        }
    };
    // The job's secret: only processes started here (or given it) can join the rendezvous.
    let (_, token) = JobToken::generate().map_err(|e| LaunchError::NoToken {
        cause: e.to_string(),
    })?;
    let program = program.as_ref().to_os_string();
    let args: Vec<OsString> = args
        .into_iter()
        .map(|a| a.as_ref().to_os_string())
        .collect();
    let tails: Tails = Arc::new(Mutex::new(vec![VecDeque::new(); nprocs]));
    let (tx, exits_rx) = mpsc::channel();
    let started = Instant::now();

    let mut launch = Launch {
        pids: Vec::with_capacity(nprocs),
        port,
        started,
        opts: opts.clone(),
        exits_rx,
        done: vec![None; nprocs],
        terminated: vec![false; nprocs],
        waiters: Vec::new(),
        readers: Vec::new(),
        tails,
    };

    for rank in 0..nprocs {
        let mut cmd = Command::new(&program);
        cmd.args(&args)
            .env(env::RANK, rank.to_string())
            .env(env::WORLD_SIZE, nprocs.to_string())
            .env(env::LOCAL_RANK, rank.to_string())
            .env(env::LOCAL_WORLD_SIZE, nprocs.to_string())
            .env(env::MASTER_ADDR, "127.0.0.1")
            .env(env::MASTER_PORT, port.to_string())
            .env(env::EP_LAUNCHER, "ep-launch")
            .env(env::EP_JOB_TOKEN, &token)
            // The children are on this host and hold the token: never open.
            .env_remove(env::EP_RDZV_OPEN)
            // Inherited values would move the rendezvous off the port picked here.
            .env_remove(env::EP_RDZV_PORT)
            .env_remove(env::EP_RDZV_LISTEN_FD)
            .env_remove(env::TORCHELASTIC_RUN_ID)
            .envs(extra_env.iter().map(|(k, v)| (k, v)))
            .envs(
                opts.rank_env
                    .get(rank)
                    .into_iter()
                    .flatten()
                    .map(|(k, v)| (k, v)),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        set_parent_death_signal(&mut cmd);
        if rank == 0 {
            if let Some(l) = &listener {
                let fd = crate::inherit::pass_to_child(&mut cmd, l);
                cmd.env(env::EP_RDZV_LISTEN_FD, fd.to_string());
            }
        }
        let mut child: Child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                // Dropping `launch` terminates the ranks already started.
                return Err(LaunchError::Spawn {
                    rank,
                    program: program.to_string_lossy().into_owned(),
                    cause: e.to_string(),
                });
            }
        };
        if rank == 0 {
            // Rank 0 holds its own copy now; the launcher's would only keep the port busy after
            // rank 0 is gone.
            listener = None;
        }
        launch.pids.push(child.id());
        if let Some(out) = child.stdout.take() {
            launch
                .readers
                .push(forward(rank, out, false, &launch.opts, &launch.tails));
        }
        if let Some(err) = child.stderr.take() {
            launch
                .readers
                .push(forward(rank, err, true, &launch.opts, &launch.tails));
        }
        let tx = tx.clone();
        launch.waiters.push(std::thread::spawn(move || {
            let status = child.wait();
            let _ = tx.send((rank, status, Instant::now()));
        }));
    }
    Ok(launch)
}

/// Copies one pipe's lines to ours with the rank prefix and keeps a tail.
fn forward(
    rank: usize,
    pipe: impl Read + Send + 'static,
    is_stderr: bool,
    opts: &LaunchOptions,
    tails: &Tails,
) -> JoinHandle<()> {
    let echo = opts.echo;
    let keep = opts.tail_lines;
    let tails = Arc::clone(tails);
    std::thread::spawn(move || {
        let mut r = BufReader::new(pipe);
        let mut buf = Vec::new();
        loop {
            buf.clear();
            match r.read_until(b'\n', &mut buf) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    while buf.last().is_some_and(|&b| b == b'\n' || b == b'\r') {
                        buf.pop();
                    }
                    let line = String::from_utf8_lossy(&buf).into_owned();
                    if echo {
                        // One formatted write per line, so lines of different ranks never mix.
                        if is_stderr {
                            eprint!("{}", prefix_line(rank, &line));
                        } else {
                            print!("{}", prefix_line(rank, &line));
                        }
                    }
                    if keep > 0 {
                        let mut t = tails.lock().unwrap_or_else(|p| p.into_inner());
                        if let Some(q) = t.get_mut(rank) {
                            if q.len() == keep {
                                q.pop_front();
                            }
                            q.push_back(line);
                        }
                    }
                }
            }
        }
    })
}

/// `[rank i] line\n`: how a child's output line appears in the launcher's output.
pub fn prefix_line(rank: usize, line: &str) -> String {
    format!("[rank {rank}] {line}\n")
}

impl Launch {
    /// The port rank 0 listens on.
    pub fn master_port(&self) -> u16 {
        self.port
    }

    /// The children's process ids, in rank order.
    pub fn pids(&self) -> &[u32] {
        &self.pids
    }

    /// Waits for every rank, at most `timeout` in all (then terminates those still running).
    /// `Ok` when all exited with code 0; otherwise [`LaunchError::RankFailed`] naming the rank to
    /// blame (the earliest failure that is not [`EXIT_PEER_FAILURE`]), with every rank's exit
    /// and last output lines.
    pub fn wait(mut self, timeout: Duration) -> Result<LaunchReport, LaunchError> {
        let n = self.pids.len();
        let deadline = deadline_at(self.started, timeout);
        let mut first_failure: Option<usize> = None;
        let mut term_at: Option<Instant> = None;
        let mut kill_at: Option<Instant> = None;
        let mut timed_out: Option<Vec<usize>> = None;

        while self.done.iter().any(Option::is_none) {
            let now = Instant::now();
            // Next moment something must happen without a child exiting.
            let mut wake = deadline;
            if let Some(t) = term_at {
                wake = wake.min(t);
            }
            if let Some(k) = kill_at {
                wake = wake.min(k);
            }
            let wait_for = wake
                .saturating_duration_since(now)
                .max(Duration::from_millis(1));
            match self.exits_rx.recv_timeout(wait_for) {
                Ok((rank, status, at)) => {
                    let status = status.map_err(|e| LaunchError::Wait {
                        rank,
                        cause: e.to_string(),
                    })?;
                    let exit = RankExit {
                        rank,
                        pid: self.pids[rank],
                        how: ExitHow::of(status),
                        after: at.saturating_duration_since(self.started),
                        terminated_by_launcher: self.terminated[rank],
                    };
                    let failed = !exit.how.success() && !exit.terminated_by_launcher;
                    self.done[rank] = Some(exit);
                    if failed && first_failure.is_none() {
                        first_failure = Some(rank);
                        term_at = Some(after(self.opts.grace));
                    }
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    // Every waiter thread has reported; nothing more can arrive.
                    break;
                }
            }
            let now = Instant::now();
            if timed_out.is_none() && now >= deadline && term_at.map_or(true, |t| t > now) {
                timed_out = Some(self.running());
                term_at = Some(now);
            }
            if let Some(t) = term_at {
                if now >= t && kill_at.is_none() {
                    self.signal_running(SIGTERM);
                    kill_at = Some(deadline_at(now, self.opts.term_grace));
                }
            }
            if let Some(k) = kill_at {
                if now >= k {
                    self.signal_running(SIGKILL);
                    // SIGKILL cannot be ignored; the waiters report promptly. Bound it anyway.
                    kill_at = Some(deadline_at(now, Duration::from_secs(5)));
                    let give_up = self
                        .opts
                        .grace
                        .saturating_add(self.opts.term_grace)
                        .saturating_add(Duration::from_secs(10));
                    if now >= deadline_at(deadline, give_up) {
                        break;
                    }
                }
            }
        }

        self.join_helpers();
        let exits: Vec<RankExit> = self
            .done
            .iter()
            .enumerate()
            .map(|(rank, e)| {
                e.clone().unwrap_or(RankExit {
                    rank,
                    pid: self.pids[rank],
                    how: ExitHow::Signal(SIGKILL),
                    after: self.started.elapsed(),
                    terminated_by_launcher: true,
                })
            })
            .collect();
        let mut output: Vec<Vec<String>> = {
            let t = self.tails.lock().unwrap_or_else(|p| p.into_inner());
            t.iter().map(|q| q.iter().cloned().collect()).collect()
        };
        output.resize(n, Vec::new());

        if first_failure.is_some() {
            let rank = primary_failure(&exits).unwrap_or(first_failure.unwrap_or(0));
            return Err(LaunchError::RankFailed {
                rank,
                how: exits[rank].how,
                exits,
                output,
            });
        }
        if let Some(running) = timed_out {
            return Err(LaunchError::Timeout {
                timeout,
                running,
                exits,
            });
        }
        Ok(LaunchReport { exits, output })
    }

    fn running(&self) -> Vec<usize> {
        (0..self.pids.len())
            .filter(|&r| self.done[r].is_none())
            .collect()
    }

    fn signal_running(&mut self, sig: i32) {
        for r in self.running() {
            self.terminated[r] = true;
            send_signal(self.pids[r], sig);
        }
    }

    /// Joins the waiter and output threads, bounded: a grandchild holding a pipe open must not
    /// hang the launcher.
    fn join_helpers(&mut self) {
        let until = after(Duration::from_secs(2));
        for h in self.readers.drain(..).chain(self.waiters.drain(..)) {
            while !h.is_finished() && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            if h.is_finished() {
                let _ = h.join();
            }
        }
    }
}

impl Drop for Launch {
    fn drop(&mut self) {
        // Not waited for (an early return, a panic): do not leave ranks behind. Drain first so
        // ranks already reaped are not signalled.
        while let Ok((rank, status, _)) = self.exits_rx.try_recv() {
            if let Ok(st) = status {
                self.done[rank] = Some(RankExit {
                    rank,
                    pid: self.pids[rank],
                    how: ExitHow::of(st),
                    after: self.started.elapsed(),
                    terminated_by_launcher: false,
                });
            }
        }
        if self.waiters.is_empty() {
            return;
        }
        self.signal_running(SIGKILL);
    }
}

const SIGTERM: i32 = 15;
const SIGKILL: i32 = 9;

extern "C" {
    fn kill(pid: i32, sig: i32) -> i32;
    fn prctl(option: i32, ...) -> i32;
}

fn send_signal(pid: u32, sig: i32) {
    if let Ok(pid) = i32::try_from(pid) {
        if pid > 0 {
            // SAFETY: kill(2) has no memory effects. The pid is one of our children whose exit we
            // have not received; at worst its waiter thread reaped it an instant ago, and Linux
            // hands out pids sequentially, so it cannot have been reused yet.
            unsafe {
                kill(pid, sig);
            }
        }
    }
}

fn set_parent_death_signal(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        const PR_SET_PDEATHSIG: i32 = 1;
        // SAFETY: prctl(PR_SET_PDEATHSIG) is async-signal-safe and touches only the child.
        unsafe {
            cmd.pre_exec(|| {
                prctl(PR_SET_PDEATHSIG, SIGTERM as std::ffi::c_ulong);
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

#[cfg(test)]
mod tests;
