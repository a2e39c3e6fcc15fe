//! All-reduce bandwidth of the ring: ranks as threads of this process (the sockets and the
//! algorithm are the same as between processes), rank 0 timed by criterion.
//!
//! `cargo bench -p tl-collective`; for a table with bus bandwidth and memcpy, run
//! `tinyllm launch -n 2 -- comm-bench`.

use std::hint::black_box;
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tl_collective::{Communicator, RingComm, RingConfig};

/// Rank 0 and the threads running the other ranks; the helpers do as many all-reduces as
/// rank 0 broadcasts, until it broadcasts 0.
struct World {
    comm: RingComm,
    helpers: Vec<std::thread::JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl World {
    fn new(n: usize, len: usize) -> World {
        let dir = tempfile::tempdir().unwrap();
        let config = |rank| RingConfig::new(rank, n, dir.path(), [9; 32]).unwrap();
        let helpers = (1..n)
            .map(|rank| {
                let config = config(rank);
                std::thread::spawn(move || {
                    let mut comm = RingComm::connect(config).unwrap();
                    let mut buf = vec![0.0f32; len];
                    loop {
                        let mut calls = [0.0f64];
                        comm.broadcast((&mut calls[..]).into(), 0).unwrap();
                        if calls[0] == 0.0 {
                            return;
                        }
                        for _ in 0..calls[0] as u64 {
                            comm.all_reduce_sum((&mut buf).into()).unwrap();
                        }
                    }
                })
            })
            .collect();
        let comm = RingComm::connect(config(0)).unwrap();
        World {
            comm,
            helpers,
            _dir: dir,
        }
    }

    fn run(&mut self, calls: u64, buf: &mut [f32]) -> Duration {
        let mut count = [calls as f64];
        self.comm.broadcast((&mut count[..]).into(), 0).unwrap();
        let start = std::time::Instant::now();
        for _ in 0..calls {
            self.comm
                .all_reduce_sum(black_box(&mut *buf).into())
                .unwrap();
        }
        start.elapsed()
    }

    fn stop(mut self) {
        self.run(0, &mut []);
        for helper in self.helpers {
            helper.join().unwrap();
        }
    }
}

fn all_reduce(c: &mut Criterion) {
    let mut group = c.benchmark_group("ring_all_reduce");
    group
        .sample_size(10)
        .warm_up_time(Duration::from_millis(300))
        .measurement_time(Duration::from_secs(2));
    for n in [2, 4] {
        for bytes in [64 << 10, 1 << 20, 16 << 20] {
            let len = bytes / 4;
            let mut world = World::new(n, len);
            let mut buf = vec![0.0f32; len];
            group.throughput(Throughput::Bytes(bytes as u64));
            group.bench_with_input(BenchmarkId::new(format!("n{n}"), bytes), &bytes, |b, _| {
                b.iter_custom(|calls| world.run(calls, &mut buf));
            });
            world.stop();
        }
    }
    group.finish();
}

criterion_group!(benches, all_reduce);
criterion_main!(benches);
