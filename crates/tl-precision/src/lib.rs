//! Mixed-precision training for tinyllm: the numerics of bf16/fp16 hardware, emulated
//! exactly on the CPU, and the tools that make low-precision training work.
//!
//! - [`cast`] rounds a tensor into a 16-bit [`Format`], and its gradient on the way back.
//!   (It and [`autocast`] take the fp8 formats too, and then round plainly as
//!   [`Round::round_to`](tl_numerics::Round::round_to) does: no per-tensor scale, overflow to
//!   inf or, in E4M3, NaN. That is not yet fp8 training, which no [`Precision`] offers.)
//! - [`autocast`] makes every matmul on the thread read and write 16-bit values, as a tensor
//!   core does, while parameters and their updates stay f32 ("master weights");
//!   [`autocast_with`] also adds the products up as a given GPU's tensor cores do
//!   ([`Accumulation`]).
//! - [`fp8_matmul`] and [`Fp8State`] train linear layers in fp8 with Transformer Engine's
//!   delayed scaling (per-tensor scales from an amax history; E4M3 forward, E5M2 backward).
//! - [`DynamicLossScaler`] keeps fp16 gradients from underflowing, skipping the steps whose
//!   gradients overflow.
//! - [`grad_accumulate`] builds the gradient of a big batch from micro-batches of any sizes.
//! - [`train_step_mixed`] puts them together into one optimizer step;
//!   [`train_step_mixed_observed`] is the same step with a [`StepObserver`] between its phases.
//!
//! ```
//! use tl_precision::{autocast_bf16, cast, Format};
//! use tl_tensor::Tensor;
//!
//! let x = Tensor::<f32>::from_vec(vec![1.01], &[1, 1])?;
//! assert_eq!(cast(&x, Format::Bf16).item(), 1.0078125);
//! let _bf16 = autocast_bf16();
//! assert_eq!(x.matmul(&x).item(), 1.015625); // rd(1.0078125²) = rd(1.01568...)
//! # Ok::<(), tl_tensor::TensorError>(())
//! ```

mod accumulate;
mod autocast;
mod cast;
mod error;
mod fp8;
mod observer;
mod precision;
mod scaler;
mod scaler_state;
mod step;
mod tensor_core;

pub use accumulate::{LOSS_LABEL, MicroBatch, grad_accumulate};
pub use autocast::{
    AutocastGuard, autocast, autocast_accumulation, autocast_bf16, autocast_format,
    autocast_product_kernel, autocast_with, mark_rounded, parse_format, round_for_products,
};
pub use cast::{
    COPY_LABEL, WEIGHT_COPY_LABEL, cast, record_underflows, round_gradient, take_underflow_count,
    underflow_count,
};
pub use error::{PrecisionError, Result};
pub use fp8::{AmaxAlgorithm, Fp8Recipe, Fp8State, LinearScales, ScaleState, fp8_matmul};
pub use observer::{StepObserver, StepPhase};
pub use precision::Precision;
pub use scaler::{DynamicLossScaler, StepOutcome, grad_is_finite};
pub use scaler_state::ScalerState;
pub use step::{
    StepReport, finish_step_observed, start_step, train_step_mixed, train_step_mixed_observed,
};
pub use tensor_core::Accumulation;
/// The formats (the 16-bit ones and fp8), re-exported from tl-numerics.
pub use tl_numerics::Format;
