//! The [`Module`] trait: a differentiable function with trainable parameters.

use std::rc::Rc;

use crate::{Element, Tensor};

/// A layer or model: a forward function plus the parameters it learns.
///
/// The trait is object safe, so models are built from `Box<dyn Module<E>>` (see
/// [`Sequential`](super::Sequential)) and generic code takes `&dyn Module<E>`. It is also
/// implemented for `Box<M>`, `&M` and `Rc<M>`, so a shared or borrowed layer can stand in for
/// an owned one.
///
/// ```
/// use tl_tensor::nn::{Linear, Module};
/// use tl_tensor::{Generator, Tensor};
/// let layer = Linear::<f32>::new(3, 2, true, &Generator::new(0));
/// let y = layer.forward(&Tensor::ones(&[4, 3]));
/// assert_eq!(y.shape(), vec![4, 2]);
/// assert_eq!(layer.num_parameters(), 3 * 2 + 2);
/// ```
pub trait Module<E: Element = f32> {
    /// Applies the layer to `x`, recording the graph when grad mode is on.
    fn forward(&self, x: &Tensor<E>) -> Tensor<E>;

    /// The trainable parameters, as handles sharing the layer's storage (an optimizer that
    /// updates them updates the layer). Order is stable from call to call.
    fn parameters(&self) -> Vec<Tensor<E>>;

    /// Switches between training and evaluation behaviour (dropout draws masks only while
    /// training). Layers without such behaviour ignore it; containers pass it on.
    fn set_training(&self, training: bool) {
        let _ = training;
    }

    /// Drops the accumulated gradient of every parameter.
    fn zero_grad(&self) {
        for parameter in self.parameters() {
            parameter.zero_grad();
        }
    }

    /// The number of trainable scalars.
    fn num_parameters(&self) -> usize {
        self.parameters().iter().map(Tensor::numel).sum()
    }
}

/// Implements [`Module`] for a pointer type by delegating every method to the pointee.
macro_rules! delegate_module {
    ($($pointer:ty),*) => {$(
        impl<E: Element, M: Module<E> + ?Sized> Module<E> for $pointer {
            fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
                (**self).forward(x)
            }
            fn parameters(&self) -> Vec<Tensor<E>> {
                (**self).parameters()
            }
            fn set_training(&self, training: bool) {
                (**self).set_training(training);
            }
            fn zero_grad(&self) {
                (**self).zero_grad();
            }
            fn num_parameters(&self) -> usize {
                (**self).num_parameters()
            }
        }
    )*};
}

delegate_module!(Box<M>, &M, Rc<M>);

#[cfg(test)]
mod tests {
    use super::*;
    use ndarray::arr1;

    /// y = w · x with one scalar weight, for exercising the provided methods.
    struct Scale {
        weight: Tensor<f64>,
    }

    impl Module<f64> for Scale {
        fn forward(&self, x: &Tensor<f64>) -> Tensor<f64> {
            x * &self.weight
        }
        fn parameters(&self) -> Vec<Tensor<f64>> {
            vec![self.weight.clone()]
        }
    }

    #[test]
    fn zero_grad_clears_every_parameter() {
        let layer = Scale {
            weight: Tensor::param(arr1(&[2.0]).into_dyn()),
        };
        layer.forward(&Tensor::ones(&[3])).sum_all().backward();
        // d(sum(w·1))/dw = 3
        assert_eq!(layer.weight.grad().unwrap()[[0]], 3.0);
        layer.zero_grad();
        assert!(layer.weight.grad().is_none());
    }

    #[test]
    fn pointers_delegate_to_the_layer() {
        let layer = Rc::new(Scale {
            weight: Tensor::param(arr1(&[2.0]).into_dyn()),
        });
        let boxed: Box<dyn Module<f64>> = Box::new(Rc::clone(&layer));
        let borrowed: &dyn Module<f64> = &*layer;
        let x = Tensor::from_vec(vec![1.5], &[1]).unwrap();
        assert_eq!(boxed.forward(&x).item(), 3.0);
        assert_eq!(borrowed.forward(&x).item(), 3.0);
        assert_eq!(boxed.num_parameters(), 1);
        assert!(boxed.parameters()[0].same(&layer.weight));
    }
}
