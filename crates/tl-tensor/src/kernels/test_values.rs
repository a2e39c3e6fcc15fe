//! Test inputs for the kernels' vector paths, shared by their bit-for-bit tests: the special
//! values every path must carry through, a fixed-seed stream of ordinary ones, and bits that
//! count every NaN as one value.

/// NaN, ±∞, ±0 and two subnormals (one of each sign).
pub(crate) const SPECIALS: [f32; 7] = [
    f32::NAN,
    f32::INFINITY,
    f32::NEG_INFINITY,
    0.0,
    -0.0,
    1e-40,
    -3e-39,
];

/// A stream of values in `[0, 1)` (24 random bits each) from a fixed-seed linear
/// congruential generator: the same inputs on every run.
pub(crate) fn uniform(seed: u64) -> impl FnMut() -> f32 {
    let mut state = seed;
    move || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// The bits of each value, every NaN as `u32::MAX`: Rust leaves a NaN's sign and payload
/// unspecified (LLVM may swap an operation's operands), so any NaN stands for any other.
pub(crate) fn bits(xs: &[f32]) -> Vec<u32> {
    let bits = |x: &f32| if x.is_nan() { u32::MAX } else { x.to_bits() };
    xs.iter().map(bits).collect()
}
