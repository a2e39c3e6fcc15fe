//! The split backward (`backward_input_from`, then `WeightGradients::run`): the inputs'
//! gradients first, the parameters' later, together exactly the gradients of one backward,
//! with the products' weight gradients really left for the second half.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use ndarray::ArrayD;
use proptest::prelude::*;
use tl_tensor::testing::random_array;
use tl_tensor::{Generator, GradReadyHook, ProductKernel, Tensor, memory, meta_mode};

/// A product kernel that sums in plain order and counts its calls.
#[derive(Debug, Default)]
struct Counting {
    calls: AtomicUsize,
}

impl Counting {
    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

macro_rules! product {
    ($name:ident, $t:ty) => {
        fn $name(
            &self,
            m: usize,
            k: usize,
            n: usize,
            lhs: &[$t],
            rhs: &[$t],
            out: &mut [$t],
            accumulate: bool,
        ) {
            self.calls.fetch_add(1, Ordering::SeqCst);
            for i in 0..m {
                for j in 0..n {
                    let sum: $t = (0..k).map(|p| lhs[i * k + p] * rhs[p * n + j]).sum();
                    out[i * n + j] = if accumulate {
                        out[i * n + j] + sum
                    } else {
                        sum
                    };
                }
            }
        }
    };
}

impl ProductKernel for Counting {
    product!(product_f32, f32);
    product!(product_f64, f64);
}

/// The model the tests split: an input `x` (a leaf that requires grad but is no
/// parameter) through a norm-like scale, two products with one weight used twice, a
/// weight that goes through an op of its own before its product, and an activation.
struct Net<E: tl_tensor::Element> {
    scale: Tensor<E>,
    w1: Tensor<E>,
    w2: Tensor<E>,
    raw: Tensor<E>,
}

impl Net<f64> {
    fn new(d: usize, rng: &Generator) -> Self {
        Self {
            scale: Tensor::param(random_array(&[d], rng)),
            w1: Tensor::param(random_array(&[d, d], rng)),
            w2: Tensor::param(random_array(&[d, d], rng)),
            raw: Tensor::param(random_array(&[d, d], rng)),
        }
    }

    fn forward(&self, x: &Tensor<f64>, kernel: Option<&Arc<dyn ProductKernel>>) -> Tensor<f64> {
        let product = |a: &Tensor<f64>, b: &Tensor<f64>| match kernel {
            Some(kernel) => a.matmul_with(b, kernel),
            None => a.matmul(b),
        };
        let h = x.mul(&self.scale);
        let h = product(&h, &self.w1).silu();
        let h = product(&h, &self.w2).add(&product(&h.tanh(), &self.w2));
        // A weight through an op of its own (as autocast rounds a weight before its product).
        product(&h, &self.raw.mul_scalar(0.5))
    }

    fn params(&self) -> [&Tensor<f64>; 4] {
        [&self.scale, &self.w1, &self.w2, &self.raw]
    }
}

fn bits(tensor: &Tensor<f64>) -> Vec<u64> {
    let grad = tensor.grad().expect("a gradient");
    grad.iter().map(|v| v.to_bits()).collect()
}

fn input(shape: &[usize], rng: &Generator) -> Tensor<f64> {
    let x = Tensor::from_array(random_array(shape, rng));
    x.set_requires_grad(true);
    x
}

#[test]
fn the_two_halves_are_one_backward_bit_for_bit() {
    let rng = Generator::new(7);
    let net = Net::new(5, &rng);
    let (x, seed) = (
        random_array(&[2, 3, 5], &rng),
        random_array(&[2, 3, 5], &rng),
    );
    let seed = Tensor::from_array(seed);
    // Two micro-batches accumulate, as a pipeline stage's do.
    let (plain_x, split_x) = (Tensor::from_array(x.clone()), Tensor::from_array(x));
    plain_x.set_requires_grad(true);
    split_x.set_requires_grad(true);
    for _ in 0..2 {
        net.forward(&plain_x, None).backward_from(&seed);
    }
    let expected: Vec<Vec<u64>> = net.params().iter().map(|p| bits(p)).collect();
    let expected_x = bits(&plain_x);
    for p in net.params() {
        p.zero_grad();
    }

    let first = net.forward(&split_x, None).backward_input_from(&seed);
    assert!(split_x.grad().is_some(), "the input's gradient comes first");
    assert!(
        net.params().iter().all(|p| p.grad().is_none()),
        "no parameter has a gradient before the second half"
    );
    let second = net.forward(&split_x, None).backward_input_from(&seed);
    first.run();
    second.run();
    assert_eq!(bits(&split_x), expected_x);
    for (p, expected) in net.params().iter().zip(&expected) {
        assert_eq!(&bits(p), expected);
    }
}

#[test]
fn a_products_weight_gradient_is_computed_only_in_the_second_half() {
    let rng = Generator::new(3);
    let net = Net::new(4, &rng);
    let counting = Arc::new(Counting::default());
    let kernel: Arc<dyn ProductKernel> = counting.clone();
    let x = input(&[3, 4], &rng);
    let output = net.forward(&x, Some(&kernel));
    let forward = counting.calls();
    let weights = output.sum_all().backward_input();
    // Each of the four products gives its input's gradient now, its weight's later.
    assert_eq!(
        counting.calls() - forward,
        4,
        "the input's half: one product each"
    );
    weights.run();
    assert_eq!(
        counting.calls() - forward,
        8,
        "the weights' half: one more each"
    );
}

#[test]
fn without_an_input_everything_waits_for_the_second_half() {
    // A pipeline's first stage starts from data: nothing is an input, the first half does
    // nothing and the second is the whole backward.
    let rng = Generator::new(11);
    let net = Net::new(3, &rng);
    let x = Tensor::from_array(random_array(&[2, 3], &rng));
    net.forward(&x, None).sum_all().backward();
    let expected: Vec<Vec<u64>> = net.params().iter().map(|p| bits(p)).collect();
    for p in net.params() {
        p.zero_grad();
    }
    let weights = net.forward(&x, None).sum_all().backward_input();
    assert!(net.params().iter().all(|p| p.grad().is_none()));
    weights.run();
    for (p, expected) in net.params().iter().zip(&expected) {
        assert_eq!(&bits(p), expected);
    }
}

#[test]
fn a_parameters_hook_runs_in_the_second_half_once() {
    let rng = Generator::new(5);
    let net = Net::new(3, &rng);
    let runs = Rc::new(Cell::new(0));
    let counter = Rc::clone(&runs);
    let hook: GradReadyHook = Rc::new(move || counter.set(counter.get() + 1));
    net.w2.set_grad_ready_hook(Some(hook));
    let x = input(&[2, 3], &rng);
    let weights = net.forward(&x, None).sum_all().backward_input();
    assert_eq!(runs.get(), 0);
    weights.run();
    assert_eq!(runs.get(), 1, "w2 is used twice and finished once");
    net.w2.set_grad_ready_hook(None);
}

#[test]
fn dropping_the_second_half_frees_what_it_held() {
    let rng = Generator::new(9);
    let net = Net::new(8, &rng);
    let x = input(&[4, 8], &rng);
    let before = memory::live_bytes();
    let weights = net.forward(&x, None).sum_all().backward_input();
    assert!(
        memory::live_bytes() > before,
        "activations wait for the weights' half"
    );
    drop(weights);
    let held_by_x = 4 * 8 * 8; // x's gradient
    assert_eq!(memory::live_bytes(), before + held_by_x);
    assert!(net.params().iter().all(|p| p.grad().is_none()));
}

/// The meter during `f`: its peak above the bytes live before, and the bytes live after
/// less those before.
fn meter_trace(f: impl FnOnce()) -> (usize, i64) {
    memory::reset_peak();
    let before = memory::live_bytes();
    f();
    let after = memory::live_bytes() as i64 - before as i64;
    (memory::peak_bytes() - before, after)
}

#[test]
fn a_meta_split_sweep_counts_what_a_real_one_does() {
    let run = |meta: bool| {
        let rng = Generator::new(1);
        let log = Rc::new(RefCell::new(Vec::new()));
        let trace = meter_trace(|| {
            let _meta = meta.then(meta_mode);
            let net = Net::new(6, &rng);
            let x = input(&[3, 6], &rng);
            let first = net.forward(&x, None).sum_all().backward_input();
            log.borrow_mut().push(memory::live_bytes());
            first.run();
            log.borrow_mut().push(memory::live_bytes());
        });
        (trace, log.take())
    };
    assert_eq!(run(true), run(false));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    /// Any sizes, any number of micro-batches, any order of their second halves after all
    /// first halves: the gradients of plain backwards, bit for bit (f32).
    #[test]
    fn split_sweeps_equal_plain_ones(
        d in 1usize..6,
        rows in 1usize..5,
        micro_batches in 1usize..4,
        seed in 0u64..1000,
    ) {
        let rng = Generator::new(seed);
        let make = |shape: &[usize]| random_array(shape, &rng).mapv(|v| v as f32);
        let (w1, w2) = (Tensor::param(make(&[d, d])), Tensor::param(make(&[d, d])));
        let scale = Tensor::param(make(&[d]));
        let xs: Vec<ArrayD<f32>> = (0..micro_batches).map(|_| make(&[rows, d])).collect();
        let forward = |x: &Tensor<f32>| {
            let h = x.mul(&scale).matmul(&w1).silu();
            h.matmul(&w2).add(&h.matmul(&w1)).sum_all()
        };
        let leaf = |x: &ArrayD<f32>| {
            let t = Tensor::from_array(x.clone());
            t.set_requires_grad(true);
            t
        };
        let mut plain_inputs = Vec::new();
        for x in &xs {
            let x = leaf(x);
            forward(&x).backward();
            plain_inputs.push(x.grad().unwrap());
        }
        let expected: Vec<ArrayD<f32>> = [&w1, &w2, &scale].iter().map(|p| p.grad().unwrap()).collect();
        for p in [&w1, &w2, &scale] {
            p.zero_grad();
        }
        let mut halves = Vec::new();
        for (x, expected_x) in xs.iter().zip(&plain_inputs) {
            let x = leaf(x);
            halves.push(forward(&x).backward_input());
            prop_assert_eq!(&x.grad().unwrap(), expected_x);
        }
        for half in halves {
            half.run();
        }
        for (p, expected) in [&w1, &w2, &scale].iter().zip(&expected) {
            let got: Vec<u32> = p.grad().unwrap().iter().map(|v| v.to_bits()).collect();
            let want: Vec<u32> = expected.iter().map(|v| v.to_bits()).collect();
            prop_assert_eq!(got, want);
        }
    }
}

/// A product written parent by parent costs what one written as a values VJP costs: what
/// it saved (its operands) is freed before its gradients are placed, as a values VJP's
/// closure is consumed by its call. The backward's peak is the same, byte for byte.
#[test]
fn a_by_parent_product_peaks_where_a_values_product_does() {
    let peak = |by_parent: bool| {
        let rng = Generator::new(2);
        let w = Tensor::param(random_array(&[16, 16], &rng));
        let product = |x: &Tensor<f64>| {
            let (lhs, rhs) = (x.clone(), w.clone());
            let shape = [x.shape()[0], 16];
            let compute = || x.value().dot_2d(&w.value());
            if by_parent {
                Tensor::from_product_by_parent(&shape, compute, &[x, &w], move |g, parent| {
                    if parent == 0 {
                        g.dot_2d_t(&rhs.value())
                    } else {
                        lhs.value().t_dot_2d(g)
                    }
                })
            } else {
                Tensor::from_product(&shape, compute, &[x, &w], move |g| {
                    vec![
                        lhs.requires_grad().then(|| g.dot_2d_t(&rhs.value())),
                        Some(lhs.value().t_dot_2d(&g)),
                    ]
                })
            }
        };
        // The input dies with the forward: only the product's closure holds it.
        let loss = product(&input(&[64, 16], &rng).mul_scalar(2.0)).sum_all();
        meter_trace(|| loss.backward()).0
    };
    assert_eq!(peak(true), peak(false));
}

/// 2-D products for the test above.
trait Dot2 {
    fn dot_2d(&self, rhs: &ArrayD<f64>) -> ArrayD<f64>;
    fn dot_2d_t(&self, rhs: &ArrayD<f64>) -> ArrayD<f64>;
    fn t_dot_2d(&self, rhs: &ArrayD<f64>) -> ArrayD<f64>;
}

impl Dot2 for ArrayD<f64> {
    fn dot_2d(&self, rhs: &ArrayD<f64>) -> ArrayD<f64> {
        two(self).dot(&two(rhs)).into_dyn()
    }
    fn dot_2d_t(&self, rhs: &ArrayD<f64>) -> ArrayD<f64> {
        two(self).dot(&two(rhs).t()).into_dyn()
    }
    fn t_dot_2d(&self, rhs: &ArrayD<f64>) -> ArrayD<f64> {
        two(self).t().dot(&two(rhs)).into_dyn()
    }
}

fn two(a: &ArrayD<f64>) -> ndarray::ArrayView2<'_, f64> {
    a.view().into_dimensionality().expect("2-D")
}
