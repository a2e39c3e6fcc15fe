//! [`AdamW`]: Adam with decoupled weight decay (Loshchilov & Hutter, 2019).

use ndarray::ArrayD;
use serde::{Deserialize, Serialize};

use super::{Optimizer, assert_learning_rate, check_non_negative, check_shapes, restore};
use crate::kernels::adamw::{AdamWStep, update_arrays};
use crate::{Element, Result, Tensor, TensorError};

/// Adam with decoupled weight decay, as `torch.optim.AdamW` (non-amsgrad, single-tensor).
///
/// For a parameter `p` with gradient `g` at its `t`-th step:
///
/// ```text
/// p ← p · (1 − lr·wd)                      decoupled weight decay, before the Adam update
/// m ← m + (1 − β1)·(g − m)                 = β1·m + (1 − β1)·g, as torch's lerp
/// v ← v·β2 + (1 − β2)·g·g
/// denom = sqrt(v) / sqrt(1 − β2^t) + eps
/// p ← p − lr/(1 − β1^t) · m / denom
/// ```
///
/// The scalar coefficients (`1 − lr·wd`, the bias corrections, the step size) are computed
/// in `f64` and rounded once to `E`; everything elementwise runs in `E`, one operation at a
/// time in the order above, as PyTorch's kernels do in `f32` (its vectorised CPU lerp fuses
/// a multiply-add, which this does not). The moments are kept in `E` too — the `f32`
/// "master" state of mixed-precision training. Each parameter counts its own steps from its
/// first gradient, as in PyTorch.
///
/// ```
/// use tl_tensor::optim::{AdamW, Optimizer};
/// use tl_tensor::Tensor;
/// let w = Tensor::<f64>::param(ndarray::arr1(&[1.0]).into_dyn());
/// let mut opt = AdamW::new(vec![w.clone()], 0.1)?.with_weight_decay(0.0)?;
/// w.set_grad(Some(ndarray::arr1(&[0.5]).into_dyn()));
/// opt.step(); // first step: m̂ = g, v̂ = g², so w = 1 − 0.1·0.5/(0.5 + 1e-8)
/// assert!((w.item() - (1.0 - 0.05 / (0.5 + 1e-8))).abs() < 1e-15);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub struct AdamW<E: Element = f32> {
    parameters: Vec<Tensor<E>>,
    lr: f64,
    betas: (f64, f64),
    eps: f64,
    weight_decay: f64,
    states: Vec<Option<Moments<E>>>,
}

/// The running moments of one parameter; tensors so the memory meter counts them.
struct Moments<E: Element> {
    step: u64,
    exp_avg: Tensor<E>,
    exp_avg_sq: Tensor<E>,
}

/// One parameter's moments as [`AdamW::moments`] shares them: handles on the optimizer's
/// own tensors, not copies.
#[derive(Clone)]
pub struct SharedMoments<E: Element> {
    /// Steps taken with a gradient (the `t` of the bias corrections).
    pub step: u64,
    /// First moment `m`.
    pub exp_avg: Tensor<E>,
    /// Second moment `v`.
    pub exp_avg_sq: Tensor<E>,
}

/// A snapshot of an [`AdamW`]: hyperparameters and each parameter's step count and moments,
/// serializable.
///
/// Moments are stored as `f64` (exact for `f32` and `f64` elements), so loading a saved state
/// continues bit for bit. Through JSON, `f32` values always survive; `f64` values need a
/// parser that round-trips floats exactly (serde_json's `float_roundtrip` feature).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWState {
    /// Learning rate.
    pub lr: f64,
    /// Decay rates of the first and second moments.
    pub betas: (f64, f64),
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// The shape of each parameter, to check the state fits.
    pub shapes: Vec<Vec<usize>>,
    /// Each parameter's state, `None` before its first step.
    pub params: Vec<Option<AdamWParamState>>,
}

/// The saved state of one parameter in an [`AdamWState`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdamWParamState {
    /// Steps taken with a gradient (the `t` of the bias corrections).
    pub step: u64,
    /// First moment `m`, row-major.
    pub exp_avg: Vec<f64>,
    /// Second moment `v`, row-major.
    pub exp_avg_sq: Vec<f64>,
}

/// Checks that a decay rate is in `[0, 1)`.
fn check_beta(name: &'static str, beta: f64) -> Result<f64> {
    if (0.0..1.0).contains(&beta) {
        Ok(beta)
    } else {
        Err(TensorError::InvalidArgument {
            name,
            value: beta.to_string(),
            reason: "must be in [0, 1)".into(),
        })
    }
}

impl<E: Element> AdamW<E> {
    /// AdamW on `parameters` with learning rate `lr` and PyTorch's defaults: betas
    /// (0.9, 0.999), eps 1e-8, weight decay 0.01.
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] if `lr` is negative or not finite.
    pub fn new(parameters: Vec<Tensor<E>>, lr: f64) -> Result<Self> {
        let states = parameters.iter().map(|_| None).collect();
        Ok(Self {
            parameters,
            lr: check_non_negative("learning rate", lr)?,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            states,
        })
    }

    /// Sets the moment decay rates `(β1, β2)`.
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] unless both are in `[0, 1)`.
    pub fn with_betas(mut self, beta1: f64, beta2: f64) -> Result<Self> {
        self.betas = (check_beta("beta1", beta1)?, check_beta("beta2", beta2)?);
        Ok(self)
    }

    /// Sets the constant added to the denominator.
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] if `eps` is negative or not finite.
    pub fn with_eps(mut self, eps: f64) -> Result<Self> {
        self.eps = check_non_negative("eps", eps)?;
        Ok(self)
    }

    /// Sets the decoupled weight decay.
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] if `weight_decay` is negative or not finite.
    pub fn with_weight_decay(mut self, weight_decay: f64) -> Result<Self> {
        self.weight_decay = check_non_negative("weight decay", weight_decay)?;
        Ok(self)
    }

    /// The moment decay rates `(β1, β2)`.
    pub fn betas(&self) -> (f64, f64) {
        self.betas
    }

    /// The constant added to the denominator.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// The decoupled weight decay.
    pub fn weight_decay(&self) -> f64 {
        self.weight_decay
    }

    /// Each parameter's step count and moments, shared with the optimizer
    /// rather than copied (a [`Tensor`] clone is a handle); `None` before its first step.
    ///
    /// What a checkpoint writer streams to disk: [`AdamW::state_dict`] copies every moment
    /// into `f64`, four times the optimizer's own memory for `f32` moments.
    pub fn moments(&self) -> Vec<Option<SharedMoments<E>>> {
        self.states
            .iter()
            .map(|state| {
                state.as_ref().map(|moments| SharedMoments {
                    step: moments.step,
                    exp_avg: moments.exp_avg.clone(),
                    exp_avg_sq: moments.exp_avg_sq.clone(),
                })
            })
            .collect()
    }

    /// The hyperparameters, step counts and moments, to save.
    pub fn state_dict(&self) -> AdamWState {
        let to_f64 = |t: &Tensor<E>| t.to_vec().into_iter().map(Element::to_f64).collect();
        AdamWState {
            lr: self.lr,
            betas: self.betas,
            eps: self.eps,
            weight_decay: self.weight_decay,
            shapes: self.parameters.iter().map(Tensor::shape).collect(),
            params: self
                .states
                .iter()
                .map(|state| {
                    state.as_ref().map(|moments| AdamWParamState {
                        step: moments.step,
                        exp_avg: to_f64(&moments.exp_avg),
                        exp_avg_sq: to_f64(&moments.exp_avg_sq),
                    })
                })
                .collect(),
        }
    }

    /// Restores a saved state: hyperparameters, step counts and moments.
    ///
    /// # Errors
    /// [`TensorError::StateMismatch`] if the state is for a different number of parameters,
    /// different shapes, or a moment has the wrong length; [`TensorError::InvalidArgument`]
    /// for an invalid hyperparameter. On error nothing changes.
    pub fn load_state_dict(&mut self, state: AdamWState) -> Result<()> {
        check_shapes("AdamW state", &self.parameters, &state.shapes)?;
        if state.params.len() != self.parameters.len() {
            return Err(TensorError::StateMismatch {
                what: "AdamW state",
                parameter: None,
                expected: format!("{} parameter states", self.parameters.len()),
                found: format!("{} parameter states", state.params.len()),
            });
        }
        let lr = check_non_negative("learning rate", state.lr)?;
        let betas = (
            check_beta("beta1", state.betas.0)?,
            check_beta("beta2", state.betas.1)?,
        );
        let eps = check_non_negative("eps", state.eps)?;
        let weight_decay = check_non_negative("weight decay", state.weight_decay)?;
        let mut states = Vec::with_capacity(self.parameters.len());
        for (index, (saved, shape)) in state.params.into_iter().zip(&state.shapes).enumerate() {
            states.push(match saved {
                None => None,
                Some(saved) => Some(Moments {
                    step: saved.step,
                    exp_avg: Tensor::from_array(restore(index, saved.exp_avg, shape)?),
                    exp_avg_sq: Tensor::from_array(restore(index, saved.exp_avg_sq, shape)?),
                }),
            });
        }
        (self.lr, self.betas, self.eps, self.weight_decay) = (lr, betas, eps, weight_decay);
        self.states = states;
        Ok(())
    }

    /// Restores parameter `index`'s step count and moments, taking the arrays as they are
    /// (no copy): [`AdamW::load_state_dict`] one parameter at a time, for a checkpoint read
    /// tensor by tensor. The hyperparameters are left as they are ([`AdamW::with_betas`]
    /// and the others set them).
    ///
    /// # Errors
    /// [`TensorError::StateMismatch`] if there is no parameter `index` or a moment's shape
    /// is not the parameter's. On error nothing changes.
    pub fn load_moments(
        &mut self,
        index: usize,
        step: u64,
        exp_avg: ArrayD<E>,
        exp_avg_sq: ArrayD<E>,
    ) -> Result<()> {
        let Some(parameter) = self.parameters.get(index) else {
            return Err(TensorError::StateMismatch {
                what: "AdamW moments",
                parameter: Some(index),
                expected: format!("at most {} parameters", self.parameters.len()),
                found: format!("parameter {index}"),
            });
        };
        for moment in [&exp_avg, &exp_avg_sq] {
            if moment.shape() != parameter.shape().as_slice() {
                return Err(TensorError::StateMismatch {
                    what: "AdamW moments",
                    parameter: Some(index),
                    expected: format!("shape {:?}", parameter.shape()),
                    found: format!("shape {:?}", moment.shape()),
                });
            }
        }
        self.states[index] = Some(Moments {
            step,
            exp_avg: Tensor::from_array(exp_avg),
            exp_avg_sq: Tensor::from_array(exp_avg_sq),
        });
        Ok(())
    }

    /// Sets the learning rate, moment decay rates, epsilon and weight decay together, as
    /// a saved state holds them.
    ///
    /// # Errors
    /// [`TensorError::InvalidArgument`] for a value out of its range; on error nothing
    /// changes.
    pub fn load_hyperparameters(
        &mut self,
        lr: f64,
        betas: (f64, f64),
        eps: f64,
        weight_decay: f64,
    ) -> Result<()> {
        let lr = check_non_negative("learning rate", lr)?;
        let betas = (check_beta("beta1", betas.0)?, check_beta("beta2", betas.1)?);
        let eps = check_non_negative("eps", eps)?;
        let weight_decay = check_non_negative("weight decay", weight_decay)?;
        (self.lr, self.betas, self.eps, self.weight_decay) = (lr, betas, eps, weight_decay);
        Ok(())
    }

    /// One AdamW update of `parameter` from `grad`, advancing its moments.
    fn update(&self, parameter: &Tensor<E>, grad: &ArrayD<E>, moments: &Moments<E>) {
        let step = AdamWStep::new(
            self.lr,
            self.betas,
            self.eps,
            self.weight_decay,
            moments.step,
        );
        parameter.update_value(|p| {
            moments.exp_avg.update_value(|m| {
                moments
                    .exp_avg_sq
                    .update_value(|v| update_arrays(&step, p, m, v, grad))
            })
        });
    }
}

impl<E: Element> Optimizer<E> for AdamW<E> {
    fn step(&mut self) {
        let mut states = std::mem::take(&mut self.states);
        for (parameter, state) in self.parameters.iter().zip(&mut states) {
            // A meta step makes the moments as a real one does, and updates nothing.
            let meta = parameter.is_meta() || parameter.grad_is_meta();
            let shape = parameter.shape();
            let moment = || {
                let _state = super::state_scope(parameter);
                match meta {
                    true => Tensor::meta(&shape),
                    false => Tensor::zeros(&shape),
                }
            };
            parameter.with_grad(|grad| {
                let Some(grad) = grad else { return };
                let moments = state.get_or_insert_with(|| Moments {
                    step: 0,
                    exp_avg: moment(),
                    exp_avg_sq: moment(),
                });
                moments.step += 1;
                if !meta && !moments.exp_avg.is_meta() {
                    self.update(parameter, grad, moments);
                }
            });
        }
        self.states = states;
    }

    fn parameters(&self) -> &[Tensor<E>] {
        &self.parameters
    }

    fn learning_rate(&self) -> f64 {
        self.lr
    }

    fn set_learning_rate(&mut self, lr: f64) {
        assert_learning_rate(lr);
        self.lr = lr;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::elementwise::PARALLEL_MIN_LEN;
    use ndarray::arr1;

    fn param(values: &[f64]) -> Tensor<f64> {
        Tensor::param(arr1(values).into_dyn())
    }

    #[test]
    fn a_constant_gradient_moves_lr_per_step() {
        // With g constant, m̂ = g and v̂ = g² at every step (the bias corrections divide out
        // exactly what the zero start left), so each update is lr·g/(|g| + eps):
        // 0.1·0.5/(0.5 + 1e-8) = 0.099999998…; weight decay 0.01 first scales p by 0.999.
        let p = param(&[1.0]);
        let mut opt = AdamW::new(vec![p.clone()], 0.1).unwrap();
        let update = 0.1 * 0.5 / (0.5 + 1e-8);
        let mut expected = 1.0;
        for _ in 0..3 {
            p.set_grad(Some(arr1(&[0.5]).into_dyn()));
            opt.step();
            expected = expected * 0.999 - update;
            assert!(
                (p.item() - expected).abs() < 1e-14,
                "{} vs {expected}",
                p.item()
            );
        }
        // 1·0.999 − 0.099999998 = 0.899000002 after the first step, as by hand.
        assert!(((1.0 * 0.999 - update) - 0.899_000_002).abs() < 1e-15);
    }

    /// Textbook AdamW in f64, written independently of the implementation's operation order.
    fn reference(grads: &[[f64; 2]], lr: f64, wd: f64) -> [f64; 2] {
        let (beta1, beta2, eps) = (0.8, 0.99, 1e-6);
        let mut p = [0.5, -1.0];
        let (mut m, mut v) = ([0.0; 2], [0.0; 2]);
        for (t, g) in grads.iter().enumerate() {
            let t = (t + 1) as i32;
            for i in 0..2 {
                p[i] -= lr * wd * p[i];
                m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
                v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
                let m_hat = m[i] / (1.0 - beta1.powi(t));
                let v_hat = v[i] / (1.0 - beta2.powi(t));
                p[i] -= lr * m_hat / (v_hat.sqrt() + eps);
            }
        }
        p
    }

    fn run<E: Element>(grads: &[[f64; 2]], lr: f64, wd: f64) -> Vec<f64> {
        let p = Tensor::<E>::param(arr1(&[E::from_f64(0.5), E::from_f64(-1.0)]).into_dyn());
        let mut opt = AdamW::new(vec![p.clone()], lr)
            .and_then(|o| o.with_betas(0.8, 0.99))
            .and_then(|o| o.with_eps(1e-6))
            .and_then(|o| o.with_weight_decay(wd))
            .unwrap();
        for g in grads {
            p.set_grad(Some(
                arr1(&[E::from_f64(g[0]), E::from_f64(g[1])]).into_dyn(),
            ));
            opt.step();
        }
        p.to_vec().into_iter().map(Element::to_f64).collect()
    }

    #[test]
    fn varying_gradients_match_the_textbook_formula() {
        let grads = [
            [0.5, -0.2],
            [-1.5, 0.1],
            [0.25, 3.0],
            [0.0, -0.7],
            [2.0, 0.05],
        ];
        let expected = reference(&grads, 0.05, 0.1);
        let in_f64 = run::<f64>(&grads, 0.05, 0.1);
        let in_f32 = run::<f32>(&grads, 0.05, 0.1);
        for i in 0..2 {
            assert!(
                (in_f64[i] - expected[i]).abs() < 1e-14,
                "{in_f64:?} vs {expected:?}"
            );
            assert!(
                (in_f32[i] - expected[i]).abs() < 1e-6,
                "{in_f32:?} vs {expected:?}"
            );
        }
    }

    #[test]
    fn parameters_count_their_own_steps() {
        // The second parameter gets its first gradient at the optimizer's second step: its
        // update must be the first-step update lr·g/(|g| + eps), not a bias-corrected later one.
        let (a, b) = (param(&[0.0]), param(&[0.0]));
        let mut opt = AdamW::new(vec![a.clone(), b.clone()], 0.1)
            .unwrap()
            .with_weight_decay(0.0)
            .unwrap();
        a.set_grad(Some(arr1(&[1.0]).into_dyn()));
        opt.step();
        assert_eq!(b.item(), 0.0);
        b.set_grad(Some(arr1(&[1.0]).into_dyn()));
        opt.step();
        assert!((b.item() + 0.1 / (1.0 + 1e-8)).abs() < 1e-15);
        let state = opt.state_dict();
        assert_eq!(state.params[0].as_ref().unwrap().step, 2);
        assert_eq!(state.params[1].as_ref().unwrap().step, 1);
    }

    #[test]
    fn invalid_hyperparameters_are_rejected() {
        let fresh = || AdamW::<f32>::new(vec![], 1e-3).unwrap();
        assert!(AdamW::<f32>::new(vec![], -1.0).is_err());
        assert!(fresh().with_betas(1.0, 0.999).is_err());
        assert!(fresh().with_betas(0.9, -0.1).is_err());
        assert!(fresh().with_betas(0.9, f64::NAN).is_err());
        assert!(fresh().with_eps(-1e-8).is_err());
        assert!(fresh().with_weight_decay(f64::INFINITY).is_err());
        let opt = fresh().with_betas(0.0, 0.5).unwrap();
        assert_eq!(
            (opt.betas(), opt.eps(), opt.weight_decay()),
            ((0.0, 0.5), 1e-8, 0.01)
        );
    }

    #[test]
    fn a_mismatched_state_is_rejected_and_changes_nothing() {
        let p = param(&[1.0, 2.0]);
        let mut opt = AdamW::new(vec![p.clone()], 0.1).unwrap();
        p.set_grad(Some(arr1(&[1.0, -1.0]).into_dyn()));
        opt.step();
        let before = opt.state_dict();
        let mut other_count = before.clone();
        other_count.shapes.push(vec![2]);
        other_count.params.push(None);
        let mut other_shape = before.clone();
        other_shape.shapes = vec![vec![1, 2]];
        let mut short_moment = before.clone();
        short_moment.params[0].as_mut().unwrap().exp_avg.pop();
        for state in [other_count, other_shape, short_moment] {
            assert!(matches!(
                opt.load_state_dict(state),
                Err(TensorError::StateMismatch { .. })
            ));
        }
        let mut bad_beta = before.clone();
        bad_beta.betas.0 = 1.5;
        assert!(matches!(
            opt.load_state_dict(bad_beta),
            Err(TensorError::InvalidArgument { .. })
        ));
        assert_eq!(opt.state_dict(), before);
    }

    /// A parameter stored column-major (not ndarray's standard layout, so not one slice in
    /// index order) takes the element-by-element path, and gets the bits a row-major one
    /// gets from the same gradients.
    #[test]
    fn a_column_major_parameter_is_updated_as_a_row_major_one() {
        use crate::Generator;
        use crate::testing::random_array;
        use ndarray::ShapeBuilder;

        let rng = Generator::new(7);
        let start = random_array(&[3, 5], &rng).mapv(|x| x as f32);
        let column_major = ArrayD::from_shape_vec(
            ndarray::IxDyn(&[3, 5]).f(),
            start.t().iter().copied().collect(),
        )
        .unwrap();
        assert_eq!(column_major, start);
        assert!(column_major.as_slice().is_none(), "not in standard layout");
        let before: Vec<u32> = start.iter().map(|x| x.to_bits()).collect();
        let params = [start, column_major].map(Tensor::param);
        let mut opt = AdamW::new(params.to_vec(), 1e-2)
            .and_then(|o| o.with_weight_decay(0.1))
            .unwrap();
        for _ in 0..3 {
            let grad = random_array(&[3, 5], &rng).mapv(|x| x as f32 * 1e-3);
            params.iter().for_each(|p| p.set_grad(Some(grad.clone())));
            opt.step();
        }
        let [row, column] =
            params.map(|p| p.value().iter().map(|x| x.to_bits()).collect::<Vec<_>>());
        assert_eq!(row, column);
        assert_ne!(row, before, "the steps moved the values");
    }

    /// A parameter large enough to be updated on the pool gets, value for value, the bits
    /// that the same values get as small parameters updated on the calling thread, on 1 and
    /// 3 threads, through steps with and without weight decay.
    #[test]
    fn a_large_parameter_updated_on_the_pool_matches_small_ones_updated_in_turn() {
        use crate::Generator;
        use crate::testing::random_array;

        let len = PARALLEL_MIN_LEN + 7;
        let rng = Generator::new(38);
        let start = random_array(&[len], &rng).mapv(|x| x as f32);
        let grads: Vec<ArrayD<f32>> = (0..3)
            .map(|_| random_array(&[len], &rng).mapv(|x| x as f32 * 1e-3))
            .collect();
        let chunk = 1000;
        assert!(chunk < PARALLEL_MIN_LEN);
        // Tensors stay on the thread that made them: the whole run happens on the pool.
        let run = |starts: Vec<ArrayD<f32>>, threads: usize, wd: f64| {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .build()
                .unwrap();
            pool.install(|| {
                let params: Vec<Tensor<f32>> = starts.into_iter().map(Tensor::param).collect();
                let mut opt = AdamW::new(params.clone(), 1e-2)
                    .and_then(|o| o.with_weight_decay(wd))
                    .unwrap();
                for g in &grads {
                    let flat = g.as_slice().unwrap();
                    let mut offset = 0;
                    for p in &params {
                        let n = p.shape().iter().product::<usize>();
                        let part = flat[offset..offset + n].to_vec();
                        p.set_grad(Some(ArrayD::from_shape_vec(vec![n], part).unwrap()));
                        offset += n;
                    }
                    opt.step();
                }
                params
                    .iter()
                    .flat_map(|p| p.to_vec())
                    .map(f32::to_bits)
                    .collect::<Vec<_>>()
            })
        };
        let flat = start.as_slice().unwrap();
        for wd in [0.0, 0.1] {
            let small = flat.chunks(chunk).map(|c| arr1(c).into_dyn()).collect();
            let expected = run(small, 1, wd);
            for threads in [1, 3] {
                let large = vec![start.clone()];
                assert_eq!(
                    run(large, threads, wd),
                    expected,
                    "{threads} threads, wd {wd}"
                );
            }
        }
    }
}
