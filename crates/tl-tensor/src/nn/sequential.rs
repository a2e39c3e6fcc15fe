//! [`Sequential`]: layers applied one after another.

use super::Module;
use crate::{Element, Tensor};

/// A chain of layers: the output of each is the input of the next.
///
/// Its parameters are the layers' parameters in layer order, and
/// [`set_training`](Module::set_training) reaches every layer.
///
/// ```
/// use tl_tensor::nn::{Linear, Module, RmsNorm, Sequential};
/// use tl_tensor::{Generator, Tensor};
/// let rng = Generator::new(0);
/// let mut model = Sequential::<f32>::new(vec![Box::new(Linear::new(4, 8, true, &rng))]);
/// model.push(Box::new(RmsNorm::new(8, 1e-5)));
/// model.push(Box::new(Linear::new(8, 2, false, &rng)));
/// assert_eq!(model.forward(&Tensor::ones(&[3, 4])).shape(), vec![3, 2]);
/// assert_eq!(model.num_parameters(), (4 * 8 + 8) + 8 + 8 * 2);
/// ```
pub struct Sequential<E: Element = f32> {
    layers: Vec<Box<dyn Module<E>>>,
}

impl<E: Element> Sequential<E> {
    /// A chain of `layers`, applied in order.
    pub fn new(layers: Vec<Box<dyn Module<E>>>) -> Self {
        Self { layers }
    }

    /// Appends a layer at the end of the chain.
    pub fn push(&mut self, layer: Box<dyn Module<E>>) {
        self.layers.push(layer);
    }

    /// The layers, in order (what `checkpoint_sequential` splits into segments).
    pub fn layers(&self) -> &[Box<dyn Module<E>>] {
        &self.layers
    }

    /// The number of layers.
    pub fn len(&self) -> usize {
        self.layers.len()
    }

    /// Whether the chain has no layers (its forward is then the identity).
    pub fn is_empty(&self) -> bool {
        self.layers.is_empty()
    }
}

impl<E: Element> Default for Sequential<E> {
    fn default() -> Self {
        Self::new(Vec::new())
    }
}

impl<E: Element> Module<E> for Sequential<E> {
    fn forward(&self, x: &Tensor<E>) -> Tensor<E> {
        self.layers
            .iter()
            .fold(x.clone(), |hidden, layer| layer.forward(&hidden))
    }

    fn parameters(&self) -> Vec<Tensor<E>> {
        self.layers
            .iter()
            .flat_map(|layer| layer.parameters())
            .collect()
    }

    fn set_training(&self, training: bool) {
        for layer in &self.layers {
            layer.set_training(training);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Generator;
    use crate::nn::{Dropout, Linear};

    #[test]
    fn layers_run_in_order() {
        // a(x) = 2x + 1 and b(x) = 3x: b(a(1)) = 9, while the wrong order a(b(1)) = 7.
        let a = Linear::from_parts(
            Tensor::<f64>::full(&[1, 1], 2.0),
            Some(Tensor::full(&[1], 1.0)),
        );
        let b = Linear::from_parts(Tensor::<f64>::full(&[1, 1], 3.0), None);
        let model = Sequential::new(vec![Box::new(a), Box::new(b)]);
        assert_eq!(model.forward(&Tensor::ones(&[1, 1])).item(), 9.0);
        assert_eq!(model.len(), 2);
    }

    #[test]
    fn parameters_follow_layer_order() {
        let rng = Generator::new(0);
        let first = Linear::<f32>::new(2, 3, true, &rng);
        let second = Linear::<f32>::new(3, 1, false, &rng);
        let handles = [
            first.weight().clone(),
            first.bias().unwrap().clone(),
            second.weight().clone(),
        ];
        let model = Sequential::new(vec![Box::new(first), Box::new(second)]);
        let parameters = model.parameters();
        assert_eq!(parameters.len(), 3);
        assert!(parameters.iter().zip(&handles).all(|(p, h)| p.same(h)));
    }

    #[test]
    fn set_training_reaches_every_layer() {
        let rng = Generator::new(0);
        let model = Sequential::<f32>::new(vec![Box::new(Dropout::new(0.5, rng.clone()).unwrap())]);
        model.set_training(false);
        let before = rng.state();
        assert_eq!(model.forward(&Tensor::ones(&[8])).to_vec(), vec![1.0; 8]);
        assert_eq!(rng.state(), before);
        assert!(Sequential::<f32>::default().is_empty());
    }
}
