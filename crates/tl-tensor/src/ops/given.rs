//! Products whose result is known already: [`with_given_product`].
//!
//! Selective checkpointing keeps the output of some products from a segment's forward pass
//! so that the rerun during backward need not multiply again. The rerun still has to record
//! the product's node, since its VJP reads the rerun's operands (and, under autocast, their
//! rounded copies, and rounds the gradient it sends back). So the rerun runs the product's
//! code as it always does, and only the multiplication itself is skipped: the product takes
//! the kept tensor as its result, sharing its storage, as [`Tensor::from_op_shared`] does.
//! Every node, every rounding and every gradient is the one the plain product makes.

use std::any::Any;
use std::cell::RefCell;

use ndarray::ArrayD;

use crate::graph::Backward;
use crate::{Element, Tensor};

thread_local! {
    /// The result waiting for the next product on this thread, as a `Tensor<E>`.
    static GIVEN: RefCell<Option<Box<dyn Any>>> = const { RefCell::new(None) };
}

/// Empties the slot when dropped, so a panic inside [`with_given_product`] leaves no stale
/// result behind for an unrelated product.
struct Clear;

impl Drop for Clear {
    fn drop(&mut self) {
        let stale = GIVEN.with(|slot| slot.borrow_mut().take());
        drop(stale); // outside the borrow
    }
}

/// Runs `f`, in which the first matrix product on this thread takes `value` as its result
/// instead of computing it; returns what `f` returns.
///
/// The products that take a given result are [`Tensor::matmul_plain`],
/// [`Tensor::matmul_with`] (so [`Tensor::matmul`] under any hook that calls one of them) and
/// every op built with [`Tensor::from_product`]. The product records its node and VJP as it
/// always does; its result shares `value`'s storage, so nothing is allocated for it. `value`
/// must be what the product would compute, bit for bit: nothing checks the values, only the
/// shape.
///
/// # Panics
/// If `f` runs no product (the value would silently go unused), if the product's shape is
/// not `value`'s, if the element types differ, or when called inside another
/// `with_given_product` whose value is still waiting.
///
/// ```
/// use tl_tensor::{Tensor, ops::given::with_given_product};
/// let x = Tensor::<f64>::param(ndarray::arr2(&[[1.0, 2.0]]).into_dyn());
/// let w = Tensor::<f64>::param(ndarray::arr2(&[[3.0], [4.0]]).into_dyn());
/// let known = x.matmul(&w).detach(); // 11, computed earlier
/// let y = with_given_product(known.clone(), || x.matmul(&w));
/// assert!(y.shares_storage(&known)); // not multiplied again
/// y.sum_all().backward(); // yet the node is there: dy/dw = xᵀ
/// assert_eq!(w.grad().unwrap().iter().copied().collect::<Vec<_>>(), [1.0, 2.0]);
/// ```
pub fn with_given_product<E: Element, T>(value: Tensor<E>, f: impl FnOnce() -> T) -> T {
    GIVEN.with(|slot| {
        let mut slot = slot.borrow_mut();
        assert!(
            slot.is_none(),
            "with_given_product: another given product is still waiting"
        );
        *slot = Some(Box::new(value));
    });
    let clear = Clear;
    let result = f();
    let unused = GIVEN.with(|slot| slot.borrow().is_some());
    drop(clear);
    assert!(
        !unused,
        "with_given_product: no product ran, so the given result was not used"
    );
    result
}

/// The result given to the product about to run, if one is waiting (see
/// [`with_given_product`]); for a product kernel outside this crate. The caller builds its
/// node on it with [`Tensor::from_op_shared`], or uses [`Tensor::from_product`].
///
/// # Panics
/// If a result is waiting but its shape is not `shape` or its element type is not `E`.
pub fn take_given_product<E: Element>(shape: &[usize]) -> Option<Tensor<E>> {
    let given = GIVEN.with(|slot| slot.borrow_mut().take())?;
    let given = match given.downcast::<Tensor<E>>() {
        Ok(given) => *given,
        Err(_) => panic!("take_given_product: the given result has another element type"),
    };
    assert_eq!(
        given.shape(),
        shape,
        "take_given_product: the given result's shape is not the product's"
    );
    Some(given)
}

impl<E: Element> Tensor<E> {
    /// [`Tensor::from_op`] for a product of shape `shape`: its value is `compute()`, or the
    /// result given by [`with_given_product`] when one is waiting, in which case `compute` is
    /// not called and the output shares the given tensor's storage.
    ///
    /// # Panics
    /// As [`take_given_product`].
    pub fn from_product(
        shape: &[usize],
        compute: impl FnOnce() -> ArrayD<E>,
        parents: &[&Tensor<E>],
        vjp: impl FnOnce(ArrayD<E>) -> Vec<Option<ArrayD<E>>> + 'static,
    ) -> Self {
        match take_given_product::<E>(shape) {
            Some(given) => Tensor::from_op_shared(&given, parents, vjp),
            None => Tensor::from_op_shaped(shape, compute, parents, vjp),
        }
    }
}

impl<E: Element> Tensor<E> {
    /// [`Tensor::from_product`] with a backward written one parent at a time: `vjp(grad, i)`
    /// is parent `i`'s gradient, called only for parents that require grad. A sweep calls
    /// it for each of them in order, as a VJP returning them all would; a split sweep
    /// ([`Tensor::backward_input_from`]) calls it for the input now and for the weight in
    /// its second half, so the weight's gradient costs nothing until then.
    ///
    /// # Panics
    /// As [`take_given_product`].
    pub fn from_product_by_parent(
        shape: &[usize],
        compute: impl FnOnce() -> ArrayD<E>,
        parents: &[&Tensor<E>],
        vjp: impl Fn(&ArrayD<E>, usize) -> ArrayD<E> + 'static,
    ) -> Self {
        let output = match take_given_product::<E>(shape) {
            Some(given) => given.detach(),
            None if !crate::meta::computes(parents) => Tensor::meta(shape),
            None => {
                let value = compute();
                assert_eq!(
                    value.shape(),
                    shape,
                    "an op's kernel made a result of another shape than its shape rule says"
                );
                Tensor::from_array(value)
            }
        };
        output.attach_op(parents, Backward::ByParent(Box::new(vjp)));
        output
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory;
    use crate::ops::matmul_with::tests::Naive;
    use crate::testing::random_array;
    use crate::{Generator, ProductKernel};
    use std::sync::Arc;

    fn grads(tensors: &[&Tensor<f64>]) -> Vec<Vec<f64>> {
        tensors
            .iter()
            .map(|t| t.grad().unwrap().iter().copied().collect())
            .collect()
    }

    /// Runs `product` plainly, then again with its own result given, and checks that the
    /// second run allocates nothing for the result and gives the same value and gradients.
    fn given_equals_computed(product: impl Fn(&Tensor<f64>, &Tensor<f64>) -> Tensor<f64>) {
        let rng = Generator::new(1);
        for (lhs_shape, rhs_shape) in [
            (vec![2, 3, 4], vec![4, 5]),    // rows times a matrix
            (vec![2, 3, 4], vec![2, 4, 5]), // batched
            (vec![3, 4], vec![4, 5]),
        ] {
            let x = Tensor::param(random_array(&lhs_shape, &rng));
            let w = Tensor::param(random_array(&rhs_shape, &rng));
            let plain = product(&x, &w);
            plain.sum_all().backward();
            let expected = grads(&[&x, &w]);
            x.zero_grad();
            w.zero_grad();

            let known = plain.detach();
            let before = memory::live_bytes();
            let given = with_given_product(known.clone(), || product(&x, &w));
            assert_eq!(
                memory::live_bytes(),
                before,
                "{lhs_shape:?}: nothing allocated"
            );
            assert!(given.shares_storage(&known));
            assert!(given.requires_grad());
            given.sum_all().backward();
            assert_eq!(grads(&[&x, &w]), expected, "{lhs_shape:?}");
        }
    }

    #[test]
    fn a_given_plain_product_records_its_node_without_multiplying() {
        given_equals_computed(|x, w| x.matmul_plain(w));
    }

    #[test]
    fn a_given_kernel_product_records_its_node_without_multiplying() {
        let kernel: Arc<dyn ProductKernel> = Arc::new(Naive { on_views: false });
        given_equals_computed(|x, w| x.matmul_with(w, &kernel));
    }

    #[test]
    fn only_the_first_product_takes_the_given_result() {
        let x = Tensor::<f64>::param(ndarray::arr2(&[[1.0, 2.0]]).into_dyn());
        let w = Tensor::<f64>::param(ndarray::arr2(&[[3.0], [4.0]]).into_dyn());
        let known = Tensor::from_vec(vec![99.0], &[1, 1]).unwrap();
        let (first, second) = with_given_product(known, || (x.matmul(&w), x.matmul(&w)));
        assert_eq!((first.item(), second.item()), (99.0, 11.0));
    }

    #[test]
    #[should_panic(expected = "no product ran")]
    fn a_given_result_no_product_takes_is_an_error() {
        let known = Tensor::<f64>::from_vec(vec![1.0], &[1, 1]).unwrap();
        with_given_product(known, || ());
    }

    #[test]
    #[should_panic(expected = "shape is not the product's")]
    fn a_given_result_of_another_shape_is_an_error() {
        let x = Tensor::<f64>::ones(&[2, 3]);
        let known = Tensor::<f64>::from_vec(vec![1.0], &[1, 1]).unwrap();
        with_given_product(known, || x.matmul(&Tensor::ones(&[3, 2])));
    }

    #[test]
    fn a_panic_inside_leaves_no_result_waiting() {
        let known = Tensor::<f64>::from_vec(vec![1.0], &[1, 1]).unwrap();
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            with_given_product(known, || panic!("inside"))
        }));
        assert!(caught.is_err());
        assert!(take_given_product::<f64>(&[1, 1]).is_none());
        let x = Tensor::<f64>::ones(&[1, 1]);
        assert_eq!(x.matmul(&x).item(), 1.0, "computed, not given");
    }
}
