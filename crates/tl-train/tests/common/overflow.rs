//! An fp16 overflow made, not injected, for the tests of ranks that must skip a step
//! together: one hidden unit of block 0's MLP made loud (its `W1` and `W3` columns 40 times
//! larger, so its activation grows by 1600) and silent (its `W2` row zero). The block's
//! output does not change and no activation's gradient grows; only that unit's `W2`
//! gradient, the loud activation times the output's scaled gradient, passes fp16's largest
//! value for the first steps. Whoever holds that unit overflows alone.

use tl_train::model::Llama;
use tl_train::train::{Record, Trainer};

/// Makes hidden unit `local` (an index into this model's part of the hidden units) of
/// block 0 loud and silent, if `model` holds block 0.
pub fn make_unit_loud(model: &Llama<f32>, local: usize) {
    for (name, param) in model.named_parameters() {
        match name.as_str() {
            // `[d, hidden]`: the unit's column.
            "blocks.0.w1.weight" | "blocks.0.w3.weight" => param.update_value(|w| {
                w.index_axis_mut(tl_tensor::ndarray::Axis(1), local)
                    .mapv_inplace(|v| 40.0 * v);
            }),
            // `[hidden, d]`: the unit's row.
            "blocks.0.w2.weight" => param.update_value(|w| {
                w.index_axis_mut(tl_tensor::ndarray::Axis(0), local)
                    .fill(0.0);
            }),
            _ => {}
        }
    }
}

/// What a step reported: its loss, whether it was skipped, the loss scale after it.
pub type Step = (f64, bool, f64);

/// `steps` fp16 steps of `trainer`, as reported.
pub fn steps(mut trainer: Trainer, steps: usize) -> Vec<Step> {
    (0..steps)
        .map(|_| match trainer.train_step().unwrap() {
            Record::Train {
                loss,
                skipped,
                scale,
                ..
            } => (loss, skipped, scale.expect("fp16 scales the loss")),
            other => panic!("not a training step: {other:?}"),
        })
        .collect()
}
