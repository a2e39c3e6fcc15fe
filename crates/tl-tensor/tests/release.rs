//! Releasing a parameter's value storage and restoring it (what ZeRO-3 does between the
//! uses of a layer's weights).

use tl_tensor::ndarray::{ArrayD, arr1};
use tl_tensor::{Tensor, memory};

fn param(values: &[f64], shape: &[usize]) -> Tensor<f64> {
    Tensor::param(ArrayD::from_shape_vec(shape.to_vec(), values.to_vec()).unwrap())
}

#[test]
fn release_frees_the_bytes_and_keeps_shape_grad_and_graph_place() {
    let w = param(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3]);
    w.set_grad(Some(ArrayD::ones(vec![2, 3])));
    let copy = w.detach(); // same storage: sees the release too
    let before = memory::live_bytes();
    w.release_value();
    assert_eq!(before - memory::live_bytes(), 6 * 8);
    assert!(w.is_released() && copy.is_released());
    assert_eq!((w.shape(), w.ndim(), w.numel()), (vec![2, 3], 2, 6));
    assert_eq!(w.value().len(), 0);
    assert!(w.requires_grad());
    assert_eq!(w.grad().unwrap().sum(), 6.0);

    w.restore_value(ArrayD::from_elem(vec![2, 3], 7.0));
    assert_eq!(memory::live_bytes(), before);
    assert!(!w.is_released());
    assert_eq!(copy.to_vec(), vec![7.0; 6]);
}

#[test]
fn a_released_and_restored_parameter_trains_as_before() {
    // loss = Σ (w·x)², dloss/dw = 2(w·x)x: with w = [1, 2], x = [3, 4] that is 22·[3, 4].
    let w = param(&[1.0, 2.0], &[2]);
    let x = Tensor::from_array(arr1(&[3.0, 4.0]).into_dyn());
    let kept = w.to_array();
    w.release_value();
    w.restore_value(kept);
    let y = (&w * &x).sum_all();
    (&y * &y).backward();
    assert_eq!(w.grad().unwrap().as_slice().unwrap(), &[66.0, 88.0]);
}

#[test]
fn a_released_value_is_released_only_once() {
    let w = param(&[1.0], &[1]);
    w.release_value();
    let twice = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.release_value()));
    assert!(twice.is_err());
    assert!(w.is_released(), "the failed call changed nothing");
}

#[test]
#[should_panic(expected = "released shape")]
fn restoring_another_shape_panics() {
    let w = param(&[1.0, 2.0], &[2]);
    w.release_value();
    w.restore_value(ArrayD::zeros(vec![3]));
}

#[test]
#[should_panic(expected = "not released")]
fn restoring_a_value_that_was_not_released_panics() {
    param(&[1.0], &[1]).restore_value(ArrayD::zeros(vec![1]));
}
