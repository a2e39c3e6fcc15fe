//! The core of causal self-attention, `softmax(q·kᵀ/√hd + M)·v` for every head, as one op.
//!
//! Built from separate ops, attention splits q, k and v into heads (copies), multiplies
//! `B·H` pairs of `T×hd` matrices into a `B·H·T·T` tensor of scores, takes its masked
//! softmax into a second such tensor — which the backward pass keeps — multiplies again and
//! copies the heads back together. At the capstone's shapes the two `T×T` tensors are
//! 84 MB each per block, and half of every product is spent on entries the mask throws away.
//!
//! This op does what flash attention does on a GPU, for a CPU's caches. The kernel — one
//! task per (sequence, head) reading its columns where the projections wrote them, blocks of
//! query rows against only the keys they may see, no `T×T` tensor kept — is tl-tensor's
//! [`CausalAttention`], which takes where and how to round as a parameter. This file is the
//! op around it: the autograd node, the autocast format and what it rounds to, the marks,
//! and the underflow count.
//!
//! - **Computed once under checkpointing, if the policy says so.** The op's result is named
//!   `attention` with tl-recompute's `keep_named`: a checkpointed block whose keep policy
//!   names it (all of `tinyllm`'s do, see `Checkpointing::keep_policy`) keeps it (`N·d`
//!   values, a sixteenth of what a capstone block saves without checkpointing) and its rerun
//!   during backward takes it back instead of running this forward pass again.
//!
//! # Under autocast
//!
//! A tensor core multiplies 16-bit operands, so the separate ops compute, with `rd` rounding
//! into the autocast format,
//!
//! ```text
//! S = rd(rd(q)·rd(k)ᵀ)     P = softmax(scale·S + M) in f32     O = rd(rd(P)·rd(v))
//! ```
//!
//! and the backward pass rounds each gradient where a `cast` stands in that graph:
//! `dO`, `dP`, `dS`, and the gradients of `q`, `k` and `v`. This op rounds at exactly those
//! points, and adds the gradient values each rounding flushes to zero to tl-precision's
//! underflow count, as `cast` does. What differs from the separate ops is only the order in
//! which the f32 products accumulate (blocks instead of whole rows), and that masked entries
//! are never computed, so never counted.
//!
//! Its result `O` is a rounded product, so the op marks it with tl-precision's
//! `mark_rounded`: the output projection that reads it next takes it as its rounded operand
//! as it is, instead of rounding a copy that would equal it.

use std::rc::Rc;

use std::sync::Arc;
use tl_numerics::{Format, round_slice, round_slice_counting_flushes};

use tl_precision::{autocast_format, autocast_product_kernel, mark_rounded, record_underflows};
use tl_recompute::keep_named;
use tl_tensor::kernels::attention::{CausalAttention, Rounding};
use tl_tensor::{Element, ProductKernel, Tensor};

/// The name of the attention's result for a checkpoint's keep policy.
pub const ATTENTION: &str = "attention";

/// `softmax(q·kᵀ/√hd + M)·v` for each of `n_heads` heads, where `q` is `[B, T, H·hd]` with
/// head `h` in columns `h·hd..(h+1)·hd`, `k` and `v` are `[B, T, H_kv·hd]` with `H_kv`
/// dividing `H` (query head `h` reads key/value head `h / (H / H_kv)`: grouped-query
/// attention, or multi-head attention when `H_kv = H`), `M = −∞` above the diagonal, and
/// the result is `[B, T, H·hd]` laid out as `q`.
///
/// Saves `q`, `k` and `v` (shared, not copied) and two numbers per row; see the module
/// documentation for how it computes, how a checkpointed block keeps its result, and for its
/// rounding under autocast.
///
/// # Panics
/// If the shapes are not 3-D of one batch and time, `q`'s width is not a multiple of
/// `n_heads`, or `k`'s and `v`'s width is not a whole number of heads dividing `n_heads`.
pub fn causal_attention<E: Element>(
    q: &Tensor<E>,
    k: &Tensor<E>,
    v: &Tensor<E>,
    n_heads: usize,
) -> Tensor<E> {
    let shape = q.shape();
    let kv_shape = k.shape();
    let fits = shape.len() == 3
        && kv_shape.len() == 3
        && v.shape() == kv_shape
        && shape[..2] == kv_shape[..2]
        && n_heads > 0
        && shape[2].is_multiple_of(n_heads)
        && shape[2] >= n_heads
        && kv_shape[2].is_multiple_of(shape[2] / n_heads)
        && n_heads.is_multiple_of((kv_shape[2] / (shape[2] / n_heads)).max(1))
        && kv_shape[2] > 0;
    assert!(
        fits,
        "causal_attention: expected q [B, T, H·hd] with H = {n_heads} and k, v [B, T, H_kv·hd] \
         with H_kv dividing H, got {shape:?}, {kv_shape:?}, {:?}",
        v.shape()
    );
    let head_dim = shape[2] / n_heads;
    let kernel = CausalAttention {
        batch: shape[0],
        time: shape[1],
        n_heads,
        n_kv_heads: kv_shape[2] / head_dim,
        head_dim,
        scale: E::from_f64(1.0 / (head_dim as f64).sqrt()),
    };
    // The format and the accumulation model in force now; the backward pass rounds to it
    // and multiplies by it too, wherever it runs.
    let format = autocast_format();
    let products = autocast_product_kernel();
    // The most expensive part of a block's forward pass for one `[B, T, d]` result: a
    // checkpointed block whose policy names it keeps it rather than computing it again.
    let _label = tl_tensor::memory::label_scope(ATTENTION);
    let (output, row_stats) = keep_named(ATTENTION, || {
        if !tl_tensor::meta::computes(&[q, k, v]) {
            // No values: a result of its shape, and no row statistics (kept off the meter
            // in a real run too).
            return (Tensor::meta(&shape), Rc::new(Vec::new()));
        }
        let (value, row_stats) = with_rounding(format, products.as_ref(), |rounding| {
            kernel.forward(&q.value(), &k.value(), &v.value(), rounding)
        });
        (Tensor::from_array(value), Rc::new(row_stats))
    });
    let saved = [q.clone(), k.clone(), v.clone()];
    let result = Tensor::from_op_shared(&output, &[q, k, v], move |grad| {
        let [q, k, v] = &saved;
        let (grads, flushed) = with_rounding(format, products.as_ref(), |rounding| {
            kernel.backward(
                [&q.value(), &k.value(), &v.value()],
                &row_stats,
                &grad,
                rounding,
            )
        });
        record_underflows(flushed);
        saved
            .iter()
            .zip(grads)
            .map(|(input, grad)| input.requires_grad().then_some(grad))
            .collect()
    });
    // Its last product was rounded: the output projection can read it as it is.
    if let Some(format) = format {
        mark_rounded(&result, format);
    }
    result
}

/// Runs `f` with the kernel's rounding into `format` (tl-numerics' rounding, and its count
/// of gradient values flushed to zero, as tl-precision's `cast` counts them) and products by
/// autocast's accumulation model, or none.
pub(crate) fn with_rounding<E: Element, T>(
    format: Option<Format>,
    products: Option<&Arc<dyn ProductKernel>>,
    f: impl FnOnce(Option<&Rounding<'_, E>>) -> T,
) -> T {
    let Some(format) = format else {
        return f(None);
    };
    let values = move |xs: &mut [E]| round_slice(xs, format);
    let gradients = move |xs: &mut [E]| round_slice_counting_flushes(xs, format);
    f(Some(&Rounding {
        values: &values,
        gradients: &gradients,
        products: products.map(|kernel| kernel.as_ref()),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_numerics::Round;
    use tl_precision::{Accumulation, autocast, autocast_with, take_underflow_count};
    use tl_tensor::kernels::attention::ROW_BLOCK;
    use tl_tensor::ndarray::IxDyn;
    use tl_tensor::testing::{assert_gradients, random_array};
    use tl_tensor::{Generator, ndarray::ArrayD};

    /// The same attention from the library's separate ops: head split, `q·kᵀ`, scale, mask,
    /// softmax, `·v`, heads merged.
    fn separate_ops<E: Element>(
        q: &Tensor<E>,
        k: &Tensor<E>,
        v: &Tensor<E>,
        n_heads: usize,
    ) -> Tensor<E> {
        let shape = q.shape();
        let (batch, time, d) = (shape[0], shape[1], shape[2]);
        let head_dim = d / n_heads;
        let heads = |x: &Tensor<E>| {
            x.reshape(&[batch, time, n_heads, head_dim])
                .permute(&[0, 2, 1, 3])
        };
        let mask = ArrayD::from_shape_fn(IxDyn(&[time, time]), |i| i[1] > i[0]);
        heads(q)
            .matmul(&heads(k).transpose(2, 3))
            .mul_scalar(E::from_f64(1.0 / (head_dim as f64).sqrt()))
            .masked_fill(&mask, E::neg_infinity())
            .softmax(3)
            .matmul(&heads(v))
            .permute(&[0, 2, 1, 3])
            .reshape(&[batch, time, d])
    }

    /// The output and the gradients of q, k, v for the upstream gradient `d_out`.
    fn run<E: Element>(
        attention: impl Fn(&Tensor<E>, &Tensor<E>, &Tensor<E>) -> Tensor<E>,
        inputs: &[ArrayD<E>; 3],
        d_out: &ArrayD<E>,
    ) -> [Vec<E>; 4] {
        let [q, k, v] = inputs.clone().map(Tensor::param);
        let out = attention(&q, &k, &v);
        out.backward_with(d_out.clone());
        let grad = |x: &Tensor<E>| x.grad().expect("a gradient").iter().copied().collect();
        [out.to_vec(), grad(&q), grad(&k), grad(&v)]
    }

    /// Random q, k, v and upstream gradient of shape `[2, T, d]`, with T = 70 so that the
    /// rows fall into a full block of 64 and a partial one.
    fn inputs(d: usize, seed: u64) -> ([ArrayD<f64>; 3], ArrayD<f64>) {
        let rng = Generator::new(seed);
        let shape = [2, ROW_BLOCK + 6, d];
        let inputs = [(); 3].map(|()| random_array(&shape, &rng));
        (inputs, random_array(&shape, &rng))
    }

    fn to_f32(x: &ArrayD<f64>) -> ArrayD<f32> {
        x.mapv(|v| v as f32)
    }

    #[test]
    fn agrees_with_the_separate_ops_forward_and_backward() {
        let (inputs, d_out) = inputs(8, 1);
        let fused = run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out);
        let separate = run(|q, k, v| separate_ops(q, k, v, 2), &inputs, &d_out);
        for (name, (a, b)) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(fused.iter().zip(&separate))
        {
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() < 1e-13, "{name}: {x} vs {y}");
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let rng = Generator::new(4);
        let shape = [1, ROW_BLOCK + 2, 4];
        let xs = [(); 3].map(|()| random_array(&shape, &rng));
        assert_gradients(|xs| causal_attention(&xs[0], &xs[1], &xs[2], 2), &xs);
    }

    #[test]
    fn under_autocast_it_rounds_where_the_separate_ops_do() {
        let (inputs, d_out) = inputs(16, 2);
        let (inputs, d_out) = (inputs.each_ref().map(to_f32), to_f32(&d_out));
        let bf16 = |x: &f32| x.round_to(Format::Bf16) == *x;
        let [fused, separate] = [0, 1].map(|which| {
            let _bf16 = autocast(Format::Bf16);
            if which == 0 {
                run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out)
            } else {
                run(|q, k, v| separate_ops(q, k, v, 2), &inputs, &d_out)
            }
        });
        for (name, (a, b)) in ["output", "dq", "dk", "dv"]
            .iter()
            .zip(fused.iter().zip(&separate))
        {
            // Every value comes out of a 16-bit rounding ...
            assert!(a.iter().all(bf16), "{name}: not all values are bf16");
            // ... and differs from the separate ops only where an f32 sum, accumulated in
            // another order, landed on the other side of a rounding boundary.
            let scale = b.iter().fold(0f32, |m, x| m.max(x.abs()));
            let differ = a.iter().zip(b).filter(|(x, y)| x != y).count();
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= scale * 2f32.powi(-7), "{name}: {x} vs {y}");
            }
            assert!(
                differ * 100 < a.len(),
                "{name}: {differ} of {} differ",
                a.len()
            );
        }
        // Without autocast the same output is not bf16, so the check above can fail.
        let plain = run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out);
        assert!(!plain[0].iter().all(bf16));
    }

    #[test]
    fn under_a_tensor_core_model_it_multiplies_as_the_separate_ops_do() {
        // The separate ops' products go through autocast's hook, hence the model; the fused
        // kernel takes the same model's kernel. Blocks of 64 query rows are whole blocks of
        // every model, so even dk and dv, chained across row blocks, add up as one product.
        let (inputs, d_out) = inputs(64, 6);
        let (inputs, d_out) = (inputs.each_ref().map(to_f32), to_f32(&d_out));
        for accumulation in [Accumulation::V100, Accumulation::H100] {
            let under = |accumulation, fused: bool| {
                let _guard = autocast_with(Format::Fp16, accumulation);
                if fused {
                    run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out)
                } else {
                    run(|q, k, v| separate_ops(q, k, v, 2), &inputs, &d_out)
                }
            };
            let (fused, separate) = (under(accumulation, true), under(accumulation, false));
            let f32_sums = under(Accumulation::F32, true);
            let mut changed = 0;
            for (i, name) in ["output", "dq", "dk", "dv"].iter().enumerate() {
                // Only the softmax's own f32 sums differ between the two; they move a
                // rounding boundary now and then.
                let differ = fused[i]
                    .iter()
                    .zip(&separate[i])
                    .filter(|(x, y)| x != y)
                    .count();
                assert!(
                    differ * 100 < fused[i].len(),
                    "{accumulation} {name}: {differ} differ"
                );
                changed += fused[i]
                    .iter()
                    .zip(&f32_sums[i])
                    .filter(|(x, y)| x != y)
                    .count();
            }
            assert!(changed > 0, "{accumulation} changes nothing in attention");
        }
    }

    #[test]
    fn fp16_gradient_underflows_are_counted_like_the_separate_ops() {
        // An upstream gradient of 1e-9 flushes to zero in fp16 (below 2^-25) at the first
        // rounding, so both count every element of it, and nothing after.
        let (inputs, d_out) = inputs(8, 3);
        let (inputs, d_out) = (inputs.each_ref().map(to_f32), d_out.mapv(|_| 1e-9_f32));
        let _fp16 = autocast(Format::Fp16);
        take_underflow_count();
        let fused = run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out);
        assert_eq!(take_underflow_count(), d_out.len() as u64);
        run(|q, k, v| separate_ops(q, k, v, 2), &inputs, &d_out);
        assert_eq!(take_underflow_count(), d_out.len() as u64);
        assert!(fused[1..].iter().flatten().all(|&g| g == 0.0));
    }

    #[test]
    fn the_split_over_threads_does_not_change_a_bit() {
        let (inputs, d_out) = inputs(8, 5);
        let (inputs, d_out) = (inputs.each_ref().map(to_f32), to_f32(&d_out));
        let [one, three] = [1, 3].map(|threads| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .expect("a pool");
            pool.install(|| run(|q, k, v| causal_attention(q, k, v, 2), &inputs, &d_out))
        });
        assert_eq!(one, three);
    }

    #[test]
    fn an_empty_sequence_gives_an_empty_output() {
        let x = Tensor::<f32>::param(ArrayD::zeros(IxDyn(&[2, 0, 8])));
        let y = causal_attention(&x, &x, &x, 2);
        assert_eq!(y.shape(), [2, 0, 8]);
        y.backward_with(ArrayD::zeros(IxDyn(&[2, 0, 8])));
        assert_eq!(x.grad().unwrap().shape(), [2, 0, 8]);
    }

    #[test]
    #[should_panic(expected = "causal_attention: expected q [B, T, H·hd] with H = 4")]
    fn heads_that_do_not_divide_the_width_are_refused() {
        let x = Tensor::<f32>::zeros(&[1, 2, 6]);
        causal_attention(&x, &x, &x, 4);
    }

    #[test]
    #[should_panic(expected = "with H_kv dividing H")]
    fn key_value_heads_that_do_not_divide_the_query_heads_are_refused() {
        // 6 heads of 2; keys and values of 4 heads of 2.
        let q = Tensor::<f32>::zeros(&[1, 2, 12]);
        let kv = Tensor::<f32>::zeros(&[1, 2, 8]);
        causal_attention(&q, &kv, &kv, 6);
    }
}
