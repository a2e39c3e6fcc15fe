//! The scaler as a state machine: its schedule against the chapter's rules, resuming from a
//! state dict anywhere in it, malformed states, and the floor and ceiling.

use proptest::prelude::*;
use tl_precision::{DynamicLossScaler, PrecisionError, ScalerState};
use tl_tensor::ndarray::arr1;

use crate::common::{fixed_cases, sgd, weight};

#[test]
fn a_state_dict_round_trip_resumes_the_count() {
    // Interval 3: two good steps, save, resume in a fresh scaler, one more good step grows.
    let w = weight(&[0.0]);
    let mut opt = sgd(std::slice::from_ref(&w), 0.1);
    let mut scaler = DynamicLossScaler::new(16.0, 2.0, 0.5, 3).unwrap();
    for _ in 0..2 {
        w.set_grad(Some(arr1(&[16.0]).into_dyn()));
        scaler
            .step(&mut opt, std::slice::from_ref(&w), None)
            .unwrap();
    }
    let json = serde_json::to_string(&scaler.state_dict()).unwrap();
    let mut resumed = DynamicLossScaler::default();
    resumed
        .load_state_dict(&serde_json::from_str(&json).unwrap())
        .unwrap();
    assert_eq!(resumed, scaler);
    assert_eq!((resumed.loss_scale(), resumed.good_steps()), (16.0, 2));
    w.set_grad(Some(arr1(&[16.0]).into_dyn()));
    let outcome = resumed
        .step(&mut opt, std::slice::from_ref(&w), None)
        .unwrap();
    assert_eq!((outcome.scale, resumed.good_steps()), (32.0, 0));
}

#[test]
fn a_malformed_state_is_rejected_and_changes_nothing() {
    let scaler = DynamicLossScaler::new(16.0, 2.0, 0.5, 3).unwrap();
    let good = scaler.state_dict();
    let bad_states = [
        ScalerState {
            good_steps: 3,
            ..good.clone()
        },
        ScalerState {
            scale: -1.0,
            ..good.clone()
        },
        ScalerState {
            backoff_factor: 1.5,
            ..good.clone()
        },
        ScalerState {
            growth_interval: 0,
            good_steps: 0,
            ..good.clone()
        },
        ScalerState {
            floor: Some(32.0),
            ..good.clone()
        },
        ScalerState {
            ceiling: Some(8.0),
            ..good.clone()
        },
        ScalerState {
            skips_at_floor: 1,
            ..good.clone()
        },
    ];
    let mut target = DynamicLossScaler::default();
    for state in bad_states {
        assert!(
            matches!(
                target.load_state_dict(&state),
                Err(PrecisionError::InvalidState { .. })
            ),
            "{state:?}"
        );
        assert_eq!(target, DynamicLossScaler::default());
    }
    // Missing and unknown fields fail to deserialize.
    assert!(serde_json::from_str::<ScalerState>(r#"{"scale": 8.0}"#).is_err());
    let mut value = serde_json::to_value(&good).unwrap();
    value["extra"] = serde_json::json!(1);
    assert!(serde_json::from_value::<ScalerState>(value).is_err());
}

#[test]
fn the_ceiling_caps_growth() {
    let w = weight(&[0.0]);
    let mut opt = sgd(std::slice::from_ref(&w), 0.1);
    let mut scaler = DynamicLossScaler::new(4.0, 2.0, 0.5, 1)
        .unwrap()
        .with_ceiling(8.0)
        .unwrap();
    let mut scales = Vec::new();
    for _ in 0..3 {
        w.set_grad(Some(arr1(&[1.0]).into_dyn()));
        scales.push(
            scaler
                .step(&mut opt, std::slice::from_ref(&w), None)
                .unwrap()
                .scale,
        );
    }
    assert_eq!(scales, [8.0, 8.0, 8.0]);
    assert!(
        DynamicLossScaler::new(4.0, 2.0, 0.5, 1)
            .unwrap()
            .with_ceiling(2.0)
            .is_err()
    );
}

#[test]
fn a_scale_stuck_at_its_floor_becomes_an_error() {
    // S = 4, floor 1, patience 2: overflows take S to 2 and 1 (not yet at the floor when
    // they happened), then two overflows at the floor fail the second of them.
    let w = weight(&[0.0]);
    let mut opt = sgd(std::slice::from_ref(&w), 0.1);
    let mut scaler = DynamicLossScaler::new(4.0, 2.0, 0.5, 10)
        .unwrap()
        .with_floor(1.0, 2)
        .unwrap();
    let mut overflow = |scaler: &mut DynamicLossScaler| {
        w.set_grad(Some(arr1(&[f32::INFINITY]).into_dyn()));
        scaler.step(&mut opt, std::slice::from_ref(&w), None)
    };
    assert_eq!(overflow(&mut scaler).unwrap().scale, 2.0);
    assert_eq!(overflow(&mut scaler).unwrap().scale, 1.0);
    assert_eq!(overflow(&mut scaler).unwrap().scale, 1.0);
    assert_eq!(
        overflow(&mut scaler),
        Err(PrecisionError::ScaleStuckAtFloor {
            scale: 1.0,
            skips: 2
        })
    );
    assert!(
        DynamicLossScaler::new(4.0, 2.0, 0.5, 1)
            .unwrap()
            .with_floor(8.0, 1)
            .is_err()
    );
    assert!(
        DynamicLossScaler::new(4.0, 2.0, 0.5, 1)
            .unwrap()
            .with_floor(1.0, 0)
            .is_err()
    );
}

#[test]
fn a_good_step_at_the_floor_resets_the_patience() {
    let w = weight(&[0.0]);
    let mut opt = sgd(std::slice::from_ref(&w), 0.1);
    let mut scaler = DynamicLossScaler::new(1.0, 2.0, 0.5, 10)
        .unwrap()
        .with_floor(1.0, 2)
        .unwrap();
    for grad in [f32::INFINITY, 1.0, f32::INFINITY, 1.0, f32::INFINITY] {
        w.set_grad(Some(arr1(&[grad]).into_dyn()));
        assert!(
            scaler
                .step(&mut opt, std::slice::from_ref(&w), None)
                .is_ok()
        );
    }
    assert_eq!(scaler.state_dict().skips_at_floor, 1);
}

/// The scale and count the chapter's rules give after a sequence of steps (true = overflow),
/// from S = 2^10 with growth 2, backoff 1/2 and interval 3.
fn reference_schedule(overflows: &[bool]) -> Vec<(f64, u32)> {
    let (mut scale, mut count) = (1024.0, 0);
    overflows
        .iter()
        .map(|&overflow| {
            if overflow {
                (scale, count) = (scale / 2.0, 0);
            } else if count + 1 == 3 {
                (scale, count) = (scale * 2.0, 0);
            } else {
                count += 1;
            }
            (scale, count)
        })
        .collect()
}

proptest! {
    #![proptest_config(fixed_cases(64))]

    #[test]
    fn the_scaler_follows_its_rules_and_resumes_anywhere(
        overflows in proptest::collection::vec(any::<bool>(), 1..24),
        resume_at in 0usize..24,
    ) {
        let w = weight(&[0.0]);
        let mut opt = sgd(std::slice::from_ref(&w), 0.0);
        let mut scaler = DynamicLossScaler::new(1024.0, 2.0, 0.5, 3).unwrap();
        let mut trace = Vec::new();
        for (i, &overflow) in overflows.iter().enumerate() {
            if i == resume_at {
                // A save and a resume in a fresh scaler continue the same schedule.
                let mut resumed = DynamicLossScaler::default();
                resumed.load_state_dict(&scaler.state_dict()).unwrap();
                scaler = resumed;
            }
            let grad = if overflow { f32::NAN } else { 1.0 };
            w.set_grad(Some(arr1(&[grad]).into_dyn()));
            let outcome = scaler.step(&mut opt, std::slice::from_ref(&w), None).unwrap();
            prop_assert_eq!(outcome.stepped, !overflow);
            trace.push((scaler.loss_scale(), scaler.good_steps()));
        }
        prop_assert_eq!(trace, reference_schedule(&overflows));
    }
}

#[test]
fn a_floor_with_skips_round_trips_and_skips_must_stay_below_the_patience() {
    let with_floor = DynamicLossScaler::new(16.0, 2.0, 0.5, 3)
        .unwrap()
        .with_floor(4.0, 3)
        .unwrap();
    let mut state = with_floor.state_dict();
    state.skips_at_floor = 2;
    let mut resumed = DynamicLossScaler::default();
    resumed.load_state_dict(&state).unwrap();
    assert_eq!(resumed.state_dict(), state);

    state.skips_at_floor = 3;
    let before = resumed.clone();
    assert!(matches!(
        resumed.load_state_dict(&state),
        Err(PrecisionError::InvalidState { .. })
    ));
    assert_eq!(resumed, before, "a rejected state changed the scaler");
}
