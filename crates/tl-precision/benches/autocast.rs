//! The cost of bf16 autocast on a capstone-sized matmul: (4096×320)·(320×896), forward and
//! backward, against the plain f32 product.
//!
//! Autocast adds O(n²) rounding passes (both operands and the output forward, the three
//! gradients backward) around three O(n³) products, so the target is at most 1.10× the f32
//! time. After criterion's report, a short manual run prints the ratio and the time of the
//! rounding passes alone.
//!
//! The same product on a tensor-core accumulation model (`autocast_with`, bf16 on an H100,
//! fp16 on a V100) shows what the block-FMA kernel costs against the f32 GEMM; the issue's
//! target is at most 10×.
//!
//! Run with `cargo bench -p tl-precision --bench autocast`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use tl_precision::{Accumulation, Format, autocast_bf16, autocast_with, cast};
use tl_tensor::ndarray::{ArrayD, IxDyn};
use tl_tensor::{Generator, Tensor};

const TOKENS: usize = 4096;
const D_MODEL: usize = 320;
const HIDDEN: usize = 896;

fn random(shape: &[usize], rng: &Generator) -> ArrayD<f32> {
    ArrayD::from_shape_simple_fn(IxDyn(shape), || rng.next_normal() as f32)
}

struct Operands {
    lhs: Tensor<f32>,
    rhs: Tensor<f32>,
}

impl Operands {
    fn new() -> Self {
        let rng = Generator::new(0);
        Self {
            lhs: Tensor::param(random(&[TOKENS, D_MODEL], &rng)),
            rhs: Tensor::param(random(&[D_MODEL, HIDDEN], &rng)),
        }
    }

    /// One forward and backward pass; the gradients are dropped first so every iteration
    /// does the same work.
    fn forward_backward(&self) {
        self.lhs.zero_grad();
        self.rhs.zero_grad();
        let y = self.lhs.matmul(&self.rhs);
        y.sum_all().backward();
        black_box(self.rhs.with_grad(|g| g.map(|g| g[[0, 0]])));
    }

    fn forward_backward_bf16(&self) {
        let _bf16 = autocast_bf16();
        self.forward_backward();
    }

    fn forward_backward_on(&self, format: Format, accumulation: Accumulation) {
        let _model = autocast_with(format, accumulation);
        self.forward_backward();
    }

    /// Only the rounding work autocast adds: the casts of both operands and of an
    /// output-sized tensor forward, and the casts of their three gradients backward (plus
    /// allocating the three seed gradients, which the real backward gets from the matmul).
    fn rounding_only(&self, output: &Tensor<f32>) {
        for x in [&self.lhs, &self.rhs, output] {
            x.zero_grad();
            let y = cast(x, Format::Bf16);
            y.backward_with(ArrayD::from_elem(y.value().raw_dim(), 1.0));
        }
    }
}

fn mean_time(iterations: u32, f: impl Fn()) -> Duration {
    f();
    let start = Instant::now();
    for _ in 0..iterations {
        f();
    }
    start.elapsed() / iterations
}

fn main() {
    let operands = Operands::new();
    let mut criterion = Criterion::default()
        .sample_size(10)
        .measurement_time(Duration::from_secs(8))
        .configure_from_args();
    let mut group = criterion.benchmark_group("matmul_4096x320x896_fwd_bwd");
    group.bench_function("f32", |b| b.iter(|| operands.forward_backward()));
    group.bench_function("bf16_autocast", |b| {
        b.iter(|| operands.forward_backward_bf16())
    });
    group.bench_function("bf16_h100", |b| {
        b.iter(|| operands.forward_backward_on(Format::Bf16, Accumulation::H100))
    });
    group.bench_function("fp16_v100", |b| {
        b.iter(|| operands.forward_backward_on(Format::Fp16, Accumulation::V100))
    });
    group.finish();
    criterion.final_summary();

    // Interleaved manual runs, so both see the same machine load.
    let output = Tensor::param(ArrayD::<f32>::ones(IxDyn(&[TOKENS, HIDDEN])));
    let (mut plain, mut bf16, mut rounding) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    for _ in 0..5 {
        plain += mean_time(4, || operands.forward_backward());
        bf16 += mean_time(4, || operands.forward_backward_bf16());
        rounding += mean_time(4, || operands.rounding_only(&output));
    }
    println!(
        "f32 {:.1} ms, bf16 autocast {:.1} ms: ratio {:.3}; the rounding passes alone {:.1} ms",
        plain.as_secs_f64() * 200.0,
        bf16.as_secs_f64() * 200.0,
        bf16.as_secs_f64() / plain.as_secs_f64(),
        rounding.as_secs_f64() * 200.0,
    );
    let (mut h100, mut v100) = (Duration::ZERO, Duration::ZERO);
    let mut plain = Duration::ZERO;
    for _ in 0..3 {
        plain += mean_time(2, || operands.forward_backward_bf16());
        h100 += mean_time(2, || {
            operands.forward_backward_on(Format::Bf16, Accumulation::H100)
        });
        v100 += mean_time(2, || {
            operands.forward_backward_on(Format::Fp16, Accumulation::V100)
        });
    }
    println!(
        "bf16 autocast {:.1} ms; on an H100 model {:.1} ms (ratio {:.2}); fp16 on a V100 model \
         {:.1} ms (ratio {:.2})",
        plain.as_secs_f64() * 1000.0 / 3.0,
        h100.as_secs_f64() * 1000.0 / 3.0,
        h100.as_secs_f64() / plain.as_secs_f64(),
        v100.as_secs_f64() * 1000.0 / 3.0,
        v100.as_secs_f64() / plain.as_secs_f64(),
    );
}
