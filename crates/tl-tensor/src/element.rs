//! The element types a tensor can hold: `f32` (the default) and `f64`.

use std::fmt::{Debug, Display};
use std::iter::Sum;
use std::mem::MaybeUninit;
use std::ops::{AddAssign, DivAssign, MulAssign, SubAssign};

use ndarray::{ArrayView2, ArrayViewMut2, LinalgScalar, ScalarOperand};
use num_traits::Float;

use crate::Tensor;
use crate::ops::matmul::MatmulHook;
use crate::ops::matmul_with::{PreparedRhs, ProductKernel};

/// A floating-point element type of a [`Tensor`]: implemented for `f32` and `f64`.
///
/// Every op is generic over it, so the same model runs in `f32` (training) and in `f64`
/// (finite-difference gradient checks). Conversions to and from `f64` are exact for
/// `f64` and round to nearest for `f32`.
pub trait Element:
    Float
    + LinalgScalar
    + ScalarOperand
    + Sum
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
    + Default
    + Debug
    + Display
    + Send
    + Sync
    + tl_numerics::Round
    + 'static
{
    /// The type's name as users write it: `"f32"` or `"f64"`.
    const NAME: &'static str;

    /// Converts from `f64` (rounding to nearest for `f32`).
    fn from_f64(x: f64) -> Self;

    /// Converts to `f64` (exact).
    fn to_f64(self) -> f64;

    /// Converts from `f32` (exact).
    fn from_f32(x: f32) -> Self;

    /// Converts to `f32` (rounding to nearest for `f64`).
    fn to_f32(self) -> f32;

    /// Replaces every `x` of `xs` by `e^x`: for `f32` the vectorized
    /// [`exp_in_place`](crate::kernels::exp::exp_in_place) (within 1 ulp, the same bits on
    /// every x86-64 machine), for `f64` the C library's `exp` per element.
    fn exp_in_place(xs: &mut [Self]);

    /// The largest `scale·x` of a row, NaNs ignored: for `f32` on AVX-512 where the CPU has
    /// it, with the portable [`scaled_max`](crate::kernels::softmax_row::scaled_max)'s
    /// value.
    fn scaled_max(xs: &[Self], scale: Self) -> Self {
        crate::kernels::softmax_row::scaled_max(xs, scale)
    }

    /// `x ← e^(scale·x − shift)` (then `× factor`) over a row, returning the exponentials'
    /// sum: for `f32` on AVX-512 where the CPU has it, with the portable
    /// [`scaled_exp`](crate::kernels::softmax_row::scaled_exp)'s bits.
    fn scaled_exp(xs: &mut [Self], scale: Self, shift: Self, factor: Option<Self>) -> Self {
        crate::kernels::softmax_row::scaled_exp(xs, scale, shift, factor)
    }

    /// `dp ← scale·p·(dp − Σ_j dp_j·p_j)` over a row of a softmax's output gradient `grads`
    /// and its probabilities `probs`: for `f32` on AVX-512 where the CPU has it, with the
    /// portable [`scaled_grad`](crate::kernels::softmax_row::scaled_grad)'s bits.
    ///
    /// # Panics
    /// If the rows differ in length.
    fn scaled_grad(grads: &mut [Self], probs: &[Self], scale: Self) {
        crate::kernels::softmax_row::scaled_grad(grads, probs, scale)
    }

    /// The SwiGLU gate `g·σ(g)·u` of every `g` of `gate` and `u` of `up`, written into
    /// `out` and returned: for `f32` on AVX-512 where the CPU has it, with the portable
    /// [`swiglu`](crate::kernels::swiglu::swiglu)'s bits.
    ///
    /// # Panics
    /// If the three differ in length.
    fn swiglu<'a>(gate: &[Self], up: &[Self], out: &'a mut [MaybeUninit<Self>]) -> &'a mut [Self] {
        crate::kernels::swiglu::swiglu(gate, up, out)
    }

    /// The SwiGLU gate's VJP: `grads` (the output gradient on entry) overwritten with the
    /// gate's gradient, the up projection's written into `up_grads` and returned: for `f32`
    /// on AVX-512 where the CPU has it, with the portable
    /// [`swiglu_grads`](crate::kernels::swiglu::swiglu_grads)'s bits.
    ///
    /// # Panics
    /// If the four differ in length.
    fn swiglu_grads<'a>(
        grads: &mut [Self],
        gate: &[Self],
        up: &[Self],
        up_grads: &'a mut [MaybeUninit<Self>],
    ) -> &'a mut [Self] {
        crate::kernels::swiglu::swiglu_grads(grads, gate, up, up_grads)
    }

    /// Every pair of each head of `src` turned by the angles of the pair tables `cos`, `sin`
    /// (a rotary embedding), written into `out` and returned: for `f32` on AVX-512 where the
    /// CPU has it, with the portable
    /// [`rotate_pairs`](crate::kernels::rotary::rotate_pairs)'s bits.
    ///
    /// # Panics
    /// As [`rotate_pairs`](crate::kernels::rotary::rotate_pairs) does, for lengths that do
    /// not fit.
    fn rotate_pairs<'a>(
        src: &[Self],
        out: &'a mut [MaybeUninit<Self>],
        cos: &[Self],
        sin: &[Self],
    ) -> &'a mut [Self] {
        crate::kernels::rotary::rotate_pairs(src, out, cos, sin)
    }

    /// AdamW's update of `p`, `m`, `v` from the gradient `g` with the constants of `step`:
    /// for `f32` compiled for AVX-512 where the CPU has it, with the portable
    /// [`update`](crate::kernels::adamw::update)'s bits.
    ///
    /// # Panics
    /// If the four differ in length.
    fn adamw_update(
        step: &crate::kernels::adamw::AdamWStep<Self>,
        p: &mut [Self],
        m: &mut [Self],
        v: &mut [Self],
        g: &[Self],
    ) {
        crate::kernels::adamw::update(step, p, m, v, g)
    }

    /// Calls the matmul hook's method for this element type (the dispatch behind
    /// [`Tensor::matmul`]'s override point).
    #[doc(hidden)]
    fn dispatch_matmul(
        hook: &dyn MatmulHook,
        lhs: &Tensor<Self>,
        rhs: &Tensor<Self>,
    ) -> Tensor<Self>;

    /// Calls the product kernel's method for this element type (the dispatch behind
    /// [`Tensor::matmul_with`]).
    #[doc(hidden)]
    fn kernel_product(
        kernel: &dyn ProductKernel,
        shape: (usize, usize, usize),
        lhs: &[Self],
        rhs: &[Self],
        out: &mut [Self],
        accumulate: bool,
    );

    /// Calls the product kernel's method for views of this element type.
    #[doc(hidden)]
    fn kernel_product_view(
        kernel: &dyn ProductKernel,
        out: &mut ArrayViewMut2<'_, Self>,
        lhs: ArrayView2<'_, Self>,
        rhs: ArrayView2<'_, Self>,
        accumulate: bool,
    );

    /// Asks the product kernel to lay out a right operand for several products (f32 only:
    /// no kernel prepares f64 operands).
    #[doc(hidden)]
    fn kernel_prepare_rhs<'a>(
        kernel: &dyn ProductKernel,
        rhs: ArrayView2<'a, Self>,
    ) -> Option<Box<dyn PreparedRhs<Self> + 'a>>;
}

impl Element for f32 {
    const NAME: &'static str = "f32";

    fn from_f64(x: f64) -> Self {
        x as f32
    }

    fn to_f64(self) -> f64 {
        f64::from(self)
    }

    fn from_f32(x: f32) -> Self {
        x
    }

    fn to_f32(self) -> f32 {
        self
    }

    fn exp_in_place(xs: &mut [f32]) {
        crate::kernels::exp::exp_in_place(xs);
    }

    fn scaled_max(xs: &[f32], scale: f32) -> f32 {
        crate::kernels::softmax_row::scaled_max_f32(xs, scale)
    }

    fn scaled_exp(xs: &mut [f32], scale: f32, shift: f32, factor: Option<f32>) -> f32 {
        crate::kernels::softmax_row::scaled_exp_f32(xs, scale, shift, factor)
    }

    fn scaled_grad(grads: &mut [f32], probs: &[f32], scale: f32) {
        crate::kernels::softmax_row::scaled_grad_f32(grads, probs, scale)
    }

    fn swiglu<'a>(gate: &[f32], up: &[f32], out: &'a mut [MaybeUninit<f32>]) -> &'a mut [f32] {
        crate::kernels::swiglu::swiglu_f32(gate, up, out)
    }

    fn swiglu_grads<'a>(
        grads: &mut [f32],
        gate: &[f32],
        up: &[f32],
        up_grads: &'a mut [MaybeUninit<f32>],
    ) -> &'a mut [f32] {
        crate::kernels::swiglu::swiglu_grads_f32(grads, gate, up, up_grads)
    }

    fn rotate_pairs<'a>(
        src: &[f32],
        out: &'a mut [MaybeUninit<f32>],
        cos: &[f32],
        sin: &[f32],
    ) -> &'a mut [f32] {
        crate::kernels::rotary::rotate_pairs_f32(src, out, cos, sin)
    }

    fn adamw_update(
        step: &crate::kernels::adamw::AdamWStep<f32>,
        p: &mut [f32],
        m: &mut [f32],
        v: &mut [f32],
        g: &[f32],
    ) {
        crate::kernels::adamw::update_f32(step, p, m, v, g)
    }

    fn dispatch_matmul(hook: &dyn MatmulHook, lhs: &Tensor<f32>, rhs: &Tensor<f32>) -> Tensor<f32> {
        hook.matmul_f32(lhs, rhs)
    }

    fn kernel_product(
        kernel: &dyn ProductKernel,
        (m, k, n): (usize, usize, usize),
        lhs: &[f32],
        rhs: &[f32],
        out: &mut [f32],
        accumulate: bool,
    ) {
        kernel.product_f32(m, k, n, lhs, rhs, out, accumulate);
    }

    fn kernel_product_view(
        kernel: &dyn ProductKernel,
        out: &mut ArrayViewMut2<'_, f32>,
        lhs: ArrayView2<'_, f32>,
        rhs: ArrayView2<'_, f32>,
        accumulate: bool,
    ) {
        kernel.product_view_f32(out, lhs, rhs, accumulate);
    }

    fn kernel_prepare_rhs<'a>(
        kernel: &dyn ProductKernel,
        rhs: ArrayView2<'a, f32>,
    ) -> Option<Box<dyn PreparedRhs<f32> + 'a>> {
        kernel.prepare_rhs_f32(rhs)
    }
}

impl Element for f64 {
    const NAME: &'static str = "f64";

    fn from_f64(x: f64) -> Self {
        x
    }

    fn to_f64(self) -> f64 {
        self
    }

    fn from_f32(x: f32) -> Self {
        f64::from(x)
    }

    fn to_f32(self) -> f32 {
        self as f32
    }

    fn exp_in_place(xs: &mut [f64]) {
        for x in xs {
            *x = x.exp();
        }
    }

    fn dispatch_matmul(hook: &dyn MatmulHook, lhs: &Tensor<f64>, rhs: &Tensor<f64>) -> Tensor<f64> {
        hook.matmul_f64(lhs, rhs)
    }

    fn kernel_product(
        kernel: &dyn ProductKernel,
        (m, k, n): (usize, usize, usize),
        lhs: &[f64],
        rhs: &[f64],
        out: &mut [f64],
        accumulate: bool,
    ) {
        kernel.product_f64(m, k, n, lhs, rhs, out, accumulate);
    }

    fn kernel_product_view(
        kernel: &dyn ProductKernel,
        out: &mut ArrayViewMut2<'_, f64>,
        lhs: ArrayView2<'_, f64>,
        rhs: ArrayView2<'_, f64>,
        accumulate: bool,
    ) {
        kernel.product_view_f64(out, lhs, rhs, accumulate);
    }

    fn kernel_prepare_rhs<'a>(
        _kernel: &dyn ProductKernel,
        _rhs: ArrayView2<'a, f64>,
    ) -> Option<Box<dyn PreparedRhs<f64> + 'a>> {
        None
    }
}
