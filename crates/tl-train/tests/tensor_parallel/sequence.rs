//! Sequence parallelism: the residual stream split over the group as rows of the tokens.
//! Against the whole model on one process (loss, every gradient once the gains' shares are
//! summed, dropout's masks), against the plain split (checkpointing, bit for bit), and the
//! collectives it makes, counted by kind and costed by the ring's formula.

use std::sync::{Arc, Mutex};

use tl_collective::{
    Collective, CommStats, Communicator, ReduceOp, Slice, SliceMut, ring_bytes_sent,
};
use tl_parallel::{GradElement, TensorParallel};
use tl_tensor::nn::Module;
use tl_train::model::{Checkpointing, Llama, ModelConfig};

use super::{Pass, assemble, config, max_relative, world};

/// 2 sequences of 6 positions: 12 tokens, 6 rows a rank at t = 2 and 3 at t = 4.
const ROWS: usize = 2;
const TIME: usize = 6;
const INPUTS: [usize; 12] = [1, 4, 7, 2, 0, 10, 3, 3, 15, 8, 5, 11];
const TARGETS: [usize; 12] = [4, 7, 2, 9, 10, 3, 3, 5, 8, 12, 11, 6];

/// A collective as the ring costs it: which, how many elements, bytes each on the wire.
type Call = (Collective, u64, u64);

/// A communicator that logs each call, with the element size the wire carries.
struct Logged {
    inner: Box<dyn Communicator>,
    calls: Arc<Mutex<Vec<Call>>>,
}

impl Logged {
    fn push(&self, collective: Collective, elements: usize, bytes: usize) {
        let call = (collective, elements as u64, bytes as u64);
        self.calls.lock().unwrap().push(call);
    }
}

impl Communicator for Logged {
    fn rank(&self) -> usize {
        self.inner.rank()
    }
    fn world_size(&self) -> usize {
        self.inner.world_size()
    }
    fn all_reduce(&mut self, data: SliceMut<'_>, op: ReduceOp) -> tl_collective::Result<()> {
        self.push(
            Collective::AllReduce,
            data.len(),
            op.wire_bytes(data.element_type()),
        );
        self.inner.all_reduce(data, op)
    }
    fn reduce_scatter(
        &mut self,
        input: Slice<'_>,
        output: SliceMut<'_>,
        op: ReduceOp,
    ) -> tl_collective::Result<()> {
        let bytes = op.wire_bytes(input.element_type());
        self.push(Collective::ReduceScatter, input.len(), bytes);
        self.inner.reduce_scatter(input, output, op)
    }
    fn all_gather(&mut self, input: Slice<'_>, output: SliceMut<'_>) -> tl_collective::Result<()> {
        let bytes = output.element_type().bytes();
        self.push(Collective::AllGather, output.len(), bytes);
        self.inner.all_gather(input, output)
    }
    fn broadcast(&mut self, data: SliceMut<'_>, root: usize) -> tl_collective::Result<()> {
        let bytes = data.element_type().bytes();
        self.push(Collective::Broadcast { root }, data.len(), bytes);
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

/// A rank's pass, the calls of its forward, its backward and the sum of the gains' shares,
/// and its dropout stream after them.
struct SequencePass {
    pass: Pass,
    calls: [Vec<Call>; 3],
    dropout_state: tl_tensor::GeneratorState,
}

/// One forward and backward pass of the batch, then the gains' shares summed over the
/// group, as the trainer's step sums them.
fn sequence_pass<E: GradElement>(
    model: &Llama<E>,
    tp: &TensorParallel,
    log: &Arc<Mutex<Vec<Call>>>,
) -> SequencePass {
    model.zero_grad();
    let (rank, t) = (tp.rank(), tp.world_size());
    let before = tp.stats().bytes_sent;
    let loss = model.loss(&INPUTS, &TARGETS, ROWS, TIME).unwrap();
    let forward = std::mem::take(&mut *log.lock().unwrap());
    loss.backward();
    let backward = std::mem::take(&mut *log.lock().unwrap());
    tp.all_reduce_gradients(&model.sequence_parallel_parameters())
        .unwrap();
    let shares = std::mem::take(&mut *log.lock().unwrap());
    assert!(model.tensor_split().unwrap().take_error().is_none());
    // The bytes this rank sent are the ring's, call by call.
    let formula: u64 = [&forward, &backward, &shares]
        .into_iter()
        .flatten()
        .map(|&(c, n, bytes)| ring_bytes_sent(c, n, bytes, t, rank))
        .sum();
    assert_eq!(
        tp.stats().bytes_sent - before,
        formula,
        "rank {rank} of {t}"
    );
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| {
            let grad = p.grad().unwrap_or_else(|| panic!("{name} has no gradient"));
            (name, grad.mapv(|g| g.to_f64()))
        })
        .collect();
    SequencePass {
        pass: Pass {
            loss: loss.item().to_f64(),
            grads,
            collectives: (forward.len() as u64, backward.len() as u64),
        },
        calls: [forward, backward, shares],
        dropout_state: model.dropout_generator().state(),
    }
}

/// The sequence-parallel split at `t` on the ring, each rank's pass.
fn sequence_run<E: GradElement>(
    t: usize,
    config: &ModelConfig,
    checkpointing: Checkpointing,
) -> Vec<SequencePass> {
    world(t, |comm| {
        let calls = Arc::default();
        let logged = Logged {
            inner: Box::new(comm),
            calls: Arc::clone(&calls),
        };
        let tp = TensorParallel::new(Box::new(logged));
        let whole = Llama::<E>::new(config, 3).unwrap();
        let part = whole.tensor_parallel_with(tp.clone(), true).unwrap();
        drop(whole);
        part.set_checkpointing(checkpointing);
        sequence_pass(&part, &tp, &calls)
    })
}

/// The whole model's pass on the same batch, and its dropout stream after it.
fn whole_pass<E: GradElement>(config: &ModelConfig) -> (Pass, tl_tensor::GeneratorState) {
    let model = Llama::<E>::new(config, 3).unwrap();
    model.zero_grad();
    let loss = model.loss(&INPUTS, &TARGETS, ROWS, TIME).unwrap();
    loss.backward();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| (name, p.grad().unwrap().mapv(|g| g.to_f64())))
        .collect();
    let pass = Pass {
        loss: loss.item().to_f64(),
        grads,
        collectives: (0, 0),
    };
    (pass, model.dropout_generator().state())
}

fn count(calls: &[Call], collective: Collective) -> usize {
    calls.iter().filter(|call| call.0 == collective).count()
}

#[test]
fn a_sequence_parallel_llama_computes_the_whole_models_loss_and_gradients() {
    use Collective::{AllGather, AllReduce, ReduceScatter};
    let config = config(0.0);
    let blocks = config.n_layers;
    for t in [2, 4] {
        let (whole, _) = whole_pass::<f64>(&config);
        let ranks = sequence_run::<f64>(t, &config, Checkpointing::Off);
        for (rank, logged) in ranks.iter().enumerate() {
            let loss = logged.pass.loss;
            assert!(
                (loss - whole.loss).abs() <= 1e-14 * whole.loss,
                "t {t}: {loss} vs {}",
                whole.loss
            );
            // Forward: the embedding's reduce-scatter; per block an all-gather into and a
            // reduce-scatter out of the attention and of the MLP; the head's all-gather;
            // the cross-entropy's two all-reduces. Backward, each gather's conjugate
            // reduce-scatter and each scatter's all-gather: per block the same two and two.
            let [forward, backward, shares] = &logged.calls;
            let per_kind = |calls: &[Call]| {
                [AllGather, ReduceScatter, AllReduce].map(|kind| count(calls, kind))
            };
            let what = format!("t {t} rank {rank}");
            assert_eq!(
                per_kind(forward),
                [2 * blocks + 1, 2 * blocks + 1, 2],
                "{what}"
            );
            assert_eq!(
                per_kind(backward),
                [2 * blocks + 1, 2 * blocks + 1, 0],
                "{what}"
            );
            // The gains of both norms of each block and the final norm: one all-reduce.
            let gains = ((2 * blocks + 1) * config.d_model) as u64;
            assert_eq!(shares, &[(AllReduce, gains, 8)], "{what}");
            // Each gather moves the whole batch's activations, [B·T, d].
            let tokens = (ROWS * TIME * config.d_model) as u64;
            assert!(
                forward
                    .iter()
                    .filter(|c| c.0 != AllReduce)
                    .all(|c| c.1 == tokens)
            );
        }
        // Measured: 9.7e-16 (t = 2) and 9.4e-16 (t = 4) of each tensor's largest gradient,
        // 4 ε: the partial products' sums, as for the plain split, and the gains' row sums
        // added rank by rank.
        let error = max_relative(&assemble(&passes(&ranks)), &whole.grads);
        eprintln!("sequence parallel, t {t}, f64: gradients within {error:.2e}");
        assert!(
            error < 8.0 * f64::EPSILON,
            "t {t}: gradients differ by {error:e}"
        );

        let (whole32, _) = whole_pass::<f32>(&config);
        let ranks32 = sequence_run::<f32>(t, &config, Checkpointing::Off);
        let error = max_relative(&assemble(&passes(&ranks32)), &whole32.grads);
        eprintln!("sequence parallel, t {t}, f32: gradients within {error:.2e}");
        // Measured: 4.6e-7 and 3.7e-7, 4 ε of f32.
        let bound = 8.0 * f64::from(f32::EPSILON);
        assert!(error < bound, "t {t} f32: gradients differ by {error:e}");
    }
}

fn passes(ranks: &[SequencePass]) -> Vec<Pass> {
    ranks.iter().map(|logged| logged.pass.clone()).collect()
}

/// Dropout's masks are the whole model's: every rank draws the whole mask and applies its
/// rows, so the gradients are the whole model's and every rank's stream ends where one
/// process's does. Checkpointed, the reruns replay those draws: every policy gives the
/// plain sequence-parallel run's bits, and reruns a block's two gathers and two scatters.
#[test]
fn dropout_and_every_checkpoint_policy_under_sequence_parallelism() {
    let config = config(0.25);
    let (whole, whole_stream) = whole_pass::<f64>(&config);
    for t in [2, 4] {
        let ranks = sequence_run::<f64>(t, &config, Checkpointing::Off);
        for logged in &ranks {
            let loss = logged.pass.loss;
            assert!((loss - whole.loss).abs() <= 1e-14 * whole.loss, "t {t}");
            assert_eq!(
                logged.dropout_state, whole_stream,
                "t {t}: the streams in step"
            );
        }
        // Measured: 1.5e-15 (t = 2) and 1.8e-15 (t = 4), 8 ε, in the first w2's gradient:
        // the partial sums' rounding, carried back through both blocks.
        let error = max_relative(&assemble(&passes(&ranks)), &whole.grads);
        eprintln!("sequence parallel with dropout, t {t}, f64: gradients within {error:.2e}");
        assert!(
            error < 16.0 * f64::EPSILON,
            "t {t}: gradients differ by {error:e}"
        );
    }

    let plain = sequence_run::<f32>(2, &config, Checkpointing::Off);
    for checkpointing in Checkpointing::POLICIES.into_iter().skip(1) {
        let checkpointed = sequence_run::<f32>(2, &config, checkpointing);
        for (rank, (p, c)) in plain.iter().zip(&checkpointed).enumerate() {
            let what = format!("{checkpointing} rank {rank}");
            assert_eq!(p.pass.loss.to_bits(), c.pass.loss.to_bits(), "{what}");
            assert_eq!(p.pass.grads, c.pass.grads, "{what}");
            assert_eq!(p.dropout_state, c.dropout_state, "{what}");
            // Every block but the last is rerun (the last runs plainly), with its forward
            // collectives: two all-gathers and two reduce-scatters.
            let reruns = (config.n_layers - 1) as u64;
            assert_eq!(c.pass.collectives.0, p.pass.collectives.0, "{what}");
            assert_eq!(
                c.pass.collectives.1,
                p.pass.collectives.1 + 4 * reruns,
                "{what}"
            );
        }
    }
}

/// A batch whose tokens the group cannot share evenly is refused before any collective,
/// naming its sizes.
#[test]
fn a_batch_whose_tokens_do_not_divide_is_refused_before_any_collective() {
    let config = config(0.0);
    let outcomes = world(4, |comm| {
        let tp = TensorParallel::new(Box::new(comm));
        let part = Llama::<f32>::new(&config, 3)
            .unwrap()
            .tensor_parallel_with(tp.clone(), true)
            .unwrap();
        // 2 x 5 = 10 tokens over 4 ranks.
        let error = part.loss(&INPUTS[..10], &TARGETS[..10], 2, 5).err();
        (error.map(|e| e.to_string()), tp.stats().collectives)
    });
    for (error, collectives) in outcomes {
        let error = error.expect("refused");
        assert!(
            error.contains("2 x 5 tokens") && error.contains("divisible by 4"),
            "{error}"
        );
        assert_eq!(collectives, 0);
    }
    // The same batch over 2 ranks splits: 5 tokens each.
    let losses = world(2, |comm| {
        let tp = TensorParallel::new(Box::new(comm));
        let part = Llama::<f32>::new(&config, 3)
            .unwrap()
            .tensor_parallel_with(tp, true)
            .unwrap();
        part.loss(&INPUTS[..10], &TARGETS[..10], 2, 5).is_ok()
    });
    assert_eq!(losses, [true, true]);
}

/// Without sequence parallelism no parameter's gradient is a share.
#[test]
fn only_a_sequence_parallel_split_has_shares_to_sum() {
    let config = config(0.0);
    let shares = world(2, |comm| {
        let tp = TensorParallel::new(Box::new(comm));
        let whole = Llama::<f32>::new(&config, 3).unwrap();
        let plain = whole.tensor_parallel(tp.clone()).unwrap();
        let sequence = whole.tensor_parallel_with(tp, true).unwrap();
        let names: Vec<String> = sequence
            .named_parameters()
            .into_iter()
            .filter(|(_, p)| {
                sequence
                    .sequence_parallel_parameters()
                    .iter()
                    .any(|s| s.same(p))
            })
            .map(|(name, _)| name)
            .collect();
        (plain.sequence_parallel_parameters().len(), names)
    });
    for (plain, names) in shares {
        assert_eq!(plain, 0);
        assert_eq!(
            names,
            [
                "blocks.0.n1.w",
                "blocks.0.n2.w",
                "blocks.1.n1.w",
                "blocks.1.n2.w",
                "norm.w"
            ]
        );
        assert!(
            Llama::<f32>::new(&config, 3)
                .unwrap()
                .sequence_parallel_parameters()
                .is_empty()
        );
    }
}
