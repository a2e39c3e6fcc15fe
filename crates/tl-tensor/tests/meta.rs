//! Meta mode against the real run: every op of the crate, and random graphs of them, make
//! the same allocations and frees, byte for byte and in order, with values and without.

use std::sync::Arc;

use ndarray::{ArrayD, IxDyn};
use proptest::prelude::*;
use tl_tensor::memory::{self, EventKind, Tag};
use tl_tensor::nn::{Dropout, Embedding, Linear, Module, RmsNorm, Sequential};
use tl_tensor::ops::given::with_given_product;
use tl_tensor::optim::{AdamW, Optimizer, Sgd, clip_grad_norm};
use tl_tensor::{Generator, ProductKernel, Tensor, losses, meta_mode};

type Events = Vec<(EventKind, usize, Tag, Option<Tag>)>;

/// Values in [0.5, 1.5): every op of the catalogue is finite on them.
fn values(shape: &[usize], rng: &Generator) -> ArrayD<f64> {
    ArrayD::from_shape_simple_fn(IxDyn(shape), || 0.5 + rng.next_f64())
}

/// Runs `body` with values or in meta mode, recording the meter's events.
fn record<T>(meta: bool, body: impl FnOnce() -> T) -> (T, Events) {
    let _meta = meta.then(meta_mode);
    let (out, events) = memory::record(body);
    let events = events
        .into_iter()
        .map(|e| (e.kind, e.bytes, e.tag, e.previous))
        .collect();
    (out, events)
}

/// A product kernel by definition, for `matmul_with`.
#[derive(Debug)]
struct Plain;

#[allow(clippy::too_many_arguments)]
fn plain<T: Copy + Default + std::ops::Add<Output = T> + std::ops::Mul<Output = T>>(
    (m, k, n): (usize, usize, usize),
    lhs: &[T],
    rhs: &[T],
    out: &mut [T],
    accumulate: bool,
) {
    for i in 0..m {
        for j in 0..n {
            let start = if accumulate {
                out[i * n + j]
            } else {
                T::default()
            };
            out[i * n + j] = (0..k).fold(start, |sum, p| sum + lhs[i * k + p] * rhs[p * n + j]);
        }
    }
}

impl ProductKernel for Plain {
    fn product_f32(
        &self,
        m: usize,
        k: usize,
        n: usize,
        lhs: &[f32],
        rhs: &[f32],
        out: &mut [f32],
        accumulate: bool,
    ) {
        plain((m, k, n), lhs, rhs, out, accumulate);
    }
    fn product_f64(
        &self,
        m: usize,
        k: usize,
        n: usize,
        lhs: &[f64],
        rhs: &[f64],
        out: &mut [f64],
        accumulate: bool,
    ) {
        plain((m, k, n), lhs, rhs, out, accumulate);
    }
}

/// One op of the catalogue: its name as the source spells it, the shapes of its inputs (all
/// parameters), and a forward pass using it.
struct Op {
    name: &'static str,
    inputs: &'static [&'static [usize]],
    forward: fn(&[Tensor<f64>]) -> Tensor<f64>,
}

const fn op(
    name: &'static str,
    inputs: &'static [&'static [usize]],
    forward: fn(&[Tensor<f64>]) -> Tensor<f64>,
) -> Op {
    Op {
        name,
        inputs,
        forward,
    }
}

const ROW: &[usize] = &[2, 3];
const BATCH: &[usize] = &[2, 2, 3];
const SQUARE: &[usize] = &[3, 3];

/// Every public op of tl-tensor, by the name `catalogue_is_complete` finds in the source.
fn catalogue() -> Vec<Op> {
    vec![
        op("add", &[ROW, &[3]], |x| &x[0] + &x[1]),
        op("sub", &[ROW, ROW], |x| &x[0] - &x[1]),
        op("mul", &[ROW, &[1, 3]], |x| &x[0] * &x[1]),
        op("div", &[ROW, ROW], |x| &x[0] / &x[1]),
        op("neg", &[ROW], |x| x[0].neg()),
        op("add_scalar", &[ROW], |x| x[0].add_scalar(1.0)),
        op("mul_scalar", &[ROW], |x| x[0].mul_scalar(2.0)),
        op("div_scalar", &[ROW], |x| x[0].div_scalar(2.0)),
        op("rsub_scalar", &[ROW], |x| x[0].rsub_scalar(1.0)),
        op("map_with_derivative", &[ROW], |x| {
            x[0].map_with_derivative(|v| v * v, |v| 2.0 * v)
        }),
        op("map_with_output_derivative", &[ROW], |x| {
            x[0].map_with_output_derivative(f64::exp, |y| y)
        }),
        op("from_op_saving_output", &[ROW], |x| {
            let x = &x[0];
            Tensor::from_op_saving_output(&x.shape(), || x.value().mapv(f64::exp), &[x], {
                |g, y| vec![Some(g * y)]
            })
        }),
        op("from_op_shaped", &[ROW], |x| {
            let x = &x[0];
            Tensor::from_op_shaped(&x.shape(), || x.to_array(), &[x], |g| vec![Some(g)])
        }),
        op("from_op_shared", &[ROW], |x| {
            let doubled = x[0].mul_scalar(2.0);
            Tensor::from_op_shared(&doubled.detach(), &[&x[0]], |g| vec![Some(g * 2.0)])
        }),
        op("from_op_in_place", &[ROW], |x| {
            let doubled = x[0].mul_scalar(2.0);
            Tensor::from_op_in_place(doubled, |v| v.mapv_inplace(|v| v + 1.0), |g| vec![Some(g)])
        }),
        op("from_op_tensors", &[ROW], |x| {
            Tensor::from_op_tensors(&x[0].mul_scalar(3.0), &[&x[0]], |g| {
                vec![Some(g.mul_scalar(3.0))]
            })
        }),
        op("from_product", &[ROW], |x| {
            let x = &x[0];
            Tensor::from_product(&x.shape(), || x.to_array(), &[x], |g| vec![Some(g)])
        }),
        op("from_product_by_parent", &[ROW], |x| {
            let x = &x[0];
            Tensor::from_product_by_parent(&x.shape(), || x.to_array(), &[x], |g, _| g.clone())
        }),
        op("exp", &[ROW], |x| x[0].exp()),
        op("log", &[ROW], |x| x[0].log()),
        op("sqrt", &[ROW], |x| x[0].sqrt()),
        op("rsqrt", &[ROW], |x| x[0].rsqrt()),
        op("powi", &[ROW], |x| x[0].powi(3)),
        op("relu", &[ROW], |x| x[0].relu()),
        op("gelu", &[ROW], |x| x[0].gelu()),
        op("silu", &[ROW], |x| x[0].silu()),
        op("sigmoid", &[ROW], |x| x[0].sigmoid()),
        op("tanh", &[ROW], |x| x[0].tanh()),
        op("abs", &[ROW], |x| x[0].abs()),
        op("swiglu", &[ROW, ROW], |x| x[0].swiglu(&x[1])),
        op("swiglu_then", &[ROW, ROW], |x| {
            x[0].swiglu_then(&x[1], &|chunk| chunk.iter_mut().for_each(|y| *y *= 2.0))
        }),
        op("narrow", &[ROW], |x| x[0].narrow(1, 1, 2)),
        op("concat", &[ROW, &[1, 3]], |x| {
            Tensor::concat(&[&x[0], &x[1]], 0)
        }),
        op("masked_fill", &[ROW], |x| {
            let mask = ndarray::arr1(&[true, false, true]).into_dyn();
            x[0].masked_fill(&mask, 0.0)
        }),
        op("gather_rows", &[SQUARE], |x| {
            x[0].gather_rows(&[2, 0, 2, 1])
        }),
        op("matmul", &[BATCH, SQUARE], |x| x[0].matmul(&x[1])),
        op("matmul_plain", &[BATCH, &[2, 3, 3]], |x| {
            x[0].matmul_plain(&x[1])
        }),
        op("matmul_with", &[BATCH, SQUARE], |x| {
            let kernel: Arc<dyn ProductKernel> = Arc::new(Plain);
            x[0].matmul_with(&x[1], &kernel)
        }),
        op("with_given_product", &[ROW, SQUARE], |x| {
            let known = x[0].matmul(&x[1]).detach();
            with_given_product(known, || x[0].matmul(&x[1]))
        }),
        op("sum_all", &[ROW], |x| x[0].sum_all()),
        op("mean_all", &[ROW], |x| x[0].mean_all()),
        op("sum_axes", &[BATCH], |x| x[0].sum_axes(&[0, 2], false)),
        op("mean_axes", &[BATCH], |x| x[0].mean_axes(&[1], true)),
        op("max_axis", &[BATCH], |x| x[0].max_axis(2, false)),
        op("reshape", &[BATCH], |x| x[0].reshape(&[3, 4])),
        op("permute", &[BATCH], |x| x[0].permute(&[2, 0, 1])),
        op("transpose", &[BATCH], |x| x[0].transpose(0, 2)),
        op("softmax", &[BATCH], |x| x[0].softmax(2)),
        op("log_softmax", &[BATCH], |x| x[0].log_softmax(1)),
        op("mse", &[ROW, ROW], |x| losses::mse(&x[0], &x[1])),
        op("cross_entropy", &[BATCH], |x| {
            losses::cross_entropy(&x[0], &[0, 2, 1, 1])
        }),
        op("Linear::forward", &[BATCH], |x| {
            Linear::new(3, 4, true, &Generator::new(1)).forward(&x[0])
        }),
        op("Embedding::forward_ids", &[], |_| {
            Embedding::new(5, 3, &Generator::new(1)).forward_ids(&[4, 0, 4], &[3])
        }),
        op("RmsNorm::forward", &[BATCH], |x| {
            RmsNorm::new(3, 1e-5).forward(&x[0])
        }),
        op("forward_then", &[BATCH], |x| {
            RmsNorm::new(3, 1e-5).forward_then(&x[0], &|chunk| chunk.fill(1.0))
        }),
        op("Dropout::forward", &[BATCH], |x| {
            let dropout = Dropout::new(0.5, Generator::new(3)).expect("a valid p");
            dropout.forward(&x[0])
        }),
        // Rows 1..3 of a mask of 4 rows: a sequence-parallel rank's rows.
        op("Dropout::forward_rows", &[&[2, 3]], |x| {
            let dropout = Dropout::new(0.5, Generator::new(3)).expect("a valid p");
            dropout.forward_rows(&x[0], 1, 4)
        }),
        op("Sequential::forward", &[BATCH], |x| {
            let rng = Generator::new(2);
            let layers: Vec<Box<dyn Module<f64>>> = vec![
                Box::new(Linear::new(3, 5, false, &rng)),
                Box::new(tl_tensor::nn::Silu),
                Box::new(Linear::new(5, 3, true, &rng)),
            ];
            Sequential::new(layers).forward(&x[0])
        }),
        op("Silu::forward", &[ROW], |x| {
            tl_tensor::nn::Silu.forward(&x[0])
        }),
        op("Relu::forward", &[ROW], |x| {
            tl_tensor::nn::Relu.forward(&x[0])
        }),
        op("Gelu::forward", &[ROW], |x| {
            tl_tensor::nn::Gelu.forward(&x[0])
        }),
        op("Tanh::forward", &[ROW], |x| {
            tl_tensor::nn::Tanh.forward(&x[0])
        }),
    ]
}

/// The op's forward and backward, an AdamW step, and everything dropped; with values or
/// in meta mode. Returns the output's shape and the meter's events.
fn run_op(op: &Op, meta: bool) -> (Vec<usize>, Vec<Vec<usize>>, Events) {
    let rng = Generator::new(7);
    let ((shape, grads), events) = record(meta, || {
        let inputs: Vec<Tensor<f64>> = op
            .inputs
            .iter()
            .map(|shape| Tensor::param_with(shape, || values(shape, &rng)))
            .collect();
        let output = (op.forward)(&inputs);
        let shape = output.shape();
        assert_eq!(output.is_meta(), meta, "{}: the output's mode", op.name);
        let loss = if output.ndim() == 0 {
            output.clone()
        } else {
            output.sum_all()
        };
        if loss.requires_grad() {
            loss.backward();
        }
        drop((output, loss));
        let grads: Vec<Vec<usize>> = inputs
            .iter()
            .map(|x| x.grad().map_or(Vec::new(), |g| g.shape().to_vec()))
            .collect();
        let mut adamw = AdamW::new(inputs.clone(), 1e-3).expect("a valid rate");
        adamw.step();
        (shape, grads)
    });
    (shape, grads, events)
}

#[test]
fn every_op_allocates_and_frees_in_meta_mode_as_with_values() {
    for op in catalogue() {
        let (real_shape, real_grads, real) = run_op(&op, false);
        let (meta_shape, meta_grads, meta) = run_op(&op, true);
        assert_eq!(meta_shape, real_shape, "{}: output shape", op.name);
        assert!(!real.is_empty(), "{}: the real run allocates", op.name);
        assert_eq!(meta, real, "{}: the meter's events", op.name);
        // A meta gradient reads as an empty array; a real one has its parameter's shape.
        for ((real, meta), shape) in real_grads.iter().zip(&meta_grads).zip(op.inputs) {
            assert_eq!(real.as_slice(), *shape, "{}: a real gradient", op.name);
            assert_eq!(meta.as_slice(), [0], "{}: a meta gradient", op.name);
        }
    }
}

/// The public functions of `source` that return a tensor: the crate's ops.
fn ops_in(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    for (start, _) in source.match_indices("pub fn ") {
        let rest = &source[start + "pub fn ".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        let signature = &rest[..rest.find('{').unwrap_or(rest.len())];
        let returns = signature.rsplit("->").next().unwrap_or("").trim();
        if signature.contains("->") && (returns == "Tensor<E>" || returns == "Self") {
            names.push(name);
        }
    }
    names
}

#[test]
fn catalogue_is_complete() {
    // Every public function returning a tensor in the files of ops, and every module's
    // forward, must be in the catalogue: an op added without a meta test fails here, and an
    // op without a shape rule then fails `every_op_...` (from_op refuses meta inputs).
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files: Vec<_> = ["ops", "nn"]
        .iter()
        .flat_map(|dir| std::fs::read_dir(root.join(dir)).expect("a source folder"))
        .map(|entry| entry.expect("an entry").path())
        .collect();
    files.extend(["losses.rs", "tensor.rs"].map(|file| root.join(file)));
    let names: Vec<&str> = catalogue().iter().map(|op| op.name).collect();
    // Constructors of leaves and constants, not ops: they have no inputs to be meta.
    let not_ops = [
        "from_array",
        "param",
        "from_vec",
        "scalar",
        "full",
        "zeros",
        "ones",
        "meta",
        "meta_param",
        "param_with",
        "detach",
        "detach_leaf",
        "from_op",
        "new",
        "from_parts",
        "from_weight",
    ];
    let mut missing = Vec::new();
    for file in files {
        let source = std::fs::read_to_string(&file).expect("readable source");
        for name in ops_in(&source) {
            if !not_ops.contains(&name.as_str()) && !names.iter().any(|n| n.ends_with(&*name)) {
                missing.push(format!("{name} ({})", file.display()));
            }
        }
        for (start, _) in source.match_indices("Module<E> for ") {
            let module: String = source[start + "Module<E> for ".len()..]
                .chars()
                .take_while(|c| c.is_alphanumeric())
                .collect();
            // A macro's impls (`for $name`) are named where the macro is used.
            if !module.is_empty() && !names.contains(&format!("{module}::forward").as_str()) {
                missing.push(format!("{module}::forward ({})", file.display()));
            }
        }
    }
    assert!(missing.is_empty(), "ops without a meta test: {missing:?}");
}

#[test]
#[should_panic(expected = "no shape rule")]
fn an_op_without_a_shape_rule_refuses_a_meta_input() {
    let x = Tensor::<f32>::meta_param(&[2]);
    let _ = Tensor::from_op(ndarray::arr1(&[0.0, 0.0]).into_dyn(), &[&x], |g| {
        vec![Some(g)]
    });
}

#[test]
fn a_wrong_shape_rule_fails_on_values() {
    let x = Tensor::<f32>::param(ndarray::arr1(&[1.0, 2.0]).into_dyn());
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Tensor::from_op_shaped(&[3], || x.to_array(), &[&x], |g| vec![Some(g)])
    }));
    assert!(
        caught.is_err(),
        "a kernel's result of another shape than its rule is refused"
    );
}

#[test]
fn values_dependent_reads_have_their_meta_answers() {
    let _meta = meta_mode();
    let w = Tensor::<f32>::param(ArrayD::ones(IxDyn(&[3, 4])));
    assert!(w.is_meta() && w.value().is_empty());
    let loss = w.sum_all();
    assert_eq!(loss.item(), 0.0, "item of a meta scalar is zero");
    loss.backward();
    assert!(w.grad_is_meta());
    assert_eq!(
        clip_grad_norm(std::slice::from_ref(&w), 1.0).expect("a valid max"),
        0.0
    );
    // Even a max below the norm's epsilon, which asks to scale, scales nothing.
    assert_eq!(
        clip_grad_norm(std::slice::from_ref(&w), 1e-300).expect("a valid max"),
        0.0
    );
    assert_eq!(w.argmax_axis(1).shape(), &[3]);
    assert!(tl_tensor::kernels::finite::all_finite(
        w.grad()
            .expect("a gradient")
            .as_slice()
            .expect("contiguous")
    ));
    let mut sgd = Sgd::new(vec![w.clone()], 0.1)
        .expect("valid")
        .with_momentum(0.9)
        .expect("valid");
    let before = memory::live_bytes();
    sgd.step();
    assert_eq!(
        memory::live_bytes() - before,
        48,
        "the momentum buffer, as a real step"
    );
}

/// One step of a random graph over `[rows, width]` tensors: which op, and which earlier
/// tensors it reads (indices taken modulo the pool).
#[derive(Clone, Debug)]
struct Step {
    op: usize,
    lhs: usize,
    rhs: usize,
    forget: Option<usize>,
}

const RANDOM_OPS: usize = 30;

/// Applies op `which` to `a` and `b` (both `[rows, width]`), giving `[rows, width]`.
fn apply(which: usize, a: &Tensor<f64>, b: &Tensor<f64>, weight: &Tensor<f64>) -> Tensor<f64> {
    let width = a.shape()[1];
    match which {
        0 => a + b,
        1 => a - b,
        2 => a * b,
        3 => a / &b.abs().add_scalar(1.0),
        4 => a.neg(),
        5 => a.mul_scalar(0.5).add_scalar(0.25),
        6 => a.rsub_scalar(1.0).div_scalar(2.0),
        7 => a.tanh().exp(),
        8 => a.abs().add_scalar(1.0).log(),
        9 => a.abs().add_scalar(1.0).sqrt().rsqrt(),
        10 => a.powi(2),
        11 => a.relu() + b.gelu(),
        12 => a.silu() * b.sigmoid(),
        13 => a.swiglu(b),
        14 => a.matmul(weight),
        15 => a.softmax(1),
        16 => a.log_softmax(1),
        17 => a + &a.sum_axes(&[1], true),
        18 => a - &a.max_axis(1, true),
        19 => a + &b.mean_axes(&[0], true),
        20 if width >= 2 => Tensor::concat(&[&a.narrow(1, 0, 1), &b.narrow(1, 1, width - 1)], 1),
        21 => a.reshape(&[a.numel()]).reshape(&a.shape()),
        22 => a.transpose(0, 1).permute(&[1, 0]),
        23 => {
            let mask = ArrayD::from_shape_fn(IxDyn(&[width]), |i| i[0] % 2 == 0);
            a.masked_fill(&mask, 0.0)
        }
        24 => Dropout::new(0.5, Generator::new(width as u64))
            .expect("a valid p")
            .forward(a),
        25 => RmsNorm::new(width, 1e-6).forward(a),
        26 => weight.gather_rows(&vec![0; a.shape()[0]]) + a,
        27 => Tensor::from_op_in_place(
            a * b,
            |v| v.mapv_inplace(|v| v * 2.0),
            |g| vec![Some(g * 2.0)],
        ),
        28 => Tensor::from_op_tensors(&a.mul_scalar(2.0), &[a], |g| vec![Some(g.mul_scalar(2.0))]),
        _ => a.mul_scalar(1.5),
    }
}

/// A random graph, its backward and an AdamW step, every tensor dropped at the end; the
/// output's shape and the meter's events.
fn run_graph(rows: usize, width: usize, steps: &[Step], meta: bool) -> Events {
    let rng = Generator::new(11);
    let ((), events) = record(meta, || {
        let param = |shape: &[usize]| Tensor::param_with(shape, || values(shape, &rng));
        let weight = param(&[width, width]);
        let leaves = vec![param(&[rows, width]), param(&[rows, width])];
        let mut pool: Vec<Option<Tensor<f64>>> = leaves.iter().cloned().map(Some).collect();
        for step in steps {
            let live: Vec<&Tensor<f64>> = pool.iter().flatten().collect();
            let (a, b) = (live[step.lhs % live.len()], live[step.rhs % live.len()]);
            let out = apply(step.op, a, b, &weight);
            if let Some(forget) = step.forget {
                // Drop an earlier result (never the leaves): its graph lives on in what reads it.
                let index = 2 + forget % pool.len().saturating_sub(2).max(1);
                if index < pool.len() {
                    pool[index] = None;
                }
            }
            pool.push(Some(out));
        }
        let last = pool
            .iter()
            .flatten()
            .last()
            .expect("the leaves at least")
            .clone();
        let targets: Vec<usize> = (0..rows).map(|r| r % width).collect();
        let loss = pool
            .iter()
            .flatten()
            .map(Tensor::mean_all)
            .fold(losses::cross_entropy(&last, &targets), |acc, term| {
                &acc + &term
            });
        drop(pool);
        drop(last);
        loss.backward();
        drop(loss);
        let mut parameters = leaves.clone();
        parameters.push(weight.clone());
        let mut adamw = AdamW::new(parameters, 1e-3).expect("a valid rate");
        adamw.step();
        adamw.zero_grad();
    });
    events
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    prop::collection::vec(
        (
            0..RANDOM_OPS,
            any::<usize>(),
            any::<usize>(),
            prop::option::of(any::<usize>()),
        )
            .prop_map(|(op, lhs, rhs, forget)| Step {
                op,
                lhs,
                rhs,
                forget,
            }),
        1..12,
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn random_graphs_make_the_same_events_in_meta_mode(
        rows in 1usize..4,
        width in 1usize..5,
        steps in steps(),
    ) {
        let real = run_graph(rows, width, &steps, false);
        let meta = run_graph(rows, width, &steps, true);
        prop_assert!(!real.is_empty());
        prop_assert_eq!(meta, real);
    }
}
