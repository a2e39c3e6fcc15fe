//! `autocast`: every matmul on this thread computed as a 16-bit tensor core would.
//!
//! A tensor core reads two 16-bit matrices, accumulates in f32 and writes a 16-bit result,
//! so under autocast `Y = A·B` becomes `cast(cast(A) · cast(B))`. Since [`cast`] rounds its
//! gradient too, the backward matmuls read and write rounded values as well:
//! `Ā = rd(rd(Ȳ) · rd(B)ᵀ)`.
//!
//! tl-tensor knows nothing about formats: it offers one per-thread override point for
//! [`Tensor::matmul`], a [`MatmulHook`]. The guard installs a hook that rounds, and puts back
//! whatever was installed before when it drops — at the end of the scope, on `?`, and while
//! unwinding from a panic — so guards nest and the innermost format applies.

use std::any::Any;
use std::cell::RefCell;
use std::fmt;
use std::marker::PhantomData;
use std::sync::Arc;

use tl_numerics::{Format, round_slice};
use tl_tensor::{
    Element, Finisher, MatmulHook, ProductKernel, Tensor, WeakValue, matmul_hook, set_matmul_hook,
};

use crate::cast::{cast, cast_owned, cast_sharing};
use crate::error::Result;
use crate::tensor_core::Accumulation;

/// The format every matmul on this thread rounds to, or `None` outside autocast.
///
/// It is read off the installed matmul hook, the one piece of state autocast keeps: a
/// checkpointed segment that reruns during backward enters the modes its forward pass
/// captured ([`ModeSnapshot`](tl_tensor::ModeSnapshot)), hook included, so an op that asks
/// for the format in the rerun gets the forward's answer even when backward runs after the
/// guard has dropped. Another hook installed over autocast's (a test's counting hook) means
/// the matmul no longer rounds, and this says `None`.
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{autocast, autocast_format};
///
/// assert_eq!(autocast_format(), None);
/// let _bf16 = autocast(Format::Bf16);
/// assert_eq!(autocast_format(), Some(Format::Bf16));
/// ```
pub fn autocast_format() -> Option<Format> {
    format_of(matmul_hook().as_deref())
}

/// How the products of this thread's autocast accumulate: [`Accumulation::F32`] outside
/// autocast or under plain [`autocast`], the model of [`autocast_with`] otherwise. Like
/// [`autocast_format`], it is read off the installed hook, so a checkpoint's rerun sees its
/// forward's model.
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{Accumulation, autocast_accumulation, autocast_with};
///
/// assert_eq!(autocast_accumulation(), Accumulation::F32);
/// let _h100 = autocast_with(Format::Bf16, Accumulation::H100);
/// assert_eq!(autocast_accumulation(), Accumulation::H100);
/// ```
pub fn autocast_accumulation() -> Accumulation {
    rounded_of(matmul_hook().as_deref()).map_or(Accumulation::F32, |rounded| rounded.accumulation)
}

/// The product kernel of this thread's autocast model, `None` outside autocast or where the
/// model multiplies with the plain GEMM (fp16 under [`Accumulation::F32`]; see
/// [`Accumulation::product_kernel`]): for an op that computes its own products (a fused attention), so
/// that they add up as autocast's matmuls do.
pub fn autocast_product_kernel() -> Option<Arc<dyn ProductKernel>> {
    rounded_of(matmul_hook().as_deref()).and_then(|rounded| rounded.kernel.clone())
}

/// The format of `hook` if it is autocast's.
fn format_of(hook: Option<&(dyn MatmulHook + 'static)>) -> Option<Format> {
    rounded_of(hook).map(|rounded| rounded.format)
}

/// `hook` if it is autocast's.
fn rounded_of<'a>(hook: Option<&'a (dyn MatmulHook + 'static)>) -> Option<&'a RoundedMatmul> {
    let hook: &dyn Any = hook?;
    hook.downcast_ref::<RoundedMatmul>()
}

/// Parses a format name: exactly `"bf16"`, `"fp16"`, `"e4m3"` or `"e5m2"` (tl-numerics'
/// names; a family name like `"fp8"` names no one format).
///
/// # Errors
/// [`PrecisionError::Format`](crate::PrecisionError::Format) for any other text.
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::parse_format;
///
/// assert_eq!(parse_format("fp16")?, Format::Fp16);
/// assert_eq!(parse_format("e4m3")?, Format::E4M3);
/// assert!(parse_format("fp8").is_err());
/// # Ok::<(), tl_precision::PrecisionError>(())
/// ```
pub fn parse_format(name: &str) -> Result<Format> {
    Ok(name.parse::<Format>()?)
}

/// The hook autocast installs: the product of the rounded operands, rounded; summed by the
/// accumulation model's kernel, or in f32 by the plain GEMM.
struct RoundedMatmul {
    format: Format,
    accumulation: Accumulation,
    kernel: Option<Arc<dyn ProductKernel>>,
}

impl RoundedMatmul {
    /// `cast(cast(lhs)·cast(rhs))`, with two savings that change no bit of the values or
    /// the gradients: an operand rounded for an earlier product is shared (see
    /// [`rounded_operand`]), and the product, which nothing else reads, is rounded in
    /// place.
    fn product<E: Element>(&self, lhs: &Tensor<E>, rhs: &Tensor<E>) -> Tensor<E> {
        let f = self.format;
        let (lhs, rhs) = (rounded_operand(lhs, f), rounded_operand(rhs, f));
        let product = match &self.kernel {
            Some(kernel) => lhs.matmul_with(&rhs, kernel),
            None => lhs.matmul_plain(&rhs),
        };
        cast_owned(product, f)
    }
}

thread_local! {
    /// The activation this thread's autocast rounded last, as a [`LastRounded`] of the
    /// element type it was in.
    ///
    /// It is a cache, not a mode: no result depends on it. An entry lives until the next
    /// activation is rounded (or marked) on this thread, and answers only while both of its
    /// tensors' storages are alive and unwritten ([`WeakValue`]) and for its own format; a
    /// miss rounds the operand again and gets the same bits. That is why it needs no place
    /// in [`ModeSnapshot`](tl_tensor::ModeSnapshot): a checkpoint's rerun on this thread, or
    /// a worker thread, that finds no entry (or another activation's) only rounds once more.
    static LAST_ROUNDED: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// An activation and its rounded copy, both held weakly: the entry keeps no memory alive,
/// and lapses when either is freed or written in place.
struct LastRounded<E: Element> {
    source: WeakValue<E>,
    format: Format,
    rounded: WeakValue<E>,
}

/// `cast(x, format)` for a product's operand, sharing the rounded copy of the last
/// activation rounded on this thread if `x` is that activation.
///
/// A layer often feeds one activation to several products (the norm's output to the q, k
/// and v projections, or to the gate and up projections of the MLP). Each product gets its
/// own cast node, so each rounds the gradient it sends back on its own, as separate casts
/// do; only the forward value, identical by construction, is stored once instead of once
/// per product (which also saves the copies the products keep for backward).
///
/// Parameters and constants (leaves) are not remembered: each weight feeds one product, and
/// the slot is kept for the activation that the next product may read again.
fn rounded_operand<E: Element>(x: &Tensor<E>, format: Format) -> Tensor<E> {
    let known = LAST_ROUNDED.with(|slot| {
        let slot = slot.borrow();
        let last = slot.as_ref()?.downcast_ref::<LastRounded<E>>()?;
        (last.format == format && last.source.refers_to(x))
            .then(|| last.rounded.upgrade())
            .flatten()
    });
    if let Some(rounded) = known {
        return cast_sharing(x, &rounded, format);
    }
    let rounded = cast(x, format);
    if !x.is_leaf() {
        remember(x, &rounded, format);
    }
    rounded
}

/// Puts `rounded`, holding `rd(x)` in `format`, in this thread's slot.
fn remember<E: Element>(x: &Tensor<E>, rounded: &Tensor<E>, format: Format) {
    let entry = LastRounded {
        source: x.downgrade(),
        format,
        rounded: rounded.downgrade(),
    };
    LAST_ROUNDED.with(|slot| *slot.borrow_mut() = Some(Box::new(entry)));
}

/// Tells this thread's autocast that every value of `x` is already representable in
/// `format`, so that the next products reading `x` under that format take its own storage
/// as their rounded operand instead of rounding a copy of it. Each of them still records its
/// own cast node, so the gradients are rounded as for any operand.
///
/// This is for an op that rounds its own result under autocast, as a fused attention does
/// (its last product is a 16-bit one): the product after it, the output projection, would
/// otherwise spend a pass over memory and a buffer on a copy equal to its input. Like any
/// rounded copy, the mark lapses when `x` is freed or written in place, or when another
/// activation is rounded.
///
/// # Panics
/// In debug builds, if some value of `x` is not representable in `format` (a NaN, which
/// rounds to a NaN, passes).
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{autocast, mark_rounded};
/// use tl_tensor::{Tensor, memory};
///
/// let w = Tensor::<f32>::param(tl_tensor::ndarray::arr2(&[[1.0], [2.0]]).into_dyn());
/// let x = w.transpose(0, 1).mul_scalar(0.5); // [0.5, 1.0]: bf16 values
/// let _bf16 = autocast(Format::Bf16);
/// mark_rounded(&x, Format::Bf16);
/// let before = memory::live_bytes();
/// let y = x.matmul(&w);
/// // The rounded weight and the result; no copy of x.
/// assert_eq!(memory::live_bytes() - before, 4 * (2 + 1));
/// assert_eq!(y.item(), 2.5);
/// ```
pub fn mark_rounded<E: Element>(x: &Tensor<E>, format: Format) {
    debug_assert!(
        x.value()
            .iter()
            .all(|v| v.is_nan() || v.round_to(format) == *v),
        "mark_rounded: a value of the tensor is not a {format} value"
    );
    remember(x, x, format);
}

/// Makes an activation that only this thread's autocast products will read, rounded into
/// the autocast format as it is produced, and marks it as its own rounded operand
/// ([`mark_rounded`]); outside autocast, just makes it.
///
/// `produce` builds the activation with an op that applies a finisher to each block of its
/// result as soon as the block is written (tl-tensor's `RmsNorm::forward_then` and
/// `Tensor::swiglu_then`). Under autocast the finisher rounds the block where it lies, while
/// it is in cache; outside autocast it does nothing.
///
/// Each product rounds its operand anyway, so nothing they compute changes: the values,
/// the gradients and the underflow counts are bit for bit those of the graph without this
/// call. What changes is the cost. The products would round a copy of the activation into
/// a second buffer, another pass over memory; here no copy is made, and the rounding rides
/// on the op's own pass.
///
/// Two conditions make that exact, and they are the caller's to keep:
/// - **every reader of the result is a product under the same autocast** — anything else
///   (a residual sum, a norm) would read rounded values where the unfused graph has f32 ones;
/// - **the op's VJP does not read its own result**, so the gradient it sends back is the
///   same whether or not the result was rounded (true of the norm and the SwiGLU gate, which
///   save their inputs).
///
/// The model uses it on the outputs of its norms, which feed only the projections, and on
/// the SwiGLU gate, which feeds only the down projection.
///
/// # Panics
/// In debug builds, under autocast, if `produce` did not apply the finisher to every value
/// (the check of [`mark_rounded`]).
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{autocast, round_for_products};
/// use tl_tensor::{Tensor, memory, ndarray::arr2};
///
/// let w = Tensor::<f32>::param(arr2(&[[1.0], [1.0]]).into_dyn());
/// let gate = Tensor::<f32>::param(arr2(&[[1.5, 3.0]]).into_dyn());
/// let up = Tensor::<f32>::param(arr2(&[[1.0, 1.0]]).into_dyn());
/// let _bf16 = autocast(Format::Bf16);
/// let h = round_for_products(|finish| gate.swiglu_then(&up, finish));
/// // silu(1.5) = 1.2263..., rounded to bf16 as the op wrote it
/// assert_eq!(h.to_vec()[0], 1.2265625);
/// let before = memory::live_bytes();
/// let y = h.matmul(&w);
/// // The product's rounded weight and its result; no copy of h.
/// assert_eq!(memory::live_bytes() - before, 4 * (2 + 1));
/// ```
pub fn round_for_products<E: Element>(
    produce: impl FnOnce(&Finisher<'_, E>) -> Tensor<E>,
) -> Tensor<E> {
    let Some(format) = autocast_format() else {
        return produce(&|_| {});
    };
    let result = produce(&|block: &mut [E]| round_slice(block, format));
    mark_rounded(&result, format);
    result
}

impl MatmulHook for RoundedMatmul {
    fn matmul_f32(&self, lhs: &Tensor<f32>, rhs: &Tensor<f32>) -> Tensor<f32> {
        self.product(lhs, rhs)
    }

    fn matmul_f64(&self, lhs: &Tensor<f64>, rhs: &Tensor<f64>) -> Tensor<f64> {
        self.product(lhs, rhs)
    }
}

/// Keeps autocast on while it lives; dropping it restores the state that was in force
/// when it was made (the outer autocast's format, or the plain matmul).
///
/// The guard is tied to its thread (not `Send`): the state it restores is thread-local.
/// Guards must drop in the reverse order of their creation, as scopes drop them; dropping
/// an outer guard by hand while an inner one lives would restore the states out of order.
#[must_use = "autocast ends as soon as the guard is dropped"]
pub struct AutocastGuard {
    previous: Option<Arc<dyn MatmulHook>>,
    _same_thread: PhantomData<*const ()>,
}

impl fmt::Debug for AutocastGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AutocastGuard")
            .field("restores_format", &format_of(self.previous.as_deref()))
            .finish_non_exhaustive()
    }
}

impl Drop for AutocastGuard {
    fn drop(&mut self) {
        set_matmul_hook(self.previous.take());
    }
}

/// Computes every [`Tensor::matmul`] on this thread as `cast(cast(a) · cast(b))` in
/// `format` until the returned guard drops.
///
/// Guards nest: the innermost format applies, and dropping an inner guard brings back the
/// outer one. Only matmuls are rounded; parameters, their updates and every other op stay in
/// the element type (the f32 "master weights").
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{autocast, autocast_format};
/// use tl_tensor::Tensor;
///
/// let a = Tensor::<f32>::from_vec(vec![1.0, 1.0], &[1, 2])?;
/// let b = Tensor::<f32>::from_vec(vec![1.0, 2f32.powi(-8)], &[2, 1])?;
/// {
///     let _bf16 = autocast(Format::Bf16);
///     // 1 + 2^-8 is a tie between the bf16 values 1 and 1 + 2^-7: it goes to even.
///     assert_eq!(a.matmul(&b).item(), 1.0);
///     {
///         let _fp16 = autocast(Format::Fp16);
///         assert_eq!(a.matmul(&b).item(), 1.00390625); // fp16 holds 1 + 2^-8
///     }
///     assert_eq!(autocast_format(), Some(Format::Bf16));
/// }
/// assert_eq!(a.matmul(&b).item(), 1.00390625); // plain f32 again
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn autocast(format: Format) -> AutocastGuard {
    autocast_with(format, Accumulation::F32)
}

/// [`autocast`] with the products accumulated by `accumulation`: for a tensor-core model,
/// every product of the thread — forward, and the two of each backward — is
/// `cast(D)` with `D` the binary32 result of the model's block FMA on the rounded operands
/// (see tl-numerics' `BlockFma`). Guards nest and restore exactly as [`autocast`]'s, the
/// model included.
///
/// # Panics
/// If `accumulation` is a [`TensorCore`](Accumulation::TensorCore) with an invalid block
/// (check it first with [`Accumulation::block_fma`]; parsing a name checks it).
///
/// ```
/// use tl_numerics::Format;
/// use tl_precision::{Accumulation, autocast_with};
/// use tl_tensor::Tensor;
///
/// // 1 + 2^-11 + 2^-24 + 2^-24, all fp16 values. In f32 each 2^-24 is a tie that goes to
/// // the even 1 + 2^-11, itself a tie between fp16's 1 and 1 + 2^-10: 1. An H100 keeps
/// // both 2^-24 terms (two extra bits), so the binary32 sum lies above the tie.
/// let a = Tensor::<f32>::from_vec(vec![1.0, 2f32.powi(-11), 2f32.powi(-24), 2f32.powi(-24)], &[1, 4])?;
/// let b = Tensor::<f32>::from_vec(vec![1.0; 4], &[4, 1])?;
/// {
///     let _h100 = autocast_with(Format::Fp16, Accumulation::H100);
///     assert_eq!(a.matmul(&b).item(), 1.0 + 2f32.powi(-10));
///     let _v100 = autocast_with(Format::Fp16, Accumulation::V100); // cuts 2^-24 away
///     assert_eq!(a.matmul(&b).item(), 1.0);
/// }
/// let _f32 = autocast_with(Format::Fp16, Accumulation::F32);
/// assert_eq!(a.matmul(&b).item(), 1.0);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub fn autocast_with(format: Format, accumulation: Accumulation) -> AutocastGuard {
    let kernel = match accumulation.product_kernel(format) {
        Ok(kernel) => kernel,
        Err(error) => panic!("autocast_with: {error}"),
    };
    let hook: Arc<dyn MatmulHook> = Arc::new(RoundedMatmul {
        format,
        accumulation,
        kernel,
    });
    let previous = set_matmul_hook(Some(hook));
    AutocastGuard {
        previous,
        _same_thread: PhantomData,
    }
}

/// [`autocast`] in bf16, the format of mixed-precision training that needs no loss scaling.
pub fn autocast_bf16() -> AutocastGuard {
    autocast(Format::Bf16)
}
