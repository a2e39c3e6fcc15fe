//! Selective checkpointing: an op that marks its result with `keep_for_rerun` is computed
//! once per checkpointed segment; the rerun reuses the kept value, the gradients stay bit for
//! bit those of the plain run, and the node holds exactly the kept bytes until backward.

use std::cell::Cell;
use std::rc::Rc;

use tl_recompute::{checkpoint_sequential_with, keep_for_rerun};
use tl_tensor::memory::live_bytes;
use tl_tensor::nn::{Linear, Module};
use tl_tensor::{Generator, Tensor};

use crate::common::{Step, data, parameters, step};

/// `tanh(x·W + b)` where the tanh is an "expensive" op that keeps its result for the rerun,
/// counting how often it really computes.
struct KeptTanh {
    linear: Linear<f64>,
    computed: Rc<Cell<usize>>,
}

impl Module<f64> for KeptTanh {
    fn forward(&self, x: &Tensor<f64>) -> Tensor<f64> {
        let z = self.linear.forward(x);
        let y = keep_for_rerun(|| {
            self.computed.set(self.computed.get() + 1);
            Tensor::from_array(z.value().mapv(f64::tanh))
        });
        let saved = y.clone();
        Tensor::from_op_shared(&y, &[&z], move |grad| {
            vec![Some(grad * saved.value().mapv(|t| 1.0 - t * t))]
        })
    }

    fn parameters(&self) -> Vec<Tensor<f64>> {
        self.linear.parameters()
    }
}

fn stack(n: usize, computed: &Rc<Cell<usize>>) -> Vec<Rc<KeptTanh>> {
    let init = Generator::new(11);
    (0..n)
        .map(|_| {
            Rc::new(KeptTanh {
                linear: Linear::new(6, 6, true, &init),
                computed: Rc::clone(computed),
            })
        })
        .collect()
}

#[test]
fn the_rerun_reuses_kept_results_and_the_gradients_are_the_plain_runs() {
    let computed = Rc::new(Cell::new(0));
    let layers = stack(6, &computed);
    let (x, target) = (data::<f64>(&[5, 6], 1), data::<f64>(&[5, 6], 2));
    let watched = parameters(&layers);
    let plain: Step = step(&layers, &x, &target, None, &[], &watched);
    assert_eq!(computed.replace(0), 6);
    for schedule in [&[0, 2, 4][..], &[0, 3], &[0, 1, 2, 3, 4, 5]] {
        let checkpointed = step(&layers, &x, &target, Some(schedule), &[], &watched);
        assert_eq!(checkpointed, plain, "{schedule:?}");
        // Each tanh ran once, in the forward pass: no rerun computed one again.
        assert_eq!(computed.replace(0), 6, "{schedule:?}");
    }
}

#[test]
fn a_node_holds_its_kept_results_until_backward_frees_them() {
    let computed = Rc::new(Cell::new(0));
    let layers = stack(4, &computed);
    let x = data::<f64>(&[5, 6], 3);
    let unit = 5 * 6 * std::mem::size_of::<f64>();
    let base = live_bytes();
    // Segments [0, 2) and [2, 4): the first is checkpointed and keeps its two tanh outputs;
    // the last runs plainly and keeps its activations as any graph does.
    let y = checkpoint_sequential_with(&layers, &x, &[0, 2], &[], false).unwrap();
    let checkpointed_share = 2 * unit; // the two kept tanh outputs
    let node_output = unit; // the node's own output, which layer 2 saves
    // The tanh outputs of layers 2 and 3 (the second is y); a tanh saves its output, not z.
    let last_segment = 2 * unit;
    assert_eq!(
        live_bytes() - base,
        checkpointed_share + node_output + last_segment
    );
    y.sum_all().backward();
    drop(y);
    let gradients: usize = parameters(&layers)
        .iter()
        .map(|p| p.numel() * std::mem::size_of::<f64>())
        .sum();
    assert_eq!(live_bytes() - base, gradients, "kept values are gone");
    assert_eq!(computed.get(), 4);
}

#[test]
fn a_checkpoint_nested_in_a_segment_keeps_its_own_values() {
    use tl_recompute::checkpoint;
    // scale(x, c) = x · c, with c a "kept" scalar. The outer segment keeps 2 and 5; the inner
    // checkpoint, which records no node in the outer forward pass (grad mode is off there) but
    // does in the outer rerun, keeps 3. Were the inner call to reach the outer frame, the
    // rerun would hand 3 to the outer's second call and the gradient would change.
    fn scale(x: &Tensor<f64>, c: f64) -> Tensor<f64> {
        x.mul_scalar(keep_for_rerun(move || c))
    }
    let run = |checkpointed: bool| {
        let x = Tensor::<f64>::param(tl_tensor::ndarray::arr1(&[1.5, -0.5]).into_dyn());
        let inner = |xs: &[Tensor<f64>]| scale(&xs[0], 3.0).tanh();
        let outer = move |xs: &[Tensor<f64>]| {
            let h = scale(&xs[0], 2.0).tanh();
            let h = if checkpointed {
                checkpoint(inner, &[h], &[], &[])
            } else {
                inner(&[h])
            };
            scale(&h, 5.0)
        };
        let y = if checkpointed {
            checkpoint(outer, std::slice::from_ref(&x), &[], &[])
        } else {
            outer(std::slice::from_ref(&x))
        };
        y.sum_all().backward();
        (y.to_vec(), x.grad().unwrap().into_raw_vec_and_offset().0)
    };
    assert_eq!(run(true), run(false));
}
