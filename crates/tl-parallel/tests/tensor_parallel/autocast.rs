//! Tensor parallelism under bf16 autocast: the ranks' partial results summed in bf16 at
//! every hop of the ring (the default, as a GPU's NCCL all-reduce adds them) or in f32
//! (`ReduceIn::F32`); against the ring's reference bit for bit, against the one-process
//! product within the bound that the roundings give, and on the wire at 2 bytes an element.

use tl_collective::{
    Collective, CollectiveError, CommStats, Communicator, ReduceOp, reference_all_reduce,
    ring_bytes_sent, shard_range,
};
use tl_parallel::{
    ColumnParallelLinear, ParallelError, ReduceIn, RowParallelLinear, TensorParallel,
    VocabParallelEmbedding,
};
use tl_precision::{Format, autocast};
use tl_tensor::ndarray::{ArrayD, Axis, Slice as Span};
use tl_tensor::nn::Embedding;
use tl_tensor::{Generator, Tensor};

use super::common::world;
use super::{ROWS, delta, matrix};

/// Input features of the row-parallel layer: long enough dot products that the partial
/// sums carry bf16 rounding errors worth measuring.
const K: usize = 64;
/// Output features.
const N: usize = 16;
/// bf16's unit roundoff, `2^-8`: a rounding moves a value by at most `u` of itself.
const U: f64 = 1.0 / 256.0;

fn x_whole() -> ArrayD<f32> {
    matrix(0..ROWS, K, |r, c| ((r * 13 + c * 7) as f64 * 0.37).sin())
}

fn w_whole() -> ArrayD<f32> {
    matrix(0..K, N, |r, c| ((r * 5 + c * 11) as f64 * 0.53).cos())
}

fn part_of(array: &ArrayD<f32>, axis: usize, part: std::ops::Range<usize>) -> ArrayD<f32> {
    array.slice_axis(Axis(axis), Span::from(part)).to_owned()
}

/// Rank `r`'s share of `size`, as `TensorParallel::split` gives it.
fn share(size: usize, t: usize, r: usize) -> std::ops::Range<usize> {
    r * size / t..(r + 1) * size / t
}

/// Every rank's partial product `rd(rd(x_r)·rd(W_r))`, computed here under bf16 autocast.
fn partials(t: usize) -> Vec<Vec<f32>> {
    let _bf16 = autocast(Format::Bf16);
    (0..t)
        .map(|r| {
            let part = share(K, t, r);
            let x = Tensor::from_array(part_of(&x_whole(), 1, part.clone()));
            x.matmul(&Tensor::from_array(part_of(&w_whole(), 0, part)))
                .to_vec()
        })
        .collect()
}

fn bits(xs: &[f32]) -> Vec<u32> {
    xs.iter().map(|x| x.to_bits()).collect()
}

/// What one rank of a row-parallel layer computed under bf16 autocast.
struct RowRun {
    output: Vec<f32>,
    /// The rank's partial product, as the layer's matmul makes it.
    partial: Vec<f32>,
    sent: CommStats,
}

fn row_parallel(t: usize, reduce_in: ReduceIn, sequence_parallel: bool) -> Vec<RowRun> {
    world(t, |comm| {
        let _bf16 = autocast(Format::Bf16);
        let tp = TensorParallel::new(Box::new(comm)).with_reduce_in(reduce_in);
        let layer = RowParallelLinear::from_full(&Tensor::param(w_whole()), None, &tp)
            .unwrap()
            .with_sequence_parallel(sequence_parallel);
        let part = tp.split("input features", K).unwrap();
        let x = Tensor::param(part_of(&x_whole(), 1, part));
        let partial = x.matmul(layer.weight()).to_vec();
        let before = tp.stats();
        let y = layer.forward(&x).unwrap();
        RowRun {
            output: y.to_vec(),
            partial,
            sent: delta(before, tp.stats()),
        }
    })
}

#[test]
fn a_row_parallel_layer_sums_its_partial_outputs_as_the_ring_reference_does() {
    let len = ROWS * N;
    for t in [2, 4] {
        let partials = partials(t);
        let refs: Vec<&[f32]> = partials.iter().map(Vec::as_slice).collect();
        for (reduce_in, op, wire_bytes) in [
            (ReduceIn::AutocastFormat, ReduceOp::SumIn(Format::Bf16), 2),
            (ReduceIn::F32, ReduceOp::Sum, 4),
        ] {
            let expected = reference_all_reduce(&refs, op);
            for sequence_parallel in [false, true] {
                let what = format!("t {t}, {reduce_in:?}, sequence parallel {sequence_parallel}");
                for (r, run) in row_parallel(t, reduce_in, sequence_parallel)
                    .iter()
                    .enumerate()
                {
                    // The matmul's output is rounded by autocast already: the sum's own
                    // rounding of each rank's input changes nothing.
                    assert_eq!(bits(&run.partial), bits(&partials[r]), "{what}");
                    let rounded: Vec<f32> = run
                        .partial
                        .iter()
                        .map(|&p| tl_numerics::round_to_bf16(p))
                        .collect();
                    assert_eq!(bits(&rounded), bits(&run.partial), "{what}");
                    let (want, collective) = match sequence_parallel {
                        true => (&expected[shard_range(len, t, r)], Collective::ReduceScatter),
                        false => (&expected[..], Collective::AllReduce),
                    };
                    assert_eq!(bits(&run.output), bits(want), "{what}: rank {r}");
                    let bytes_sent = ring_bytes_sent(collective, len as u64, wire_bytes, t, r);
                    let sent = CommStats {
                        collectives: 1,
                        bytes_sent,
                        ..CommStats::default()
                    };
                    assert_eq!(run.sent, sent, "{what}: rank {r}");
                }
            }
        }
    }
}

/// `max_ij |got_ij − want_ij| / M_ij`, with `M_ij = Σ_k |rd(x_ik)·rd(w_kj)|`, the scale
/// every rounding error of the dot product is bounded by.
fn worst_relative_to_m(got: &[f32], want: &[f32]) -> f64 {
    let (x, w) = (x_whole(), w_whole());
    let rd = |v: f32| f64::from(tl_numerics::round_to_bf16(v));
    let mut worst = 0.0f64;
    for i in 0..ROWS {
        for j in 0..N {
            let m: f64 = (0..K).map(|k| (rd(x[[i, k]]) * rd(w[[k, j]])).abs()).sum();
            let error = (f64::from(got[i * N + j]) - f64::from(want[i * N + j])).abs();
            worst = worst.max(error / m);
        }
    }
    worst
}

#[test]
fn bf16_partial_sums_stay_within_their_bound_of_one_process_and_f32_ones_closer() {
    // One process: rd(Σ_k rd(x_ik)·rd(w_kj)), the products added in f32.
    let one = {
        let _bf16 = autocast(Format::Bf16);
        Tensor::from_array(x_whole())
            .matmul(&Tensor::from_array(w_whole()))
            .to_vec()
    };
    // Both sides add K products in f32, in different groupings: 2K·2^-24 of M covers it.
    let f32_slack = 2.0 * K as f64 * f64::from(f32::EPSILON) / 2.0;
    for t in [2, 4] {
        let ring = &row_parallel(t, ReduceIn::AutocastFormat, false)[0].output;
        let in_f32 = &row_parallel(t, ReduceIn::F32, false)[0].output;
        let (ring_error, f32_error) = (
            worst_relative_to_m(ring, &one),
            worst_relative_to_m(in_f32, &one),
        );
        // The ring rounds each partial once and each of the t − 1 sums once: a partial goes
        // through at most t roundings, so |ŝ − s| ≤ γ_t·Σ|p_r| ≤ γ_t·M, γ_t = tu/(1 − tu);
        // one process rounds its sum once more apart, u·M.
        let gamma = t as f64 * U / (1.0 - t as f64 * U);
        let ring_bound = gamma + U + f32_slack;
        // In f32: the partials' own roundings (u·M in all), the one process's (u·M).
        let f32_bound = 2.0 * U + f32_slack + (t - 1) as f64 * f64::from(f32::EPSILON);
        eprintln!(
            "t {t}: bf16 ring {:.3} u (bound {:.3} u), f32 {:.3} u (bound {:.3} u)",
            ring_error / U,
            ring_bound / U,
            f32_error / U,
            f32_bound / U
        );
        assert!(
            ring_error <= ring_bound,
            "t {t}: {ring_error:e} > {ring_bound:e}"
        );
        assert!(
            f32_error <= f32_bound,
            "t {t}: {f32_error:e} > {f32_bound:e}"
        );
        assert!(
            f32_error < ring_error,
            "t {t}: f32 {f32_error:e}, bf16 {ring_error:e}"
        );
        assert!(ring_error > 0.0, "t {t}: the bf16 ring rounded nothing");
    }
}

const COLUMN_IN: usize = 16;
const COLUMN_OUT: usize = 32;

fn column_weight() -> ArrayD<f32> {
    matrix(0..COLUMN_IN, COLUMN_OUT, |r, c| {
        ((r * 3 + c * 7) as f64 * 0.29).sin()
    })
}

fn column_input() -> ArrayD<f32> {
    matrix(0..ROWS, COLUMN_IN, |r, c| {
        ((r * 11 + c * 5) as f64 * 0.41).cos()
    })
}

fn column_loss_weights() -> ArrayD<f32> {
    matrix(0..ROWS, COLUMN_OUT, |r, c| {
        ((r * 7 + c * 3) as f64 * 0.63).sin()
    })
}

#[test]
fn a_column_parallel_layers_input_gradients_are_summed_in_bf16_after_the_guard_drops() {
    let len = ROWS * COLUMN_IN;
    for t in [2, 4] {
        // Each rank's partial gradient: rd(rd(Ȳ_r)·rd(W_r)ᵀ), computed here.
        let partials: Vec<Vec<f32>> = (0..t)
            .map(|r| {
                let part = share(COLUMN_OUT, t, r);
                let x = Tensor::param(column_input());
                let w = Tensor::from_array(part_of(&column_weight(), 1, part.clone()));
                let y = {
                    let _bf16 = autocast(Format::Bf16);
                    x.matmul(&w)
                };
                let weights = Tensor::from_array(part_of(&column_loss_weights(), 1, part));
                (&y * &weights).sum_all().backward();
                x.grad().unwrap().iter().copied().collect()
            })
            .collect();
        let refs: Vec<&[f32]> = partials.iter().map(Vec::as_slice).collect();
        let expected = reference_all_reduce(&refs, ReduceOp::SumIn(Format::Bf16));
        let runs = world(t, |comm| {
            let tp = TensorParallel::new(Box::new(comm));
            let layer = ColumnParallelLinear::from_full(&Tensor::param(column_weight()), None, &tp)
                .unwrap();
            let x = Tensor::param(column_input());
            // The backward runs after the guard: the sum is the forward's choice.
            let y = {
                let _bf16 = autocast(Format::Bf16);
                layer.forward(&x).unwrap()
            };
            let part = tp.split("output features", COLUMN_OUT).unwrap();
            let weights = Tensor::from_array(part_of(&column_loss_weights(), 1, part));
            let before = tp.stats();
            (&y * &weights).sum_all().backward();
            assert!(tp.take_error().is_none());
            let grad: Vec<f32> = x.grad().unwrap().iter().copied().collect();
            (grad, delta(before, tp.stats()))
        });
        for (r, (grad, sent)) in runs.iter().enumerate() {
            assert_eq!(
                bits(grad),
                bits(&expected),
                "t {t}: rank {r}'s input gradient"
            );
            let bytes_sent = ring_bytes_sent(Collective::AllReduce, len as u64, 2, t, r);
            let want = CommStats {
                collectives: 1,
                bytes_sent,
                ..CommStats::default()
            };
            assert_eq!(*sent, want, "t {t}: rank {r}");
        }
    }
}

#[test]
fn ranks_that_choose_different_reductions_all_fail_with_a_mismatch() {
    let errors = world(2, |comm| {
        let _bf16 = autocast(Format::Bf16);
        let reduce_in = [ReduceIn::F32, ReduceIn::AutocastFormat][comm.rank()];
        let tp = TensorParallel::new(Box::new(comm)).with_reduce_in(reduce_in);
        let x = Tensor::from_array(x_whole());
        match tp.reduce_from(&x) {
            Err(error) => error,
            Ok(_) => panic!("the ranks disagree"),
        }
    });
    for error in errors {
        match error {
            ParallelError::Collective {
                source: CollectiveError::Mismatch { calls },
                ..
            } => assert_eq!(
                (calls[0].op, calls[1].op),
                ("all_reduce_sum", "all_reduce_sum_bf16")
            ),
            other => panic!("{other}"),
        }
    }
}

#[test]
fn an_embeddings_lookups_are_summed_exactly_in_f32_under_autocast() {
    // A lookup is no product: one process does not round it, so neither do the ranks.
    let full = || Embedding::<f32>::new(16, 8, &Generator::new(3));
    let ids = [3, 15, 0, 9];
    let whole = full().forward_ids(&ids, &[4]).to_vec();
    let runs = world(2, |comm| {
        let _bf16 = autocast(Format::Bf16);
        let full = full();
        let tp = TensorParallel::new(Box::new(comm));
        let embedding = VocabParallelEmbedding::from_full(full.weight(), &tp).unwrap();
        let before = tp.stats();
        let x = embedding.forward_ids(&ids, &[4]).unwrap();
        (x.to_vec(), delta(before, tp.stats()))
    });
    for (r, (x, sent)) in runs.iter().enumerate() {
        assert_eq!(bits(x), bits(&whole));
        let bytes_sent = ring_bytes_sent(Collective::AllReduce, 32, 4, 2, r);
        assert_eq!(sent.bytes_sent, bytes_sent);
    }
}
