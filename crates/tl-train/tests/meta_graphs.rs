//! Meta mode across the crates the trainer's step is made of: random small graphs of
//! tl-tensor's ops, tl-precision's casts, autocast products and fp8 product, and
//! tl-recompute's checkpoint under each keep policy make the same allocations and frees —
//! byte for byte, tag for tag and in order — with values and on meta tensors, forward and
//! backward. (tl-tensor's own catalogue and graphs are in `crates/tl-tensor/tests/meta.rs`.)

use std::cell::RefCell;
use std::rc::Rc;

use proptest::prelude::*;
use tl_numerics::Format;
use tl_precision::{Fp8Recipe, Fp8State, autocast, cast, fp8_matmul};
use tl_recompute::{KeepPolicy, checkpoint, keep_named, keep_product, keeping};
use tl_tensor::memory::{self, EventKind, Tag};
use tl_tensor::ndarray::{ArrayD, IxDyn};
use tl_tensor::{Generator, Tensor, meta_mode};

type Events = Vec<(EventKind, usize, Tag, Option<Tag>)>;

/// One step of a random graph over `[rows, width]` tensors.
#[derive(Clone, Debug)]
struct Step {
    op: usize,
    lhs: usize,
    rhs: usize,
}

const OPS: usize = 9;

/// Op `which` of `a` and `b` (both `[rows, width]`), with the square weights `w`.
fn apply(which: usize, a: &Tensor<f32>, b: &Tensor<f32>, w: &[Tensor<f32>; 2]) -> Tensor<f32> {
    let fp8 = || {
        Rc::new(RefCell::new(
            Fp8State::new(Fp8Recipe::default(), 1).unwrap(),
        ))
    };
    match which {
        0 => cast(a, Format::Bf16),
        1 => {
            let _bf16 = autocast(Format::Bf16);
            a.matmul(&w[0])
        }
        2 => {
            let _fp16 = autocast(Format::Fp16);
            (a + b).matmul(&w[1]).silu()
        }
        3 => fp8_matmul(a, &w[0], &fp8(), 0),
        // A checkpointed segment: a kept product (keep_product), a kept result (keep_named)
        // and plain ops, rerun during backward under whatever keep policy is in force.
        4 | 5 => {
            let weight = w[which - 4].clone();
            let segment = move |xs: &[Tensor<f32>]| {
                let product = keep_product("p", || xs[0].matmul(&weight));
                let gated = keep_named("g", || product.sigmoid());
                (&gated * &xs[1]).tanh()
            };
            checkpoint(segment, &[a.clone(), b.clone()], &w[..], &[])
        }
        6 => {
            let _bf16 = autocast(Format::Bf16);
            let weight = w[0].clone();
            checkpoint(
                move |xs| xs[0].matmul(&weight).gelu(),
                std::slice::from_ref(a),
                &w[..1],
                &[],
            )
        }
        7 => a.swiglu(b),
        _ => a.mul_scalar(0.5) - b,
    }
}

/// A random graph, its backward, every tensor dropped; with values or in meta mode.
fn run(rows: usize, width: usize, steps: &[Step], policy: &KeepPolicy, meta: bool) -> Events {
    let rng = Generator::new(3);
    let _meta = meta.then(meta_mode);
    let _policy = keeping(policy.clone());
    let ((), events) = memory::record(|| {
        let param = |shape: &[usize]| {
            Tensor::param_with(shape, || {
                ArrayD::from_shape_simple_fn(IxDyn(shape), || rng.next_f64() as f32 - 0.5)
            })
        };
        let w = [param(&[width, width]), param(&[width, width])];
        let mut pool = vec![param(&[rows, width]), param(&[rows, width])];
        for step in steps {
            let (a, b) = (&pool[step.lhs % pool.len()], &pool[step.rhs % pool.len()]);
            let out = apply(step.op, a, b, &w);
            pool.push(out);
        }
        let loss = pool
            .iter()
            .map(Tensor::mean_all)
            .reduce(|acc, term| &acc + &term)
            .expect("the leaves at least");
        drop(pool);
        loss.backward();
    });
    events
        .into_iter()
        .map(|e| (e.kind, e.bytes, e.tag, e.previous))
        .collect()
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (0..OPS, any::<usize>(), any::<usize>()).prop_map(|(op, lhs, rhs)| Step { op, lhs, rhs }),
        1..8,
    )
}

fn policies() -> impl Strategy<Value = KeepPolicy> {
    prop_oneof![
        Just(KeepPolicy::nothing()),
        Just(KeepPolicy::only(["p"])),
        Just(KeepPolicy::only(["g"])),
        Just(KeepPolicy::everything()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn graphs_across_the_crates_make_the_same_events_on_meta_tensors(
        rows in 1usize..4,
        width in 1usize..6,
        steps in steps(),
        policy in policies(),
    ) {
        let real = run(rows, width, &steps, &policy, false);
        let meta = run(rows, width, &steps, &policy, true);
        prop_assert!(!real.is_empty());
        prop_assert_eq!(meta, real);
    }
}
