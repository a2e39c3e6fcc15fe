//! Tensor parallelism on the in-process ring (t ranks on threads) against one process
//! running the whole model: outputs, every gradient (the ranks' slices assembled), the
//! collectives each rank makes and the bytes it sends, and the same step on meta tensors
//! over a `Phantom`, allocation for allocation.

mod common;

use std::cell::RefCell;
use std::rc::Rc;

use common::world;
use tl_collective::{
    Collective, CommStats, Communicator, Phantom, ReduceOp, Slice, SliceMut, ring_bytes_sent,
};
use tl_parallel::{
    ColumnParallelLinear, GradElement, ParallelError, RowParallelLinear, TensorParallel,
    VocabParallelEmbedding,
};
use tl_tensor::losses::cross_entropy;
use tl_tensor::memory::{self, Event, EventKind};
use tl_tensor::ndarray::{ArrayD, IxDyn};
use tl_tensor::nn::{Embedding, Linear, Module};
use tl_tensor::{Element, Generator, Tensor, meta_mode};

const SEED: u64 = 11;
/// Sequence length: rows of the batch, split over 2 or 4 ranks under sequence parallelism.
const ROWS: usize = 8;
const IN: usize = 8;
const HIDDEN: usize = 16;
const OUT: usize = 4;

/// Largest difference over the largest magnitude of the reference: the ranks add partial
/// products in another order than one process does, so the gradients differ by rounding.
fn relative_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let worst = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
    assert!(scale > 0.0, "a reference of zeros proves nothing");
    worst / scale
}

fn values<E: Element>(tensor: &Tensor<E>) -> Vec<f64> {
    tensor.to_vec().into_iter().map(Element::to_f64).collect()
}

fn grad<E: Element>(tensor: &Tensor<E>) -> Vec<f64> {
    let grad = tensor.grad().expect("a gradient");
    grad.iter().map(|&g| g.to_f64()).collect()
}

/// `[rows, cols]` from `f(row, col)`, as a parameter when `param`.
fn matrix<E: Element>(
    rows: std::ops::Range<usize>,
    cols: usize,
    f: impl Fn(usize, usize) -> f64,
) -> ArrayD<E> {
    let data = rows
        .clone()
        .flat_map(|r| (0..cols).map(move |c| (r, c)))
        .map(|(r, c)| E::from_f64(f(r, c)))
        .collect();
    ArrayD::from_shape_vec(IxDyn(&[rows.len(), cols]), data).unwrap()
}

fn input<E: Element>(rows: std::ops::Range<usize>) -> Tensor<E> {
    Tensor::param(matrix(rows, IN, |r, c| {
        ((r * 13 + c * 7) as f64 * 0.37).sin()
    }))
}

/// The loss `Σ y ⊙ w` with fixed, uneven weights: a sum, so that under sequence
/// parallelism the ranks' losses over their rows add up to the whole one.
fn loss_weights<E: Element>(rows: std::ops::Range<usize>) -> Tensor<E> {
    Tensor::from_array(matrix(rows, OUT, |r, c| {
        ((r * 5 + c * 3) as f64 * 0.71).cos()
    }))
}

/// Columns `part` of `parts` of each rank's `[rows, parts·w]` slices, assembled into the
/// whole `[rows, t·w]` in rank order.
fn assemble_columns(slices: &[Vec<f64>], rows: usize, part: usize, parts: usize) -> Vec<f64> {
    let width = slices[0].len() / rows / parts;
    (0..rows)
        .flat_map(|i| {
            slices.iter().flat_map(move |s| {
                let start = i * parts * width + part * width;
                s[start..start + width].iter().copied()
            })
        })
        .collect()
}

fn concatenated(slices: &[Vec<f64>]) -> Vec<f64> {
    slices.concat()
}

// ---- The MLP: a column-parallel layer, tanh or SwiGLU, a row-parallel layer. ----

#[derive(Clone, Copy, Debug, PartialEq)]
enum Middle {
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
struct RankRun {
    output: Vec<f64>,
    grads: Vec<Vec<f64>>,
    forward: Calls,
    backward: Calls,
    stats: [CommStats; 2],
    /// Everything the rank sent, the sum of the sequence-parallel gradients included.
    total: CommStats,
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
fn mlp_rank<E: GradElement>(
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

fn delta(before: CommStats, after: CommStats) -> CommStats {
    CommStats {
        collectives: after.collectives - before.collectives,
        bytes_sent: after.bytes_sent - before.bytes_sent,
    }
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

/// Tolerance of a comparison with the one-process run, relative to the tensor's largest
/// magnitude. The ranks add partial products in another order (and the GEMM blocks a
/// narrower matrix otherwise), so results differ by rounding only. Measured worst cases
/// over t = 2 and 4, with and without sequence parallelism, tanh and SwiGLU: 2.85 ε in both
/// f64 (6.3e-16) and f32 (3.4e-7), for a column weight's gradient; the vocabulary model
/// 1.8 ε (f64) and 1.4 ε (f32). The bound allows 8 ε: a missing reduction or a bias added t
/// times is off by order 1.
fn tolerance<E: Element>() -> f64 {
    8.0 * E::epsilon().to_f64()
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

// ---- The vocabulary: embedding, a column-parallel head, the cross-entropy. ----

const VOCAB: usize = 32;
const DIM: usize = 6;

fn token_ids() -> Vec<usize> {
    (0..ROWS).map(|n| (n * 5 + 1) % VOCAB).collect() // every rank's quarter is hit
}

fn targets() -> Vec<usize> {
    (0..ROWS).map(|n| (n * 7 + 3) % VOCAB).collect()
}

struct FullLm<E: Element> {
    embedding: Embedding<E>,
    head: Linear<E>,
}

impl<E: Element> FullLm<E> {
    fn new() -> Self {
        let rng = Generator::new(SEED);
        Self {
            embedding: Embedding::new(VOCAB, DIM, &rng),
            head: Linear::new(DIM, VOCAB, true, &rng),
        }
    }

    fn loss(&self) -> Tensor<E> {
        let hidden = self.embedding.forward_ids(&token_ids(), &[ROWS]).tanh();
        cross_entropy(&self.head.forward(&hidden), &targets())
    }
}

/// What one rank of the vocabulary model saw.
struct LmRun {
    loss: f64,
    /// The table's rows, the head's columns and bias.
    grads: Vec<Vec<f64>>,
    forward: Calls,
    backward: Calls,
    /// The meter's events while the layers are made from the whole model, then during the
    /// step.
    setup: Vec<Event>,
    step: Vec<Event>,
    total: CommStats,
}

fn lm_rank<E: GradElement>(
    comm: Box<dyn Communicator>,
    sequence_parallel: bool,
    meta: bool,
) -> LmRun {
    let _meta = meta.then(meta_mode);
    let (recorder, calls) = Recorder::new(comm);
    let tp = TensorParallel::new(Box::new(recorder));
    let ((full, embedding, head), setup) = memory::record(|| {
        let full = FullLm::<E>::new();
        let embedding = VocabParallelEmbedding::from_full(full.embedding.weight(), &tp)
            .unwrap()
            .with_sequence_parallel(sequence_parallel);
        let head = ColumnParallelLinear::from_full(full.head.weight(), full.head.bias(), &tp)
            .unwrap()
            .with_sequence_parallel(sequence_parallel);
        (full, embedding, head)
    });
    let ((loss, forward, backward), step) = memory::record(|| {
        let hidden = embedding.forward_ids(&token_ids(), &[ROWS]).unwrap().tanh();
        let logits = head.forward(&hidden).unwrap();
        let loss = tp
            .vocab_parallel_cross_entropy(&logits, &targets())
            .unwrap();
        let forward = calls.take();
        loss.backward();
        (loss.item().to_f64(), forward, calls.take())
    });
    assert!(tp.take_error().is_none());
    let mut grads = vec![grad(embedding.weight())];
    grads.extend(head.parameters().iter().map(grad));
    drop(full);
    LmRun {
        loss,
        grads,
        forward,
        backward,
        setup,
        step,
        total: tp.stats(),
    }
}

fn assert_lm_matches_one_process<E: GradElement>(t: usize, sequence_parallel: bool) {
    let runs = world(t, |comm| {
        lm_rank::<E>(Box::new(comm), sequence_parallel, false)
    });
    let full = FullLm::<E>::new();
    let loss = full.loss();
    loss.backward();
    let what = format!(
        "{} t = {t}, sequence parallel {sequence_parallel}",
        <E as Element>::NAME
    );
    let slices = |i: usize| -> Vec<Vec<f64>> { runs.iter().map(|r| r.grads[i].clone()).collect() };
    let assembled = [
        concatenated(&slices(0)),
        assemble_columns(&slices(1), DIM, 0, 1),
        concatenated(&slices(2)),
    ];
    let wanted = [
        grad(full.embedding.weight()),
        grad(full.head.weight()),
        grad(full.head.bias().unwrap()),
    ];
    let mut worst = 0.0f64;
    for run in &runs {
        assert_eq!(
            run.loss, runs[0].loss,
            "{what}: every rank has the same loss"
        );
        worst = worst.max(relative_error(&[run.loss], &[loss.item().to_f64()]));
    }
    for (got, want) in assembled.iter().zip(&wanted) {
        worst = worst.max(relative_error(got, want));
    }
    assert!(worst <= tolerance::<E>(), "{what}: off by {worst:e}");
    eprintln!("{what}: worst relative error {worst:e}");

    // No rank ever holds a row's whole logits: no allocation of the step is that large.
    let whole_logits = ROWS * VOCAB * size_of::<E>();
    for run in &runs {
        let largest = run
            .step
            .iter()
            .filter(|e| e.kind == EventKind::Alloc)
            .map(|e| e.bytes)
            .max();
        assert!(
            largest.unwrap() < whole_logits,
            "{what}: {largest:?} bytes allocated at once"
        );
    }

    // The embedding's reduction and the loss's two all-reduces (the maximum; the sums and
    // the targets' logits) forward; backward the head's input gradient, nothing for the loss.
    use Collective::{AllGather, AllReduce, ReduceScatter};
    let (forward, backward) = match sequence_parallel {
        false => (
            vec![
                (AllReduce, ROWS * DIM),
                (AllReduce, ROWS),
                (AllReduce, 2 * ROWS),
            ],
            vec![(AllReduce, ROWS * DIM)],
        ),
        true => (
            vec![
                (ReduceScatter, ROWS * DIM),
                (AllGather, ROWS * DIM),
                (AllReduce, ROWS),
                (AllReduce, 2 * ROWS),
            ],
            vec![(ReduceScatter, ROWS * DIM), (AllGather, ROWS * DIM)],
        ),
    };
    for run in &runs {
        assert_eq!(
            (&run.forward, &run.backward),
            (&forward, &backward),
            "{what}"
        );
    }
}

#[test]
fn vocabulary_parallel_embedding_and_cross_entropy_match_the_full_ones() {
    for t in [2, 4] {
        for sequence_parallel in [false, true] {
            assert_lm_matches_one_process::<f64>(t, sequence_parallel);
            assert_lm_matches_one_process::<f32>(t, sequence_parallel);
        }
    }
}

/// `[rows, classes]` logits spread over ±`spread`, the same on every thread.
fn wide_logits<E: Element>(rows: usize, classes: usize, spread: f64) -> ArrayD<E> {
    let rng = Generator::new(3);
    matrix(0..rows, classes, |_, _| {
        (2.0 * rng.next_f64() - 1.0) * spread
    })
}

#[test]
fn the_vocabulary_parallel_loss_is_the_full_one_on_wide_logits() {
    // 5 rows (the rows need not divide), 12 classes, logits up to ±40: exp would overflow
    // f32 without the maximum taken first.
    let (rows, classes) = (5, 12);
    let targets = [0, 11, 5, 6, 3];
    for t in [2, 4] {
        let check = |spread: f64| {
            let runs = world(t, |comm| {
                let tp = TensorParallel::new(Box::new(comm));
                let local = classes / t;
                let all = wide_logits::<f32>(rows, classes, spread);
                let columns = all.slice_axis(
                    tl_tensor::ndarray::Axis(1),
                    (tp.rank() * local..(tp.rank() + 1) * local).into(),
                );
                let logits = Tensor::param(columns.to_owned());
                let loss = tp.vocab_parallel_cross_entropy(&logits, &targets).unwrap();
                loss.backward();
                (loss.item().to_f64(), grad(&logits))
            });
            let logits = Tensor::param(wide_logits::<f32>(rows, classes, spread));
            let loss = cross_entropy(&logits, &targets);
            loss.backward();
            let slices: Vec<_> = runs.iter().map(|r| r.1.clone()).collect();
            let loss_error = relative_error(&[runs[0].0], &[loss.item().to_f64()]);
            let grad_error = relative_error(&assemble_columns(&slices, rows, 0, 1), &grad(&logits));
            assert!(
                loss_error <= tolerance::<f32>() && grad_error <= tolerance::<f32>(),
                "t = {t}, spread {spread}: loss off by {loss_error:e}, gradient by {grad_error:e}"
            );
            eprintln!("t = {t}, spread {spread}: loss {loss_error:e}, gradient {grad_error:e}");
        };
        check(1.0);
        check(40.0);
    }
}

// ---- Meta: the same step on shapes over a Phantom. ----

/// `program` on every rank of a ring of `t`, then on each rank alone on meta tensors over a
/// `Phantom`: the same meter events, in order, with their bytes and tags, and the same
/// collectives and bytes sent.
fn assert_meta_is_real(
    t: usize,
    what: &str,
    program: impl Fn(Box<dyn Communicator>, bool) -> (Vec<Event>, CommStats) + Sync,
) {
    let real = world(t, |comm| program(Box::new(comm), false));
    for (rank, (real_events, real_stats)) in real.iter().enumerate() {
        let (meta_events, meta_stats) = std::thread::scope(|scope| {
            scope
                .spawn(|| program(Box::new(Phantom::new(rank, t).unwrap()), true))
                .join()
                .unwrap()
        });
        let what = format!("{what}, rank {rank} of {t}");
        let first = meta_events
            .iter()
            .zip(real_events)
            .position(|(m, r)| m != r);
        assert_eq!(
            (first, meta_events.len()),
            (None, real_events.len()),
            "{what}: first differing event, then the counts"
        );
        assert_eq!(meta_stats, *real_stats, "{what}: communication");
        assert!(
            real_stats.bytes_sent > 0 && real_events.len() > 20,
            "{what}: a real step"
        );
    }
}

#[test]
fn the_step_on_meta_tensors_allocates_and_sends_what_the_real_one_does() {
    for t in [2, 4] {
        for sequence_parallel in [false, true] {
            let what = format!("MLP, sequence parallel {sequence_parallel}");
            assert_meta_is_real(t, &what, |comm, meta| {
                let (run, events) = mlp_rank::<f32>(comm, Middle::SwiGlu, sequence_parallel, meta);
                (events, run.total)
            });
            let what = format!("vocabulary, sequence parallel {sequence_parallel}");
            assert_meta_is_real(t, &what, |comm, meta| {
                let run = lm_rank::<f64>(comm, sequence_parallel, meta);
                ([run.setup, run.step].concat(), run.total)
            });
        }
    }
}

// ---- Errors. ----

#[test]
fn sizes_that_do_not_split_over_the_group_are_refused_by_name() {
    let tp = TensorParallel::new(Box::new(Phantom::new(1, 4).unwrap()));
    let layer = Linear::<f32>::new(6, 10, true, &Generator::new(0));
    let indivisible = |error: Option<ParallelError>| match error {
        Some(ParallelError::Indivisible {
            what,
            size,
            tensor_parallel,
        }) => (what, size, tensor_parallel),
        other => panic!("expected Indivisible, got {other:?}"),
    };
    let column = ColumnParallelLinear::from_full(layer.weight(), layer.bias(), &tp);
    let error = column.err();
    assert_eq!(
        error.as_ref().map(ToString::to_string).as_deref(),
        Some("output features of 10 does not split evenly over 4 tensor-parallel ranks")
    );
    assert_eq!(indivisible(error), ("output features", 10, 4));
    let row = RowParallelLinear::from_full(layer.weight(), layer.bias(), &tp);
    assert_eq!(indivisible(row.err()), ("input features", 6, 4));
    let table = Embedding::<f32>::new(10, 3, &Generator::new(0));
    let embedding = VocabParallelEmbedding::from_full(table.weight(), &tp);
    assert_eq!(indivisible(embedding.err()), ("vocabulary", 10, 4));
    let rows = Tensor::<f32>::zeros(&[6, 2]);
    assert_eq!(
        indivisible(tp.scatter_sequence(&rows).err()),
        ("sequence length", 6, 4)
    );
    // A row layer under sequence parallelism refuses 6 rows before it communicates.
    let even = Linear::<f32>::new(8, 3, false, &Generator::new(0));
    let row = RowParallelLinear::from_full(even.weight(), None, &tp)
        .unwrap()
        .with_sequence_parallel(true);
    assert_eq!(
        indivisible(row.forward(&rows).err()),
        ("sequence length", 6, 4)
    );
    assert_eq!(tp.stats().collectives, 0);
    // What divides is accepted: a column layer's input and a row layer's output need not.
    let odd = Linear::<f32>::new(7, 8, true, &Generator::new(0));
    assert!(ColumnParallelLinear::from_full(odd.weight(), odd.bias(), &tp).is_ok());
    let wide = Linear::<f32>::new(4, 10, true, &Generator::new(0));
    assert!(RowParallelLinear::from_full(wide.weight(), wide.bias(), &tp).is_ok());
}

/// Rank 1 of 2, whose every collective fails.
struct Broken;

impl Communicator for Broken {
    fn rank(&self) -> usize {
        1
    }
    fn world_size(&self) -> usize {
        2
    }
    fn all_reduce(&mut self, _: SliceMut<'_>, _: ReduceOp) -> tl_collective::Result<()> {
        Err(tl_collective::CollectiveError::Closed)
    }
    fn reduce_scatter(
        &mut self,
        _: Slice<'_>,
        _: SliceMut<'_>,
        _: ReduceOp,
    ) -> tl_collective::Result<()> {
        Err(tl_collective::CollectiveError::Closed)
    }
    fn all_gather(&mut self, _: Slice<'_>, _: SliceMut<'_>) -> tl_collective::Result<()> {
        Err(tl_collective::CollectiveError::Closed)
    }
    fn broadcast(&mut self, _: SliceMut<'_>, _: usize) -> tl_collective::Result<()> {
        Err(tl_collective::CollectiveError::Closed)
    }
    fn barrier(&mut self) -> tl_collective::Result<()> {
        Err(tl_collective::CollectiveError::Closed)
    }
    fn stats(&self) -> CommStats {
        CommStats::default()
    }
}

#[test]
fn a_collective_that_fails_in_backward_is_kept_and_handed_out_later() {
    let tp = TensorParallel::new(Box::new(Broken));
    let x = Tensor::<f64>::param(ArrayD::ones(IxDyn(&[2, 3])));
    // Copy-to communicates only backward, where it cannot return the error.
    tp.copy_to(&x).sum_all().backward();
    assert!(
        x.grad().unwrap().iter().all(|g| g.is_nan()),
        "a refused gradient"
    );
    let kept = tp.take_error();
    assert!(
        matches!(kept, Some(ParallelError::Collective { rank: 1, .. })),
        "{kept:?}"
    );
    assert!(tp.take_error().is_none(), "handed out once");
    // A forward collective returns its error at once.
    let error = tp.reduce_from(&x).err();
    assert!(
        matches!(error, Some(ParallelError::Collective { rank: 1, .. })),
        "{error:?}"
    );
}

// ---- A communicator that logs its calls, as PyTorch's CommDebugMode does. ----

/// Collectives called, with the elements of the whole buffer (for a reduce-scatter its
/// input, for an all-gather its output), in order.
type Calls = Vec<(Collective, usize)>;

#[derive(Clone, Default)]
struct Log(Rc<RefCell<Calls>>);

impl Log {
    /// The calls since the last take.
    fn take(&self) -> Calls {
        std::mem::take(&mut self.0.borrow_mut())
    }

    fn push(&self, collective: Collective, elements: usize) {
        self.0.borrow_mut().push((collective, elements));
    }
}

struct Recorder {
    inner: Box<dyn Communicator>,
    log: Log,
}

impl Recorder {
    fn new(inner: Box<dyn Communicator>) -> (Self, Log) {
        let log = Log::default();
        (
            Self {
                inner,
                log: log.clone(),
            },
            log,
        )
    }
}

impl Communicator for Recorder {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> tl_collective::Result<()> {
        self.log.push(Collective::AllReduce, data.len());
        self.inner.all_reduce(data, op)
    }
    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> tl_collective::Result<()> {
        self.log.push(Collective::ReduceScatter, input.len());
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> tl_collective::Result<()> {
        self.log.push(Collective::AllGather, output.len());
        self.inner.all_gather(input, output)
    }
    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> tl_collective::Result<()> {
        self.log.push(Collective::Broadcast { root }, data.len());
        self.inner.broadcast(data, root)
    }
    fn barrier(&mut self) -> tl_collective::Result<()> {
        self.log.push(Collective::Barrier, 0);
        self.inner.barrier()
    }
    fn stats(&self) -> CommStats {
        self.inner.stats()
    }
}
