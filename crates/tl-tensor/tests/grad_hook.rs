//! The gradient-ready hook of a leaf: when it runs, what it sees, and what it may do.

use std::cell::RefCell;
use std::rc::Rc;

use ndarray::arr1;
use tl_tensor::{GradReadyHook, Tensor};

fn param(values: &[f64]) -> Tensor<f64> {
    Tensor::param(arr1(values).into_dyn())
}

/// A hook that appends `(name, the leaf's gradient at that moment)` to `log`.
fn logging(log: &Rc<RefCell<Vec<(&'static str, f64)>>>, name: &'static str, leaf: &Tensor<f64>) {
    // The hook holds a clone of its own leaf (a cycle): the tests clear it at the end.
    let (log, leaf_handle) = (Rc::clone(log), leaf.clone());
    let hook: GradReadyHook = Rc::new(move || {
        let grad = leaf_handle
            .grad()
            .expect("a gradient is there when the hook runs")[0];
        log.borrow_mut().push((name, grad));
    });
    leaf.set_grad_ready_hook(Some(hook));
}

#[test]
fn the_hook_runs_once_per_sweep_after_every_use_has_contributed() {
    // loss = w·x + w·w with w = 3, x = 2: dloss/dw = x + 2w = 8, dloss/dx = w = 3. The
    // gradient reaching the output side first is x's (it is used once, near the loss); w
    // is reached once both of its uses are in.
    let (w, x) = (param(&[3.0]), param(&[2.0]));
    let log = Rc::new(RefCell::new(Vec::new()));
    logging(&log, "w", &w);
    logging(&log, "x", &x);
    ((&w * &x) + (&w * &w)).sum_all().backward();
    let seen = log.borrow().clone();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert!(
        seen.contains(&("w", 8.0)) && seen.contains(&("x", 3.0)),
        "{seen:?}"
    );
    // A second sweep accumulates and fires again: w's gradient is now 16.
    ((&w * &x) + (&w * &w)).sum_all().backward();
    assert_eq!(log.borrow().len(), 4);
    assert!(log.borrow()[2..].contains(&("w", 16.0)));
    w.set_grad_ready_hook(None);
    x.set_grad_ready_hook(None);
}

#[test]
fn leaves_fire_in_the_order_backward_reaches_them() {
    // y = w2 · tanh(w1 · x): w2 is nearer the loss, so its gradient is complete first.
    let (w1, w2, x) = (param(&[0.5]), param(&[2.0]), param(&[1.0]));
    let log = Rc::new(RefCell::new(Vec::new()));
    for (name, leaf) in [("w1", &w1), ("w2", &w2)] {
        logging(&log, name, leaf);
    }
    (&w2 * &(&w1 * &x).tanh()).sum_all().backward();
    let names: Vec<_> = log.borrow().iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["w2", "w1"]);
    w1.set_grad_ready_hook(None);
    w2.set_grad_ready_hook(None);
}

#[test]
fn a_cleared_hook_does_not_run_and_a_new_one_replaces_the_old() {
    let w = param(&[1.0]);
    let count = Rc::new(RefCell::new((0, 0)));
    let first = Rc::clone(&count);
    w.set_grad_ready_hook(Some(Rc::new(move || first.borrow_mut().0 += 1)));
    let second = Rc::clone(&count);
    w.set_grad_ready_hook(Some(Rc::new(move || second.borrow_mut().1 += 1)));
    (&w * &w).sum_all().backward();
    assert_eq!(*count.borrow(), (0, 1));
    w.set_grad_ready_hook(None);
    (&w * &w).sum_all().backward();
    assert_eq!(*count.borrow(), (0, 1));
}

#[test]
fn a_hook_may_take_the_gradient_away() {
    // What ZeRO-2 does: copy the finished gradient elsewhere and drop it from the leaf.
    let w = param(&[1.0, 2.0]);
    let taken = Rc::new(RefCell::new(None));
    let (sink, leaf) = (Rc::clone(&taken), w.clone());
    w.set_grad_ready_hook(Some(Rc::new(move || {
        *sink.borrow_mut() = leaf.grad();
        leaf.set_grad(None);
    })));
    (&w * &w).sum_all().backward(); // d(w²)/dw = 2w
    assert_eq!(
        taken.borrow().as_ref().unwrap().as_slice().unwrap(),
        [2.0, 4.0]
    );
    assert!(w.grad().is_none());
    w.set_grad_ready_hook(None);
}

#[test]
#[should_panic(expected = "only a leaf that requires grad")]
fn only_a_leaf_that_requires_grad_takes_a_hook() {
    let w = param(&[1.0]);
    (&w * &w).set_grad_ready_hook(Some(Rc::new(|| {})));
}

#[test]
fn a_hooked_leaf_is_finished_as_soon_as_its_last_consumer_has_run() {
    // h = tanh(w1·x), y = tanh(w2·h), loss = Σ y: when w2's hook runs, backward has not
    // reached w1 yet, so w2's gradient can be released while the sweep goes on below it.
    let (x, w1, w2) = (param(&[0.5]), param(&[2.0]), param(&[-1.5]));
    let w1_had_grad = Rc::new(RefCell::new(None));
    let (probe, w1_handle, w2_handle) = (Rc::clone(&w1_had_grad), w1.clone(), w2.clone());
    w2.set_grad_ready_hook(Some(Rc::new(move || {
        *probe.borrow_mut() = Some(w1_handle.grad().is_some());
        w2_handle.set_grad(None); // released at once
    })));
    let loss = (&w2 * &(&w1 * &x).tanh()).tanh().sum_all();
    let (_, peak) = tl_tensor::memory::measure_peak(|| loss.backward());
    assert_eq!(*w1_had_grad.borrow(), Some(false));
    assert!(w2.grad().is_none() && w1.grad().is_some() && x.grad().is_some());
    assert!(peak > 0);
    w2.set_grad_ready_hook(None);
}
