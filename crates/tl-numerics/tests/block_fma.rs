//! The tensor-core accumulation models against the probes that reveal a block FMA's
//! parameters, and against an exact reference in wide integers on random blocks.
//!
//! The reference shares no code with the crate: every term is a `BigInt` multiple of
//! `2^-SCALE`, the alignment is a division of those integers, and the final truncation into
//! binary32 is found by comparing the exact sum with f32 candidates, not by shifting bits.

use half::f16;
use num_bigint::BigInt;
use num_traits::{Signed, ToPrimitive, Zero};
use proptest::prelude::*;
use tl_numerics::{BlockFma, Format, GemmKernel, Round};

const MODELS: [(&str, BlockFma); 3] = [
    ("V100", BlockFma::V100),
    ("A100", BlockFma::A100),
    ("H100", BlockFma::H100),
];

fn p2(e: i32) -> f64 {
    2f64.powi(e)
}

/// A probe: `c + Σ a[i]·b[i]` and the result expected on V100, A100 and H100.
struct Probe {
    what: &'static str,
    format: Format,
    a: Vec<f64>,
    b: Vec<f64>,
    c: f64,
    expected: [f64; 3],
}

fn probe(what: &'static str, a: &[f64], b: &[f64], c: f64, expected: [f64; 3]) -> Probe {
    Probe {
        what,
        format: Format::Fp16,
        a: a.to_vec(),
        b: b.to_vec(),
        c,
        expected,
    }
}

/// The probes of Fasi, Higham, Mikaitis & Pranesh's test suite (tensor-cores-numerical-
/// behavior, the V100, T4/A100 binary16 and A100 bf16 programs): the values each program
/// requires to pass on its GPU. Their H100 column is the Khattak–Mikaitis H100 model's.
fn fasi_probes() -> Vec<Probe> {
    let one4 = [1.0; 4];
    let tiny4 = [p2(-24); 4];
    let x = 1.0 - p2(-11);
    let mut probes = vec![
        probe(
            "no extra bit on V100",
            &[1.0],
            &[1.0],
            -(1.0 - p2(-24)),
            [p2(-23), p2(-24), p2(-24)],
        ),
        probe(
            "the extra bit cancels exactly",
            &[1.0, 1.0],
            &[1.0, -p2(-24)],
            -1.0 + p2(-24),
            [p2(-23), 0.0, 0.0],
        ),
        probe(
            "four 2^-24 beside 1",
            &one4,
            &tiny4,
            1.0,
            [1.0, 1.0 + p2(-22), 1.0 + p2(-22)],
        ),
        probe(
            "four 2^-25 beside 1",
            &[0.5; 4],
            &tiny4,
            1.0,
            [1.0, 1.0, 1.0 + p2(-23)],
        ),
        probe(
            "truncation",
            &one4,
            &[2.0, 3.0 * p2(-24), 0.0, 0.0],
            0.0,
            [2.0; 3],
        ),
        probe(
            "truncation, negative",
            &one4,
            &[-2.0, -3.0 * p2(-24), 0.0, 0.0],
            0.0,
            [-2.0; 3],
        ),
        probe(
            "one normalisation at the end",
            &one4,
            &tiny4,
            1.0 - p2(-24),
            [1.0 + p2(-23); 3],
        ),
        probe(
            "carry bits",
            &one4,
            &[1.0, 1.5, 1.75, 1.875],
            1.875,
            [8.0; 3],
        ),
        probe(
            "carries and truncation",
            &one4,
            &one4,
            1.0 + p2(-22) + p2(-23),
            [5.0; 3],
        ),
        probe(
            "same, negative",
            &one4,
            &[-1.0; 4],
            -(1.0 + p2(-22) + p2(-23)),
            [-5.0; 3],
        ),
        probe(
            "exact products",
            &[x; 4],
            &[x; 4],
            0.0,
            [4.0 * (1.0 - p2(-10) + p2(-22)); 3],
        ),
        probe(
            "one exact product",
            &[x],
            &[x],
            0.0,
            [1.0 - p2(-10) + p2(-22); 3],
        ),
        probe(
            "fp16 subnormal input",
            &[p2(-24)],
            &[4.0],
            0.0,
            [p2(-22); 3],
        ),
        probe(
            "binary32 subnormal accumulator",
            &[0.0],
            &[0.0],
            p2(-149),
            [p2(-149); 3],
        ),
    ];
    for i in 0..4 {
        let mut b = one4;
        b[i] = p2(-23);
        probes.push(probe(
            "a tiny term among ones",
            &one4,
            &b,
            1.0 + p2(-22) + p2(-23),
            [4.0 + p2(-21); 3],
        ));
    }
    // The A100 bf16 program's subnormal probes.
    for (a, b, c, r) in [
        (p2(-133), p2(7), 0.0, p2(-126)),
        (p2(-126), 0.5, 0.0, p2(-127)),
        (p2(-126), 1.0, -p2(-127), p2(-127)),
    ] {
        probes.push(Probe {
            what: "bf16 subnormals",
            format: Format::Bf16,
            a: vec![a],
            b: vec![b],
            c,
            expected: [r; 3],
        });
    }
    probes
}

/// The test vectors of Khattak & Mikaitis (IEEE HPEC 2025 block-FMA tests), with the
/// results their V100, A100 and H100 models give.
fn khattak_probes() -> Vec<Probe> {
    let mut probes = vec![
        probe(
            "one extra bit",
            &[p2(-24); 2],
            &[1.0; 2],
            1.0,
            [1.0, 1.0 + p2(-23), 1.0 + p2(-23)],
        ),
        probe(
            "two extra bits",
            &[p2(-24); 3],
            &[1.0, 0.5, 0.5],
            1.0,
            [1.0, 1.0, 1.0 + p2(-23)],
        ),
        probe(
            "late normalisation",
            &[p2(-21) + p2(-24); 2],
            &[1.0; 2],
            1.0 - p2(-21),
            [1.0 + p2(-21) + p2(-23); 3],
        ),
        probe(
            "final truncation",
            &[1.0; 3],
            &[1.0; 3],
            1.0 + p2(-23) + p2(-22),
            [4.0; 3],
        ),
        probe(
            "final truncation, negative",
            &[1.0; 3],
            &[-1.0; 3],
            -(1.0 + p2(-23) + p2(-22)),
            [-4.0; 3],
        ),
    ];
    for (i, (_, fma)) in MODELS.iter().enumerate() {
        let scale = p2(-(fma.extra_bits() as i32));
        let mut expected = [f64::NAN; 3];
        expected[i] = 1.0;
        probes.push(probe(
            "alignment truncates",
            &[p2(-24); 2],
            &[1.5 * scale; 2],
            1.0,
            expected,
        ));
        // Chaining: a term in the second block.
        let n = fma.block();
        let (mut a, mut b) = (vec![0.0; n + 1], vec![0.0; n + 1]);
        (a[n], b[n]) = (p2(-24), 1.5);
        let mut chained = probe(
            "blocks chain by truncation",
            &a,
            &b,
            1.0 + p2(-23),
            [f64::NAN; 3],
        );
        chained.expected[i] = 1.0 + p2(-23);
        probes.push(chained);
    }
    // The product's exponent is not normalised: 1.5·1.5 counts as exponent 0, so the V100
    // keeps 2^-23 beside it (a normalised exponent 1 would cut it to 0).
    probes.push(probe(
        "unnormalised product exponent",
        &[1.5, -1.5, p2(-23)],
        &[1.5, 1.5, 1.0],
        0.0,
        [p2(-23); 3],
    ));
    probes
}

#[test]
fn every_model_reproduces_the_papers_probes() {
    for probe in fasi_probes().into_iter().chain(khattak_probes()) {
        for (i, (name, fma)) in MODELS.iter().enumerate() {
            let expected = probe.expected[i];
            if expected.is_nan() {
                continue; // a probe of another model's parameters
            }
            let got = fma.dot_with(probe.format, probe.c as f32, &probe.a, &probe.b);
            assert_eq!(
                f64::from(got),
                expected,
                "{name}: {} (c = {}, a = {:?}, b = {:?})",
                probe.what,
                probe.c,
                probe.a,
                probe.b
            );
        }
    }
}

// The block size: 1·1 at index 0, 2^-23·1 at index k-1, c = 1 + 2^-23. While both products
// share the first block the exact sum 2 + 2^-22 is kept; once 2^-23 falls in the second,
// the first block's 2 + 2^-23 has been truncated to 2, and 2^-23 is below 2's unit. The
// first k that gives 2 is the block size plus one.
#[test]
fn the_block_size_probe_finds_4_8_and_16() {
    for (name, fma) in MODELS {
        let result = |k: usize| {
            let (mut a, mut b) = (vec![0.0; k], vec![0.0; k]);
            (a[0], b[0], a[k - 1], b[k - 1]) = (1.0, 1.0, p2(-23), 1.0);
            fma.dot_with(Format::Fp16, 1.0 + 2f32.powi(-23), &a, &b)
        };
        let first_out = (2..=40).find(|&k| result(k) == 2.0).unwrap();
        assert_eq!(first_out - 1, fma.block(), "{name}");
        assert_eq!(result(first_out - 1), 2.0 + 2f32.powi(-22), "{name}");
    }
}

// The extra bits: 1 and then 2^t copies of 2^-(23+t) in one block survive the alignment to
// 1's unit, 2^-(23 + extra), exactly while t ≤ extra, and add up to 2^-23.
#[test]
fn the_extra_bits_probe_finds_0_1_and_2() {
    for (name, fma) in MODELS {
        let survives = |t: i32| {
            let terms = vec![p2(-23 - t); 1 << t];
            fma.dot_with(Format::Fp16, 1.0, &terms, &vec![1.0; terms.len()]) == 1.0 + 2f32.powi(-23)
        };
        let finest = (0..=3)
            .take_while(|&t| (1 << t) <= fma.block() && survives(t))
            .last();
        assert_eq!(finest, Some(fma.extra_bits() as i32), "{name}");
    }
}

#[test]
fn special_values_zero_and_overflow() {
    let fma = BlockFma::H100;
    let f = Format::Bf16;
    assert!(fma.dot(f, &[f64::NAN, 1.0], &[1.0, 1.0]).is_nan());
    assert!(fma.dot(f, &[f64::INFINITY], &[0.0]).is_nan());
    assert!(
        fma.dot(f, &[f64::INFINITY, -1.0], &[1.0, f64::INFINITY])
            .is_nan()
    );
    assert_eq!(
        fma.dot(f, &[f64::INFINITY, 5.0], &[-1.0, 1.0]),
        f32::NEG_INFINITY
    );
    // Decided before the blocks: an infinity in the last block wins over the rest.
    let mut a = vec![1.0; 40];
    a[39] = f64::INFINITY;
    assert_eq!(fma.dot(f, &a, &[1.0; 40]), f32::INFINITY);
    // An exact zero is +0, whatever the signs that cancelled.
    assert_eq!(fma.dot(f, &[-1.0, 1.0], &[1.0, 1.0]).to_bits(), 0);
    assert_eq!(fma.dot(f, &[-0.0], &[1.0]).to_bits(), 0);
    // Two bf16 values near f32's top add beyond it: +inf, and it stays in later blocks.
    let big = 1.5 * p2(127);
    assert_eq!(fma.dot(f, &[big, big], &[1.5, 1.5]), f32::INFINITY);
    let mut terms = vec![big; 2];
    terms.extend(vec![-1.0; 20]);
    assert_eq!(fma.dot(f, &terms, &[1.5; 22]), f32::INFINITY);
    // Products beyond binary32's range can still cancel: exactly to zero, not ∞ - ∞.
    assert_eq!(fma.dot(f, &[big, -big], &[big, big]).to_bits(), 0);
    // Subnormal results are multiples of 2^-149, truncated.
    assert_eq!(fma.dot(f, &[p2(-140)], &[1.5 * p2(-9)]), 2f32.powi(-149));
    assert_eq!(fma.dot(f, &[p2(-140)], &[p2(-10)]), 0.0);
}

#[test]
fn invalid_models_are_refused_with_their_parameters() {
    assert_eq!(BlockFma::A100.min_alignment_exponent(), Some(-132));
    assert_eq!(BlockFma::H100.min_alignment_exponent(), Some(-133));
    assert_eq!(BlockFma::V100.min_alignment_exponent(), None);
    assert_eq!(BlockFma::new(8, 1).unwrap().min_alignment_exponent(), None);
    for (block, extra) in [(0, 0), (1 << 17, 0), (4, 41)] {
        let error = BlockFma::new(block, extra).unwrap_err();
        assert!(error.to_string().contains(&block.to_string()), "{error}");
    }
}

/// Any binary32 value as an exact multiple of `2^-SCALE`.
const SCALE: u32 = 2400;

fn exact(x: f64) -> BigInt {
    assert!(x.is_finite());
    let bits = x.to_bits();
    let field = ((bits >> 52) & 0x7FF) as i64;
    let fraction = bits & ((1 << 52) - 1);
    let (sig, exp) = if field == 0 {
        (fraction, -1074)
    } else {
        (fraction | (1 << 52), field - 1075)
    };
    let mut v = BigInt::from(sig) << (exp + i64::from(SCALE)) as u32;
    if x.is_sign_negative() {
        v = -v;
    }
    v
}

/// The binary32 value `v · 2^-(2·SCALE)` truncated toward zero, found by search: the
/// largest f32 of magnitude at most |v|.
fn truncated_f32(v: &BigInt) -> f32 {
    if v.is_zero() {
        return 0.0;
    }
    let magnitude = v.abs();
    let exact32 = |x: f32| exact(f64::from(x)) << SCALE;
    if magnitude >= exact(2f64.powi(128)) << SCALE {
        return if v.is_negative() {
            f32::NEG_INFINITY
        } else {
            f32::INFINITY
        };
    }
    // A close first guess from the leading bits, then exact steps.
    let length = magnitude.bits() as i64 - 2 * i64::from(SCALE);
    let top = (&magnitude >> (magnitude.bits().saturating_sub(60)))
        .to_f64()
        .unwrap();
    let guess = (top * 2f64.powi((length - 60).clamp(-1100, 1000) as i32)) as f32;
    let mut x = if guess.is_finite() { guess } else { f32::MAX };
    while exact32(x) > magnitude {
        x = x.next_down();
    }
    while x < f32::MAX && exact32(x.next_up()) <= magnitude {
        x = x.next_up();
    }
    if v.is_negative() { -x } else { x }
}

/// The smallest normal exponent of a format, restated.
fn emin(format: Format) -> i64 {
    match format {
        Format::Bf16 => -126,
        Format::Fp16 | Format::E5M2 => -14,
        Format::E4M3 => -6,
    }
}

/// `floor(log2 |x|)` of a nonzero exact value `v · 2^-scale`.
fn log2_floor(v: &BigInt, scale: u32) -> i64 {
    v.bits() as i64 - 1 - i64::from(scale)
}

/// One block step by the definition, in wide integers: products exact, the alignment
/// exponent the largest of the products' `e(x) + e(y)` (each operand's exponent in its
/// format, a subnormal's the format's smallest) and the accumulator's binary32 exponent.
fn reference_step(fma: BlockFma, format: Format, acc: f32, a: &[f64], b: &[f64]) -> f32 {
    let mut terms: Vec<BigInt> = Vec::new();
    let mut top: Option<i64> = None;
    for (&x, &y) in a.iter().zip(b) {
        let (ex, ey) = (exact(x), exact(y));
        if ex.is_zero() || ey.is_zero() {
            continue;
        }
        let e = log2_floor(&ex, SCALE).max(emin(format)) + log2_floor(&ey, SCALE).max(emin(format));
        top = Some(top.map_or(e, |t| t.max(e)));
        terms.push(ex * ey);
    }
    let c = exact(f64::from(acc)) << SCALE;
    if !c.is_zero() {
        let e = log2_floor(&c, 2 * SCALE).max(-126);
        top = Some(top.map_or(e, |t| t.max(e)));
        terms.push(c);
    }
    let Some(top) = top else {
        return 0.0;
    };
    // The model's lower limit on the alignment exponent.
    let top = fma
        .min_alignment_exponent()
        .map_or(top, |floor| top.max(i64::from(floor)));
    let unit_shift = top - 23 - i64::from(fma.extra_bits()) + 2 * i64::from(SCALE);
    let unit = BigInt::from(1) << unit_shift as u32;
    // Truncation toward zero: BigInt division truncates.
    let sum: BigInt = terms.iter().map(|t| (t / &unit) * &unit).sum();
    truncated_f32(&sum)
}

fn reference_dot(fma: BlockFma, format: Format, a: &[f64], b: &[f64]) -> f32 {
    a.chunks(fma.block())
        .zip(b.chunks(fma.block()))
        .fold(0.0, |acc, (a, b)| {
            if acc.is_infinite() {
                acc
            } else {
                reference_step(fma, format, acc, a, b)
            }
        })
}

/// Values of `format` of every kind: any pattern but NaN and infinity, zeros, subnormals,
/// and, for bf16, values near f32's top (overflow).
fn operand(format: Format) -> BoxedStrategy<f32> {
    match format {
        Format::E4M3 | Format::E5M2 => prop_oneof![
            // Values of every binade of the format, subnormals and the saturated top included.
            6 => (-20i32..17, 1.0f32..2.0, any::<bool>()).prop_map(move |(e, m, neg)| {
                let x = (m * 2f32.powi(e)).round_to_saturating(format);
                if neg { -x } else { x }
            }),
            1 => Just(0.0),
        ]
        .boxed(),
        Format::Fp16 => prop_oneof![
            6 => any::<u16>().prop_map(|h| f16::from_bits((h % 0x7C00) | (h & 0x8000)).to_f32()),
            2 => (0u16..0x400, any::<bool>()).prop_map(|(m, neg)| {
                let x = f16::from_bits(m).to_f32();
                if neg { -x } else { x }
            }),
            1 => Just(0.0),
        ]
        .boxed(),
        _ => prop_oneof![
            6 => any::<u16>().prop_map(|h| f32::from_bits(u32::from((h % 0x7F80) | (h & 0x8000)) << 16)),
            2 => (-30i32..30, any::<u8>(), any::<bool>()).prop_map(|(e, m, neg)| {
                let x = (1.0 + f32::from(m >> 1) / 128.0) * 2f32.powi(e);
                if neg { -x } else { x }
            }),
            1 => Just(0.0),
            1 => (1u32..128).prop_map(|m| f32::from_bits(m << 16)),
            1 => (120i32..=127).prop_map(|e| 1.5 * 2f32.powi(e)),
        ]
        .boxed(),
    }
}

fn model() -> impl Strategy<Value = BlockFma> {
    prop_oneof![
        Just(BlockFma::V100),
        Just(BlockFma::A100),
        Just(BlockFma::H100),
        (1usize..24, 0u32..6).prop_map(|(b, x)| BlockFma::new(b, x).unwrap()),
    ]
}

fn format() -> impl Strategy<Value = Format> {
    prop_oneof![
        2 => Just(Format::Bf16),
        2 => Just(Format::Fp16),
        1 => Just(Format::E4M3),
        1 => Just(Format::E5M2),
    ]
}

/// Operand vectors of `format` whose products often cancel: an entry may repeat the one
/// before it negated.
fn vectors(format: Format) -> impl Strategy<Value = (Vec<f64>, Vec<f64>)> {
    (1usize..48).prop_flat_map(move |k| {
        (
            proptest::collection::vec(operand(format), k),
            proptest::collection::vec(operand(format), k),
            proptest::collection::vec(any::<bool>(), k),
        )
            .prop_map(|(mut a, mut b, cancel)| {
                for i in 1..a.len() {
                    if cancel[i] {
                        a[i] = -a[i - 1];
                        b[i] = b[i - 1];
                    }
                }
                let wide = |xs: Vec<f32>| xs.into_iter().map(f64::from).collect::<Vec<_>>();
                (wide(a), wide(b))
            })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1500))]

    #[test]
    fn dot_equals_the_wide_integer_reference(
        fma in model(),
        (format, (a, b)) in format().prop_flat_map(|f| (Just(f), vectors(f))),
    ) {
        let expected = reference_dot(fma, format, &a, &b);
        let got = fma.dot(format, &a, &b);
        prop_assert_eq!(got.to_bits(), expected.to_bits(), "{:?} {}: {} vs {}", fma, format, got, expected);
    }

    #[test]
    fn gemm_equals_the_reference_on_every_output(
        fma in model(),
        (format, (m, k, n), seed) in format().prop_flat_map(|f| {
            (Just(f), (1usize..4, 1usize..40, 1usize..12), proptest::collection::vec(operand(f), 160 + 480))
        }),
    ) {
        let a: Vec<f32> = seed[..m * k].to_vec();
        let b: Vec<f32> = seed[160..160 + k * n].to_vec();
        let mut out = vec![0.0f32; m * n];
        fma.gemm(format, m, k, n, &a, &b, &mut out);
        let a64: Vec<f64> = a.iter().map(|&x| x.into()).collect();
        let b64: Vec<f64> = b.iter().map(|&x| x.into()).collect();
        let mut out64 = vec![0.0f64; m * n];
        fma.gemm(format, m, k, n, &a64, &b64, &mut out64);
        for i in 0..m {
            for j in 0..n {
                let column: Vec<f64> = (0..k).map(|p| b64[p * n + j]).collect();
                let expected = reference_dot(fma, format, &a64[i * k..(i + 1) * k], &column);
                prop_assert_eq!(out[i * n + j].to_bits(), expected.to_bits(), "{:?} {} ({}, {})", fma, format, i, j);
                prop_assert_eq!(out64[i * n + j].to_bits(), f64::from(expected).to_bits());
            }
        }
    }

    // Operands of any f64 value, not of the format: the exact path, by the same definition.
    #[test]
    fn any_f64_operands_follow_the_definition(
        fma in model(),
        a in proptest::collection::vec(-1e30f64..1e30, 1..20),
        scale in -200i32..200,
    ) {
        let b: Vec<f64> = a.iter().rev().map(|x| x * 2f64.powi(scale) / 3.0).collect();
        let got = fma.dot(Format::Bf16, &a, &b);
        prop_assert_eq!(got.to_bits(), reference_dot(fma, Format::Bf16, &a, &b).to_bits());
    }
}

/// The vectorised kernels this CPU runs. The others are named on stderr: a machine without
/// AVX-512 (or AVX2) says so, and the kernels it has are still tested.
fn vectorised_kernels() -> Vec<GemmKernel> {
    let (available, missing): (Vec<_>, Vec<_>) = GemmKernel::ALL
        .into_iter()
        .filter(|&k| k != GemmKernel::Exact)
        .partition(|k| k.is_available());
    if !missing.is_empty() {
        eprintln!("NOT TESTED on this CPU, which lacks their instructions: {missing:?}");
    }
    available
}

/// Whether a model's block sums fit the vectorised kernels' 32-bit lanes (else every
/// product takes the exact path).
fn fits_lanes(fma: BlockFma) -> bool {
    let extra = fma.extra_bits();
    fma.block() <= 32 && ((fma.block() as u64) << (25 + extra)) + (1u64 << (24 + extra)) <= 1 << 32
}

/// An operand of `format` or, one time in `special_one_in`, a special value: ±∞, NaN, or
/// a value no 12-bit format holds (which sends the product to the exact path).
fn operand_or_special(format: Format, special_one_in: u32) -> impl Strategy<Value = f32> {
    (operand(format), 0..special_one_in.max(1), 0u8..4).prop_map(|(x, r, which)| {
        if r != 0 {
            return x;
        }
        match which {
            0 => f32::INFINITY,
            1 => f32::NEG_INFINITY,
            2 => f32::NAN,
            _ => 1.0 + 2f32.powi(-20),
        }
    })
}

/// Every vectorised kernel against the exact path, bit for bit, and all of them against
/// the wide-integer reference where there is one.
fn check_every_kernel(
    fma: BlockFma,
    format: Format,
    (m, k, n): (usize, usize, usize),
    (a, b, c): (&[f32], &[f32], &[f32]),
    accumulate: bool,
) -> Result<(), TestCaseError> {
    let mut exact = c.to_vec();
    prop_assert!(fma.gemm_on(
        GemmKernel::Exact,
        format,
        (m, k, n),
        a,
        b,
        &mut exact,
        accumulate
    ));
    let plain = |xs: &[f32]| {
        xs.iter()
            .all(|x| x.is_finite() && f64::from(*x).round_to(format) == f64::from(*x))
    };
    let vectorisable =
        fits_lanes(fma) && plain(a) && plain(b) && (!accumulate || c.iter().all(|x| x.is_finite()));
    for kernel in vectorised_kernels() {
        let mut out = c.to_vec();
        let ran = fma.gemm_on(kernel, format, (m, k, n), a, b, &mut out, accumulate);
        prop_assert_eq!(ran, vectorisable, "{:?} {:?} {}", kernel, fma, format);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        if ran {
            prop_assert_eq!(
                bits(&out),
                bits(&exact),
                "{:?} {:?} {} {:?}",
                kernel,
                fma,
                format,
                (m, k, n)
            );
        } else {
            prop_assert_eq!(
                bits(&out),
                bits(c),
                "{:?} left its outputs as they were",
                kernel
            );
        }
    }
    // What gemm itself gives: the same bits, whichever kernel it picks.
    let mut auto = c.to_vec();
    if accumulate {
        fma.gemm_accumulate(format, m, k, n, a, b, &mut auto);
    } else {
        fma.gemm(format, m, k, n, a, b, &mut auto);
    }
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    prop_assert_eq!(bits(&auto), bits(&exact));
    // The exact path against the reference, output by output, when every term is finite.
    if a.iter().chain(b).chain(c).all(|x| x.is_finite()) {
        let wide = |xs: &[f32]| xs.iter().map(|&x| f64::from(x)).collect::<Vec<_>>();
        let (a64, b64) = (wide(a), wide(b));
        for i in 0..m {
            for j in 0..n {
                let column: Vec<f64> = (0..k).map(|p| b64[p * n + j]).collect();
                let row = &a64[i * k..(i + 1) * k];
                // Accumulating, the old output is the accumulator of the first block:
                // `dot_with`, itself held to the reference by the proptests above.
                let expected = if accumulate {
                    fma.dot_with(format, c[i * n + j], row, &column)
                } else {
                    reference_dot(fma, format, row, &column)
                };
                prop_assert_eq!(
                    exact[i * n + j].to_bits(),
                    expected.to_bits(),
                    "({}, {})",
                    i,
                    j
                );
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    // Shapes around the kernels' edges: k of 0 or past a block boundary, n past one or two
    // panels of 8 or 16 lanes, m of 1 to 5 (the AVX-512 kernel takes rows by four, then two,
    // then one); operands with subnormals, ±0, and now and then an infinity, a NaN or a value
    // of no 12-bit format.
    #[test]
    fn every_kernel_gives_the_exact_paths_bits_on_any_shape(
        fma in model(),
        accumulate in any::<bool>(),
        special_one_in in prop_oneof![Just(0u32), Just(400), Just(40)],
        (format, (m, k, n), seed) in format().prop_flat_map(move |f| {
            (
                Just(f),
                (1usize..6, 0usize..70, 1usize..40),
                proptest::collection::vec(operand(f), 5 * 70 + 70 * 40 + 5 * 40),
            )
        }),
        specials in proptest::collection::vec(operand_or_special(Format::Bf16, 400), 8),
        at in proptest::collection::vec(0usize..10_000, 8),
    ) {
        let mut a: Vec<f32> = seed[..m * k].to_vec();
        let mut b: Vec<f32> = seed[350..350 + k * n].to_vec();
        let c: Vec<f32> = if accumulate { seed[3150..3150 + m * n].to_vec() } else { vec![0.0; m * n] };
        if special_one_in != 0 {
            for (i, (&x, &p)) in specials.iter().zip(&at).enumerate() {
                if !x.is_finite() || p % special_one_in as usize == 0 {
                    let target = if i % 2 == 0 { &mut a } else { &mut b };
                    let len = target.len();
                    if len > 0 {
                        target[p % len] = if x.is_finite() { 1.0 + 2f32.powi(-20) } else { x };
                    }
                }
            }
        }
        check_every_kernel(fma, format, (m, k, n), (&a, &b, &c), accumulate)?;
    }
}

/// A larger fixed case on every preset and format of the papers: 67 inner terms (no block
/// divides it), 37 columns (two panels of 16 and five lanes of a third), 7 rows (four, two
/// and one), with subnormal operands, ±0, cancellations and an accumulator
/// that overflows; accumulating and not.
#[test]
fn every_kernel_agrees_on_a_ragged_product_with_subnormals_and_signed_zeros() {
    let (m, k, n) = (7, 67, 37);
    let mut state = 0x2545_F491_4F6C_DD1D_u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    for (format, fma) in [
        (Format::Fp16, BlockFma::V100),
        (Format::Bf16, BlockFma::A100),
        (Format::Fp16, BlockFma::A100),
        (Format::Bf16, BlockFma::H100),
        (Format::Fp16, BlockFma::H100),
        (Format::E4M3, BlockFma::H100),
        (Format::Bf16, BlockFma::new(5, 3).unwrap()),
    ] {
        let mut value = |_| {
            let r = next();
            let x = match r % 10 {
                0 => 0.0,
                1 => -0.0,
                // Subnormals of the format: its smallest normal exponent and below.
                2 => ((r >> 8) % 64) as f64 * format.min_subnormal(),
                _ => ((r >> 8) % 4096) as f64 / 512.0 * 2f64.powi(((r >> 20) % 24) as i32 - 12),
            };
            let x = if (r >> 40) & 1 == 1 { -x } else { x };
            x.round_to(format) as f32
        };
        let a: Vec<f32> = (0..m * k).map(&mut value).collect();
        let mut b: Vec<f32> = (0..k * n).map(&mut value).collect();
        // Cancellation: a column that is another negated.
        for p in 0..k {
            b[p * n + 5] = -b[p * n + 4];
        }
        let mut c: Vec<f32> = (0..m * n).map(&mut value).collect();
        c[3] = f32::MAX;
        c[4] = -0.0;
        for accumulate in [false, true] {
            check_every_kernel(fma, format, (m, k, n), (&a, &b, &c), accumulate)
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}
