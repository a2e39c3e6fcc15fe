//! A leaf's gradient-ready hook under checkpointing: a parameter read inside a segment gets
//! its gradient in the segment's inner sweep, and its hook fires from there, once, with the
//! gradient complete — what ZeRO-2 and ZeRO-3 rely on to release memory per block.

use std::cell::RefCell;
use std::rc::Rc;

use tl_recompute::checkpoint;
use tl_tensor::Tensor;
use tl_tensor::ndarray::arr1;

fn param(values: &[f64]) -> Tensor<f64> {
    Tensor::param(arr1(values).into_dyn())
}

/// loss = Σ w_out ⊙ tanh(x ⊙ w_in), the product and tanh in a segment when `checkpointed`;
/// returns the hooks' log `(leaf, its gradient then)` in firing order.
fn run(checkpointed: bool) -> Vec<(&'static str, Vec<f64>)> {
    let (x, w_in, w_out) = (param(&[0.5, -1.0]), param(&[2.0, 0.25]), param(&[1.5, 3.0]));
    let log = Rc::new(RefCell::new(Vec::new()));
    for (name, leaf) in [("x", &x), ("w_in", &w_in), ("w_out", &w_out)] {
        let (log, handle) = (Rc::clone(&log), leaf.clone());
        leaf.set_grad_ready_hook(Some(Rc::new(move || {
            log.borrow_mut()
                .push((name, handle.grad().unwrap().into_raw_vec_and_offset().0));
        })));
    }
    let hidden = if checkpointed {
        let w = w_in.clone();
        checkpoint(
            move |xs| (&xs[0] * &w).tanh(),
            std::slice::from_ref(&x),
            std::slice::from_ref(&w_in),
            &[],
        )
    } else {
        (&x * &w_in).tanh()
    };
    (&w_out * &hidden).sum_all().backward();
    for leaf in [&x, &w_in, &w_out] {
        leaf.set_grad_ready_hook(None);
    }
    log.take()
}

#[test]
fn a_parameter_inside_a_segment_fires_from_the_inner_sweep_once_and_complete() {
    let plain = run(false);
    let checkpointed = run(true);
    // w_out first (nearest the loss); then w_in, inside the segment's VJP, before the outer
    // sweep goes on to x, which it reaches only once that VJP has returned x's gradient.
    let names: Vec<_> = checkpointed.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["w_out", "w_in", "x"]);
    // Each fires once with the gradient of the plain run (the rerun computes the same ops).
    let sorted = |mut log: Vec<(&'static str, Vec<f64>)>| {
        log.sort_by_key(|(n, _)| *n);
        log
    };
    assert_eq!(sorted(checkpointed), sorted(plain));
}
