//! Where two tools of the chapter meet. Each passes its own rows of the table; these check
//! the pair, the way a user combines them.

use tl_numerics::Format;
use tl_precision::{autocast, autocast_format, cast};
use tl_recompute::checkpoint;
use tl_tensor::Tensor;
use tl_tensor::ndarray::arr2;

/// A user's fused op that, like a tensor-core kernel, writes its result in the autocast
/// format: `cast(3·x)` under autocast, `3·x` outside. It asks for the format when it runs,
/// so in a checkpoint's rerun it must get the forward pass's answer.
fn fused_triple(x: &Tensor<f32>) -> Tensor<f32> {
    let tripled = x * 3.0;
    match autocast_format() {
        Some(format) => cast(&tripled, format),
        None => tripled,
    }
}

/// The gradient bits of `w` after `loss(w·x)` under bf16 autocast, the segment
/// checkpointed or not, and backward inside the guard or after it.
fn gradient_bits(checkpointed: bool, backward_inside: bool) -> Vec<u32> {
    gradient_bits_in(Some(Format::Bf16), checkpointed, backward_inside)
}

fn gradient_bits_in(format: Option<Format>, checkpointed: bool, backward_inside: bool) -> Vec<u32> {
    // 1 + 2^-6 + 2^-9: the tripled values and their gradients round in bf16.
    let w = Tensor::<f32>::param(arr2(&[[1.0 + 2f32.powi(-6) + 2f32.powi(-9), 0.7]]).into_dyn());
    let x = Tensor::<f32>::from_vec(vec![1.0, 1.0 / 3.0], &[2, 1]).unwrap();
    let guard = format.map(autocast);
    let hidden = if checkpointed {
        let w_in = w.clone();
        checkpoint(
            move |inputs| fused_triple(&w_in.matmul(&inputs[0])),
            std::slice::from_ref(&x),
            std::slice::from_ref(&w),
            &[],
        )
    } else {
        fused_triple(&w.matmul(&x))
    };
    // dL/dhidden = 0.3, which bf16 rounds: rd(3·rd(0.3)) = 0.90234375 but rd(3·0.3) =
    // 0.8984375, so a rerun without the op's cast sends another gradient to the product.
    let loss = (&hidden * 0.3).sum_all();
    if backward_inside {
        loss.backward();
        drop(guard);
    } else {
        drop(guard);
        loss.backward();
    }
    w.grad().unwrap().iter().map(|g| g.to_bits()).collect()
}

#[test]
fn test_checkpoint_under_autocast_backward_outside_the_guard() {
    let plain = gradient_bits(false, true);
    assert_eq!(
        gradient_bits(false, false),
        plain,
        "plain: backward's place is irrelevant"
    );
    assert_eq!(
        gradient_bits(true, true),
        plain,
        "checkpointed, backward inside"
    );
    assert_eq!(
        gradient_bits(true, false),
        plain,
        "checkpointed, backward after the guard"
    );
    // The fused op's rounding shows in the gradient: a rerun without it would differ.
    assert_ne!(gradient_bits_in(None, false, true), plain);
}
