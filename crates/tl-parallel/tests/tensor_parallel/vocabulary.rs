//! The vocabulary split over the ranks: embedding, a column-parallel head, the
//! cross-entropy.

use tl_collective::{Collective, CommStats, Communicator};
use tl_parallel::{ColumnParallelLinear, GradElement, TensorParallel, VocabParallelEmbedding};
use tl_tensor::losses::cross_entropy;
use tl_tensor::memory::{self, Event, EventKind};
use tl_tensor::ndarray::ArrayD;
use tl_tensor::nn::{Embedding, Linear, Module};
use tl_tensor::{Element, Generator, Tensor, meta_mode};

use super::common::world;
use super::recorder::{Calls, Recorder};
use super::*;

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
pub(super) struct LmRun {
    loss: f64,
    /// The table's rows, the head's columns and bias.
    grads: Vec<Vec<f64>>,
    forward: Calls,
    backward: Calls,
    /// The meter's events while the layers are made from the whole model, then during the
    /// step.
    pub(super) setup: Vec<Event>,
    pub(super) step: Vec<Event>,
    pub(super) total: CommStats,
}

pub(super) fn lm_rank<E: GradElement>(
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
