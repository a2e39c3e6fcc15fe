//! Autocast: rounded products and gradients, the master weights, and the guard's scoping.

use std::sync::Arc;

use proptest::prelude::*;
use tl_numerics::Round;
use tl_precision::{
    Format, PrecisionError, autocast, autocast_bf16, autocast_format, cast, mark_rounded,
    parse_format, round_for_products,
};
use tl_tensor::ndarray::{Array2, ArrayD, Ix2, arr2};
use tl_tensor::nn::{Linear, Module};
use tl_tensor::optim::{Optimizer, Sgd};
use tl_tensor::{Generator, MatmulHook, Tensor, matmul_hook, set_matmul_hook};

use crate::common::{fixed_cases, grad_of, normal, rounded, values};

/// `rd(Σ_j rd(a)_ij · rd(b)_jk)` with the sum in f64: exact for the operands drawn below
/// (8- or 11-bit significands, exponents within a few binades), so it is the true rounded
/// product, independent of the GEMM kernel.
fn reference_product(a: &Array2<f64>, b: &Array2<f64>, format: Format) -> Vec<f64> {
    let (a, b) = (
        a.mapv(|v| v.round_to(format)),
        b.mapv(|v| v.round_to(format)),
    );
    a.dot(&b).iter().map(|v| v.round_to(format)).collect()
}

/// A significand in [1, 2) with a sign and an exponent in -4..=1: values of many binades
/// whose low bits do not fit a 16-bit format.
fn operand() -> impl Strategy<Value = f64> {
    (1.0f64..2.0, -4i32..=1, any::<bool>()).prop_map(|(m, e, negative)| {
        let v = m * 2f64.powi(e);
        if negative { -v } else { v }
    })
}

fn matrix(rows: usize, cols: usize) -> impl Strategy<Value = Array2<f64>> {
    proptest::collection::vec(operand(), rows * cols)
        .prop_map(move |data| Array2::from_shape_vec((rows, cols), data).unwrap())
}

fn operands() -> impl Strategy<Value = (Array2<f64>, Array2<f64>, Array2<f64>)> {
    (1usize..5, 1usize..7, 1usize..5)
        .prop_flat_map(|(m, k, n)| (matrix(m, k), matrix(k, n), matrix(m, n)))
}

fn param(a: &Array2<f64>) -> Tensor<f64> {
    Tensor::param(a.clone().into_dyn())
}

proptest! {
    #![proptest_config(fixed_cases(24))]

    #[test]
    fn products_and_their_gradients_equal_the_rounded_reference((a, b, grad_y) in operands()) {
        for format in Format::SIXTEEN_BIT {
            let (lhs, rhs) = (param(&a), param(&b));
            let y = {
                let _guard = autocast(format);
                lhs.matmul(&rhs)
            };
            prop_assert_eq!(y.to_vec(), reference_product(&a, &b, format));
            // Ā = rd(rd(Ȳ)·rd(B)ᵀ), B̄ = rd(rd(A)ᵀ·rd(Ȳ)).
            y.backward_with(grad_y.clone().into_dyn());
            prop_assert_eq!(grad_of(&lhs), reference_product(&grad_y, &b.t().to_owned(), format));
            prop_assert_eq!(grad_of(&rhs), reference_product(&a.t().to_owned(), &grad_y, format));
        }
    }

    #[test]
    fn transposed_and_constant_operands_are_rounded_too((a, b, _grad_y) in operands()) {
        // (Bᵀ·Aᵀ)ᵀ through transposed, non-contiguous operands, and a constant on the left
        // of a parameter: every operand is rounded whatever its layout or role.
        let format = Format::Bf16;
        let expected = reference_product(&a, &b, format);
        let _guard = autocast(format);
        let (lhs, rhs) = (param(&a), param(&b));
        let flipped = rhs.transpose(0, 1).matmul(&lhs.transpose(0, 1)).transpose(0, 1);
        prop_assert_eq!(flipped.to_vec(), expected.clone());
        let constant_lhs = Tensor::from_array(a.clone().into_dyn());
        prop_assert_eq!(constant_lhs.matmul(&rhs).to_vec(), expected);
    }
}

/// Three products of one activation `x = 1·p` and three weights, under autocast and, by
/// hand, with a separate `cast` of `x` for each (what autocast computed before it shared
/// the rounded copy); backward from `Σ ȳᵢ·yᵢ`. Returns each run's outputs, `p`'s gradient
/// and the underflow count.
fn three_products_of_one_activation(
    p: &ArrayD<f64>,
    weights: &[ArrayD<f64>; 3],
    grads: &[ArrayD<f64>; 3],
    format: Format,
) -> [(Vec<f64>, Vec<f64>, u64); 2] {
    let run = |by_hand: bool| {
        tl_precision::take_underflow_count();
        let p = Tensor::param(p.clone());
        let x = p.mul_scalar(1.0);
        let mut loss = Tensor::scalar(0.0);
        let mut outputs = Vec::new();
        for (w, grad) in weights.iter().zip(grads) {
            let w = Tensor::param(w.clone());
            let y = if by_hand {
                cast(&cast(&x, format).matmul_plain(&cast(&w, format)), format)
            } else {
                let _guard = autocast(format);
                x.matmul(&w)
            };
            outputs.extend(y.to_vec());
            loss = loss.add(&y.mul(&Tensor::from_array(grad.clone())).sum_all());
        }
        loss.backward();
        (outputs, grad_of(&p), tl_precision::take_underflow_count())
    };
    [run(false), run(true)]
}

#[test]
fn products_of_one_activation_share_its_rounded_copy_and_round_each_gradient() {
    let rng = Generator::new(21);
    let p: ArrayD<f64> = normal(&[4, 6], 1.0, &rng);
    let weights = [0, 1, 2].map(|_| normal(&[6, 5], 1.0, &rng));
    // Gradients spread over 2^-30..1, so that fp16 flushes some of each product's input
    // gradient to zero and the flush counts are not trivial.
    let grads = [0, 1, 2].map(|_| normal::<f64>(&[4, 5], 1.0, &rng).mapv(|v| v * 1e-7));
    for format in Format::SIXTEEN_BIT {
        let [shared, by_hand] = three_products_of_one_activation(&p, &weights, &grads, format);
        assert_eq!(
            shared, by_hand,
            "{format}: outputs, gradient and flush count"
        );
        if format == Format::Fp16 {
            assert!(by_hand.2 > 0, "the fp16 case flushes something");
        }
    }

    // One rounded copy of x (4·6 f64), not three, is alive while the products are; each
    // product rounds its own weight (6·5) and writes one output (4·5), rounded in place.
    let x = Tensor::param(p.clone()).mul_scalar(1.0);
    let weights = weights.map(Tensor::param);
    let _guard = autocast(Format::Bf16);
    let before = tl_tensor::memory::live_bytes();
    let (products, peak) =
        tl_tensor::memory::measure_peak(|| weights.iter().map(|w| x.matmul(w)).collect::<Vec<_>>());
    let held = 8 * (24 + 3 * 30 + 3 * 20);
    assert_eq!(tl_tensor::memory::live_bytes() - before, held);
    assert_eq!(peak, held, "no unrounded product next to its rounded copy");
    drop(products);
}

#[test]
fn a_marked_activation_is_its_own_rounded_operand() {
    // x = rd(p)·1 holds bf16 values; marked, the product reads its storage, and the values
    // and gradients are those of a separate cast.
    let rng = Generator::new(5);
    let p = rounded(&normal::<f64>(&[3, 4], 1.0, &rng), Format::Bf16);
    let w: ArrayD<f64> = normal(&[4, 2], 1.0, &rng);
    let grad_y: ArrayD<f64> = normal(&[3, 2], 1.0, &rng);
    let run = |mark: bool| {
        let (p, w) = (Tensor::param(p.clone()), Tensor::param(w.clone()));
        let x = p.mul_scalar(1.0);
        let _bf16 = autocast(Format::Bf16);
        if mark {
            mark_rounded(&x, Format::Bf16);
        }
        let (y, peak) = tl_tensor::memory::measure_peak(|| x.matmul(&w));
        y.backward_with(grad_y.clone());
        (y.to_vec(), grad_of(&p), grad_of(&w), peak)
    };
    let (marked, plain) = (run(true), run(false));
    assert_eq!(marked.0, plain.0);
    assert_eq!(marked.1, plain.1);
    assert_eq!(marked.2, plain.2);
    // The plain run rounded a copy of x (12 values); the marked one did not.
    assert_eq!((marked.3, plain.3), (8 * (8 + 6), 8 * (12 + 8 + 6)));
}

/// Two products of the SwiGLU gate `x = silu(p) ⊙ u`, made through `round_for_products`
/// or plainly; backward from `Σ ȳᵢ·yᵢ`. Returns the outputs, the gradients of `p` and of
/// both weights, the underflow count, and the peak bytes of the two products.
fn two_products_of_a_gate(
    [p, u]: &[ArrayD<f64>; 2],
    weights: &[ArrayD<f64>; 2],
    grads: &[ArrayD<f64>; 2],
    format: Format,
    rounded_as_produced: bool,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, u64, usize) {
    tl_precision::take_underflow_count();
    let (p, u) = (Tensor::param(p.clone()), Tensor::param(u.clone()));
    let weights = weights.clone().map(Tensor::param);
    let _guard = autocast(format);
    let x = if rounded_as_produced {
        round_for_products(|finish| p.swiglu_then(&u, finish))
    } else {
        p.swiglu(&u)
    };
    let (outputs, peak) =
        tl_tensor::memory::measure_peak(|| weights.iter().map(|w| x.matmul(w)).collect::<Vec<_>>());
    let loss = outputs
        .iter()
        .zip(grads)
        .map(|(y, grad)| y.mul(&Tensor::from_array(grad.clone())).sum_all())
        .reduce(|a, b| a.add(&b))
        .unwrap();
    loss.backward();
    let values = outputs.iter().flat_map(Tensor::to_vec).collect();
    let weight_grads = weights.iter().flat_map(grad_of).collect();
    let flushed = tl_precision::take_underflow_count();
    (values, grad_of(&p), weight_grads, flushed, peak)
}

#[test]
fn rounding_for_products_changes_no_bit_and_copies_nothing() {
    let rng = Generator::new(8);
    let inputs = [0, 1].map(|_| normal::<f64>(&[4, 6], 1.0, &rng));
    let weights = [0, 1].map(|_| normal(&[6, 5], 1.0, &rng));
    // Small gradients, so that fp16 flushes some and the counts are compared too.
    let grads = [0, 1].map(|_| normal::<f64>(&[4, 5], 1.0, &rng).mapv(|v| v * 1e-7));
    for format in Format::SIXTEEN_BIT {
        let (rounded_first, plain) = (
            two_products_of_a_gate(&inputs, &weights, &grads, format, true),
            two_products_of_a_gate(&inputs, &weights, &grads, format, false),
        );
        assert_eq!(rounded_first.0, plain.0, "{format}: outputs");
        assert_eq!(
            rounded_first.1, plain.1,
            "{format}: the activation's gradient"
        );
        assert_eq!(rounded_first.2, plain.2, "{format}: the weights' gradients");
        assert_eq!(rounded_first.3, plain.3, "{format}: flush counts");
        if format == Format::Fp16 {
            assert!(plain.3 > 0, "the fp16 case flushes something");
        }
        // Both products hold their rounded weights (2 · 30 values) and outputs (2 · 20);
        // without the call, they also hold a rounded copy of x (24 values).
        assert_eq!(rounded_first.4, 8 * (60 + 40), "{format}");
        assert_eq!(plain.4, 8 * (24 + 60 + 40), "{format}");
    }
}

#[test]
fn rounding_for_products_rounds_only_under_autocast() {
    let gate = Tensor::<f32>::from_vec(vec![1.5, -0.7, 2.2], &[1, 3]).unwrap();
    let up = Tensor::<f32>::from_vec(vec![1.01, 3.0, -0.3], &[1, 3]).unwrap();
    let plain = gate.swiglu(&up).to_vec();
    let produce = |finish: &tl_tensor::Finisher<'_, f32>| gate.swiglu_then(&up, finish);
    // Outside autocast the finisher does nothing.
    assert_eq!(round_for_products(produce).to_vec(), plain);
    let _fp16 = autocast(Format::Fp16);
    let rounded: Vec<f32> = plain.iter().map(|v| v.round_to(Format::Fp16)).collect();
    assert_ne!(rounded, plain, "the values do round in fp16");
    assert_eq!(round_for_products(produce).to_vec(), rounded);
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "not a bf16 value")]
fn a_producer_that_skips_the_finisher_is_caught_in_debug_builds() {
    let x = Tensor::<f32>::from_vec(vec![1.01], &[1, 1]).unwrap();
    let _bf16 = autocast_bf16();
    round_for_products(|_finish| x.mul_scalar(1.0));
}

#[test]
#[cfg(debug_assertions)]
#[should_panic(expected = "not a bf16 value")]
fn marking_values_that_are_not_rounded_is_caught_in_debug_builds() {
    // Infinities and NaNs (a step that overflowed) are rounded values; 1.01 is not.
    let x = Tensor::<f32>::from_vec(vec![f32::NAN, f32::INFINITY, 1.0], &[1, 3]).unwrap();
    mark_rounded(&x, Format::Fp16);
    let x = Tensor::<f32>::from_vec(vec![1.0, 1.01], &[1, 2]).unwrap();
    mark_rounded(&x, Format::Bf16);
}

#[test]
fn a_shared_rounded_copy_is_never_stale() {
    let a = arr2(&[[1.01, -2.02], [0.3, 4.4]]).into_dyn();
    let w = Tensor::param(arr2(&[[1.0, 0.5], [0.25, -1.0]]).into_dyn());
    let x = Tensor::param(a.clone()).mul_scalar(1.0);
    let expected = |a: &ArrayD<f64>, format| {
        let a = a.clone().into_dimensionality::<Ix2>().unwrap();
        let b = w.to_array().into_dimensionality::<Ix2>().unwrap();
        reference_product(&a, &b, format)
    };
    // The products are kept, so that their rounded copies of x stay alive and could be
    // shared.
    let _bf16 = autocast(Format::Bf16);
    let first = x.matmul(&w);
    assert_eq!(first.to_vec(), expected(&a, Format::Bf16));
    let second = {
        // Another format rounds x afresh.
        let _fp16 = autocast(Format::Fp16);
        x.matmul(&w)
    };
    assert_eq!(second.to_vec(), expected(&a, Format::Fp16));
    let third = x.matmul(&w);
    assert_eq!(third.to_vec(), expected(&a, Format::Bf16));
    // So does a value written in place since it was rounded.
    x.update_value(|v| v.mapv_inplace(|v| v * 3.0));
    assert_eq!(x.matmul(&w).to_vec(), expected(&(&a * 3.0), Format::Bf16));
}

#[test]
fn batched_products_with_broadcast_batch_axes_are_rounded() {
    let rng = Generator::new(7);
    let a: ArrayD<f64> = normal(&[3, 2, 4], 1.0, &rng);
    let b: ArrayD<f64> = normal(&[4, 5], 1.0, &rng);
    let y = {
        let _guard = autocast(Format::Fp16);
        Tensor::param(a.clone()).matmul(&Tensor::param(b.clone()))
    };
    let b2 = b.clone().into_dimensionality::<Ix2>().unwrap();
    let mut expected = Vec::new();
    for i in 0..3 {
        let ai = a
            .index_axis(tl_tensor::ndarray::Axis(0), i)
            .into_dimensionality::<Ix2>()
            .unwrap();
        expected.extend(reference_product(&ai.to_owned(), &b2, Format::Fp16));
    }
    assert_eq!(y.to_vec(), expected);
}

#[test]
fn linear_layers_under_autocast_round_their_product() {
    // y = rd(rd(x)·rd(W)) + b: the bias add is not a matmul and stays f32.
    let rng = Generator::new(3);
    let layer = Linear::<f32>::new(6, 3, true, &rng);
    let x: ArrayD<f32> = normal(&[5, 6], 1.0, &rng);
    let y = {
        let _bf16 = autocast_bf16();
        layer.forward(&Tensor::from_array(x.clone()))
    };
    let x2 = rounded(&x, Format::Bf16)
        .into_dimensionality::<Ix2>()
        .unwrap();
    let w2 = rounded(&layer.weight().to_array(), Format::Bf16)
        .into_dimensionality::<Ix2>()
        .unwrap();
    let product = rounded(&x2.dot(&w2).into_dyn(), Format::Bf16);
    let expected = &product + &layer.bias().unwrap().to_array();
    assert_eq!(y.to_vec(), values(&expected));
    assert_ne!(layer.forward(&Tensor::from_array(x)).to_vec(), y.to_vec());
}

#[test]
fn weight_gradients_are_bf16_values_while_the_masters_stay_f32() {
    let rng = Generator::new(11);
    let layer = Linear::<f32>::new(8, 4, false, &rng);
    let x = Tensor::from_array(normal::<f32>(&[6, 8], 1.0, &rng));
    {
        let _bf16 = autocast_bf16();
        layer.forward(&x).powi(2).mean_all().backward();
    }
    let grad = layer.weight().grad().unwrap();
    assert!(grad.iter().any(|&g| g != 0.0));
    assert_eq!(
        grad,
        rounded(&grad, Format::Bf16),
        "weight gradients are bf16 values"
    );
    // The master weights are not bf16 values, and stay so after an SGD step.
    let weight = layer.weight().to_array();
    assert_ne!(weight, rounded(&weight, Format::Bf16));
    let mut sgd = Sgd::new(layer.parameters(), 0.01).unwrap();
    sgd.step();
    let after = layer.weight().to_array();
    assert_ne!(after, rounded(&after, Format::Bf16));
}

#[test]
fn an_update_below_bf16_spacing_survives_in_the_f32_master() {
    // w = 1, y = x·w with x = 1 and L = 1e-3·y: dL/dw = rd(1e-3), a bf16 value. One SGD step
    // of lr 1 gives w = 1 − rd(1e-3) ≈ 0.999; bf16's spacing below 1 is 2^-8, so a bf16
    // weight would round straight back to 1.
    let w = Tensor::<f32>::param(arr2(&[[1.0]]).into_dyn());
    {
        let _bf16 = autocast_bf16();
        Tensor::<f32>::ones(&[1, 1])
            .matmul(&w)
            .mul_scalar(1e-3)
            .sum_all()
            .backward();
    }
    let step = 1e-3f32.round_to(Format::Bf16);
    assert_eq!(grad_of(&w), [step]);
    Sgd::new(vec![w.clone()], 1.0).unwrap().step();
    assert_eq!(w.item(), 1.0 - step);
    assert_eq!((1.0 - step).round_to(Format::Bf16), 1.0);
}

#[test]
fn f64_tensors_are_rounded_directly_under_autocast() {
    // 1 + 2^-8 + 2^-30 is just above the bf16 tie: rounded directly it goes up to 1 + 2^-7;
    // through f32 it would land on the tie and go down to 1.
    let x = Tensor::<f64>::from_vec(vec![1.0 + 2f64.powi(-8) + 2f64.powi(-30)], &[1, 1]).unwrap();
    let _bf16 = autocast_bf16();
    assert_eq!(x.matmul(&Tensor::ones(&[1, 1])).item(), 1.0078125);
}

fn plain_product_is_back() -> bool {
    let a = Tensor::<f32>::from_vec(vec![1.0, 1.0], &[1, 2]).unwrap();
    let b = Tensor::<f32>::from_vec(vec![1.0, 0.00390625], &[2, 1]).unwrap();
    autocast_format().is_none() && a.matmul(&b).item() == 1.00390625
}

fn bf16_product_applies() -> bool {
    let a = Tensor::<f32>::from_vec(vec![1.0, 1.0], &[1, 2]).unwrap();
    let b = Tensor::<f32>::from_vec(vec![1.0, 0.00390625], &[2, 1]).unwrap();
    autocast_format() == Some(Format::Bf16) && a.matmul(&b).item() == 1.0
}

#[test]
fn a_panic_inside_autocast_restores_the_plain_matmul() {
    let result = std::panic::catch_unwind(|| {
        let _bf16 = autocast_bf16();
        panic!("a failing forward pass");
    });
    assert!(result.is_err());
    assert!(plain_product_is_back());
}

#[test]
fn an_early_return_restores_the_plain_matmul() {
    fn forward_with_bad_config() -> Result<f32, PrecisionError> {
        let _bf16 = autocast_bf16();
        let format = parse_format("fp8")?;
        Ok(cast(&Tensor::<f32>::scalar(1.0), format).item())
    }
    assert!(matches!(
        forward_with_bad_config(),
        Err(PrecisionError::Format(_))
    ));
    assert!(plain_product_is_back());
}

#[test]
fn nested_guards_apply_the_innermost_format_and_restore_the_outer_one() {
    {
        let _outer = autocast_bf16();
        assert!(bf16_product_applies());
        {
            let _inner = autocast(Format::Fp16);
            assert_eq!(autocast_format(), Some(Format::Fp16));
            // fp16 holds 1 + 2^-8 exactly.
            assert!(!bf16_product_applies());
        }
        assert!(bf16_product_applies(), "the outer block is bf16 again");
        let result = std::panic::catch_unwind(|| {
            let _inner = autocast(Format::Fp16);
            panic!("inside the inner block");
        });
        assert!(result.is_err());
        assert!(
            bf16_product_applies(),
            "a panic in the inner block restores the outer one"
        );
    }
    assert!(plain_product_is_back());
}

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
fn a_hook_installed_before_autocast_comes_back_after_it() {
    let doubling: Arc<dyn MatmulHook> = Arc::new(Doubling);
    set_matmul_hook(Some(doubling.clone()));
    {
        let _bf16 = autocast_bf16();
        assert!(!Arc::ptr_eq(&matmul_hook().unwrap(), &doubling));
    }
    assert!(Arc::ptr_eq(&matmul_hook().unwrap(), &doubling));
    set_matmul_hook(None);
}

#[test]
fn autocast_is_per_thread() {
    let _bf16 = autocast_bf16();
    std::thread::spawn(|| assert!(plain_product_is_back()))
        .join()
        .unwrap();
    assert!(bf16_product_applies());
}

#[test]
fn format_names_parse_exactly() {
    assert_eq!(parse_format("bf16"), Ok(Format::Bf16));
    assert_eq!(parse_format("fp16"), Ok(Format::Fp16));
    assert_eq!(parse_format("e4m3"), Ok(Format::E4M3));
    for bad in ["fp32", "BF16", "float16", "", "fp8", "E5M2"] {
        assert!(
            matches!(parse_format(bad), Err(PrecisionError::Format(_))),
            "{bad}"
        );
    }
}

#[test]
fn a_guard_shows_the_format_it_will_restore() {
    let outer = tl_precision::autocast(tl_precision::Format::Fp16);
    let inner = tl_precision::autocast_bf16();
    assert_eq!(
        format!("{inner:?}"),
        "AutocastGuard { restores_format: Some(Fp16), .. }"
    );
    drop(inner);
    drop(outer);
}
