//! Helpers shared by the behaviour tests.

use proptest::test_runner::{Config, RngSeed};
use tl_precision::Format;
use tl_tensor::ndarray::arr1;
use tl_tensor::ndarray::{ArrayD, IxDyn};
use tl_tensor::optim::Sgd;
use tl_tensor::{Element, Generator, Tensor};

/// The elements of an array in row-major order.
pub fn values<E: Element>(array: &ArrayD<E>) -> Vec<E> {
    array.iter().copied().collect()
}

/// The gradient of a parameter, row-major.
pub fn grad_of<E: Element>(param: &Tensor<E>) -> Vec<E> {
    values(&param.grad().expect("the parameter has a gradient"))
}

/// `array` with every element rounded into `format` (the reference rounding).
pub fn rounded<E: Element>(array: &ArrayD<E>, format: Format) -> ArrayD<E> {
    array.mapv(|v| v.round_to(format))
}

/// Standard normal draws times `std`, from a seeded generator.
pub fn normal<E: Element>(shape: &[usize], std: f64, rng: &Generator) -> ArrayD<E> {
    ArrayD::from_shape_simple_fn(IxDyn(shape), || E::from_f64(std * rng.next_normal()))
}

/// Asserts `|a − b| ≤ tol·max(1, |b|)` elementwise, naming the first offending index.
pub fn assert_close(actual: &[f64], expected: &[f64], tol: f64) {
    assert_eq!(actual.len(), expected.len(), "lengths differ");
    for (i, (&a, &b)) in actual.iter().zip(expected).enumerate() {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "index {i}: {a} vs {b} (tolerance {tol})"
        );
    }
}

/// f32 values as f64.
pub fn widen(xs: &[f32]) -> Vec<f64> {
    xs.iter().map(|&x| f64::from(x)).collect()
}

/// A proptest configuration with a fixed seed and no failure files: a few cases, the same
/// every run.
pub fn fixed_cases(cases: u32) -> Config {
    Config {
        cases,
        rng_seed: RngSeed::Fixed(0x5eed_1111),
        failure_persistence: None,
        ..Config::default()
    }
}

/// A 1-D f32 parameter.
pub fn weight(values: &[f32]) -> Tensor<f32> {
    Tensor::param(arr1(values).into_dyn())
}

/// Plain SGD over `params`.
pub fn sgd(params: &[Tensor<f32>], lr: f64) -> Sgd<f32> {
    Sgd::new(params.to_vec(), lr).unwrap()
}
