//! What the L11.3 course tests train, and how their ranks run: threads of this process, each
//! with its own ring communicator over localhost (so each rank's memory meter, being
//! thread-local, measures that rank alone), bounded in time by the ring's timeout.

use std::ops::Range;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tl_collective::{CommStats, Communicator, ReduceOp, RingComm, RingConfig, Slice, SliceMut};
use tl_parallel::{DataParallel, ShardedAdamW, UnitRunner, Zero2AdamW, Zero3, batch_share};
use tl_precision::{DynamicLossScaler, Precision, StepReport};
use tl_tensor::losses::mse;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::{AdamW, Optimizer};
use tl_tensor::{Generator, Tensor, memory};

/// A collective that makes no progress for this long fails, so a broken rank cannot hang a
/// test: it fails it.
pub const TIMEOUT: Duration = Duration::from_secs(10);

/// Runs `rank_program` on `n` ranks, one thread each, and returns their results in rank
/// order.
pub fn world<T: Send>(n: usize, rank_program: impl Fn(RingComm) -> T + Sync) -> Vec<T> {
    let dir = tempfile::tempdir().expect("rendezvous directory");
    let secret = [n as u8 ^ 0x5a; 32];
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

pub const SEED: u64 = 7;
pub const IN: usize = 4;
pub const HIDDEN: usize = 8;
pub const OUT: usize = 2;
/// Parameters of the MLP: 32 + 8 + 16 + 2.
pub const PARAMS: usize = IN * HIDDEN + HIDDEN + HIDDEN * OUT + OUT;

/// `out(tanh(hidden(x)))`.
pub struct Mlp {
    pub hidden: Linear<f32>,
    pub out: Linear<f32>,
}

impl Mlp {
    pub fn new() -> Self {
        let rng = Generator::new(SEED);
        Self {
            hidden: Linear::new(IN, HIDDEN, true, &rng),
            out: Linear::new(HIDDEN, OUT, true, &rng),
        }
    }

    /// ZeRO-3's units: each layer.
    pub fn units(&self) -> Vec<Vec<Tensor<f32>>> {
        vec![self.hidden.parameters(), self.out.parameters()]
    }

    /// Every weight, flattened in the parameters' order.
    pub fn weights(&self) -> Vec<f32> {
        self.parameters().iter().flat_map(|p| p.to_vec()).collect()
    }
}

impl Module<f32> for Mlp {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        self.out.forward(&self.hidden.forward(x).tanh())
    }
    fn parameters(&self) -> Vec<Tensor<f32>> {
        [self.hidden.parameters(), self.out.parameters()].concat()
    }
}

pub type Batch = (Tensor<f32>, Tensor<f32>);

pub fn loss_fn(model: &Mlp, (x, target): &Batch) -> Tensor<f32> {
    mse(&model.forward(x), target)
}

/// The MLP's forward with each layer a ZeRO-3 unit.
pub fn unit_loss(runner: &UnitRunner<f32>, model: &Mlp, (x, target): &Batch) -> Tensor<f32> {
    let hidden = runner.run_unit(0, || model.hidden.forward(x));
    mse(
        &runner.run_unit(1, || model.out.forward(&hidden.tanh())),
        target,
    )
}

/// A step's global batch and how it is cut.
#[derive(Clone, Copy)]
pub struct Data {
    pub precision: Precision,
    pub global_rows: usize,
    pub micro_batch_rows: usize,
    /// `(step, row)`: that row of that step gets an input too large for fp16.
    pub overflow: Option<(usize, usize)>,
}

impl Data {
    pub fn fp32(global_rows: usize, micro_batch_rows: usize) -> Self {
        Self {
            precision: Precision::Fp32,
            global_rows,
            micro_batch_rows,
            overflow: None,
        }
    }

    /// Rows `rows` of step `step`'s global batch: smooth, deterministic.
    pub fn rows(&self, step: usize, rows: Range<usize>) -> Batch {
        let value = |row: usize, col: usize, salt: usize| {
            (((step * 97 + row * 13 + col * 7 + salt) as f64) * 0.37).sin() as f32
        };
        let mut x: Vec<f32> = rows
            .clone()
            .flat_map(|r| (0..IN).map(move |c| value(r, c, 0)))
            .collect();
        if let Some((s, r)) = self.overflow
            && s == step
            && rows.contains(&r)
        {
            x[(r - rows.start) * IN] = 1e6; // above fp16's 65504: inf under autocast
        }
        let target: Vec<f32> = rows
            .clone()
            .flat_map(|r| (0..OUT).map(move |c| value(r, c, 5)))
            .collect();
        (
            Tensor::from_vec(x, &[rows.len(), IN]).unwrap(),
            Tensor::from_vec(target, &[rows.len(), OUT]).unwrap(),
        )
    }

    /// Rank `rank`'s micro-batches of step `step`, as `batch_share` cuts them.
    pub fn micro_batches(&self, step: usize, world: usize, rank: usize) -> Vec<Batch> {
        let share = batch_share(self.global_rows, self.micro_batch_rows, world, rank).unwrap();
        (share.micro_batches.into_iter())
            .map(|rows| self.rows(step, rows))
            .collect()
    }

    /// One process's micro-batches of step `step`: the global batch in micro-batches of
    /// `micro_batch_rows`.
    pub fn single_process(&self, step: usize) -> Vec<Batch> {
        (0..self.global_rows)
            .step_by(self.micro_batch_rows)
            .map(|start| {
                self.rows(
                    step,
                    start..(start + self.micro_batch_rows).min(self.global_rows),
                )
            })
            .collect()
    }

    pub fn scaler(&self) -> Option<DynamicLossScaler> {
        (self.precision == Precision::Fp16)
            .then(|| DynamicLossScaler::new(1024.0, 2.0, 0.5, 2).unwrap())
    }
}

/// Counters shared between a [`Spy`] and the loss function that reads them mid-step.
#[derive(Clone, Default)]
pub struct Seen(Arc<Mutex<CommStats>>);

impl Seen {
    pub fn get(&self) -> CommStats {
        *self.0.lock().unwrap()
    }
}

/// A ring communicator whose counters the loss function can read in the middle of a step,
/// and that counts its all-gathers apart.
pub struct Spy {
    pub inner: RingComm,
    pub seen: Seen,
    pub gathers: Arc<Mutex<u64>>,
}

impl Spy {
    pub fn new(inner: RingComm) -> Self {
        let seen = Seen(Arc::new(Mutex::new(inner.stats())));
        Self {
            inner,
            seen,
            gathers: Arc::default(),
        }
    }

    fn saw<T>(&mut self, result: tl_collective::Result<T>) -> tl_collective::Result<T> {
        *self.seen.0.lock().unwrap() = self.inner.stats();
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
        self.saw(r)
    }
    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> tl_collective::Result<()> {
        let r = self.inner.reduce_scatter(input, output, op);
        self.saw(r)
    }
    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> tl_collective::Result<()> {
        *self.gathers.lock().unwrap() += 1;
        let r = self.inner.all_gather(input, output);
        self.saw(r)
    }
    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> tl_collective::Result<()> {
        let r = self.inner.broadcast(data, root);
        self.saw(r)
    }
    fn barrier(&mut self) -> tl_collective::Result<()> {
        let r = self.inner.barrier();
        self.saw(r)
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
    fn split(&mut self, members: &[usize]) -> tl_collective::Result<Box<dyn Communicator>> {
        let r = self.inner.split(members);
        self.saw(r)
    }
}

/// DDP (ZeRO-0) to ZeRO-3.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    Ddp,
    Zero1,
    Zero2,
    Zero3,
}

pub const STAGES: [Stage; 4] = [Stage::Ddp, Stage::Zero1, Stage::Zero2, Stage::Zero3];

/// How a run trains.
#[derive(Clone, Copy)]
pub struct Run {
    pub stage: Stage,
    pub world: usize,
    pub data: Data,
    pub steps: usize,
    pub clip: Option<f64>,
    /// Whether DDP and ZeRO-2 reduce their buckets while backward goes on.
    pub overlap: bool,
    /// Bytes per bucket.
    pub bucket_bytes: usize,
}

impl Run {
    pub fn new(stage: Stage, world: usize, data: Data) -> Self {
        Self {
            stage,
            world,
            data,
            steps: 3,
            clip: None,
            overlap: false,
            // 16 floats: the MLP's 58 parameters in 4 buckets, parameters split across.
            bucket_bytes: 64,
        }
    }
}

/// What one rank of a run gave.
#[derive(Debug)]
pub struct Outcome {
    pub weights: Vec<f32>,
    pub reports: Vec<StepReport>,
    /// Collectives seen by the loss function of every micro-batch but the first, past the
    /// step's start: communication during the backward of earlier micro-batches.
    pub mid_step: u64,
    /// Collectives of the last step.
    pub collectives: u64,
    /// All-gathers of the last step.
    pub gathers: u64,
    /// Bytes this rank sent in the last step.
    pub bytes: u64,
    /// The most bytes this rank's meter held during a step after the first.
    pub peak: usize,
    /// Elements of model state this rank holds after the run: its weights, its gradients
    /// and the optimizer's moments (from the stage's own counts).
    pub state: usize,
}

/// `run` on ring ranks: the MLP, AdamW at 1e-2, each rank's share of each step's batch.
pub fn train(run: Run) -> Vec<Outcome> {
    world(run.world, |comm| train_rank(run, comm))
}

/// The optimizer of a stage that has one of its own.
enum Opt {
    Plain(AdamW<f32>),
    Zero1(ShardedAdamW<f32>),
    Zero2(Zero2AdamW<f32>),
}

impl Opt {
    fn as_dyn(&mut self) -> &mut dyn Optimizer<f32> {
        match self {
            Opt::Plain(o) => o,
            Opt::Zero1(o) => o,
            Opt::Zero2(o) => o,
        }
    }

    /// Elements of model state the rank holds: weights, gradients, moments.
    fn state(&self) -> usize {
        match self {
            Opt::Plain(_) => 4 * PARAMS,
            Opt::Zero1(o) => 2 * PARAMS + o.state_elements(),
            Opt::Zero2(o) => PARAMS + o.shard_elements() + o.state_elements(),
        }
    }
}

/// One rank of `run` over `comm`.
pub fn train_rank(run: Run, comm: RingComm) -> Outcome {
    let spy = Spy::new(comm);
    let (seen, gathers) = (spy.seen.clone(), Arc::clone(&spy.gathers));
    let mut ddp = DataParallel::new(Box::new(spy))
        .with_bucket_bytes(run.bucket_bytes)
        .with_overlap(run.overlap);
    let (rank, world) = (ddp.rank(), ddp.world_size());
    let model = Mlp::new();
    let adamw = AdamW::new(model.parameters(), 1e-2).unwrap();
    let mut zero3 =
        (run.stage == Stage::Zero3).then(|| Zero3::on(&ddp, model.units(), &adamw).unwrap());
    let mut opt = match run.stage {
        Stage::Ddp => Some(Opt::Plain(adamw)),
        Stage::Zero1 => Some(Opt::Zero1(ShardedAdamW::new(&ddp, adamw).unwrap())),
        Stage::Zero2 => Some(Opt::Zero2(Zero2AdamW::new(&mut ddp, adamw).unwrap())),
        Stage::Zero3 => None,
    };
    let mut scaler = run.data.scaler();
    let mut outcome = Outcome {
        weights: Vec::new(),
        reports: Vec::new(),
        mid_step: 0,
        collectives: 0,
        gathers: 0,
        bytes: 0,
        peak: 0,
        state: 0,
    };
    for step in 0..run.steps {
        let batches = run.data.micro_batches(step, world, rank);
        let start = seen.get();
        let gathers_before = *gathers.lock().unwrap();
        let mut forwards = 0;
        let mut mid_step = 0;
        let mut count = |_: &Batch| {
            if forwards > 0 {
                mid_step += seen.get().collectives - start.collectives;
            }
            forwards += 1;
        };
        memory::reset_peak();
        let report = match (&mut zero3, &mut opt) {
            (Some(zero3), _) => {
                let runner = zero3.runner();
                let loss = |m: &Mlp, b: &Batch| {
                    count(b);
                    unit_loss(&runner, m, b)
                };
                let (global, precision) = (run.data.global_rows, run.data.precision);
                zero3.train_step(
                    &model,
                    &batches,
                    global,
                    loss,
                    precision,
                    scaler.as_mut(),
                    run.clip,
                )
            }
            (None, Some(opt)) => {
                let loss = |m: &Mlp, b: &Batch| {
                    count(b);
                    loss_fn(m, b)
                };
                let (global, precision) = (run.data.global_rows, run.data.precision);
                ddp.train_step(
                    &model,
                    &batches,
                    global,
                    loss,
                    opt.as_dyn(),
                    precision,
                    scaler.as_mut(),
                    run.clip,
                )
            }
            (None, None) => unreachable!(),
        }
        .unwrap();
        if step > 0 {
            outcome.peak = outcome.peak.max(memory::peak_bytes());
        }
        let end = ddp.stats();
        outcome.mid_step += mid_step;
        outcome.collectives = end.collectives - start.collectives;
        outcome.gathers = *gathers.lock().unwrap() - gathers_before;
        outcome.bytes = end.bytes_sent - start.bytes_sent;
        outcome.reports.push(report);
    }
    outcome.state = match (&zero3, &opt) {
        // Weights, gradients and both moments, each of the shard.
        (Some(zero3), _) => 4 * zero3.shard_elements(),
        (None, Some(opt)) => opt.state(),
        (None, None) => unreachable!(),
    };
    if let Some(zero3) = &zero3 {
        zero3.gather_full_parameters().unwrap();
    }
    outcome.weights = model.weights();
    outcome
}

/// One process training the same model on every step's whole batch, in micro-batches of
/// `data.micro_batch_rows`.
pub fn one_process(data: Data, steps: usize, clip: Option<f64>) -> (Vec<f32>, Vec<StepReport>) {
    let model = Mlp::new();
    let mut opt = AdamW::new(model.parameters(), 1e-2).unwrap();
    let mut scaler = data.scaler();
    let reports = (0..steps)
        .map(|step| {
            let batches = data.single_process(step);
            tl_precision::train_step_mixed(
                &model,
                &batches,
                loss_fn,
                &mut opt,
                data.precision,
                scaler.as_mut(),
                clip,
            )
            .unwrap()
        })
        .collect();
    (model.weights(), reports)
}

/// The largest difference between two runs' weights, relative to the larger of 1e-3 and the
/// weight.
pub fn max_relative(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(&x, &y)| f64::from((x - y).abs()) / f64::from(y.abs()).max(1e-3))
        .fold(0.0, f64::max)
}

/// Every rank holds the same weights, bit for bit.
pub fn assert_ranks_agree(outcomes: &[Outcome], what: &str) {
    for (rank, o) in outcomes.iter().enumerate() {
        assert_eq!(
            o.weights, outcomes[0].weights,
            "{what}: rank {rank}'s weights differ from rank 0's"
        );
        let decisions = |o: &Outcome| {
            o.reports
                .iter()
                .map(|r| (r.skipped, r.scale))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            decisions(o),
            decisions(&outcomes[0]),
            "{what}: rank {rank} decided otherwise"
        );
    }
}
