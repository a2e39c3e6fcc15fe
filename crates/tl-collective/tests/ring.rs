//! The ring backend on real processes: results against the sequential reference, identical
//! bits on every rank and every run, a killed rank, ranks that disagree.

mod support;

use std::io::Write;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use support::{SCENARIO, assert_all_succeeded, hash_bits, run_world, values};
use tl_collective::{
    CollectiveError, Communicator, ENV_TIMEOUT_MS, Element, ReduceOp, RingComm, RingConfig,
    reference_all_reduce, shard_range,
};

/// Lengths of the largest buffer of the reference scenario, by world size: "several MiB"
/// (3 MiB of f32, 6 MiB of f64) and not divisible by any world size tested.
const BIG: usize = 786_433;
const DEADLINE: Duration = Duration::from_secs(60);

/// The element types under test, made from the f64 test values.
trait TestElement: Element {
    fn from_f64(x: f64) -> Self;
    fn bits(self) -> u64;
}

impl TestElement for f32 {
    fn from_f64(x: f64) -> Self {
        x as f32
    }
    fn bits(self) -> u64 {
        u64::from(self.to_bits())
    }
}

impl TestElement for f64 {
    fn from_f64(x: f64) -> Self {
        x
    }
    fn bits(self) -> u64 {
        self.to_bits()
    }
}

fn result(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "RESULT {line}").unwrap();
    out.flush().unwrap();
}

fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis()
}

fn bits<T: TestElement>(xs: &[T]) -> Vec<u64> {
    xs.iter().map(|x| x.bits()).collect()
}

/// Every collective on every rank's inputs of length `len`, checked against the reference;
/// returns the bits that must agree between ranks.
fn check_collectives<T: TestElement>(comm: &mut RingComm, len: usize) -> Vec<u64> {
    let (rank, n) = (comm.rank(), comm.world_size());
    let inputs: Vec<Vec<T>> = (0..n)
        .map(|q| {
            values((q * 1000 + len) as u64, len)
                .into_iter()
                .map(T::from_f64)
                .collect()
        })
        .collect();
    let refs: Vec<&[T]> = inputs.iter().map(Vec::as_slice).collect();
    let expected = reference_all_reduce(&refs, ReduceOp::Sum);
    let mut agreed = Vec::new();

    let mut buf = inputs[rank].clone();
    let before = comm.stats();
    comm.all_reduce_sum((&mut buf).into()).unwrap();
    assert_eq!(
        bits(&buf),
        bits(&expected),
        "all_reduce_sum of {len} {}",
        T::NAME
    );
    if len >= 100_000 {
        // Bandwidth-optimal: 2(N-1)/N of the buffer, plus N-1 headers of 40 bytes.
        let sent = comm.stats().bytes_sent - before.bytes_sent;
        let bytes = (len * size_of::<T>()) as f64;
        let optimal = 2.0 * (n - 1) as f64 / n as f64 * bytes;
        assert!(
            (sent as f64 - optimal).abs() <= (40 + 2 * 8) as f64 * n as f64,
            "{sent} vs {optimal}"
        );
    }
    agreed.extend(bits(&buf));

    let mut buf = inputs[rank].clone();
    comm.all_reduce((&mut buf).into(), ReduceOp::Max).unwrap();
    assert_eq!(
        bits(&buf),
        bits(&reference_all_reduce(&refs, ReduceOp::Max))
    );

    let own = shard_range(len, n, rank);
    let mut shard = vec![T::zeroed(); own.len()];
    comm.reduce_scatter_sum((&inputs[rank]).into(), (&mut shard).into())
        .unwrap();
    assert_eq!(
        bits(&shard),
        bits(&expected[own.clone()]),
        "reduce_scatter_sum of {len}"
    );

    let mut gathered = vec![T::zeroed(); len];
    comm.all_gather((&inputs[rank][own]).into(), (&mut gathered).into())
        .unwrap();
    let concatenated: Vec<T> = (0..n)
        .flat_map(|q| inputs[q][shard_range(len, n, q)].to_vec())
        .collect();
    assert_eq!(bits(&gathered), bits(&concatenated), "all_gather of {len}");
    agreed.extend(bits(&gathered));

    let root = len % n;
    let mut buf = inputs[rank].clone();
    comm.broadcast((&mut buf).into(), root).unwrap();
    assert_eq!(
        bits(&buf),
        bits(&inputs[root]),
        "broadcast of {len} from {root}"
    );
    agreed
}

fn scenario_reference(mut comm: RingComm) {
    let n = comm.world_size();
    let big = std::env::var("TL_TEST_BIG").map_or(BIG, |v| v.parse().unwrap());
    let mut agreed = Vec::new();
    for len in [0, 1, n.saturating_sub(1), n + 1, 37 * n + n / 2 + 1, big] {
        agreed.extend(check_collectives::<f32>(&mut comm, len));
        agreed.extend(check_collectives::<f64>(&mut comm, len));
    }
    assert_eq!(
        comm.all_reduce_max_f32(comm.rank() as f32).unwrap(),
        (n - 1) as f32
    );
    let total = comm
        .all_reduce_sum_f64(0.1 * (comm.rank() + 1) as f64)
        .unwrap();
    let parts: Vec<Vec<f64>> = (0..n).map(|q| vec![0.1 * (q + 1) as f64]).collect();
    let refs: Vec<&[f64]> = parts.iter().map(Vec::as_slice).collect();
    assert_eq!(
        total.to_bits(),
        reference_all_reduce(&refs, ReduceOp::Sum)[0].to_bits()
    );
    comm.barrier().unwrap();
    agreed.push(total.to_bits());
    result(format_args!("hash={:016x}", hash_bits(agreed)));
    result(format_args!("collectives={}", comm.stats().collectives));
}

fn scenario_kill(mut comm: RingComm) {
    let victim = comm.world_size() - 1;
    if comm.rank() == victim {
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            result(format_args!("killed_at={}", unix_ms()));
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::KILL)
                .unwrap();
        });
    }
    let mut buf = vec![1.0f32; 4 << 20];
    let error = loop {
        if let Err(error) = comm.all_reduce_sum((&mut buf).into()) {
            break error;
        }
    };
    let kind = match error {
        CollectiveError::PeerExited { .. } => "PeerExited",
        CollectiveError::Timeout { .. } => "Timeout",
        other => panic!("unexpected error {other}"),
    };
    result(format_args!("error={kind}"));
    result(format_args!("failed_at={}", unix_ms()));
    // The communicator stays closed.
    assert!(matches!(comm.barrier(), Err(CollectiveError::Closed)));
}

fn scenario_mismatch(mut comm: RingComm) {
    let len = if comm.rank() == 0 { 10 } else { 12 };
    let mut buf = vec![0.0f64; len];
    match comm.all_reduce_sum((&mut buf).into()) {
        Err(CollectiveError::Mismatch { calls }) => {
            assert_eq!(calls.len(), comm.world_size());
            assert_eq!(calls[0].len, 10);
            assert!(calls[1..].iter().all(|c| c.len == 12));
            result(format_args!("error=Mismatch"));
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

/// The rank program: does nothing in a normal test run.
#[test]
fn rank_entry() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    // Errors as their messages, which the tests read from stderr.
    let config = RingConfig::from_env()
        .unwrap_or_else(|e| panic!("{e}"))
        .expect("a ring environment");
    let comm = RingComm::connect(config).unwrap_or_else(|e| panic!("{e}"));
    match scenario.as_str() {
        "reference" => scenario_reference(comm),
        "kill" => scenario_kill(comm),
        "mismatch" => scenario_mismatch(comm),
        other => panic!("unknown scenario {other}"),
    }
}

fn hashes(runs: &[support::RankRun]) -> Vec<String> {
    runs.iter()
        .map(|r| r.get("hash").expect("a hash").to_string())
        .collect()
}

#[test]
fn collectives_match_the_reference_on_1_to_4_ranks() {
    for n in 1..=4 {
        let runs = run_world(n, "reference", &[], DEADLINE);
        assert_all_succeeded(&runs);
        let hashes = hashes(&runs);
        assert!(
            hashes.iter().all(|h| *h == hashes[0]),
            "ranks disagree: {hashes:?}"
        );
    }
}

#[test]
fn eight_oversubscribed_ranks_match_the_reference() {
    let runs = run_world(
        8,
        "reference",
        &[("TL_TEST_BIG", "100003".into())],
        DEADLINE,
    );
    assert_all_succeeded(&runs);
    let hashes = hashes(&runs);
    assert!(
        hashes.iter().all(|h| *h == hashes[0]),
        "ranks disagree: {hashes:?}"
    );
}

#[test]
fn two_runs_give_identical_bits() {
    let env = [("TL_TEST_BIG", "200001".to_string())];
    let first = hashes(&run_world(3, "reference", &env, DEADLINE));
    let second = hashes(&run_world(3, "reference", &env, DEADLINE));
    assert_eq!(first, second);
}

#[test]
fn killed_rank_fails_every_other_rank_within_the_bound() {
    let timeout_ms = 2000;
    let runs = run_world(
        4,
        "kill",
        &[(ENV_TIMEOUT_MS, timeout_ms.to_string())],
        DEADLINE,
    );
    let victim = &runs[3];
    assert!(!victim.status.success(), "the victim was meant to die");
    let killed_at: u128 = victim.get("killed_at").expect("kill time").parse().unwrap();
    for (rank, run) in runs[..3].iter().enumerate() {
        assert!(run.status.success(), "rank {rank}: {}", run.stderr);
        let failed_at: u128 = run.get("failed_at").unwrap().parse().unwrap();
        assert!(
            failed_at.saturating_sub(killed_at) <= timeout_ms + 500,
            "rank {rank} noticed after {} ms",
            failed_at - killed_at
        );
        // A killed process closes its sockets: noticed at once, not by the timeout.
        assert_eq!(run.get("error"), Some("PeerExited"), "rank {rank}");
    }
}

#[test]
fn lengths_that_disagree_fail_on_every_rank() {
    let runs = run_world(3, "mismatch", &[], DEADLINE);
    assert_all_succeeded(&runs);
    assert!(runs.iter().all(|r| r.get("error") == Some("Mismatch")));
}

#[test]
fn a_malformed_variable_is_an_error_naming_it() {
    let runs = run_world(
        1,
        "reference",
        &[("TINYLLM_RANK", "first".into())],
        DEADLINE,
    );
    assert!(!runs[0].status.success());
    assert!(
        runs[0]
            .stderr
            .contains("environment variable TINYLLM_RANK=\"first\""),
        "{}",
        runs[0].stderr
    );
}
