//! A column-parallel layer, tanh or SwiGLU, a row-parallel layer: the same batch through
//! the whole MLP on one process and split over the ranks.

use tl_collective::{Collective, CommStats, Communicator, ring_bytes_sent};
use tl_parallel::{ColumnParallelLinear, GradElement, RowParallelLinear, TensorParallel};
use tl_tensor::memory::{self, Event};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Element, Generator, Tensor, meta_mode};

use super::common::world;
use super::recorder::{Calls, Recorder};
use super::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Middle {
    Tanh,
    /// `silu(gate(x)) ⊙ up(x)`, gate and up one fused column-parallel layer.
    SwiGlu,
}

struct FullMlp<E: Element> {
    up: Linear<E>,
    gate: Option<Linear<E>>,
    down: Linear<E>,
}

impl<E: Element> FullMlp<E> {
    fn new(middle: Middle) -> Self {
        let rng = Generator::new(SEED);
        Self {
            up: Linear::new(IN, HIDDEN, true, &rng),
            gate: (middle == Middle::SwiGlu).then(|| Linear::new(IN, HIDDEN, true, &rng)),
            down: Linear::new(HIDDEN, OUT, true, &rng),
        }
    }

    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let up = self.up.forward(x);
        let middle = match &self.gate {
            None => up.tanh(),
            Some(gate) => gate.forward(x).swiglu(&up),
        };
        self.down.forward(&middle)
    }

    /// Gradients in the order [`ParallelMlp::gradients`] gives them, whole.
    fn gradients(&self, x: &Tensor<E>) -> Vec<Vec<f64>> {
        let mut layers = vec![&self.up];
        layers.extend(&self.gate);
        let mut grads = vec![grad(x)];
        for layer in layers.into_iter().chain([&self.down]) {
            grads.extend(layer.parameters().iter().map(grad));
        }
        grads
    }
}

struct ParallelMlp<E: GradElement> {
    column: ColumnParallelLinear<E>,
    row: RowParallelLinear<E>,
    swiglu: bool,
}

impl<E: GradElement> ParallelMlp<E> {
    fn new(full: &FullMlp<E>, tp: &TensorParallel, sequence_parallel: bool) -> Self {
        let up = (full.up.weight(), full.up.bias());
        let column = match &full.gate {
            None => ColumnParallelLinear::from_full(up.0, up.1, tp),
            Some(gate) => {
                ColumnParallelLinear::from_full_parts(&[up, (gate.weight(), gate.bias())], tp)
            }
        };
        let row = RowParallelLinear::from_full(full.down.weight(), full.down.bias(), tp);
        Self {
            column: column.unwrap().with_sequence_parallel(sequence_parallel),
            row: row.unwrap().with_sequence_parallel(sequence_parallel),
            swiglu: full.gate.is_some(),
        }
    }

    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let hidden = self.column.forward(x).unwrap();
        let middle = match self.swiglu {
            false => hidden.tanh(),
            true => {
                let width = hidden.shape()[1] / 2;
                hidden
                    .narrow(1, width, width)
                    .swiglu(&hidden.narrow(1, 0, width))
            }
        };
        self.row.forward(&middle).unwrap()
    }
}

/// What one rank saw: its output, its gradients (x, the column layer's, the row layer's),
/// and the collectives of the forward and of the backward.
pub(super) struct RankRun {
    output: Vec<f64>,
    grads: Vec<Vec<f64>>,
    forward: Calls,
    backward: Calls,
    stats: [CommStats; 2],
    /// Everything the rank sent, the sum of the sequence-parallel gradients included.
    pub(super) total: CommStats,
}

/// The rank's rows of the sequence: all of them without sequence parallelism.
fn own_rows(sequence_parallel: bool, t: usize, rank: usize) -> std::ops::Range<usize> {
    match sequence_parallel {
        true => rank * ROWS / t..(rank + 1) * ROWS / t,
        false => 0..ROWS,
    }
}

/// One forward and backward of the MLP on `comm`'s rank: what it computed, and the meter's
/// events from before the whole model exists to after everything is dropped.
pub(super) fn mlp_rank<E: GradElement>(
    comm: Box<dyn Communicator>,
    middle: Middle,
    sequence_parallel: bool,
    meta: bool,
) -> (RankRun, Vec<Event>) {
    let _meta = meta.then(meta_mode);
    let (recorder, calls) = Recorder::new(comm);
    let (rank, t) = (recorder.rank(), recorder.world_size());
    let tp = TensorParallel::new(Box::new(recorder));
    memory::record(|| {
        let full = FullMlp::<E>::new(middle);
        let mlp = ParallelMlp::new(&full, &tp, sequence_parallel);
        let rows = own_rows(sequence_parallel, t, rank);
        let x = input::<E>(rows.clone());
        let weights = loss_weights::<E>(rows);
        let start = tp.stats();
        let y = mlp.forward(&x);
        let (forward, after_forward) = (calls.take(), tp.stats());
        (&y * &weights).sum_all().backward();
        let (backward, after_backward) = (calls.take(), tp.stats());
        tp.all_reduce_gradients(&mlp.row.sequence_parallel_parameters())
            .unwrap();
        assert!(tp.take_error().is_none());
        let mut grads = vec![grad(&x)];
        grads.extend(mlp.column.parameters().iter().map(grad));
        grads.extend(mlp.row.parameters().iter().map(grad));
        RankRun {
            output: values(&y),
            grads,
            forward,
            backward,
            stats: [
                delta(start, after_forward),
                delta(after_forward, after_backward),
            ],
            total: tp.stats(),
        }
    })
}

/// The one-process reference: output and gradients of the whole MLP.
fn mlp_reference<E: GradElement>(middle: Middle) -> (Vec<f64>, Vec<Vec<f64>>) {
    let full = FullMlp::<E>::new(middle);
    let x = input::<E>(0..ROWS);
    let y = full.forward(&x);
    (&y * &loss_weights::<E>(0..ROWS)).sum_all().backward();
    (values(&y), full.gradients(&x))
}

/// Every rank's slices assembled into whole tensors, in the reference's order.
fn assemble_mlp(
    runs: &[RankRun],
    middle: Middle,
    sequence_parallel: bool,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let each =
        |index: usize| -> Vec<Vec<f64>> { runs.iter().map(|r| r.grads[index].clone()).collect() };
    let replicated = |slices: Vec<Vec<f64>>| {
        assert!(
            slices.iter().all(|s| *s == slices[0]),
            "every rank holds the same"
        );
        slices[0].clone()
    };
    let sequence = |slices: Vec<Vec<f64>>| match sequence_parallel {
        true => concatenated(&slices),
        false => replicated(slices),
    };
    let output = sequence(runs.iter().map(|r| r.output.clone()).collect());
    let parts = if middle == Middle::SwiGlu { 2 } else { 1 };
    // Local gradients: x, column weight, column bias, row weight, row bias.
    let mut grads = vec![sequence(each(0))];
    for part in 0..parts {
        grads.push(assemble_columns(&each(1), IN, part, parts));
        grads.push(assemble_columns(&each(2), 1, part, parts));
    }
    grads.push(concatenated(&each(3)));
    grads.push(replicated(each(4)));
    (output, grads)
}

fn assert_mlp_matches_one_process<E: GradElement>(
    t: usize,
    middle: Middle,
    sequence_parallel: bool,
) {
    let runs = world(t, |comm| {
        mlp_rank::<E>(Box::new(comm), middle, sequence_parallel, false).0
    });
    let (output, grads) = assemble_mlp(&runs, middle, sequence_parallel);
    let (want_output, want_grads) = mlp_reference::<E>(middle);
    let what = format!(
        "{} t = {t}, {middle:?}, sequence parallel {sequence_parallel}",
        <E as Element>::NAME
    );
    let mut worst = relative_error(&output, &want_output);
    assert!(worst <= tolerance::<E>(), "{what}: output off by {worst:e}");
    for (index, (got, want)) in grads.iter().zip(&want_grads).enumerate() {
        let error = relative_error(got, want);
        assert!(
            error <= tolerance::<E>(),
            "{what}: gradient {index} off by {error:e}"
        );
        worst = worst.max(error);
    }
    assert_eq!(grads.len(), want_grads.len());
    eprintln!("{what}: worst relative error {worst:e}");
}

#[test]
fn an_mlp_split_over_the_ranks_computes_what_one_process_does() {
    for t in [2, 4] {
        for middle in [Middle::Tanh, Middle::SwiGlu] {
            for sequence_parallel in [false, true] {
                assert_mlp_matches_one_process::<f64>(t, middle, sequence_parallel);
                assert_mlp_matches_one_process::<f32>(t, middle, sequence_parallel);
            }
        }
    }
}

#[test]
fn a_column_row_block_makes_megatrons_collectives_and_sends_what_the_ring_costs() {
    use Collective::{AllGather, AllReduce, ReduceScatter};
    for t in [2, 4] {
        for sequence_parallel in [false, true] {
            let (forward, backward) = match sequence_parallel {
                // Copy-to: nothing forward, the input's gradient all-reduced backward;
                // reduce-from: the output all-reduced forward, nothing backward.
                false => (vec![(AllReduce, ROWS * OUT)], vec![(AllReduce, ROWS * IN)]),
                // The input all-gathered, the output reduce-scattered; backward the
                // output's gradient all-gathered, the input's reduce-scattered.
                true => (
                    vec![(AllGather, ROWS * IN), (ReduceScatter, ROWS * OUT)],
                    vec![(AllGather, ROWS * OUT), (ReduceScatter, ROWS * IN)],
                ),
            };
            // The fused gate and up projections of SwiGLU share the one copy-to.
            for middle in [Middle::Tanh, Middle::SwiGlu] {
                let runs = world(t, |comm| {
                    mlp_rank::<f32>(Box::new(comm), middle, sequence_parallel, false).0
                });
                for (rank, run) in runs.iter().enumerate() {
                    let what = format!("t = {t}, rank {rank}, {middle:?}, sp {sequence_parallel}");
                    assert_eq!(
                        (&run.forward, &run.backward),
                        (&forward, &backward),
                        "{what}"
                    );
                    let cost = |calls: &Calls| CommStats {
                        collectives: calls.len() as u64,
                        bytes_sent: calls
                            .iter()
                            .map(|&(c, n)| ring_bytes_sent(c, n as u64, 4, t, rank))
                            .sum(),
                        ..CommStats::default()
                    };
                    assert_eq!(run.stats, [cost(&forward), cost(&backward)], "{what}");
                }
            }
        }
    }
}

#[test]
fn a_gathered_column_output_is_the_whole_layers_output() {
    let t = 4;
    let runs = world(t, |comm| {
        let (recorder, calls) = Recorder::new(Box::new(comm));
        let tp = TensorParallel::new(Box::new(recorder));
        let full = Linear::<f64>::new(IN, HIDDEN, true, &Generator::new(SEED));
        let column = ColumnParallelLinear::from_full(full.weight(), full.bias(), &tp)
            .unwrap()
            .with_gather_output(true);
        let x = input::<f64>(0..ROWS);
        let y = column.forward(&x).unwrap();
        let forward = calls.take();
        let weights = Tensor::from_array(matrix(0..ROWS, HIDDEN, |r, c| (r + 2 * c) as f64));
        (&y * &weights).sum_all().backward();
        let mut grads = vec![grad(&x)];
        grads.extend(column.parameters().iter().map(grad));
        (values(&y), grads, forward, calls.take())
    });
    let full = Linear::<f64>::new(IN, HIDDEN, true, &Generator::new(SEED));
    let x = input::<f64>(0..ROWS);
    let y = full.forward(&x);
    let weights = Tensor::from_array(matrix(0..ROWS, HIDDEN, |r, c| (r + 2 * c) as f64));
    (&y * &weights).sum_all().backward();
    let slices = |i: usize| -> Vec<Vec<f64>> { runs.iter().map(|r| r.1[i].clone()).collect() };
    for (output, grads, forward, backward) in &runs {
        // One all-gather of the output forward; backward each rank keeps its columns of the
        // gradient, and the input's gradient is all-reduced.
        assert_eq!(forward, &[(Collective::AllGather, ROWS * HIDDEN)]);
        assert_eq!(backward, &[(Collective::AllReduce, ROWS * IN)]);
        assert!(relative_error(output, &values(&y)) <= tolerance::<f64>());
        assert!(relative_error(&grads[0], &grad(&x)) <= tolerance::<f64>());
    }
    let weight = assemble_columns(&slices(1), IN, 0, 1);
    assert!(relative_error(&weight, &grad(full.weight())) <= tolerance::<f64>());
    let bias = concatenated(&slices(2));
    assert!(relative_error(&bias, &grad(full.bias().unwrap())) <= tolerance::<f64>());
}
