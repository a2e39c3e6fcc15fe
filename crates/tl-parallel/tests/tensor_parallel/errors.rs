//! What tensor parallelism refuses, and a collective that fails.

use tl_collective::{CommStats, Communicator, Phantom, ReduceOp, Slice, SliceMut};
use tl_parallel::{
    ColumnParallelLinear, ParallelError, RowParallelLinear, TensorParallel, VocabParallelEmbedding,
};
use tl_tensor::ndarray::{ArrayD, IxDyn};
use tl_tensor::nn::{Embedding, Linear};
use tl_tensor::{Generator, Tensor};

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
    fn split(&mut self, _: &[usize]) -> tl_collective::Result<Box<dyn Communicator>> {
        Err(tl_collective::CollectiveError::Closed)
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
