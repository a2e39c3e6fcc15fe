//! Which code computes the units' order fastest on this CPU: the bf16 units or fused
//! multiply-adds. Both give the same bits (the module above), so this is a question of speed
//! alone, answered by timing the two instructions.
//!
//! `vdpbf16ps` adds 32 products per instruction and `vfmadd231ps` 16, so the units win
//! wherever they issue at least half as often as the fused multiply-adds. That is not a
//! property of the instruction set. On the Xeon with AMX this project is measured on (it
//! reports family 6, model 167; two 512-bit FMA ports) one `vdpbf16ps` issues every two
//! cycles against two fused multiply-adds a cycle, so the units add half as many products
//! per cycle. A CPU with one 512-bit FMA port, or one that splits 512-bit work in halves
//! (AMD's Zen 4), shifts the balance the other way. A table of CPU names would be a guess
//! that ages; a few microseconds of timing is not.

use std::sync::OnceLock;
use std::time::Duration;
#[cfg(target_arch = "x86_64")]
use std::time::Instant;

use super::units_available;

/// Whether products in the units' order should run on the bf16 units (`vdpbf16ps`) rather
/// than as fused multiply-adds: the CPU has the units and, timed once per process, they add
/// at least as many products per second as the fused multiply-adds do.
pub fn units_preferred() -> bool {
    static PREFERRED: OnceLock<bool> = OnceLock::new();
    *PREFERRED.get_or_init(|| units_available() && units_outpace_fma())
}

/// The tile that computes a product in the units' order on the units' packing of the right
/// operand: the units' own (`vdpbf16ps`), or fused multiply-adds (`Split`: the right
/// operand's pairs split in registers, the left operand read one f32 a value). The same
/// bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PairsTile {
    Units,
    Split,
}

#[cfg(test)]
thread_local! {
    /// A test's choice of tile on this thread, over the timing's.
    static CHOSEN: std::cell::Cell<Option<PairsTile>> = const { std::cell::Cell::new(None) };
}

/// The tile for this CPU ([`units_preferred`]), or the one a test chose on this thread
/// (the units only where the CPU has them).
pub(super) fn pairs_tile() -> PairsTile {
    #[cfg(test)]
    if let Some(tile) = CHOSEN.get() {
        return if units_available() {
            tile
        } else {
            PairsTile::Split
        };
    }
    if units_preferred() {
        PairsTile::Units
    } else {
        PairsTile::Split
    }
}

/// Runs `f` with products in the units' order on `tile`, on this thread (a product chooses
/// its tile on the thread that calls it, before spreading over the pool).
#[cfg(test)]
pub(super) fn with_pairs_tile<R>(tile: PairsTile, f: impl FnOnce() -> R) -> R {
    let before = CHOSEN.replace(Some(tile));
    let result = f();
    CHOSEN.set(before);
    result
}

/// Independent accumulators per timing loop: enough to cover either instruction's latency.
const CHAINS: usize = 16;
/// Iterations of a timing loop (16 instructions each): tens of microseconds.
const ROUNDS: usize = 4096;
/// Timings of each loop; the fastest counts, so that a preempted one does not.
const TRIALS: usize = 7;

/// Whether `vdpbf16ps` adds at least as many products per second as `vfmadd231ps`: each
/// timed in [`TRIALS`] alternating runs of a loop of independent instructions, the fastest
/// run of each compared.
fn units_outpace_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let (mut units, mut fma) = (Duration::MAX, Duration::MAX);
        for _ in 0..TRIALS {
            // SAFETY: the caller checked the units (AVX512-BF16 with AVX-512F).
            units = units.min(timed(|| unsafe { dot_loop(ROUNDS) }));
            // SAFETY: as above (AVX-512F).
            fma = fma.min(timed(|| unsafe { fma_loop(ROUNDS) }));
        }
        units_win(units, fma)
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether the units add at least as many products per second as the fused multiply-adds,
/// from the times of the same number of each instruction: 32 products per `vdpbf16ps`, 16
/// per `vfmadd231ps`.
#[cfg(any(target_arch = "x86_64", test))]
fn units_win(units: Duration, fma: Duration) -> bool {
    units.as_secs_f64() <= 2.0 * fma.as_secs_f64()
}

/// How long `f` took.
#[cfg(target_arch = "x86_64")]
fn timed(f: impl FnOnce() -> f32) -> Duration {
    let start = Instant::now();
    std::hint::black_box(f());
    start.elapsed()
}

/// `rounds` × CHAINS `vdpbf16ps` on CHAINS independent accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
fn dot_loop(rounds: usize) -> f32 {
    use std::arch::x86_64::*;
    let one = std::hint::black_box(_mm512_set1_epi32(0x3f80_3f80));
    // SAFETY: a vector of 32 bf16 ones, reinterpreted.
    let pairs: __m512bh = unsafe { std::mem::transmute(one) };
    let mut acc = [_mm512_setzero_ps(); CHAINS];
    for _ in 0..rounds {
        for acc in &mut acc {
            *acc = _mm512_dpbf16_ps(*acc, pairs, pairs);
        }
    }
    acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
}

/// `rounds` × CHAINS `vfmadd231ps` on CHAINS independent accumulators.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn fma_loop(rounds: usize) -> f32 {
    use std::arch::x86_64::*;
    let one = std::hint::black_box(_mm512_set1_ps(1.0));
    let mut acc = [_mm512_setzero_ps(); CHAINS];
    for _ in 0..rounds {
        for acc in &mut acc {
            *acc = _mm512_fmadd_ps(one, one, *acc);
        }
    }
    acc.iter().map(|&x| _mm512_reduce_add_ps(x)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_units_win_when_they_add_products_at_least_as_fast() {
        let ns = |n: u64| Duration::from_nanos(n);
        // This project's Xeon: 0.60 against 0.15 ns an instruction, half the products.
        assert!(!units_win(ns(600), ns(150)));
        // Both instructions at one a cycle: the units add twice the products.
        assert!(units_win(ns(300), ns(300)));
        // Equal rates of products: the units, whose packing is half the size.
        assert!(units_win(ns(400), ns(200)));
        assert!(!units_win(ns(401), ns(200)));
    }

    #[test]
    fn the_timing_loops_run_every_instruction() {
        if !units_available() {
            eprintln!("this CPU has no AVX512-BF16 units: the timing loops are not run here");
            return;
        }
        // Each instruction adds 1·1 (twice for the pairs) to every lane of every chain.
        // SAFETY: the CPU has the units (checked).
        let dots = unsafe { dot_loop(10) };
        let fmas = unsafe { fma_loop(10) };
        assert_eq!(dots, (10 * 2 * 16 * CHAINS) as f32);
        assert_eq!(fmas, (10 * 16 * CHAINS) as f32);
        // The loops take time to run, and the clock sees it.
        // SAFETY: as above.
        assert!(timed(|| unsafe { dot_loop(ROUNDS) }) > Duration::ZERO);
        // The units are chosen only where the CPU has them.
        assert!(!units_preferred() || units_available());
        // The answer is fixed once per process.
        assert_eq!(units_preferred(), units_preferred());
    }
}
