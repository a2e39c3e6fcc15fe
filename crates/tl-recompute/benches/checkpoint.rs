//! The price of checkpointing a 16-block residual MLP stack: step time and peak live bytes.
//!
//! Block: `x + Linear(gelu(Linear(x)))`, width 320, on 4096 rows (8 sequences of 512 tokens,
//! as in the capstone). One step is forward, an MSE loss, and backward. Three ways to run the
//! stack: plain; per-block checkpointing (every block but the last is its own segment); and
//! the budgeted schedule of `checkpoint_schedule(16, 6)` (6 is the smallest budget that fits
//! 16 layers: 6 + 5 + … + 1 = 21 ≥ 16). Per-block checkpointing reruns every block's forward
//! pass once, so its cost is bounded by one extra forward: about 4/3 of the plain step when
//! backward costs twice the forward.
//!
//! Peak live bytes come from tl-tensor's meter over one step, printed before the timings,
//! with the fastest of a few interleaved steps of each configuration (steadier than
//! criterion's mean when the machine is shared).
//!
//! Run: `cargo bench -p tl-recompute --bench checkpoint -- --warm-up-time 1 --measurement-time 8`

use std::hint::black_box;
use std::rc::Rc;
use std::time::Instant;

use criterion::{Criterion, criterion_group, criterion_main};
use tl_recompute::{checkpoint_schedule, checkpoint_sequential_with};
use tl_tensor::losses::mse;
use tl_tensor::memory::measure_peak;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::testing::random_array;
use tl_tensor::{Generator, Tensor, no_grad};

const BLOCKS: usize = 16;
const WIDTH: usize = 320;
const ROWS: usize = 4096;
/// Steps per configuration in the interleaved timing printed before criterion's.
const INTERLEAVED_ROUNDS: usize = 6;

/// `x + Linear(gelu(Linear(x)))`.
struct ResidualBlock {
    up: Linear<f32>,
    down: Linear<f32>,
}

impl Module<f32> for ResidualBlock {
    fn forward(&self, x: &Tensor<f32>) -> Tensor<f32> {
        x + &self.down.forward(&self.up.forward(x).gelu())
    }

    fn parameters(&self) -> Vec<Tensor<f32>> {
        let mut parameters = self.up.parameters();
        parameters.extend(self.down.parameters());
        parameters
    }
}

struct Setup {
    blocks: Vec<Rc<ResidualBlock>>,
    x: Tensor<f32>,
    target: Tensor<f32>,
}

fn setup() -> Setup {
    let init = Generator::new(0);
    let blocks = (0..BLOCKS)
        .map(|_| {
            Rc::new(ResidualBlock {
                up: Linear::new(WIDTH, WIDTH, true, &init),
                down: Linear::new(WIDTH, WIDTH, true, &init),
            })
        })
        .collect();
    let data = |seed| {
        Tensor::from_array(random_array(&[ROWS, WIDTH], &Generator::new(seed)).mapv(|v| v as f32))
    };
    Setup {
        blocks,
        x: data(1),
        target: data(2),
    }
}

/// One training step on `schedule` (`[0]` is the plain run), gradients zeroed first.
fn step(setup: &Setup, schedule: &[usize]) -> f32 {
    setup.blocks.iter().for_each(|block| block.zero_grad());
    let output = checkpoint_sequential_with(&setup.blocks, &setup.x, schedule, &[], false)
        .expect("a valid schedule");
    let loss = mse(&output, &setup.target);
    drop(output);
    loss.backward();
    loss.item()
}

/// The stack's forward pass alone.
fn forward_only(setup: &Setup) -> Tensor<f32> {
    setup
        .blocks
        .iter()
        .fold(setup.x.clone(), |h, block| block.forward(&h))
}

fn bench_checkpointing(c: &mut Criterion) {
    let setup = setup();
    let budgeted = checkpoint_schedule(BLOCKS, 6).expect("6 fits 16 layers");
    let per_block: Vec<usize> = (0..BLOCKS).collect();
    let runs = [
        ("plain", vec![0]),
        ("per_block", per_block),
        ("budgeted_6", budgeted),
    ];
    let activation_mib = (ROWS * WIDTH * 4) as f64 / (1 << 20) as f64;
    for (name, schedule) in &runs {
        let (_, peak) = measure_peak(|| step(&setup, schedule));
        eprintln!(
            "{name:>11}: schedule {schedule:?}, peak live {:.1} MiB = {:.1} activations of {activation_mib:.2} MiB",
            peak as f64 / (1 << 20) as f64,
            peak as f64 / (ROWS * WIDTH * 4) as f64,
        );
    }
    // On a shared machine criterion's means wander with the load; the fastest of a few
    // interleaved steps is a steadier estimate of each configuration's own cost.
    let mut fastest = [f64::INFINITY; 3];
    for _ in 0..INTERLEAVED_ROUNDS {
        for ((_, schedule), best) in runs.iter().zip(&mut fastest) {
            let start = Instant::now();
            black_box(step(&setup, schedule));
            *best = best.min(start.elapsed().as_secs_f64());
        }
    }
    // The bound of the issue: one extra forward pass, timed alone under no_grad.
    let mut forward = f64::INFINITY;
    for _ in 0..INTERLEAVED_ROUNDS {
        let start = Instant::now();
        let _off = no_grad();
        black_box(forward_only(&setup));
        forward = forward.min(start.elapsed().as_secs_f64());
    }
    eprintln!(
        "    forward: fastest no_grad forward pass {forward:.3} s; plain step + one forward = {:.2}x plain",
        (fastest[0] + forward) / fastest[0]
    );
    for ((name, _), best) in runs.iter().zip(&fastest) {
        eprintln!(
            "{name:>11}: fastest of {INTERLEAVED_ROUNDS} interleaved steps {best:.3} s = {:.2}x plain",
            best / fastest[0]
        );
    }
    let mut group = c.benchmark_group("residual_mlp_16x320_4096_rows");
    group.sample_size(10);
    for (name, schedule) in &runs {
        group.bench_function(*name, |b| b.iter(|| black_box(step(&setup, schedule))));
    }
    group.finish();
}

criterion_group!(benches, bench_checkpointing);
criterion_main!(benches);
