//! The launcher on real processes: a job that succeeds, a rank that fails (named, the others
//! stopped after the grace period), and Ctrl-C forwarded to every rank.

mod support;

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use support::SCENARIO;
use tl_collective::CollectiveError;
use tl_collective::launch::{LaunchOptions, launch};

fn rank_args() -> Vec<OsString> {
    [
        "--exact",
        "launched_rank",
        "--nocapture",
        "--test-threads=1",
        "--quiet",
    ]
    .map(OsString::from)
    .to_vec()
}

fn options(scenario: &str) -> LaunchOptions {
    LaunchOptions {
        comm_timeout: Some(Duration::from_secs(5)),
        grace: Duration::from_millis(500),
        deadline: Some(Duration::from_secs(60)),
        env: vec![(SCENARIO.into(), scenario.into())],
        cores: None,
    }
}

/// The rank program of these tests: does nothing in a normal test run.
#[test]
fn launched_rank() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let mut comm = tl_collective::from_env().unwrap();
    match scenario.as_str() {
        "sum" => {
            let mut x = [comm.rank() as f64 + 1.0];
            comm.all_reduce_sum((&mut x[..]).into()).unwrap();
            let n = comm.world_size() as f64;
            assert_eq!(x[0], n * (n + 1.0) / 2.0);
        }
        "rank1_fails_rank0_lingers" => {
            if comm.rank() == 1 {
                std::process::exit(3);
            }
            // Not in a collective, so nothing tells this rank; the launcher must stop it.
            std::thread::sleep(Duration::from_secs(30));
        }
        "rank1_kills_itself" => {
            for call in 0.. {
                if call == 3 && comm.rank() == 1 {
                    let me = rustix::process::getpid();
                    rustix::process::kill_process(me, rustix::process::Signal::KILL).unwrap();
                }
                let mut x = [1.0f64];
                // As tinyllm does: the error's message on stderr, a failing exit.
                comm.all_reduce_sum((&mut x[..]).into())
                    .unwrap_or_else(|e| panic!("{e}"));
            }
        }
        "rank2_stops_itself" => {
            let mut x = [1.0f64];
            comm.all_reduce_sum((&mut x[..]).into()).unwrap();
            if comm.rank() == 2 {
                let me = rustix::process::getpid();
                rustix::process::kill_process(me, rustix::process::Signal::STOP).unwrap();
                // The stop is the process's: another thread may take it while this one runs
                // on, long enough to finish the next all-reduce and let its neighbours end
                // well (the test then waited for its deadline, 1 run in 5). A sleeping thread
                // joins the stop at once, so nothing runs past this line until SIGCONT.
                std::thread::sleep(Duration::from_secs(1));
            }
            if let Err(e) = comm.all_reduce_sum((&mut x[..]).into()) {
                let dir = std::env::var("TL_TEST_READY_DIR").unwrap();
                std::fs::write(format!("{dir}/error-{}", comm.rank()), e.to_string()).unwrap();
                panic!("{e}");
            }
        }
        "affinity" => {
            // This rank's CPUs, as the launcher left them, for the test to read.
            let cores: Vec<String> = tl_collective::launch::available_cores()
                .unwrap()
                .iter()
                .map(usize::to_string)
                .collect();
            let dir = std::env::var("TL_TEST_READY_DIR").unwrap();
            std::fs::write(format!("{dir}/cores-{}", comm.rank()), cores.join(",")).unwrap();
            comm.barrier().unwrap();
        }
        "sleep" => {
            // The ring formed and used once: rank 0 has removed the rendezvous directory.
            comm.barrier().unwrap();
            if let Ok(dir) = std::env::var("TL_TEST_READY_DIR") {
                let pid = std::process::id().to_string();
                std::fs::write(format!("{dir}/ready-{}", comm.rank()), pid).unwrap();
            }
            std::thread::sleep(Duration::from_secs(30));
        }
        other => panic!("unknown scenario {other}"),
    }
}

/// A launcher process for the signal test: does nothing in a normal test run.
#[test]
fn launcher_entry() {
    if std::env::var("TL_TEST_LAUNCHER").is_err() {
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut options = options("sleep");
    options.env.push((
        "TL_TEST_READY_DIR".into(),
        std::env::var_os("TL_TEST_READY_DIR").unwrap(),
    ));
    let outcome = launch(2, &exe, &rank_args(), &options).unwrap();
    println!("RESULT forwarded={:?}", outcome.forwarded_signal);
    for rank in &outcome.ranks {
        println!("RESULT rank{}={:?}", rank.rank, rank.status.signal());
    }
}

/// Each rank runs on the CPUs it was given (here the first and the last this test may use,
/// one each: the same CPU twice on a one-CPU machine), and on the launcher's without them.
#[test]
fn ranks_run_on_the_cores_they_are_given() {
    let exe = std::env::current_exe().unwrap();
    let available = tl_collective::launch::available_cores().expect("Linux says");
    let (first, last) = (available[0], available[available.len() - 1]);
    let read = |cores: Option<Vec<Vec<usize>>>| {
        let dir = tempfile::tempdir().unwrap();
        let mut options = options("affinity");
        options
            .env
            .push(("TL_TEST_READY_DIR".into(), dir.path().into()));
        options.cores = cores;
        let outcome = launch(2, &exe, &rank_args(), &options).unwrap();
        assert!(outcome.success(), "{outcome:?}");
        [0, 1]
            .map(|rank| std::fs::read_to_string(dir.path().join(format!("cores-{rank}"))).unwrap())
    };
    let bound = read(Some(vec![vec![first], vec![last]]));
    assert_eq!(bound, [first.to_string(), last.to_string()]);
    let everywhere = available
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(read(None), [everywhere.clone(), everywhere]);
}

#[test]
fn a_job_that_succeeds_succeeds() {
    let exe = std::env::current_exe().unwrap();
    let outcome = launch(3, &exe, &rank_args(), &options("sum")).unwrap();
    assert!(outcome.success(), "{outcome:?}");
    assert!(outcome.into_result().is_ok());
}

#[test]
fn a_failing_rank_is_named_and_the_others_are_stopped() {
    let exe = std::env::current_exe().unwrap();
    let start = Instant::now();
    let outcome = launch(2, &exe, &rank_args(), &options("rank1_fails_rank0_lingers")).unwrap();
    // Rank 0 would sleep 30 s: it was stopped after the grace period.
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "took {:?}",
        start.elapsed()
    );
    assert!(!outcome.timed_out);
    assert_eq!(outcome.ranks[0].status.signal(), Some(libc_sigterm()));
    match outcome.into_result() {
        Err(CollectiveError::RankFailed {
            rank: 1,
            status,
            code: Some(3),
            others: 1,
        }) => {
            assert_eq!(status, "exit code 3");
        }
        other => panic!("expected rank 1 to be named, got {other:?}"),
    }
}

/// Rank 0 notices rank 1's death within the same poll of the launcher often enough (4 runs
/// in 9, before) that the first end seen is no guide: the killed rank is blamed, by its
/// signal's name, in every run.
#[test]
fn a_killed_rank_is_blamed_not_the_neighbour_that_noticed() {
    let exe = std::env::current_exe().unwrap();
    for _ in 0..3 {
        let outcome = launch(2, &exe, &rank_args(), &options("rank1_kills_itself")).unwrap();
        assert!(!outcome.timed_out);
        assert!(outcome.ranks[0].after_neighbour, "{outcome:?}");
        match outcome.into_result() {
            Err(CollectiveError::RankFailed {
                rank: 1,
                status,
                code: None,
                others: 1,
            }) => assert_eq!(status, "killed by SIGKILL"),
            other => panic!("expected rank 1 to be blamed, got {other:?}"),
        }
    }
}

/// A stopped rank never ends by itself: its neighbours time out naming it, and the launcher,
/// which saw it stop, blames it rather than the first rank that timed out.
#[test]
fn a_stopped_rank_is_named_by_the_launcher_and_its_neighbour() {
    let exe = std::env::current_exe().unwrap();
    let errors = support::rendezvous();
    let mut options = options("rank2_stops_itself");
    options.comm_timeout = Some(Duration::from_millis(1000));
    options
        .env
        .push(("TL_TEST_READY_DIR".into(), errors.path().into()));
    let start = Instant::now();
    let outcome = launch(3, &exe, &rank_args(), &options).unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    assert!(!outcome.timed_out);
    // Rank 0 receives from rank 2, its left neighbour.
    let error0 = std::fs::read_to_string(errors.path().join("error-0")).unwrap();
    assert!(error0.contains("waiting for rank 2"), "{error0}");
    match outcome.into_result() {
        Err(CollectiveError::RankFailed {
            rank: 2,
            status,
            code: None,
            others: 2,
        }) => assert!(status.starts_with("stopped by SIGSTOP"), "{status}"),
        other => panic!("expected rank 2 to be blamed, got {other:?}"),
    }
}

fn libc_sigterm() -> i32 {
    rustix::process::Signal::TERM.as_raw()
}

/// Starts [`launcher_entry`] with two sleeping ranks; returns it once both are ready, with
/// the ranks' process ids.
fn start_launcher(ready: &Path) -> (std::process::Child, Vec<u32>) {
    let mut launcher = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "launcher_entry",
            "--nocapture",
            "--test-threads=1",
            "--quiet",
        ])
        .env("TL_TEST_LAUNCHER", "1")
        .env("TL_TEST_READY_DIR", ready)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let start = Instant::now();
    let pids = loop {
        let pids: Vec<u32> = (0..2)
            .filter_map(|r| std::fs::read_to_string(ready.join(format!("ready-{r}"))).ok())
            .filter_map(|pid| pid.parse().ok())
            .collect();
        if pids.len() == 2 {
            break pids;
        }
        if start.elapsed() > Duration::from_secs(30) {
            let _ = launcher.kill();
            panic!("the ranks never started");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    (launcher, pids)
}

/// Waits for `child` to end within 20 s; its standard output.
fn launcher_output(mut launcher: std::process::Child) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    while launcher.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = launcher.kill();
            panic!("the launcher did not end");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = launcher.wait_with_output().unwrap();
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Whether process `pid` is gone (or a zombie, dead and not yet reaped).
fn gone(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).map_or(true, |stat| {
        stat.rsplit(") ").next().is_some_and(|s| s.starts_with('Z'))
    })
}

#[test]
fn sigint_reaches_every_rank() {
    stopping_signal_reaches_every_rank(rustix::process::Signal::INT);
}

/// SIGHUP (a closed terminal) killed the launcher and left its ranks running.
#[test]
fn sighup_reaches_every_rank() {
    stopping_signal_reaches_every_rank(rustix::process::Signal::HUP);
}

fn stopping_signal_reaches_every_rank(signal: rustix::process::Signal) {
    let ready = support::rendezvous();
    let (launcher, _) = start_launcher(ready.path());
    let pid = rustix::process::Pid::from_child(&launcher);
    rustix::process::kill_process(pid, signal).unwrap();
    let stdout = launcher_output(launcher);
    let raw = signal.as_raw();
    assert!(
        stdout.contains(&format!("RESULT forwarded=Some({raw})")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("RESULT rank0=Some({raw})")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("RESULT rank1=Some({raw})")),
        "{stdout}"
    );
}

/// A launcher killed outright (SIGKILL: nothing of it runs) takes its ranks with it, and
/// leaves no rendezvous directory: they used to run on under PID 1.
#[test]
fn ranks_die_with_a_launcher_killed_outright() {
    let ready = support::rendezvous();
    let (mut launcher, pids) = start_launcher(ready.path());
    // The directory the ranks were given.
    let environ = std::fs::read(format!("/proc/{}/environ", pids[0])).unwrap();
    let rendezvous = environ
        .split(|&b| b == 0)
        .find_map(|var| var.strip_prefix(b"TINYLLM_RENDEZVOUS="))
        .map(|path| std::path::PathBuf::from(String::from_utf8_lossy(path).into_owned()))
        .expect("rank 0 was given a rendezvous directory");
    assert!(
        !rendezvous.exists(),
        "{} outlived the ring's forming",
        rendezvous.display()
    );
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let start = Instant::now();
    while !pids.iter().all(|&pid| gone(pid)) {
        if start.elapsed() > Duration::from_secs(10) {
            for pid in &pids {
                let _ = rustix::process::kill_process(
                    rustix::process::Pid::from_raw(*pid as i32).unwrap(),
                    rustix::process::Signal::KILL,
                );
            }
            panic!("the ranks {pids:?} outlived their launcher");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}
