//! [`Linear`]: the affine layer `y = x·W + b`.

use ndarray::{ArrayD, IxDyn};

use super::Module;
use crate::{Element, Generator, Tensor};

/// A fully connected layer: `y = x·W + b`, over the last axis of `x`.
///
/// The weight is stored as `[in_features, out_features]`, so the forward pass is a plain
/// `x.matmul(&W)` with no transpose. PyTorch's `nn.Linear` stores the transpose,
/// `[out_features, in_features]`, and computes `x·Wᵀ`; transpose when exchanging weights.
///
/// The product goes through [`Tensor::matmul`], so autocast rounds it like every other
/// matmul.
///
/// ```
/// use tl_tensor::nn::{Linear, Module};
/// use tl_tensor::Tensor;
/// let w = Tensor::<f32>::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3])?;
/// let b = Tensor::<f32>::from_vec(vec![0.5, 0.5, 0.5], &[3])?;
/// let layer = Linear::from_parts(w, Some(b));
/// // [1, 1]·W = [5, 7, 9], plus the bias
/// let y = layer.forward(&Tensor::ones(&[1, 2]));
/// assert_eq!(y.to_vec(), vec![5.5, 7.5, 9.5]);
/// # Ok::<(), tl_tensor::TensorError>(())
/// ```
pub struct Linear<E: Element = f32> {
    weight: Tensor<E>,
    bias: Option<Tensor<E>>,
}

/// `shape` filled with independent draws from U(−bound, bound), row-major.
fn uniform<E: Element>(shape: &[usize], bound: f64, rng: &Generator) -> ArrayD<E> {
    ArrayD::from_shape_simple_fn(IxDyn(shape), || {
        E::from_f64((2.0 * rng.next_f64() - 1.0) * bound)
    })
}

impl<E: Element> Linear<E> {
    /// A layer with PyTorch's default initialisation: weight and bias drawn uniformly from
    /// `±1/sqrt(in_features)` (the weight first, row-major over `[in, out]`, then the bias).
    ///
    /// # Panics
    /// If `in_features` is 0.
    pub fn new(in_features: usize, out_features: usize, bias: bool, rng: &Generator) -> Self {
        assert!(in_features > 0, "Linear::new: in_features must be positive");
        let bound = 1.0 / (in_features as f64).sqrt();
        let shape = [in_features, out_features];
        let weight = Tensor::param_with(&shape, || uniform(&shape, bound, rng));
        let bias = bias
            .then(|| Tensor::param_with(&[out_features], || uniform(&[out_features], bound, rng)));
        Self { weight, bias }
    }

    /// A layer from given tensors: `weight` of shape `[in_features, out_features]` and an
    /// optional `bias` of shape `[out_features]`. They are used as they are: pass
    /// parameters ([`Tensor::param`]) to train them.
    ///
    /// # Panics
    /// If `weight` is not 2-dimensional or `bias` does not match its output size.
    pub fn from_parts(weight: Tensor<E>, bias: Option<Tensor<E>>) -> Self {
        let shape = weight.shape();
        assert_eq!(
            shape.len(),
            2,
            "Linear::from_parts: the weight must be [in_features, out_features], got {shape:?}"
        );
        if let Some(bias) = &bias {
            assert_eq!(
                bias.shape(),
                vec![shape[1]],
                "Linear::from_parts: bias shape {:?} does not fit weight shape {shape:?}",
                bias.shape()
            );
        }
        Self { weight, bias }
    }

    /// The weight, `[in_features, out_features]`.
    pub fn weight(&self) -> &Tensor<E> {
        &self.weight
    }

    /// The bias, `[out_features]`, if the layer has one.
    pub fn bias(&self) -> Option<&Tensor<E>> {
        self.bias.as_ref()
    }

    /// The size of the input's last axis.
    pub fn in_features(&self) -> usize {
        self.weight.shape()[0]
    }

    /// The size of the output's last axis.
    pub fn out_features(&self) -> usize {
        self.weight.shape()[1]
    }
}

impl<E: Element> Module<E> for Linear<E> {
    /// `[.., in_features] → [.., out_features]`, for any number of leading axes (none too).
    ///
    /// Leading axes are folded into the rows of one matrix product (a view, not a copy), so
    /// the weight's gradient comes out of it directly, not summed over a batch of them.
    ///
    /// # Panics
    /// If the last axis of `x` is not `in_features`.
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        let shape = x.shape();
        let (in_features, out_features) = (self.in_features(), self.out_features());
        assert!(
            shape.last() == Some(&in_features),
            "Linear: input shape {shape:?} does not end in in_features = {in_features} \
             (weight shape {:?})",
            self.weight.shape()
        );
        // Leading axes fold into the rows of one product inside `matmul`, without a copy.
        let y = if shape.len() == 1 {
            x.reshape(&[1, in_features])
                .matmul(&self.weight)
                .reshape(&[out_features])
        } else {
            x.matmul(&self.weight)
        };
        match &self.bias {
            Some(bias) => y.add(bias),
            None => y,
        }
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        std::iter::once(self.weight.clone())
            .chain(self.bias.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{GradcheckOptions, check_parameter_gradients, random_array};

    #[test]
    fn init_is_uniform_within_one_over_sqrt_fan_in() {
        let layer = Linear::<f64>::new(16, 32, true, &Generator::new(3));
        let bound = 0.25; // 1/sqrt(16)
        let weight = layer.weight().to_vec();
        assert!(weight.iter().all(|w| w.abs() < bound));
        assert!(
            layer
                .bias()
                .unwrap()
                .to_vec()
                .iter()
                .all(|b| b.abs() < bound)
        );
        // The mean of U(−b, b)² is b²/3.
        let second_moment = weight.iter().map(|w| w * w).sum::<f64>() / weight.len() as f64;
        assert!(
            (second_moment - bound * bound / 3.0).abs() < 0.003,
            "{second_moment}"
        );
        assert!(layer.weight().requires_grad());
    }

    #[test]
    fn leading_axes_are_kept() {
        let layer = Linear::<f32>::new(4, 3, true, &Generator::new(0));
        assert_eq!(
            layer.forward(&Tensor::ones(&[2, 5, 4])).shape(),
            vec![2, 5, 3]
        );
        assert_eq!(layer.forward(&Tensor::ones(&[4])).shape(), vec![3]);
        let batched = layer.forward(&Tensor::ones(&[2, 5, 4])).to_vec();
        let flat = layer.forward(&Tensor::ones(&[10, 4])).to_vec();
        assert_eq!(batched, flat);
    }

    #[test]
    fn without_bias_there_is_one_parameter() {
        let layer = Linear::<f32>::new(4, 3, false, &Generator::new(0));
        assert!(layer.bias().is_none());
        assert_eq!(layer.parameters().len(), 1);
        assert_eq!(layer.num_parameters(), 12);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let rng = Generator::new(1);
        let layer = Linear::<f64>::new(3, 2, true, &rng);
        let input = Tensor::param(random_array(&[2, 2, 3], &rng));
        let mut params = layer.parameters();
        params.push(input.clone());
        let result = check_parameter_gradients(
            || layer.forward(&input),
            &params,
            GradcheckOptions::default(),
        );
        assert!(result.is_ok(), "{}", result.unwrap_err());
    }

    #[test]
    #[should_panic(expected = "Linear: input shape [2, 5] does not end in in_features = 4")]
    fn a_wrong_input_size_names_the_shapes() {
        Linear::<f32>::new(4, 3, true, &Generator::new(0)).forward(&Tensor::ones(&[2, 5]));
    }

    #[test]
    #[should_panic(expected = "bias shape [2] does not fit weight shape [4, 3]")]
    fn from_parts_checks_the_bias() {
        Linear::<f32>::from_parts(Tensor::zeros(&[4, 3]), Some(Tensor::zeros(&[2])));
    }
}
