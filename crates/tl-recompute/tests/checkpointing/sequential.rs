//! Stacks run on a schedule: which layers run twice, and gradients equal to the plain run's.

use std::rc::Rc;
use std::slice::from_ref;

use proptest::prelude::*;
use tl_recompute::{
    RecomputeError, SharedLayer, checkpoint_schedule, checkpoint_sequential,
    checkpoint_sequential_with, uniform_schedule,
};
use tl_tensor::losses::mse;
use tl_tensor::nn::{Dropout, Module, Sequential};
use tl_tensor::{Element, Generator, Tensor};

use crate::common::{Block, blocks, data, grad_bits, parameters, step, value_bits};

#[test]
fn six_layers_in_four_units_rerun_the_first_three_once() {
    let layers = blocks::<f64>(6, 4, 1);
    let (x, target) = (data(&[3, 4], 2), data(&[3, 4], 3));
    let params = parameters(&layers);
    let plain = step(&layers, &x, &target, None, &[], &params);
    layers.iter().for_each(|layer| layer.forget_calls());

    for param in &params {
        param.zero_grad();
    }
    let output = checkpoint_sequential(&layers, &x, 4, &[]).unwrap();
    mse(&output, &target).backward();

    // checkpoint_schedule(6, 4) = [0, 3]: layers 0..3 run under no_grad, then again with the
    // graph on during backward; layers 3..6 run once, normally.
    let counts: Vec<usize> = layers.iter().map(|layer| layer.calls().len()).collect();
    assert_eq!(counts, [2, 2, 2, 1, 1, 1]);
    for layer in &layers[..3] {
        assert_eq!(layer.calls(), [false, true]);
    }
    for layer in &layers[3..] {
        assert_eq!(layer.calls(), [true]);
    }
    let grads: Vec<_> = params.iter().map(grad_bits).collect();
    assert_eq!(grads, plain.grads);
    assert!(grads.iter().all(Option::is_some));
}

/// 7 blocks fed by an input that requires grad: the optimal schedules of three budgets and the
/// √n schedule (two checkpointed segments) give the plain run's loss and gradients exactly.
fn seven_layers_match_the_plain_run_bit_for_bit<E: Element>() {
    let layers = blocks::<E>(7, 5, 10);
    let x = Tensor::param(data::<E>(&[4, 5], 11).to_array());
    let target = data(&[4, 5], 12);
    let mut watched = parameters(&layers);
    watched.push(x.clone());
    let plain = step(&layers, &x, &target, None, &[], &watched);
    assert!(plain.grads.iter().all(Option::is_some));

    let mut schedules: Vec<Vec<usize>> = [4, 5, 6]
        .iter()
        .map(|&budget| checkpoint_schedule(7, budget).unwrap())
        .collect();
    assert_eq!(schedules, [vec![0, 4], vec![0, 3], vec![0, 2]]);
    schedules.push(uniform_schedule(7).unwrap());
    for schedule in &schedules {
        let checkpointed = step(&layers, &x, &target, Some(schedule), &[], &watched);
        assert_eq!(checkpointed, plain, "{} schedule {schedule:?}", E::NAME);
    }
}

#[test]
fn seven_layers_three_budgets_equal_the_plain_run_bitwise_in_f64() {
    seven_layers_match_the_plain_run_bit_for_bit::<f64>();
}

#[test]
fn seven_layers_three_budgets_equal_the_plain_run_bitwise_in_f32() {
    seven_layers_match_the_plain_run_bit_for_bit::<f32>();
}

#[test]
fn the_first_segments_parameters_learn_from_a_data_input() {
    let layers = blocks::<f32>(6, 4, 20);
    let (x, target) = (data(&[3, 4], 21), data(&[3, 4], 22));
    assert!(!x.requires_grad());
    let params = parameters(&layers);
    let plain = step(&layers, &x, &target, None, &[], &params);
    let checkpointed = step(&layers, &x, &target, Some(&[0, 3]), &[], &params);
    // Layers 0..3 form the checkpointed segment fed by data: 2 parameters each.
    for (index, grad) in checkpointed.grads.iter().enumerate().take(6) {
        assert!(
            grad.is_some(),
            "parameter {index} of the first segment got no gradient"
        );
    }
    assert_eq!(checkpointed, plain);
}

#[test]
fn a_stack_input_with_another_consumer_gets_both_gradients() {
    // h = 2x feeds the stack and a skip around it: out = stack(h) + h. The rerun must start
    // from a leaf copy of h; running on h itself would backpropagate into the outer graph
    // (h's node) before the outer backward gets there.
    let layers = blocks::<f64>(4, 3, 30);
    let x = Tensor::param(data::<f64>(&[2, 3], 31).to_array());
    let target = data(&[2, 3], 32);
    let run = |schedule: Option<&[usize]>| {
        x.zero_grad();
        layers.iter().for_each(|layer| layer.zero_grad());
        let h = x.mul_scalar(2.0);
        let out = match schedule {
            Some(schedule) => {
                checkpoint_sequential_with(&layers, &h, schedule, &[], false).unwrap()
            }
            None => layers.iter().fold(h.clone(), |h, layer| layer.forward(&h)),
        };
        mse(&(&out + &h), &target).backward();
        let mut grads = vec![grad_bits(&x)];
        grads.extend(parameters(&layers).iter().map(grad_bits));
        grads
    };
    let plain = run(None);
    assert_eq!(run(Some(&[0, 2])), plain);
    assert_eq!(run(Some(&[0, 1, 3])), plain);
}

#[test]
fn a_shared_sequential_is_checkpointed_through_its_layers() {
    let blocks = blocks::<f64>(5, 3, 40);
    let model = Rc::new(Sequential::<f64>::new(
        blocks
            .iter()
            .map(|block| Box::new(Rc::clone(block)) as Box<dyn Module<f64>>)
            .collect(),
    ));
    let (x, target) = (data(&[2, 3], 41), data(&[2, 3], 42));
    let params = model.parameters();
    let plain = step(from_ref(&model), &x, &target, None, &[], &params);
    blocks.iter().for_each(|block| block.forget_calls());
    let layers = SharedLayer::all(&model);
    assert_eq!(layers.len(), 5);
    assert!(layers[2].parameters()[0].same(&blocks[2].parameters()[0]));
    let schedule = checkpoint_schedule(5, 3).unwrap(); // 3 + 2 + 1 ≥ 5
    assert_eq!(schedule, [0, 3]);
    let checkpointed = step(&layers, &x, &target, Some(&schedule), &[], &params);
    assert_eq!(checkpointed, plain);
    // The first segment was checkpointed (its parameters reached the node): run twice.
    let counts: Vec<usize> = blocks.iter().map(|block| block.calls().len()).collect();
    assert_eq!(counts, [2, 2, 2, 1, 1]);
}

#[test]
fn a_shared_layer_passes_training_mode_on() {
    let model = Rc::new(Sequential::<f32>::new(vec![Box::new(
        Dropout::new(0.5, Generator::new(43)).unwrap(),
    )]));
    let layer = SharedLayer::new(&model, 0);
    let x = Tensor::<f32>::ones(&[64]);
    assert!(
        layer.forward(&x).to_vec().contains(&0.0),
        "training: some dropped"
    );
    layer.set_training(false);
    assert_eq!(layer.forward(&x).to_vec(), vec![1.0; 64]);
}

#[test]
fn bad_budgets_and_schedules_are_errors() {
    let layers = blocks::<f32>(7, 2, 50);
    let x = data::<f32>(&[1, 2], 51);
    assert!(matches!(
        checkpoint_sequential(&layers, &x, 3, &[]),
        Err(RecomputeError::BudgetTooSmall { min_budget: 4, .. })
    ));
    assert!(matches!(
        checkpoint_sequential_with(&layers, &x, &[0, 7], &[], false),
        Err(RecomputeError::InvalidSchedule { n_layers: 7, .. })
    ));
    let none: &[Rc<Block<f32>>] = &[];
    assert!(matches!(
        checkpoint_sequential(none, &x, 3, &[]),
        Err(RecomputeError::InvalidArgument {
            name: "n_layers",
            ..
        })
    ));
    // A budget holding the stack is a plain run: no layer runs twice.
    let y = checkpoint_sequential(&layers, &x, 7, &[]).unwrap();
    y.sum_all().backward();
    assert!(layers.iter().all(|layer| layer.calls().len() == 1));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(24))]

    #[test]
    fn any_schedule_gives_the_plain_runs_gradients(
        n_layers in 1usize..7,
        cuts in any::<u8>(),
        seed in 0u64..1000,
    ) {
        let schedule: Vec<usize> = std::iter::once(0)
            .chain((1..n_layers).filter(|cut| cuts & (1 << cut) != 0))
            .collect();
        let layers = blocks::<f32>(n_layers, 3, seed);
        let x = Tensor::param(data::<f32>(&[2, 3], seed + 1).to_array());
        let target = data(&[2, 3], seed + 2);
        let mut watched = parameters(&layers);
        watched.push(x.clone());
        let plain = step(&layers, &x, &target, None, &[], &watched);
        let checkpointed = step(&layers, &x, &target, Some(&schedule), &[], &watched);
        prop_assert_eq!(checkpointed, plain);
        let output = checkpoint_sequential_with(&layers, &x, &schedule, &[], false).unwrap();
        let reference = layers.iter().fold(x.clone(), |h, layer| layer.forward(&h));
        prop_assert_eq!(value_bits(&output), value_bits(&reference));
    }
}
