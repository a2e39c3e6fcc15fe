//! Activation layers: the elementwise nonlinearities as [`Module`]s without parameters, so
//! they can sit in a [`Sequential`](super::Sequential).

use super::Module;
use crate::{Element, Tensor};

/// Defines a parameterless activation layer that applies one elementwise tensor op.
macro_rules! activation {
    ($(#[$doc:meta])* $name:ident => $op:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
        pub struct $name;

        impl<E: Element> Module<E> for $name {
            fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
                x.$op()
            }

            fn parameters(&self) -> Vec<Tensor<E>> {
                Vec::new()
            }
        }
    };
}

activation!(
    /// `max(x, 0)`, [`Tensor::relu`].
    Relu => relu
);
activation!(
    /// `x·σ(x)`, [`Tensor::silu`] (the gate of a SwiGLU MLP).
    Silu => silu
);
activation!(
    /// The exact GELU `x·Φ(x)`, [`Tensor::gelu`].
    Gelu => gelu
);
activation!(
    /// `tanh x`, [`Tensor::tanh`].
    Tanh => tanh
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_layer_applies_its_op() {
        let x = Tensor::<f64>::from_vec(vec![-1.0, 0.5], &[2]).unwrap();
        let layers: [(&dyn Module<f64>, Tensor<f64>); 4] = [
            (&Relu, x.relu()),
            (&Silu, x.silu()),
            (&Gelu, x.gelu()),
            (&Tanh, x.tanh()),
        ];
        for (layer, expected) in layers {
            assert_eq!(layer.forward(&x).to_vec(), expected.to_vec());
            assert!(layer.parameters().is_empty());
        }
        // Spot values: relu(−1) = 0, tanh(0.5) = 0.46211715726000974.
        assert_eq!(Relu.forward(&x).to_vec(), vec![0.0, 0.5]);
        assert!(
            (Module::<f64>::forward(&Tanh, &x).to_vec()[1] - 0.462_117_157_260_009_7).abs() < 1e-15
        );
    }
}
