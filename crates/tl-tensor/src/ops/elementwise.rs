//! Elementwise arithmetic with broadcasting: `+ - * /`, negation, and scalar forms.
//!
//! Operators work on references and on owned tensors: `&a + &b`, `a * 2.0`, `2.0 * &a`.

use std::ops::{Add, Div, Mul, Neg, Sub};

use ndarray::{ArrayD, IxDyn, Zip};
use rayon::prelude::*;

use super::{broadcast_shape, unbroadcast};
use crate::{Element, Tensor};

impl<E: Element> Tensor<E> {
    /// `self + rhs`, broadcasting. d/dlhs = 1, d/drhs = 1.
    ///
    /// # Panics
    /// If the shapes do not broadcast.
    pub fn add(&self, rhs: &Tensor<E>) -> Tensor<E> {
        let (lhs_shape, rhs_shape) = (self.shape(), rhs.shape());
        let shape = broadcast_shape("add", &lhs_shape, &rhs_shape);
        let value = || binary_elementwise(&self.value(), &rhs.value(), |a, b| a + b, |a, b| a + b);
        Tensor::from_op_shaped(&shape, value, &[self, rhs], move |grad| {
            // Both parents receive the gradient: one gets a copy (on the pool if large).
            vec![
                Some(unbroadcast(map_elementwise(&grad, |g| g), &lhs_shape)),
                Some(unbroadcast(grad, &rhs_shape)),
            ]
        })
    }

    /// `self - rhs`, broadcasting. d/dlhs = 1, d/drhs = −1.
    ///
    /// # Panics
    /// If the shapes do not broadcast.
    pub fn sub(&self, rhs: &Tensor<E>) -> Tensor<E> {
        let (lhs_shape, rhs_shape) = (self.shape(), rhs.shape());
        let shape = broadcast_shape("sub", &lhs_shape, &rhs_shape);
        let value = || binary_elementwise(&self.value(), &rhs.value(), |a, b| a - b, |a, b| a - b);
        Tensor::from_op_shaped(&shape, value, &[self, rhs], move |grad| {
            let neg = grad.mapv(|g| -g);
            vec![
                Some(unbroadcast(grad, &lhs_shape)),
                Some(unbroadcast(neg, &rhs_shape)),
            ]
        })
    }

    /// `self * rhs` elementwise, broadcasting. d/dlhs = rhs, d/drhs = lhs.
    ///
    /// # Panics
    /// If the shapes do not broadcast.
    pub fn mul(&self, rhs: &Tensor<E>) -> Tensor<E> {
        let shape = broadcast_shape("mul", &self.shape(), &rhs.shape());
        let value = || binary_elementwise(&self.value(), &rhs.value(), |a, b| a * b, |a, b| a * b);
        let (lhs_saved, rhs_saved) = (self.clone(), rhs.clone());
        Tensor::from_op_shaped(&shape, value, &[self, rhs], move |grad| {
            let lhs_grad = lhs_saved
                .requires_grad()
                .then(|| unbroadcast(&grad * &*rhs_saved.value(), &lhs_saved.shape()));
            let rhs_grad = rhs_saved
                .requires_grad()
                .then(|| unbroadcast(&grad * &*lhs_saved.value(), &rhs_saved.shape()));
            vec![lhs_grad, rhs_grad]
        })
    }

    /// `self / rhs` elementwise, broadcasting. d/dlhs = 1/rhs, d/drhs = −lhs/rhs².
    ///
    /// # Panics
    /// If the shapes do not broadcast.
    pub fn div(&self, rhs: &Tensor<E>) -> Tensor<E> {
        let shape = broadcast_shape("div", &self.shape(), &rhs.shape());
        let value = || &*self.value() / &*rhs.value();
        let (lhs_saved, rhs_saved) = (self.clone(), rhs.clone());
        Tensor::from_op_shaped(&shape, value, &[self, rhs], move |grad| {
            let rhs_value = rhs_saved.value();
            let lhs_grad = lhs_saved
                .requires_grad()
                .then(|| unbroadcast(&grad / &*rhs_value, &lhs_saved.shape()));
            let rhs_grad = rhs_saved.requires_grad().then(|| {
                let lhs_value = lhs_saved.value();
                let quotient = &*lhs_value / &*rhs_value;
                let scaled = (&grad * &quotient) / &*rhs_value;
                unbroadcast(scaled.mapv(|g| -g), &rhs_saved.shape())
            });
            vec![lhs_grad, rhs_grad]
        })
    }

    /// `−self`.
    pub fn neg(&self) -> Tensor<E> {
        let value = || self.value().mapv(|x| -x);
        Tensor::from_op_shaped(&self.shape(), value, &[self], |grad| {
            vec![Some(grad.mapv(|g| -g))]
        })
    }

    /// `self + c` for a scalar `c`.
    pub fn add_scalar(&self, c: E) -> Tensor<E> {
        let value = || self.value().mapv(|x| x + c);
        Tensor::from_op_shaped(&self.shape(), value, &[self], |grad| vec![Some(grad)])
    }

    /// `self · c` for a scalar `c`. d/dself = c.
    pub fn mul_scalar(&self, c: E) -> Tensor<E> {
        let value = || self.value().mapv(|x| x * c);
        Tensor::from_op_shaped(&self.shape(), value, &[self], move |grad| {
            vec![Some(grad.mapv(|g| g * c))]
        })
    }

    /// `self / c` for a scalar `c`. d/dself = 1/c.
    pub fn div_scalar(&self, c: E) -> Tensor<E> {
        let value = || self.value().mapv(|x| x / c);
        Tensor::from_op_shaped(&self.shape(), value, &[self], move |grad| {
            vec![Some(grad.mapv(|g| g / c))]
        })
    }

    /// `c − self` for a scalar `c`.
    pub fn rsub_scalar(&self, c: E) -> Tensor<E> {
        let value = || self.value().mapv(|x| c - x);
        Tensor::from_op_shaped(&self.shape(), value, &[self], |grad| {
            vec![Some(grad.mapv(|g| -g))]
        })
    }

    /// An elementwise function `f` with derivative `df` (both of the input value): the
    /// building block of the unary ops. Saves the input for backward.
    pub fn map_with_derivative(
        &self,
        f: impl Fn(E) -> E + Send + Sync,
        df: impl Fn(E) -> E + Send + Sync + 'static,
    ) -> Tensor<E> {
        let value = || map_elementwise(&self.value(), f);
        let saved = self.clone();
        Tensor::from_op_shaped(&self.shape(), value, &[self], move |mut grad| {
            scale_elementwise(&mut grad, &saved.value(), df);
            vec![Some(grad)]
        })
    }
}

/// Arrays at least this long are mapped on the rayon pool; shorter ones are not worth the
/// hand-off. Public so that elementwise ops written outside this crate (the model's rotary
/// embedding) split where the library's own do.
pub const PARALLEL_MIN_LEN: usize = 1 << 15;

/// `len` zeros, written on the rayon pool when there are many: the output buffer of a
/// kernel that then writes it in parallel. `vec![0; len]` clears a reused block (the
/// caching allocator's, or `calloc`'s) on the calling thread alone while the others wait.
///
/// ```
/// use tl_tensor::ops::elementwise::zeros_on_pool;
/// assert_eq!(zeros_on_pool::<f32>(3), [0.0; 3]);
/// assert!(zeros_on_pool::<f64>(100_000).iter().all(|&x| x.to_bits() == 0));
/// ```
pub fn zeros_on_pool<E: Element>(len: usize) -> Vec<E> {
    if len < PARALLEL_MIN_LEN {
        return vec![E::zero(); len];
    }
    let mut zeros = Vec::with_capacity(len);
    zeros.spare_capacity_mut()[..len]
        .par_chunks_mut(PARALLEL_MIN_LEN)
        .for_each(|chunk| {
            for x in chunk {
                x.write(E::zero());
            }
        });
    // SAFETY: the first `len` elements were all written just above.
    unsafe { zeros.set_len(len) };
    zeros
}

/// [`zeros_on_pool`] of a shape.
pub fn zeros_array_on_pool<E: Element>(shape: &[usize]) -> ArrayD<E> {
    let zeros = zeros_on_pool(shape.iter().product());
    ArrayD::from_shape_vec(IxDyn(shape), zeros).expect("the shape's element count")
}

/// `f` of every element, in a new array. Large arrays are split over the rayon pool; each
/// element is computed alone, so the bits do not depend on the split.
pub(crate) fn map_elementwise<E: Element>(
    x: &ArrayD<E>,
    f: impl Fn(E) -> E + Send + Sync,
) -> ArrayD<E> {
    if x.len() >= PARALLEL_MIN_LEN {
        Zip::from(x).par_map_collect(|&v| f(v))
    } else {
        x.mapv(f)
    }
}

/// `f(a, b)` of every pair of elements, in a new array: split over the rayon pool when the
/// shapes are equal and the arrays large, else `broadcasting(a, b)` (ndarray's operator,
/// which broadcasts). Each element is computed alone, so the bits do not depend on the path.
fn binary_elementwise<E: Element>(
    a: &ArrayD<E>,
    b: &ArrayD<E>,
    f: impl Fn(E, E) -> E + Send + Sync,
    broadcasting: impl FnOnce(&ArrayD<E>, &ArrayD<E>) -> ArrayD<E>,
) -> ArrayD<E> {
    if a.shape() == b.shape() && a.len() >= PARALLEL_MIN_LEN {
        Zip::from(a).and(b).par_map_collect(|&a, &b| f(a, b))
    } else {
        broadcasting(a, b)
    }
}

/// `grad ← grad · df(x)` elementwise, on the rayon pool for large arrays.
pub(crate) fn scale_elementwise<E: Element>(
    grad: &mut ArrayD<E>,
    x: &ArrayD<E>,
    df: impl Fn(E) -> E + Send + Sync,
) {
    let zip = Zip::from(grad).and(x);
    if x.len() >= PARALLEL_MIN_LEN {
        zip.par_for_each(|g, &v| *g *= df(v));
    } else {
        zip.for_each(|g, &v| *g *= df(v));
    }
}

/// Implements a binary operator for every pairing of owned and borrowed tensors.
macro_rules! tensor_binary_operator {
    ($trait:ident, $method:ident) => {
        impl<E: Element> $trait<&Tensor<E>> for &Tensor<E> {
            type Output = Tensor<E>;
            fn $method(self, rhs: &Tensor<E>) -> Tensor<E> {
                Tensor::$method(self, rhs)
            }
        }
        impl<E: Element> $trait<Tensor<E>> for Tensor<E> {
            type Output = Tensor<E>;
            fn $method(self, rhs: Tensor<E>) -> Tensor<E> {
                Tensor::$method(&self, &rhs)
            }
        }
        impl<E: Element> $trait<&Tensor<E>> for Tensor<E> {
            type Output = Tensor<E>;
            fn $method(self, rhs: &Tensor<E>) -> Tensor<E> {
                Tensor::$method(&self, rhs)
            }
        }
        impl<E: Element> $trait<Tensor<E>> for &Tensor<E> {
            type Output = Tensor<E>;
            fn $method(self, rhs: Tensor<E>) -> Tensor<E> {
                Tensor::$method(self, &rhs)
            }
        }
    };
}

tensor_binary_operator!(Add, add);
tensor_binary_operator!(Sub, sub);
tensor_binary_operator!(Mul, mul);
tensor_binary_operator!(Div, div);

/// Implements `tensor op scalar` and `scalar op tensor` for one element type.
macro_rules! tensor_scalar_operators {
    ($elem:ty) => {
        impl Add<$elem> for &Tensor<$elem> {
            type Output = Tensor<$elem>;
            fn add(self, c: $elem) -> Tensor<$elem> {
                self.add_scalar(c)
            }
        }
        impl Add<$elem> for Tensor<$elem> {
            type Output = Tensor<$elem>;
            fn add(self, c: $elem) -> Tensor<$elem> {
                self.add_scalar(c)
            }
        }
        impl Sub<$elem> for &Tensor<$elem> {
            type Output = Tensor<$elem>;
            fn sub(self, c: $elem) -> Tensor<$elem> {
                self.add_scalar(-c)
            }
        }
        impl Sub<$elem> for Tensor<$elem> {
            type Output = Tensor<$elem>;
            fn sub(self, c: $elem) -> Tensor<$elem> {
                self.add_scalar(-c)
            }
        }
        impl Mul<$elem> for &Tensor<$elem> {
            type Output = Tensor<$elem>;
            fn mul(self, c: $elem) -> Tensor<$elem> {
                self.mul_scalar(c)
            }
        }
        impl Mul<$elem> for Tensor<$elem> {
            type Output = Tensor<$elem>;
            fn mul(self, c: $elem) -> Tensor<$elem> {
                self.mul_scalar(c)
            }
        }
        impl Div<$elem> for &Tensor<$elem> {
            type Output = Tensor<$elem>;
            fn div(self, c: $elem) -> Tensor<$elem> {
                self.div_scalar(c)
            }
        }
        impl Div<$elem> for Tensor<$elem> {
            type Output = Tensor<$elem>;
            fn div(self, c: $elem) -> Tensor<$elem> {
                self.div_scalar(c)
            }
        }
        impl Add<&Tensor<$elem>> for $elem {
            type Output = Tensor<$elem>;
            fn add(self, t: &Tensor<$elem>) -> Tensor<$elem> {
                t.add_scalar(self)
            }
        }
        impl Sub<&Tensor<$elem>> for $elem {
            type Output = Tensor<$elem>;
            fn sub(self, t: &Tensor<$elem>) -> Tensor<$elem> {
                t.rsub_scalar(self)
            }
        }
        impl Mul<&Tensor<$elem>> for $elem {
            type Output = Tensor<$elem>;
            fn mul(self, t: &Tensor<$elem>) -> Tensor<$elem> {
                t.mul_scalar(self)
            }
        }
    };
}

tensor_scalar_operators!(f32);
tensor_scalar_operators!(f64);

impl<E: Element> Neg for &Tensor<E> {
    type Output = Tensor<E>;
    fn neg(self) -> Tensor<E> {
        Tensor::neg(self)
    }
}

impl<E: Element> Neg for Tensor<E> {
    type Output = Tensor<E>;
    fn neg(self) -> Tensor<E> {
        Tensor::neg(&self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn large_maps_run_in_parallel_with_the_same_bits_as_a_plain_loop() {
        // Long enough for the rayon path; a rounding-heavy function shows any difference.
        let x = ArrayD::from_shape_fn(ndarray::IxDyn(&[3, PARALLEL_MIN_LEN]), |i| {
            (i[0] as f32 - 1.0) * (i[1] as f32).sin()
        });
        let f = |v: f32| v / (1.0 + (-v).exp());
        let bits = |a: &ArrayD<f32>| a.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let mapped = map_elementwise(&x, f);
        assert!(mapped.is_standard_layout());
        assert_eq!(bits(&mapped), bits(&x.mapv(f)));
        let mut scaled = mapped.clone();
        scale_elementwise(&mut scaled, &x, f);
        let expected = Zip::from(&mapped).and(&x).map_collect(|&g, &v| g * f(v));
        assert_eq!(bits(&scaled), bits(&expected));
    }

    #[test]
    fn large_binary_ops_and_their_gradients_match_ndarrays_on_the_pool() {
        // Long enough for the pool; `a` used twice, so its gradient is summed in the graph
        // (the pool's add_into) from the add's copied gradient and the mul's.
        let shape = [3, PARALLEL_MIN_LEN + 5];
        let [a, b] = [1.0f32, 2.0].map(|k| {
            ArrayD::from_shape_fn(ndarray::IxDyn(&shape), |i| {
                (i[1] as f32 * 0.37 * k).sin() * (i[0] as f32 + k)
            })
        });
        let (ta, tb) = (Tensor::param(a.clone()), Tensor::param(b.clone()));
        let bits = |x: &ArrayD<f32>| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&Tensor::add(&ta, &tb).value()), bits(&(&a + &b)));
        assert_eq!(bits(&Tensor::sub(&ta, &tb).value()), bits(&(&a - &b)));
        assert_eq!(bits(&Tensor::mul(&ta, &tb).value()), bits(&(&a * &b)));
        // A large array and a broadcast row take ndarray's broadcasting path.
        let row = Tensor::param(b.index_axis(ndarray::Axis(0), 1).to_owned());
        let broadcast = &a + &b.index_axis(ndarray::Axis(0), 1);
        assert_eq!(bits(&Tensor::add(&ta, &row).value()), bits(&broadcast));
        // L = sum((a + b) + a·b): dL/da = 1 + b, dL/db = 1 + a.
        let sum = Tensor::add(&ta, &tb);
        Tensor::add(&sum, &Tensor::mul(&ta, &tb))
            .sum_all()
            .backward();
        let expected_a = b.mapv(|b| 1.0 + b);
        let expected_b = a.mapv(|a| 1.0 + a);
        assert_eq!(bits(&ta.grad().unwrap()), bits(&expected_a));
        assert_eq!(bits(&tb.grad().unwrap()), bits(&expected_b));
    }
    use ndarray::arr2;

    #[test]
    fn product_rule_with_broadcasting() {
        // L = sum(a * b) with b broadcast over rows: dL/da = b, dL/db = column sums of a.
        let a = Tensor::<f64>::param(arr2(&[[1.0, 2.0], [3.0, 4.0]]).into_dyn());
        let b = Tensor::<f64>::param(ndarray::arr1(&[10.0, 20.0]).into_dyn());
        (&a * &b).sum_all().backward();
        assert_eq!(
            a.grad().unwrap(),
            arr2(&[[10.0, 20.0], [10.0, 20.0]]).into_dyn()
        );
        assert_eq!(b.grad().unwrap(), ndarray::arr1(&[4.0, 6.0]).into_dyn());
    }

    #[test]
    fn quotient_rule() {
        // d(a/b)/da = 1/b = 0.5, d(a/b)/db = -a/b² = -0.75
        let a = Tensor::<f64>::param(ndarray::arr1(&[3.0]).into_dyn());
        let b = Tensor::<f64>::param(ndarray::arr1(&[2.0]).into_dyn());
        (&a / &b).sum_all().backward();
        assert_eq!(a.grad().unwrap()[[0]], 0.5);
        assert_eq!(b.grad().unwrap()[[0]], -0.75);
    }

    #[test]
    fn scalar_forms_on_both_sides() {
        let x = Tensor::<f32>::param(ndarray::arr1(&[1.0, 2.0]).into_dyn());
        let y = 3.0 - &(2.0 * &(&x + 1.0));
        assert_eq!(y.to_vec(), vec![-1.0, -3.0]);
        y.sum_all().backward();
        assert_eq!(x.grad().unwrap().as_slice().unwrap(), &[-2.0, -2.0]);
    }
}
