//! Multi-process tests: the test binary re-executes itself as the ranks.
//!
//! A test calls [`run_world`], which starts `n` copies of the current test executable,
//! each running only the `rank_entry` test with [`SCENARIO`] and the `TINYLLM_*` variables
//! set; `rank_entry` is a no-op in a normal test run. Each world has its own deadline: past
//! it every rank is killed and the test fails, so nothing hangs.
//!
//! Tests that only need the ring's bytes, not separate processes, run the ranks as threads
//! with [`thread_world`] (the sockets and the algorithm are the same).

#![allow(dead_code)]

use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tl_collective::{
    ENV_RANK, ENV_RENDEZVOUS, ENV_SECRET, ENV_WORLD_SIZE, RingComm, RingConfig, format_secret,
};

/// The variable that tells a re-executed test binary which scenario to run as a rank.
pub const SCENARIO: &str = "TL_TEST_SCENARIO";

/// What one rank did.
#[derive(Debug)]
pub struct RankRun {
    pub status: ExitStatus,
    /// The lines the rank printed as `RESULT <line>`.
    pub results: Vec<String>,
    pub stderr: String,
}

impl RankRun {
    /// The value of `RESULT key=value`.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.results
            .iter()
            .find_map(|line| line.strip_prefix(key)?.strip_prefix('='))
    }
}

/// A fresh 0700 rendezvous directory.
pub fn rendezvous() -> tempfile::TempDir {
    let dir = tempfile::Builder::new()
        .prefix("tl-collective-test-")
        .tempdir()
        .expect("temporary directory");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o700)).expect("chmod");
    dir
}

/// Runs `rank_program` on the `n` ranks of a ring, one thread each, with the ring's
/// `timeout` (a rank that waits that long fails, so nothing hangs), and returns what each
/// returned, in rank order. A rank that panics drops its sockets, so the others fail at once.
pub fn thread_world<T: Send>(
    n: usize,
    timeout: Duration,
    rank_program: impl Fn(RingComm) -> T + Sync,
) -> Vec<T> {
    let dir = rendezvous();
    let secret = [n as u8; 32];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (dir, rank_program) = (dir.path(), &rank_program);
                scope.spawn(move || {
                    let config = RingConfig::new(rank, n, dir, secret)
                        .expect("a valid rank")
                        .timeout(timeout);
                    rank_program(RingComm::connect(config).expect("the ring forms"))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

/// Runs `scenario` on `n` ranks with `env`, killing them all and panicking past `deadline`.
pub fn run_world(
    n: usize,
    scenario: &str,
    env: &[(&str, String)],
    deadline: Duration,
) -> Vec<RankRun> {
    let dir = rendezvous();
    let secret: [u8; 32] =
        std::array::from_fn(|i| (i as u8).wrapping_mul(151).wrapping_add(n as u8));
    let exe = std::env::current_exe().expect("test executable");
    let mut children: Vec<Child> = (0..n)
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "rank_entry",
                    "--nocapture",
                    "--test-threads=1",
                    "--quiet",
                ])
                .env(SCENARIO, scenario)
                .env(ENV_RANK, rank.to_string())
                .env(ENV_WORLD_SIZE, n.to_string())
                .env(ENV_RENDEZVOUS, dir.path())
                .env(ENV_SECRET, format_secret(&secret))
                .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn a rank")
        })
        .collect();
    // Drain the pipes on threads so a chatty rank cannot block on a full pipe.
    let readers: Vec<_> = children
        .iter_mut()
        .map(|child| {
            let mut out = child.stdout.take().expect("piped");
            let mut err = child.stderr.take().expect("piped");
            std::thread::spawn(move || {
                let (mut o, mut e) = (String::new(), String::new());
                let err_thread = std::thread::spawn(move || {
                    let _ = err.read_to_string(&mut e);
                    e
                });
                let _ = out.read_to_string(&mut o);
                (o, err_thread.join().unwrap_or_default())
            })
        })
        .collect();
    let start = Instant::now();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; n];
    while statuses.iter().any(Option::is_none) {
        for (child, status) in children.iter_mut().zip(statuses.iter_mut()) {
            if status.is_none() {
                *status = child.try_wait().expect("wait");
            }
        }
        if start.elapsed() > deadline {
            for child in &mut children {
                let _ = child.kill();
                let _ = child.wait();
            }
            panic!("world of {n} running {scenario} exceeded its deadline of {deadline:?}");
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    statuses
        .into_iter()
        .zip(readers)
        .map(|(status, reader)| {
            let (stdout, stderr) = reader.join().expect("reader");
            let results = stdout
                .lines()
                .filter_map(|l| l.strip_prefix("RESULT "))
                .map(str::to_string)
                .collect();
            RankRun {
                status: status.expect("all exited"),
                results,
                stderr,
            }
        })
        .collect()
}

/// Panics with every rank's stderr unless all ranks exited successfully.
pub fn assert_all_succeeded(runs: &[RankRun]) {
    for (rank, run) in runs.iter().enumerate() {
        assert!(
            run.status.success(),
            "rank {rank} failed with {}:\n{}",
            run.status,
            run.stderr
        );
    }
}

/// Deterministic test values of very different magnitudes, so that the summation order
/// shows in the bits.
pub fn values(seed: u64, len: usize) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let unit = (state >> 11) as f64 / (1u64 << 53) as f64 - 0.5;
            let scale = [1.0, 1e-3, 1e4, 1e-7][(state % 4) as usize];
            unit * scale
        })
        .collect()
}

/// A hash of bit patterns, for comparing results across ranks and runs.
pub fn hash_bits(bits: impl IntoIterator<Item = u64>) -> u64 {
    bits.into_iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b).wrapping_mul(0x0000_0100_0000_01B3)
    })
}
