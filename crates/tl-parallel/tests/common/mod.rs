//! What the DDP tests train: a two-layer MLP, a deterministic global batch whose shape and
//! precision the environment sets, and a communicator whose counters the loss function can
//! read in the middle of a step.

#![allow(dead_code)]

use std::io::Write;
use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex};

use std::time::Duration;

use tl_collective::{CommStats, Communicator, ReduceOp, RingComm, RingConfig, Slice, SliceMut};
use tl_parallel::{UnitRunner, batch_share};
use tl_precision::{DynamicLossScaler, Precision};
use tl_recompute::checkpoint;
use tl_tensor::losses::mse;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Element, Generator, Tensor};

pub const STEPS: usize = 5;
pub const SEED: u64 = 7;
pub const IN: usize = 4;
pub const HIDDEN: usize = 8;
pub const OUT: usize = 2;
/// Parameters of the MLP: two weights and two biases.
pub const PARAMS: usize = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT;

/// `out(tanh(hidden(x)))`.
pub struct Mlp<E: Element> {
    pub hidden: Linear<E>,
    pub out: Linear<E>,
}

impl<E: Element> Mlp<E> {
    pub fn new(seed: u64) -> Self {
        let rng = Generator::new(seed);
        Self {
            hidden: Linear::new(IN, HIDDEN, true, &rng),
            out: Linear::new(HIDDEN, OUT, true, &rng),
        }
    }
}

impl<E: Element> Module<E> for Mlp<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        self.out.forward(&self.hidden.forward(x).tanh())
    }
    fn parameters(&self) -> Vec<Tensor<E>> {
        [self.hidden.parameters(), self.out.parameters()].concat()
    }
}

pub type Batch<E> = (Tensor<E>, Tensor<E>);

pub fn loss_fn<E: Element>(model: &Mlp<E>, (x, target): &Batch<E>) -> Tensor<E> {
    mse(&model.forward(x), target)
}

/// What a world trains: read from the environment by the ranks.
pub struct Config {
    pub precision: Precision,
    pub global_rows: usize,
    pub micro_batch_rows: usize,
    pub bucket_bytes: usize,
    /// `(step, row)`: that row of that step's global batch gets an input too large for fp16.
    pub overflow: Option<(usize, usize)>,
}

impl Config {
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        let number = |name: &str, default: usize| var(name).map_or(default, |v| v.parse().unwrap());
        Self {
            precision: var("TL_PRECISION").map_or(Precision::Fp32, |p| p.parse().unwrap()),
            global_rows: number("TL_GLOBAL_ROWS", 8),
            micro_batch_rows: number("TL_MICRO", 4),
            bucket_bytes: number("TL_BUCKET_BYTES", tl_parallel::DEFAULT_BUCKET_BYTES),
            overflow: var("TL_OVERFLOW").map(|v| {
                let (step, row) = v.split_once(',').unwrap();
                (step.parse().unwrap(), row.parse().unwrap())
            }),
        }
    }

    pub fn scaler(&self) -> Option<DynamicLossScaler> {
        // Growth every 2 good steps, so the scale moves and a disagreement would show.
        (self.precision == Precision::Fp16)
            .then(|| DynamicLossScaler::new(1024.0, 2.0, 0.5, 2).unwrap())
    }

    /// Rows `rows` of step `step`'s global batch: smooth inputs and targets, deterministic.
    pub fn rows<E: Element>(&self, step: usize, rows: Range<usize>) -> Batch<E> {
        let value = |row: usize, col: usize, salt: usize| {
            (((step * 97 + row * 13 + col * 7 + salt) as f64) * 0.37).sin()
        };
        let mut x: Vec<f64> = rows
            .clone()
            .flat_map(|r| (0..IN).map(move |c| value(r, c, 0)))
            .collect();
        if let Some((s, r)) = self.overflow
            && s == step
            && rows.contains(&r)
        {
            x[(r - rows.start) * IN] = 1e6; // above fp16's 65504: inf under autocast
        }
        let target: Vec<f64> = rows
            .clone()
            .flat_map(|r| (0..OUT).map(move |c| value(r, c, 5)))
            .collect();
        let tensor = |v: Vec<f64>, cols| {
            Tensor::from_vec(
                v.into_iter().map(E::from_f64).collect(),
                &[rows.len(), cols],
            )
            .unwrap()
        };
        (tensor(x, IN), tensor(target, OUT))
    }

    pub fn micro_batches<E: Element>(
        &self,
        step: usize,
        world: usize,
        rank: usize,
    ) -> Vec<Batch<E>> {
        let share = batch_share(self.global_rows, self.micro_batch_rows, world, rank).unwrap();
        share
            .micro_batches
            .into_iter()
            .map(|rows| self.rows(step, rows))
            .collect()
    }
}

/// A latch a [`Gated`] communicator waits on: opened by the test when the computation the
/// gated call must overlap has run.
#[derive(Clone, Default)]
pub struct Gate {
    open: Arc<(Mutex<bool>, Condvar)>,
    timed_out: Arc<Mutex<bool>>,
}

impl Gate {
    pub fn open(&self) {
        let (open, opened) = &*self.open;
        *open.lock().unwrap() = true;
        opened.notify_all();
    }

    /// Waits until the gate opens, or for 10 s, which it records.
    fn pass(&self) {
        let (open, opened) = &*self.open;
        let open = opened
            .wait_timeout_while(open.lock().unwrap(), Duration::from_secs(10), |open| !*open)
            .unwrap()
            .0;
        if !*open {
            *self.timed_out.lock().unwrap() = true;
        }
    }

    /// Whether a gated call gave up waiting.
    pub fn timed_out(&self) -> bool {
        *self.timed_out.lock().unwrap()
    }
}

/// Which calls a [`Gated`] communicator holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Held {
    /// Every all-reduce.
    AllReduces,
    /// The all-gather of this number (from 1).
    AllGather(usize),
}

/// A ring communicator whose `held` calls wait at `gate` first: a call that must run while
/// the rank computes, and would wait for ever if it ran on the rank's own thread.
pub struct Gated {
    pub inner: RingComm,
    pub held: Held,
    pub gate: Gate,
    pub gathers: usize,
}

impl Communicator for Gated {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> tl_collective::Result<()> {
        if self.held == Held::AllReduces {
            self.gate.pass();
        }
        self.inner.all_reduce(data, op)
    }
    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> tl_collective::Result<()> {
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> tl_collective::Result<()> {
        self.gathers += 1;
        if self.held == Held::AllGather(self.gathers) {
            self.gate.pass();
        }
        self.inner.all_gather(input, output)
    }
    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> tl_collective::Result<()> {
        self.inner.broadcast(data, root)
    }
    fn barrier(&mut self) -> tl_collective::Result<()> {
        self.inner.barrier()
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn split(&mut self, members: &[usize]) -> tl_collective::Result<Box<dyn Communicator>> {
        self.inner.split(members)
    }
}

/// Counters shared between a [`Spy`] and the code that reads them mid-step.
#[derive(Clone)]
pub struct SeenStats(Arc<Mutex<CommStats>>);

impl SeenStats {
    pub fn new(stats: CommStats) -> Self {
        Self(Arc::new(Mutex::new(stats)))
    }

    /// The counters after the spy's last call.
    pub fn get(&self) -> CommStats {
        *self.0.lock().unwrap()
    }
}

/// A communicator that mirrors its counters where the loss function can read them in the
/// middle of a step.
pub struct Spy {
    pub inner: RingComm,
    pub stats: SeenStats,
}

impl Spy {
    fn seen<T>(&mut self, result: tl_collective::Result<T>) -> tl_collective::Result<T> {
        *self.stats.0.lock().unwrap() = self.inner.stats();
        result
    }
}

impl Communicator for Spy {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> tl_collective::Result<()> {
        let r = self.inner.all_reduce(data, op);
        self.seen(r)
    }
    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> tl_collective::Result<()> {
        let r = self.inner.reduce_scatter(input, output, op);
        self.seen(r)
    }
    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> tl_collective::Result<()> {
        let r = self.inner.all_gather(input, output);
        self.seen(r)
    }
    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> tl_collective::Result<()> {
        let r = self.inner.broadcast(data, root);
        self.seen(r)
    }
    fn barrier(&mut self) -> tl_collective::Result<()> {
        let r = self.inner.barrier();
        self.seen(r)
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn split(&mut self, members: &[usize]) -> tl_collective::Result<Box<dyn Communicator>> {
        let r = self.inner.split(members);
        self.seen(r)
    }
}

pub fn result(line: std::fmt::Arguments<'_>) {
    let mut out = std::io::stdout().lock();
    writeln!(out, "RESULT {line}").unwrap();
    out.flush().unwrap();
}

pub fn weights<E: Element>(model: &Mlp<E>) -> Vec<f64> {
    model
        .parameters()
        .iter()
        .flat_map(|p| p.to_vec())
        .map(Element::to_f64)
        .collect()
}

/// A collective that makes no progress for this long fails, so a broken test cannot hang.
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// Runs `rank_program` on `n` ranks, one thread each, and returns their results in rank
/// order.
pub fn world<T: Send>(n: usize, rank_program: impl Fn(RingComm) -> T + Sync) -> Vec<T> {
    let dir = tempfile::tempdir().expect("rendezvous directory");
    let secret = [n as u8; 32];
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..n)
            .map(|rank| {
                let (dir, rank_program) = (dir.path(), &rank_program);
                scope.spawn(move || {
                    let config = RingConfig::new(rank, n, dir, secret)
                        .unwrap()
                        .timeout(TIMEOUT);
                    rank_program(RingComm::connect(config).unwrap())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The MLP's forward with each layer a ZeRO-3 unit of `runner`, the hidden one checkpointed when
/// `recompute` (its rerun in backward gathers it again).
pub fn unit_forward(
    runner: &UnitRunner<f32>,
    model: &Mlp<f32>,
    x: &Tensor<f32>,
    recompute: bool,
) -> Tensor<f32> {
    let hidden = if recompute {
        let params = model.hidden.parameters();
        let copy = Linear::from_parts(params[0].clone(), params.get(1).cloned());
        let runner = runner.clone();
        checkpoint(
            move |xs| runner.run_unit(0, || copy.forward(&xs[0])),
            std::slice::from_ref(x),
            &params,
            &[],
        )
    } else {
        runner.run_unit(0, || model.hidden.forward(x))
    };
    runner.run_unit(1, || model.out.forward(&hidden.tanh()))
}
