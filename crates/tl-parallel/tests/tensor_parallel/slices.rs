//! A rank's part of a whole parameter or moment, cut by `slice_param` and `slice_values`,
//! and the parts joined again by `TensorParallel::gather_values`: one all-gather of plain
//! values, its buffer on the meter, its time in the group's communication time.

use std::time::Duration;

use tl_collective::{Collective, CommStats, ring_bytes_sent};
use tl_parallel::tensor_parallel::{slice_param, slice_values};
use tl_parallel::{TensorParallel, labels};
use tl_tensor::Tensor;
use tl_tensor::memory::{self, EventKind, Kind};
use tl_tensor::ndarray::{ArrayD, ArrayViewD, IxDyn};

use super::common::world;
use super::delta;

const SHAPE: [usize; 3] = [4, 8, 12];

/// `[4, 8, 12]` holding 0, 1, 2, … in row-major order: every element says where it was.
fn whole() -> ArrayD<f64> {
    let count = SHAPE.iter().product::<usize>();
    ArrayD::from_shape_vec(IxDyn(&SHAPE), (0..count).map(|i| i as f64).collect()).unwrap()
}

/// Each rank of `t` cuts its part of the whole along every axis and gathers the parts back
/// whole; its part as a parameter is the same values.
#[test]
fn parts_cut_along_any_axis_gather_back_into_the_whole() {
    for t in [2, 4] {
        world(t, |comm| {
            let tp = TensorParallel::new(Box::new(comm));
            let whole = whole();
            let values = whole.as_slice().unwrap();
            for axis in 0..SHAPE.len() {
                let part = tp.split("axis", SHAPE[axis]).unwrap();
                let cut = slice_values(values, &SHAPE, axis, part.clone());
                let param = slice_param(&Tensor::param(whole.clone()), axis, part.clone());
                assert_eq!(param.to_vec(), cut, "t {t}, axis {axis}");
                let mut shape = SHAPE;
                shape[axis] = part.len();
                assert_eq!(param.shape(), shape);
                let local = ArrayViewD::from_shape(IxDyn(&shape), &cut).unwrap();
                let before = tp.stats();
                let gathered = tp
                    .gather_values(local, axis, labels::GATHERED_MOMENTS)
                    .unwrap();
                assert_eq!(gathered, whole, "t {t}, axis {axis}");
                let rank = tp.rank();
                let count = SHAPE.iter().product::<usize>();
                let bytes_sent = ring_bytes_sent(Collective::AllGather, count as u64, 8, t, rank);
                let one_gather = CommStats {
                    collectives: 1,
                    bytes_sent,
                    ..CommStats::default()
                };
                assert_eq!(delta(before, tp.stats()), one_gather);
            }
        });
    }
}

/// The gather's buffer of every rank's part is a communication buffer with the label given,
/// allocated and freed around the call, and the call's wall-clock time is counted in the
/// group's communication time.
#[test]
fn a_gathers_buffer_is_metered_and_its_time_counted() {
    let bytes = world(2, |comm| {
        let tp = TensorParallel::new(Box::new(comm));
        assert_eq!(tp.communication_time(), Duration::ZERO);
        let part = tp.split("rows", SHAPE[0]).unwrap();
        let whole = whole();
        let cut = slice_values(whole.as_slice().unwrap(), &SHAPE, 0, part);
        let local = ArrayViewD::from_shape(IxDyn(&[2, 8, 12]), &cut).unwrap();
        let (gathered, events) =
            memory::record(|| tp.gather_values(local, 0, labels::GATHERED_WEIGHTS));
        assert_eq!(gathered.unwrap(), whole);
        assert!(tp.communication_time() > Duration::ZERO);
        let events: Vec<_> = events
            .iter()
            .map(|e| (e.kind, e.bytes, e.tag.kind, e.tag.label))
            .collect();
        let buffer = (Kind::Communication, labels::GATHERED_WEIGHTS);
        let whole_bytes = 4 * 8 * 12 * 8;
        assert_eq!(
            events,
            [
                (EventKind::Alloc, whole_bytes, buffer.0, buffer.1),
                (EventKind::Free, whole_bytes, buffer.0, buffer.1),
            ]
        );
        whole_bytes
    });
    assert_eq!(bytes, [3072, 3072]);
}
