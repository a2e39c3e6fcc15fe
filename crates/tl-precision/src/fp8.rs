//! fp8 training with delayed scaling, as NVIDIA Transformer Engine does it.
//!
//! fp8's range is narrow (E4M3 holds 2^-9 to 448, E5M2 2^-16 to 57344), so a tensor is
//! multiplied by a per-tensor *scale* before it is cast, and the product divided by the
//! scales after. The scale comes from the tensor's recent past, not its present: every step
//! records the tensor's largest magnitude (`amax`) in a history, and after the step the scale
//! becomes `(largest finite / amax) / 2^margin`, with `amax` the history's maximum (or its
//! newest entry). The step uses the scale the previous steps chose, which is why it is
//! "delayed": a GPU never waits for the amax of the tensor it is casting.
//!
//! The HYBRID recipe: the forward pass's operands (activations and weights) in E4M3, the
//! backward pass's gradients in E5M2, which trades precision for range. Products are exact
//! fp8 products accumulated in f32, then unscaled; the master weights stay f32. Every fp8
//! value is a bf16 value, and fp8's exponents keep every product and sum far from the
//! subnormals, so the products run as bf16 products (tl-tensor's `bf16_dot`: the CPU's
//! bf16 units where it has them, their order on any CPU).
//!
//! [`fp8_matmul`] is one linear layer's product; [`Fp8State`] holds every layer's three
//! [`ScaleState`]s (input, weight, gradient) and steps them with [`Fp8State::update`].

use std::cell::RefCell;
use std::rc::Rc;

use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use tl_numerics::{Format, RangeCounts, ScaledCast, scale_round_saturating_into};
use tl_tensor::kernels::bf16_dot::bf16_matmul as gemm;
use tl_tensor::ndarray::{ArrayD, Ix2, IxDyn};
use tl_tensor::{Element, Tensor, in_backward};

use crate::cast::BLOCK;
use crate::error::{PrecisionError, Result};

/// How the amax history gives the scale's amax.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmaxAlgorithm {
    /// The largest amax of the history (Transformer Engine's default).
    #[default]
    Max,
    /// The newest amax only.
    MostRecent,
}

/// The delayed-scaling recipe: margin, amax history length and algorithm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp8Recipe {
    /// The scale leaves `2^margin` of headroom below the largest finite value.
    pub margin: u32,
    /// Steps of amax history kept per tensor.
    pub history_len: usize,
    /// How the history gives the amax.
    pub amax: AmaxAlgorithm,
}

impl Default for Fp8Recipe {
    /// Transformer Engine's defaults: margin 0, a history of 1024 steps, its maximum.
    fn default() -> Self {
        Fp8Recipe {
            margin: 0,
            history_len: 1024,
            amax: AmaxAlgorithm::Max,
        }
    }
}

/// The longest amax history [`Fp8Recipe::validate`] accepts.
pub const MAX_HISTORY_LEN: usize = 1 << 16;
/// The largest margin [`Fp8Recipe::validate`] accepts.
pub const MAX_MARGIN: u32 = 64;

impl Fp8Recipe {
    /// Checks the recipe.
    ///
    /// # Errors
    /// [`PrecisionError::InvalidFp8Recipe`] for a history of 0 or more than
    /// [`MAX_HISTORY_LEN`] steps, or a margin above [`MAX_MARGIN`].
    pub fn validate(&self) -> Result<()> {
        if !(1..=MAX_HISTORY_LEN).contains(&self.history_len) {
            return Err(PrecisionError::InvalidFp8Recipe {
                name: "history_len",
                value: self.history_len.to_string(),
                reason: format!("must be in 1..={MAX_HISTORY_LEN}"),
            });
        }
        if self.margin > MAX_MARGIN {
            return Err(PrecisionError::InvalidFp8Recipe {
                name: "margin",
                value: self.margin.to_string(),
                reason: format!("must be at most {MAX_MARGIN}"),
            });
        }
        Ok(())
    }
}

/// One tensor's delayed scaling: its fp8 format, the scale in force, the amax history, and
/// what the current step has seen (its amax and its range counts).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScaleState {
    /// The format the tensor is cast to (by name: `"e4m3"`, `"e5m2"`).
    #[serde(with = "format_name")]
    pub format: Format,
    /// The scale the casts of the current step use.
    pub scale: f32,
    /// Recorded amaxes, oldest first, at most the recipe's length.
    pub history: Vec<f32>,
    /// The largest magnitude seen in the current step (0 before any).
    pub pending: f32,
    /// Values that saturated (beyond the largest finite value after scaling) and nonzero
    /// values flushed to zero, in the current step.
    #[serde(skip)]
    pub counts: RangeCounts,
}

impl ScaleState {
    /// A tensor cast to `format`, with scale 1 and no history.
    pub fn new(format: Format) -> Self {
        ScaleState {
            format,
            scale: 1.0,
            history: Vec::new(),
            pending: 0.0,
            counts: RangeCounts::default(),
        }
    }

    /// Records a magnitude the current step saw (a NaN poisons the step's amax).
    pub fn observe(&mut self, amax: f32) {
        self.pending = if amax.is_nan() || self.pending.is_nan() {
            f32::NAN
        } else {
            self.pending.max(amax)
        };
    }

    /// Ends the step: appends its amax to the history (dropping the oldest beyond
    /// `recipe.history_len`), then sets the scale from the history's amax,
    /// `(largest finite / amax) / 2^margin`, keeping the old scale when that amax is zero
    /// or not finite, or the new scale would not be a positive finite f32.
    ///
    /// ```
    /// use tl_numerics::Format;
    /// use tl_precision::{Fp8Recipe, ScaleState};
    ///
    /// let recipe = Fp8Recipe { history_len: 2, ..Fp8Recipe::default() };
    /// let mut s = ScaleState::new(Format::E4M3);
    /// s.observe(2.0);
    /// s.update(&recipe);
    /// assert_eq!(s.scale, 224.0); // 448 / 2
    /// s.observe(0.5);
    /// s.update(&recipe);
    /// assert_eq!(s.scale, 224.0); // the history's max is still 2
    /// s.observe(0.5);
    /// s.update(&recipe);
    /// assert_eq!(s.scale, 896.0); // 2 has left a history of two steps
    /// ```
    pub fn update(&mut self, recipe: &Fp8Recipe) {
        self.history.push(self.pending);
        let excess = self.history.len().saturating_sub(recipe.history_len);
        self.history.drain(..excess);
        self.pending = 0.0;
        self.counts = RangeCounts::default();
        let amax = match recipe.amax {
            AmaxAlgorithm::Max => self.history.iter().copied().fold(0.0f32, |m, a| {
                if a.is_nan() || m.is_nan() {
                    f32::NAN
                } else {
                    m.max(a)
                }
            }),
            AmaxAlgorithm::MostRecent => *self.history.last().expect("just pushed"),
        };
        if !(amax > 0.0 && amax.is_finite()) {
            return;
        }
        let largest = self.format.max_finite() as f32;
        let scale = (largest / amax) / 2f32.powi(recipe.margin as i32);
        if scale > 0.0 && scale.is_finite() {
            self.scale = scale;
        }
    }
}

/// A [`Format`] as its name in serialized states.
mod format_name {
    use serde::{Deserialize, Deserializer, Serializer, de::Error};
    use tl_numerics::Format;

    pub(super) fn serialize<S: Serializer>(
        format: &Format,
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(format.name())
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Format, D::Error> {
        let name = String::deserialize(deserializer)?;
        name.parse().map_err(D::Error::custom)
    }
}

/// The three tensors of one linear layer: its input and weight (E4M3) and the gradient of
/// its output (E5M2).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinearScales {
    /// The activation the layer reads.
    pub input: ScaleState,
    /// The layer's weight.
    pub weight: ScaleState,
    /// The gradient flowing back into the layer's output.
    pub grad: ScaleState,
}

impl LinearScales {
    /// The HYBRID formats: E4M3 forward, E5M2 for the gradient.
    pub fn hybrid() -> Self {
        LinearScales {
            input: ScaleState::new(Format::E4M3),
            weight: ScaleState::new(Format::E4M3),
            grad: ScaleState::new(Format::E5M2),
        }
    }

    /// The three states, in the order input, weight, grad.
    pub fn all(&self) -> [&ScaleState; 3] {
        [&self.input, &self.weight, &self.grad]
    }

    /// The three states, mutable, in the same order: where processes that train one model
    /// put back the step's observations they made global (each state's `pending` amax and
    /// `counts`) before [`Fp8State::update`].
    pub fn all_mut(&mut self) -> [&mut ScaleState; 3] {
        [&mut self.input, &mut self.weight, &mut self.grad]
    }
}

/// Every fp8 layer's scaling state and the recipe that steps it: what a checkpoint saves.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Fp8State {
    /// The recipe.
    pub recipe: Fp8Recipe,
    /// One entry per fp8 linear layer, in the model's order.
    pub layers: Vec<LinearScales>,
    /// Whether the forward casts record their amaxes and counts: on by default, off while a
    /// model is evaluated (the trainer's validation). Not saved: a loaded state observes.
    #[serde(skip, default = "observing_by_default")]
    pub observing: bool,
}

/// [`Fp8State::observing`] of a new or loaded state.
fn observing_by_default() -> bool {
    true
}

impl Fp8State {
    /// `layers` fresh HYBRID layers under `recipe`.
    ///
    /// # Errors
    /// Those of [`Fp8Recipe::validate`].
    pub fn new(recipe: Fp8Recipe, layers: usize) -> Result<Self> {
        recipe.validate()?;
        Ok(Fp8State {
            recipe,
            layers: vec![LinearScales::hybrid(); layers],
            observing: true,
        })
    }

    /// Ends an optimizer step for every tensor ([`ScaleState::update`]) and returns what
    /// each saw in it, per layer in the order input, weight, grad.
    pub fn update(&mut self) -> Vec<[RangeCounts; 3]> {
        let recipe = self.recipe;
        self.layers
            .iter_mut()
            .map(|layer| {
                let counts = [layer.input.counts, layer.weight.counts, layer.grad.counts];
                for state in [&mut layer.input, &mut layer.weight, &mut layer.grad] {
                    state.update(&recipe);
                }
                counts
            })
            .collect()
    }

    /// Checks a loaded state against the model: `layers` layers, HYBRID formats, positive
    /// finite scales, histories no longer than the recipe's.
    ///
    /// # Errors
    /// [`PrecisionError::InvalidState`] naming what does not fit.
    pub fn check(&self, layers: usize) -> Result<()> {
        self.recipe.validate()?;
        let invalid = |reason: String| PrecisionError::InvalidState {
            field: "fp8",
            reason,
        };
        if self.layers.len() != layers {
            return Err(invalid(format!(
                "{} layers, the model has {layers}",
                self.layers.len()
            )));
        }
        let hybrid = LinearScales::hybrid();
        for (i, layer) in self.layers.iter().enumerate() {
            for (state, expected) in layer.all().into_iter().zip(hybrid.all()) {
                if state.format != expected.format {
                    return Err(invalid(format!("layer {i}: a {} tensor", state.format)));
                }
                if !(state.scale > 0.0 && state.scale.is_finite()) {
                    return Err(invalid(format!("layer {i}: scale {}", state.scale)));
                }
                if state.history.len() > self.recipe.history_len {
                    return Err(invalid(format!(
                        "layer {i}: a history longer than the recipe's"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// `x · w` in fp8 with delayed scaling, for the linear layer `layer` of `state`: `x`
/// (`[.., k]`, any rows) and `w` (`[k, n]`) scaled and cast to E4M3 with saturation, their
/// product accumulated in f32 and divided by both scales; backward, the output's gradient
/// scaled and cast to E5M2, and each VJP the same kind of product of fp8 values
/// (`dx = rd(g·s_g)·rd(w·s_w)ᵀ / (s_g·s_w)`, `dw = rd(x·s_x)ᵀ·rd(g·s_g) / (s_x·s_g)`); the
/// gradient reaches `x` and `w` as if the casts were the identity (straight through).
///
/// Every cast records its tensor's amax and its range counts in `state` while the state is
/// [`observing`](Fp8State::observing) and outside a backward pass: the forward pass of a
/// training step (a checkpointed segment's forward, which runs without a graph, included),
/// not a checkpoint's rerun, which repeats a forward the step has already seen, nor an
/// evaluation, during which the trainer turns observing off. The scales change only in
/// [`Fp8State::update`].
///
/// # Panics
/// If `w` is not 2-D, the inner sizes differ, or `layer` is not a layer of `state`.
pub fn fp8_matmul<E: Element>(
    x: &Tensor<E>,
    w: &Tensor<E>,
    state: &Rc<RefCell<Fp8State>>,
    layer: usize,
) -> Tensor<E> {
    let (x_shape, w_shape) = (x.shape(), w.shape());
    assert!(
        w_shape.len() == 2 && x_shape.last() == Some(&w_shape[0]),
        "fp8_matmul: cannot multiply {x_shape:?} by {w_shape:?}"
    );
    let (k, n) = (w_shape[0], w_shape[1]);
    let rows = x.numel() / k.max(1);
    let record = state.borrow().observing && !in_backward();
    let (s_x, s_w) = {
        let state = state.borrow();
        let scales = &state.layers[layer];
        (scales.input.scale, scales.weight.scale)
    };
    // The fp8 copies of the operands, made (and their amaxes recorded) for values only.
    let quantized = tl_tensor::meta::computes(&[x, w]).then(|| {
        let xq = cast_scaled(
            &x.value(),
            s_x,
            Format::E4M3,
            record.then_some((state, layer, Role::Input)),
        );
        let wq = cast_scaled(
            &w.value(),
            s_w,
            Format::E4M3,
            record.then_some((state, layer, Role::Weight)),
        );
        (Rc::new(xq), Rc::new(wq))
    });
    let unscale = |mut product: ArrayD<E>, a: f32, b: f32| {
        scale_in_place(&mut product, E::from_f32(1.0 / a) * E::from_f32(1.0 / b));
        product
    };
    let mut out_shape = x_shape[..x_shape.len() - 1].to_vec();
    out_shape.push(n);
    // The fp8 copies stay for the VJP; a checkpoint's rerun that kept this product's
    // output gives it back (tl-tensor's `with_given_product`), and it is not computed again.
    let forward = {
        let (quantized, out_shape) = (quantized.clone(), out_shape.clone());
        move || {
            let (xq, wq) = quantized.expect("computed for real operands");
            let forward = gemm(as2(&xq, rows, k), as2(&wq, k, n)).into_dyn();
            unscale(forward, s_x, s_w)
                .into_shape_with_order(IxDyn(&out_shape))
                .expect("rows of the output")
        }
    };
    let (x_in, w_in, state) = (x.clone(), w.clone(), Rc::clone(state));
    Tensor::from_product(&out_shape, forward, &[x, w], move |grad| {
        let (xq, wq) = quantized.expect("a values VJP runs on real gradients only");
        // Each VJP runs once per step (a checkpoint's rerun builds the nodes that backward
        // then runs), so the gradient's cast always records.
        let s_g = state.borrow().layers[layer].grad.scale;
        let gq = cast_scaled(&grad, s_g, Format::E5M2, Some((&state, layer, Role::Grad)));
        let g2 = as2(&gq, rows, n);
        let dx = x_in.requires_grad().then(|| {
            let product = gemm(g2, as2(&wq, k, n).t()).into_dyn();
            unscale(product, s_g, s_w)
                .into_shape_with_order(IxDyn(&x_shape))
                .expect("the input's shape")
        });
        let dw = w_in
            .requires_grad()
            .then(|| unscale(gemm(as2(&xq, rows, k).t(), g2).into_dyn(), s_x, s_g));
        vec![dx, dw]
    })
}

/// `a` (in standard layout) seen as an `r × c` matrix.
fn as2<E: Element>(a: &ArrayD<E>, r: usize, c: usize) -> tl_tensor::ndarray::ArrayView2<'_, E> {
    a.view()
        .into_shape_with_order((r, c))
        .expect("standard layout")
        .into_dimensionality::<Ix2>()
        .expect("2-D")
}

/// Which of a layer's tensors a cast is of.
#[derive(Clone, Copy)]
enum Role {
    Input,
    Weight,
    Grad,
}

/// `rd_sat(x · scale)` in `format`, as f32-or-f64 values; with a target, its amax (of `x`,
/// unscaled) and range counts are recorded there.
///
/// One pass over `x` ([`scale_round_saturating_into`]: scale, round, count and amax per
/// element, vectorized) in blocks on the rayon pool, into a buffer that is written once.
/// The blocks are fixed, not per thread, and what they return is order-free (integer sums
/// and a max), so the cast, its counts and its amax are the same bits on any thread count.
fn cast_scaled<E: Element>(
    x: &ArrayD<E>,
    scale: f32,
    format: Format,
    record: Option<(&Rc<RefCell<Fp8State>>, usize, Role)>,
) -> ArrayD<E> {
    let (cast, seen) = scaled_copy(x, E::from_f32(scale), format);
    if let Some((state, layer, role)) = record {
        let mut state = state.borrow_mut();
        let scales = &mut state.layers[layer];
        let target = match role {
            Role::Input => &mut scales.input,
            Role::Weight => &mut scales.weight,
            Role::Grad => &mut scales.grad,
        };
        target.observe(seen.amax);
        target.counts += seen.counts;
    }
    cast
}

/// `rd_sat(x · scale)` of every element of `x`, in standard layout, with what the cast saw
/// of the whole tensor: [`cast_scaled`] without the recording.
fn scaled_copy<E: Element>(x: &ArrayD<E>, scale: E, format: Format) -> (ArrayD<E>, ScaledCast) {
    // Activations, weights and gradients are contiguous; anything else is copied first.
    let standard = x.as_standard_layout();
    let src = standard.as_slice().expect("standard layout");
    let mut cast = Vec::with_capacity(src.len());
    let out = &mut cast.spare_capacity_mut()[..src.len()];
    let seen = if src.len() <= BLOCK {
        scale_round_saturating_into(src, scale, out, format)
    } else {
        out.par_chunks_mut(BLOCK)
            .zip(src.par_chunks(BLOCK))
            .map(|(out, block)| scale_round_saturating_into(block, scale, out, format))
            .reduce(ScaledCast::default, ScaledCast::merge)
    };
    // SAFETY: the blocks above cover the first `src.len()` elements of the spare capacity,
    // and `scale_round_saturating_into` initialised every element of each block.
    unsafe { cast.set_len(src.len()) };
    let cast = ArrayD::from_shape_vec(x.raw_dim(), cast).expect("the input's shape");
    (cast, seen)
}

/// Multiplies every element of `a` by `factor`, in place: the unscaling of an fp8 product,
/// without the new array a `mapv` would allocate, in blocks on the rayon pool. Each element
/// is the one product `v · factor`, so the blocks change no bit.
fn scale_in_place<E: Element>(a: &mut ArrayD<E>, factor: E) {
    match a.as_slice_memory_order_mut() {
        Some(values) if values.len() > BLOCK => values
            .par_chunks_mut(BLOCK)
            .for_each(|block| block.iter_mut().for_each(|v| *v *= factor)),
        Some(values) => values.iter_mut().for_each(|v| *v *= factor),
        None => a.map_inplace(|v| *v *= factor),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recipe(len: usize, amax: AmaxAlgorithm, margin: u32) -> Fp8Recipe {
        Fp8Recipe {
            margin,
            history_len: len,
            amax,
        }
    }

    /// A hand-worked trace of one E4M3 tensor (largest finite 448), history of 3, `max`.
    #[test]
    fn the_delayed_scaling_state_machine_step_by_step() {
        let r = recipe(3, AmaxAlgorithm::Max, 0);
        let mut s = ScaleState::new(Format::E4M3);
        assert_eq!((s.scale, s.history.len()), (1.0, 0));
        // Step 1 sees 4 then 8: the amax is 8, the next scale 448 / 8 = 56.
        s.observe(4.0);
        s.observe(8.0);
        assert_eq!(s.scale, 1.0, "the step in progress keeps its scale");
        s.update(&r);
        assert_eq!((s.scale, s.history.clone()), (56.0, vec![8.0]));
        // Step 2 sees 2: the history's max is still 8.
        s.observe(2.0);
        s.update(&r);
        assert_eq!((s.scale, s.history.clone()), (56.0, vec![8.0, 2.0]));
        // Step 3 sees nothing at all (amax 0): recorded, max still 8.
        s.update(&r);
        assert_eq!((s.scale, s.history.clone()), (56.0, vec![8.0, 2.0, 0.0]));
        // Step 4 sees 1: the 8 leaves the window of 3; max(2, 0, 1) = 2, scale 224.
        s.observe(1.0);
        s.update(&r);
        assert_eq!((s.scale, s.history.clone()), (224.0, vec![2.0, 0.0, 1.0]));
        // Steps 5 and 6 see 0: max(1, 0) = 1 → 448; then max(0, 0, 0) = 0 → scale kept.
        s.update(&r);
        assert_eq!(s.scale, 448.0);
        s.update(&r);
        s.update(&r);
        assert_eq!((s.scale, s.history.clone()), (448.0, vec![0.0, 0.0, 0.0]));
        // An infinite amax: recorded, and the scale kept while it is in the window.
        s.observe(f32::INFINITY);
        s.update(&r);
        assert_eq!(s.scale, 448.0);
        s.observe(0.25);
        s.update(&r);
        assert_eq!(s.scale, 448.0, "max(0, inf, 0.25) is inf: kept");
        // A NaN poisons its step's amax like an infinity.
        let mut t = ScaleState::new(Format::E5M2);
        t.observe(3.0);
        t.observe(f32::NAN);
        t.observe(5.0);
        t.update(&r);
        assert!(t.history[0].is_nan());
        assert_eq!(t.scale, 1.0);
    }

    #[test]
    fn most_recent_and_the_margin() {
        let r = recipe(1024, AmaxAlgorithm::MostRecent, 2);
        let mut s = ScaleState::new(Format::E5M2);
        s.observe(57344.0);
        s.update(&r);
        assert_eq!(s.scale, 0.25, "(57344 / 57344) / 2^2");
        s.observe(7.0);
        s.update(&r);
        assert_eq!(s.scale, 57344.0 / 7.0 / 4.0);
        // A tiny amax whose scale would overflow f32 keeps the old scale.
        s.observe(1e-40);
        s.update(&r);
        assert_eq!(s.scale, 57344.0 / 7.0 / 4.0);
    }

    #[test]
    fn bad_recipes_and_states_are_refused() {
        assert!(recipe(0, AmaxAlgorithm::Max, 0).validate().is_err());
        assert!(recipe(1 << 17, AmaxAlgorithm::Max, 0).validate().is_err());
        assert!(recipe(8, AmaxAlgorithm::Max, 65).validate().is_err());
        let state = Fp8State::new(Fp8Recipe::default(), 2).unwrap();
        assert!(state.check(2).is_ok());
        assert!(state.check(3).is_err());
        let mut broken = state.clone();
        broken.layers[1].grad.scale = 0.0;
        assert!(broken.check(2).unwrap_err().to_string().contains("layer 1"));
        let mut swapped = state.clone();
        swapped.layers[0].grad.format = Format::E4M3;
        assert!(swapped.check(2).is_err());
        let json = serde_json::to_string(&state).unwrap();
        assert_eq!(serde_json::from_str::<Fp8State>(&json).unwrap(), state);
    }

    /// `rd_sat(v · s)` by tl-numerics' rounding, as a reference.
    fn q(v: f64, s: f32, f: Format) -> f64 {
        use tl_numerics::Round;
        (v * f64::from(s)).round_to_saturating(f)
    }

    #[test]
    #[allow(clippy::needless_range_loop)] // the formulas' indices, as written
    fn fp8_matmul_is_the_scaled_product_of_fp8_values_forward_and_backward() {
        use tl_tensor::ndarray::arr2;
        let state = Rc::new(RefCell::new(
            Fp8State::new(Fp8Recipe::default(), 1).unwrap(),
        ));
        {
            let mut st = state.borrow_mut();
            st.layers[0].input.scale = 64.0;
            st.layers[0].weight.scale = 16.0;
            st.layers[0].grad.scale = 262144.0;
        }
        let (xs, ws) = (
            [[0.3, -1.7, 5.1], [0.01, 2.2, -0.00001]],
            [[1.1, -0.2], [0.05, 3.3], [-2.5, 0.7]],
        );
        let x = Tensor::<f64>::param(arr2(&xs).into_dyn());
        let w = Tensor::<f64>::param(arr2(&ws).into_dyn());
        let y = fp8_matmul(&x, &w, &state, 0);
        let g = [[0.001, -0.02], [0.3, 0.0001]];
        y.backward_with(arr2(&g).into_dyn());
        let (e4, e5) = (Format::E4M3, Format::E5M2);
        for i in 0..2 {
            for j in 0..2 {
                let sum: f64 = (0..3)
                    .map(|p| q(xs[i][p], 64.0, e4) * q(ws[p][j], 16.0, e4))
                    .sum();
                let expected = sum * f64::from(1.0f32 / 64.0) * f64::from(1.0f32 / 16.0);
                assert_eq!(y.value()[[i, j]], expected, "y[{i}][{j}]");
            }
        }
        let dx = x.grad().unwrap();
        let dw = w.grad().unwrap();
        for i in 0..2 {
            for p in 0..3 {
                let sum: f64 = (0..2)
                    .map(|j| q(g[i][j], 262144.0, e5) * q(ws[p][j], 16.0, e4))
                    .sum();
                assert_eq!(
                    dx[[i, p]],
                    sum * (1.0 / 262144.0) * (1.0 / 16.0),
                    "dx[{i}][{p}]"
                );
            }
        }
        for p in 0..3 {
            for j in 0..2 {
                let sum: f64 = (0..2)
                    .map(|i| q(xs[i][p], 64.0, e4) * q(g[i][j], 262144.0, e5))
                    .sum();
                assert_eq!(
                    dw[[p, j]],
                    sum * (1.0 / 64.0) * (1.0 / 262144.0),
                    "dw[{p}][{j}]"
                );
            }
        }
        // The amaxes were recorded, of the tensors before scaling; 5.1·64 = 326 fits E4M3,
        // and -0.00001·64 is below half of E4M3's smallest subnormal 2^-9: flushed.
        let st = state.borrow();
        let layer = &st.layers[0];
        assert_eq!(
            (
                layer.input.pending,
                layer.weight.pending,
                layer.grad.pending
            ),
            (5.1, 3.3, 0.3)
        );
        assert_eq!(layer.input.counts.flushed, 1);
        assert_eq!(
            layer.grad.counts.saturated, 1,
            "0.3 · 1024 = 307 > 57344? no: see below"
        );
    }

    /// `cast_scaled` as it was before the fused pass, kept as the oracle: a scaled copy,
    /// the saturating counting round, then a fold of the magnitudes.
    fn cast_reference<E: Element>(
        x: &ArrayD<E>,
        scale: f32,
        format: Format,
    ) -> (Vec<E>, ScaledCast) {
        let scale = E::from_f32(scale);
        let mut scaled: Vec<E> = x.iter().map(|&v| v * scale).collect();
        let counts = tl_numerics::round_slice_saturating_counting(&mut scaled, format);
        let amax = x.iter().fold(0.0f32, |m, &v| {
            let a = v.to_f32().abs();
            if a.is_nan() || m.is_nan() {
                f32::NAN
            } else {
                m.max(a)
            }
        });
        (scaled, ScaledCast { counts, amax })
    }

    /// Values of every kind, from a reproducible stream: ordinary, flushing, f32-subnormal,
    /// saturating, ±0, and (for `specials` 8 or 10 of 10 kinds) ±inf and NaNs.
    fn values(seed: &mut u64, n: usize, kinds: u64) -> Vec<f64> {
        let mut next = || {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            *seed
        };
        (0..n)
            .map(|_| {
                let sign = if next() % 2 == 0 { 1.0 } else { -1.0 };
                let unit = (next() % (1 << 40)) as f64 / (1u64 << 40) as f64;
                match next() % kinds {
                    0 | 1 => sign * unit * 4.0,
                    2 => sign * unit * 1e-6,
                    3 => sign * f64::from(f32::from_bits((next() % 0x0080_0000) as u32)),
                    4 => sign * (1.0 + unit) * 1e6,
                    5 => 0.0 * sign,
                    6 => sign * unit * 3e4,
                    7 => f64::INFINITY * sign,
                    _ => f64::NAN * sign,
                }
            })
            .collect()
    }

    fn bits<E: Element>(xs: &[E]) -> Vec<u64> {
        xs.iter().map(|&x| Element::to_f64(x).to_bits()).collect()
    }

    /// The fused, blocked cast against the old three passes, for f32 and f64, both formats,
    /// lengths around the block size and odd ones, on 1 and on 3 threads: the same values,
    /// counts and amax. (The SIMD builds against the portable one are tl-numerics' test.)
    #[test]
    fn the_fused_cast_is_the_old_one_bit_for_bit_on_any_thread_count() {
        fn check<E: Element>(x: &[f64], scale: f32, format: Format, what: &str) {
            let x = ArrayD::from_shape_vec(
                IxDyn(&[x.len()]),
                x.iter().map(|&v| E::from_f64(v)).collect(),
            )
            .unwrap();
            let (expected, expected_seen) = cast_reference(&x, scale, format);
            for threads in [1, 3] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let (got, seen) = pool.install(|| scaled_copy(&x, E::from_f32(scale), format));
                let got = got.as_slice().unwrap();
                let at = format!("{what} {} {format} scale {scale} on {threads}", E::NAME);
                assert_eq!(bits(got), bits(&expected), "{at}");
                assert_eq!(seen.counts, expected_seen.counts, "{at}");
                assert_eq!(seen.amax.to_bits(), expected_seen.amax.to_bits(), "{at}");
            }
        }
        let mut seed = 0x2545_F491_4F6C_DD1D_u64;
        let lengths = [
            0,
            1,
            7,
            33,
            BLOCK - 1,
            BLOCK,
            BLOCK + 1,
            3 * BLOCK + 17,
            5 * BLOCK / 2,
        ];
        for (i, &n) in lengths.iter().enumerate() {
            for kinds in [7, 8, 10] {
                let x = values(&mut seed, n, kinds);
                for (format, scale) in [(Format::E4M3, 448.0 / 3.9), (Format::E5M2, 2f32.powi(12))]
                {
                    let what = format!("length {n} (#{i}), {kinds} kinds");
                    check::<f32>(&x, scale, format, &what);
                    check::<f64>(&x, scale, format, &what);
                }
            }
        }
        // A NaN or an infinity in one block only, the last: the blocks' merge carries it.
        let mut x = values(&mut seed, 3 * BLOCK + 5, 7);
        x[3 * BLOCK + 2] = f64::INFINITY;
        check::<f32>(&x, 1.0, Format::E4M3, "an inf in the last block");
        x[3 * BLOCK + 1] = f64::NAN;
        check::<f32>(&x, 1.0, Format::E4M3, "a NaN in the last block");
    }

    #[test]
    fn scaling_in_place_is_the_mapv_it_replaces() {
        let mut seed = 7_u64;
        for n in [5, BLOCK + 3] {
            let x = values(&mut seed, n, 10);
            let a =
                ArrayD::from_shape_vec(IxDyn(&[n]), x.iter().map(|&v| v as f32).collect()).unwrap();
            let factor = (1.0f32 / 448.0) * (1.0 / 57344.0);
            let expected = a.mapv(|v| v * factor);
            let mut got = a.clone();
            scale_in_place(&mut got, factor);
            assert_eq!(
                bits(got.as_slice().unwrap()),
                bits(expected.as_slice().unwrap())
            );
            // A view that is not contiguous takes the element loop.
            let mut t = a.clone().into_shape_with_order(IxDyn(&[1, n])).unwrap();
            t.swap_axes(0, 1);
            scale_in_place(&mut t, factor);
            let t: Vec<f32> = t.iter().copied().collect();
            assert_eq!(bits(&t), bits(expected.as_slice().unwrap()));
        }
    }

    #[test]
    fn a_state_that_is_not_observing_records_nothing() {
        let state = Rc::new(RefCell::new(
            Fp8State::new(Fp8Recipe::default(), 1).unwrap(),
        ));
        let x = Tensor::<f32>::param(tl_tensor::ndarray::arr2(&[[3.0, -5.0]]).into_dyn());
        let w = Tensor::<f32>::param(tl_tensor::ndarray::arr2(&[[0.5], [0.25]]).into_dyn());
        state.borrow_mut().observing = false;
        let _ = fp8_matmul(&x, &w, &state, 0);
        assert_eq!(state.borrow().layers[0].input.pending, 0.0);
        state.borrow_mut().observing = true;
        // Without a graph too (a checkpointed segment's forward pass): recorded.
        let _ = {
            let _off = tl_tensor::no_grad();
            fp8_matmul(&x, &w, &state, 0)
        };
        let layer = &state.borrow().layers[0];
        assert_eq!((layer.input.pending, layer.weight.pending), (5.0, 0.5));
    }
}
