//! The autograd core's behaviour: deep graphs, accumulation, grad mode and its guards,
//! modes on worker threads, and memory released during backward.
//!
//! Every test runs on the default test thread (2 MiB of stack): the depth tests exist to
//! show the sweep — and the graph's destruction — need no deep recursion.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;

use ndarray::{ArrayD, IxDyn, arr1};
use tl_tensor::testing::random_array;
use tl_tensor::{
    Generator, MatmulHook, ModeSnapshot, Tensor, is_grad_enabled, matmul_hook, memory, no_grad,
    set_grad_enabled, set_matmul_hook,
};

fn param(values: &[f64]) -> Tensor<f64> {
    Tensor::param(arr1(values).into_dyn())
}

/// A chain of `len` ops alternating |·| and ×1 on a positive input: value and gradient stay
/// exact. `abs` saves its input tensor, so each node's VJP holds a handle on the node before
/// it — the shape of graph whose destruction recurses if done naively.
fn abs_chain(x: &Tensor<f64>, len: usize) -> Tensor<f64> {
    let mut y = x.clone();
    for i in 0..len {
        y = if i % 2 == 0 {
            y.abs()
        } else {
            y.mul_scalar(1.0)
        };
    }
    y
}

#[test]
fn a_chain_of_ten_thousand_ops_backpropagates_on_a_small_stack() {
    let x = param(&[3.0]);
    let y = abs_chain(&x, 10_000);
    assert_eq!(y.item(), 3.0);
    y.backward();
    assert_eq!(x.grad().unwrap()[[0]], 1.0);
}

#[test]
fn a_chain_of_ten_thousand_ops_drops_without_backward() {
    // Dropping the last tensor frees the whole chain behind it, without recursing per op.
    let x = param(&[3.0]);
    let before = memory::live_bytes();
    let y = abs_chain(&x, 10_000);
    drop(y);
    assert_eq!(memory::live_bytes(), before);
}

#[test]
fn gradients_accumulate_across_backward_calls_until_zero_grad() {
    // L = Σ 3x: dL/dx = 3 per call.
    let x = param(&[1.0, 2.0]);
    let loss = || x.mul_scalar(3.0).sum_all();
    loss().backward();
    loss().backward();
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[6.0, 6.0]);
    x.zero_grad();
    assert!(x.grad().is_none());
    loss().backward();
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[3.0, 3.0]);
}

#[test]
fn a_value_used_twice_gets_the_sum_of_both_paths() {
    // a = 3x feeds both factors of a² and the + a: dL/dx = (2a + 1) · 3.
    // x = [1, 2] → a = [3, 6] → dL/dx = [21, 39].
    let x = param(&[1.0, 2.0]);
    let a = x.mul_scalar(3.0);
    (&(&a * &a) + &a).sum_all().backward();
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[21.0, 39.0]);
}

#[test]
fn intermediate_results_keep_no_gradient() {
    let x = param(&[1.0]);
    let hidden = x.mul_scalar(2.0);
    hidden.exp().sum_all().backward();
    assert!(!hidden.is_leaf());
    assert!(hidden.grad().is_none());
    assert!(x.grad().is_some());
}

#[test]
fn no_grad_records_nothing_and_nested_guards_restore_in_order() {
    let w = param(&[2.0]);
    assert!(is_grad_enabled());
    {
        let _outer = no_grad();
        let y = w.mul_scalar(3.0).exp();
        assert!(!y.requires_grad());
        assert!(y.is_leaf());
        {
            let _inner = set_grad_enabled(true);
            assert!(w.mul_scalar(3.0).requires_grad());
        }
        assert!(!is_grad_enabled());
    }
    assert!(is_grad_enabled());
    assert!(w.mul_scalar(3.0).requires_grad());
}

#[test]
fn the_grad_mode_is_restored_after_a_panic() {
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        let _guard = no_grad();
        assert!(!is_grad_enabled());
        panic!("a failure inside a no_grad region");
    }));
    assert!(outcome.is_err());
    assert!(is_grad_enabled());
}

#[test]
#[should_panic(expected = "backward through a graph that a previous backward already freed")]
fn a_second_backward_through_one_graph_panics() {
    let x = param(&[1.0]);
    let loss = x.exp().sum_all();
    loss.backward();
    loss.backward();
}

#[test]
#[should_panic(expected = "backward: the tensor does not require grad")]
fn backward_from_a_constant_panics() {
    Tensor::<f64>::scalar(1.0).backward();
}

/// A matmul hook that doubles every product, so its presence shows in the result.
struct Doubling;

impl MatmulHook for Doubling {
    fn matmul_f32(&self, lhs: &Tensor<f32>, rhs: &Tensor<f32>) -> Tensor<f32> {
        lhs.matmul_plain(rhs).mul_scalar(2.0)
    }
    fn matmul_f64(&self, lhs: &Tensor<f64>, rhs: &Tensor<f64>) -> Tensor<f64> {
        lhs.matmul_plain(rhs).mul_scalar(2.0)
    }
}

#[test]
fn a_mode_snapshot_carries_grad_mode_and_matmul_hook_to_a_worker() {
    let previous_hook = set_matmul_hook(Some(Arc::new(Doubling)));
    let off = no_grad();
    let modes = ModeSnapshot::capture();
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let w = Tensor::<f64>::param(ArrayD::ones(IxDyn(&[1, 1])));
                // A fresh thread starts in the defaults: grad on, no hook.
                assert!(is_grad_enabled());
                assert!(matmul_hook().is_none());
                assert_eq!(w.matmul(&w).item(), 1.0);
                {
                    let _same = modes.enter();
                    assert!(!is_grad_enabled());
                    let product = w.matmul(&w);
                    assert_eq!(product.item(), 2.0);
                    assert!(!product.requires_grad());
                }
                // Leaving the snapshot puts the worker's own modes back.
                assert!(is_grad_enabled());
                assert!(matmul_hook().is_none());
            })
            .join()
            .expect("the worker's assertions hold");
    });
    drop(off);
    set_matmul_hook(previous_hook);
    assert!(is_grad_enabled());
}

/// Memory during backward on a 32-layer chain x ← tanh(x · Wᵢ) with a data input.
///
/// What forward leaves alive above the parameters and the data: each layer's output xᵢ
/// (`tanh` saves its output, and the next matmul saves the same storage as its input; the
/// matmul's own output is saved by no one and dies at once), and the loss.
///
/// What backward adds: the gradient in flight (one activation), and each Wᵢ's gradient as it
/// is produced (one parameter's size per layer; these stay as `.grad`). What it frees: layer
/// i's saved xᵢ as soon as `tanh`'s VJP has run. With activations at least as large as one
/// parameter's gradient, each layer frees at least what it adds, so the peak stays below
///
///     forward-held + one activation + one layer's parameter gradient.
///
/// (In practice the peak comes first: the sum's VJP broadcasts the seed to one activation.)
/// An engine that kept saved values until the sweep ended would climb by one parameter
/// gradient per layer instead — measured at 7× this bound.
#[test]
fn backward_frees_saved_activations_as_it_goes() {
    const LAYERS: usize = 32;
    const BATCH: usize = 64;
    const WIDTH: usize = 16;
    let bytes = std::mem::size_of::<f64>();
    let activation_bytes = BATCH * WIDTH * bytes;
    let layer_param_bytes = WIDTH * WIDTH * bytes;
    assert!(activation_bytes >= layer_param_bytes);

    let rng = Generator::new(5);
    let weights: Vec<Tensor<f64>> = (0..LAYERS)
        .map(|_| Tensor::param(random_array(&[WIDTH, WIDTH], &rng) / (WIDTH as f64).sqrt()))
        .collect();
    let data = Tensor::from_array(random_array(&[BATCH, WIDTH], &rng));
    let baseline = memory::live_bytes();

    let mut x = data.clone();
    for w in &weights {
        x = x.matmul(w).tanh();
    }
    let loss = x.sum_all();
    drop(x);
    let forward_held = memory::live_bytes();
    assert_eq!(forward_held - baseline, LAYERS * activation_bytes + bytes);

    memory::reset_peak();
    loss.backward();
    let backward_peak = memory::peak_bytes();
    assert!(
        backward_peak <= forward_held + activation_bytes + layer_param_bytes,
        "backward peaked at {} bytes above forward-held, bound {}",
        backward_peak - forward_held,
        activation_bytes + layer_param_bytes
    );

    let all_param_grads = LAYERS * layer_param_bytes;
    assert_eq!(memory::live_bytes(), baseline + all_param_grads + bytes);
    drop(loss);
    assert_eq!(memory::live_bytes(), baseline + all_param_grads);
    assert!(weights.iter().all(|w| w.grad().is_some()));
}

#[test]
fn an_op_over_a_known_value_allocates_nothing_and_still_backpropagates() {
    let x = param(&[1.0, -2.0]);
    let known = Tensor::from_array(x.value().mapv(|v| v * v));
    let before = memory::live_bytes();
    let y = Tensor::from_op_shared(&known, &[&x], {
        let x = x.clone();
        move |grad| vec![Some(grad * x.value().mapv(|v| 2.0 * v))]
    });
    assert_eq!(memory::live_bytes(), before, "no new storage");
    assert!(y.shares_storage(&known) && y.requires_grad() && !y.is_leaf());
    y.sum_all().backward();
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[2.0, -4.0]);

    // Without a graph, the result is a constant on the same storage.
    let constant = {
        let _off = no_grad();
        Tensor::from_op_shared(&known, &[&x], |_| unreachable!("no node, no VJP"))
    };
    assert!(constant.shares_storage(&known) && !constant.requires_grad());
}

#[test]
fn an_in_place_op_rewrites_a_value_only_its_caller_holds() {
    let x = param(&[1.0, -2.0]);
    let square = |v: &mut ArrayD<f64>| v.mapv_inplace(|v| v * v);
    let doubled = x.mul_scalar(2.0);
    let before = memory::live_bytes();
    let y = Tensor::from_op_in_place(doubled, square, |grad| vec![Some(grad)]);
    assert_eq!(
        memory::live_bytes(),
        before,
        "the input's storage was reused"
    );
    assert_eq!(y.to_vec(), vec![4.0, 16.0]);
    assert!(y.requires_grad() && !y.is_leaf());
    // The VJP's gradient reaches the input's node, and through it x: d(2x)/dx = 2.
    y.sum_all().backward();
    assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[2.0, 2.0]);

    // A value someone else still reads is copied, and that reader sees it unchanged.
    for keep in [|t: &Tensor<f64>| t.clone(), |t: &Tensor<f64>| t.detach()] {
        let doubled = x.mul_scalar(2.0);
        let reader = keep(&doubled);
        let before = memory::live_bytes();
        let y = Tensor::from_op_in_place(doubled, square, |grad| vec![Some(grad)]);
        assert_eq!(
            memory::live_bytes(),
            before + 16,
            "a new buffer for the output"
        );
        assert_eq!(y.to_vec(), vec![4.0, 16.0]);
        assert_eq!(reader.to_vec(), vec![2.0, -4.0]);
    }
}

#[test]
fn a_weak_value_follows_its_storage_and_lapses_when_freed_or_written() {
    let x = Tensor::<f64>::from_array(arr1(&[1.0, 2.0]).into_dyn());
    let weak = x.downgrade();
    let other = Tensor::<f64>::from_array(arr1(&[1.0, 2.0]).into_dyn());
    assert!(
        weak.refers_to(&x) && !weak.refers_to(&other),
        "storage, not equal values"
    );
    let alias = weak.upgrade().expect("alive");
    assert!(alias.shares_storage(&x) && !alias.requires_grad());
    drop(alias);

    // An in-place op on a sole holder writes the storage: the old reference lapses.
    let before_write = x.clone().downgrade();
    let y = Tensor::from_op_in_place(x, |v| v.fill(0.0), |grad| vec![Some(grad)]);
    assert!(!before_write.refers_to(&y) && before_write.upgrade().is_none());

    let fresh = y.downgrade();
    assert!(fresh.refers_to(&y));
    assert_eq!(
        format!("{fresh:?}"),
        "WeakValue { alive: true, version: 1 }"
    );
    drop(y);
    assert!(fresh.upgrade().is_none(), "freed with its last holder");
    assert_eq!(
        format!("{fresh:?}"),
        "WeakValue { alive: false, version: 1 }"
    );
}
