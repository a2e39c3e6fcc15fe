//! The wire of a sum in a 16-bit format ([`ReduceOp::SumIn`](crate::ReduceOp::SumIn)):
//! every value a rank sends is a value of the format, so it travels as its 16 bits, as a
//! GPU's bf16 or fp16 all-reduce moves it, and the bytes a collective counts are the
//! hardware's.
//!
//! bf16 is the top half of an f32 with the same value: its bits are the f32's shifted right
//! by 16, and back. fp16 goes through the `half` crate, whose f32 conversions are exact for
//! the values fp16 holds (tl-numerics cross-checks them). An f64 buffer goes through f32,
//! which holds every value of both formats exactly.
//!
//! [`packed_ring_phase`] is the one loop of such a sum's two ring phases, on either
//! transport: the socket ring and the ring over MPI hand it only their exchange.

use std::ops::Range;

use half::f16;
use tl_numerics::Format;

use crate::element::{Element, sum_in};
use crate::error::Result;
use crate::shard::shard_range;

/// The quiet bit of a bf16 NaN: a NaN whose payload lay only in the low half of the f32
/// keeps a NaN, not an infinity, when the low half is dropped.
const BF16_QUIET: u16 = 0x0040;

/// The 16 bits of `x`, a value of `format` (bf16 or fp16).
#[inline]
fn to_bits<T: Element>(x: T, format: Format) -> u16 {
    let x = x.widen() as f32;
    match format {
        Format::Bf16 if x.is_nan() => (x.to_bits() >> 16) as u16 | BF16_QUIET,
        Format::Bf16 => {
            debug_assert_eq!(x.to_bits() & 0xffff, 0, "{x} is not a bf16 value");
            (x.to_bits() >> 16) as u16
        }
        _ => f16::from_f32(x).to_bits(),
    }
}

/// The value of the 16 bits `bits` of `format`.
#[inline]
fn from_bits<T: Element>(bits: u16, format: Format) -> T {
    let x = match format {
        Format::Bf16 => f32::from_bits(u32::from(bits) << 16),
        _ => f16::from_bits(bits).to_f32(),
    };
    T::narrow(f64::from(x))
}

/// `values` (of `format`) as their 16 bits, into `out` of the same length.
pub(crate) fn pack<T: Element>(values: &[T], format: Format, out: &mut [u16]) {
    debug_assert_eq!(values.len(), out.len());
    out.iter_mut()
        .zip(values)
        .for_each(|(o, &x)| *o = to_bits(x, format));
}

/// The values of the 16-bit words `bits` of `format`, into `out` of the same length.
pub(crate) fn unpack<T: Element>(bits: &[u16], format: Format, out: &mut [T]) {
    debug_assert_eq!(bits.len(), out.len());
    out.iter_mut()
        .zip(bits)
        .for_each(|(o, &b)| *o = from_bits(b, format));
}

/// One hop of the ring's sum in `format`: `dst[i] ← rd(dst[i] + received[i])`, the received
/// partial sums given as their 16 bits.
pub(crate) fn reduce_packed<T: Element>(format: Format, dst: &mut [T], received: &[u16]) {
    debug_assert_eq!(dst.len(), received.len());
    dst.iter_mut()
        .zip(received)
        .for_each(|(d, &b)| *d = sum_in(format, *d, from_bits(b, format)));
}

/// What a rank does with the 16-bit words of the shard it receives at a step of the ring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Finish {
    /// Reduce-scatter: adds them to its own partial sums and rounds ([`reduce_packed`]).
    AddAndRound,
    /// All-gather: takes them as the shard's values ([`unpack`]).
    Unpack,
}

impl Finish {
    fn apply<T: Element>(self, format: Format, dst: &mut [T], received: &[u16]) {
        match self {
            Finish::AddAndRound => reduce_packed(format, dst, received),
            Finish::Unpack => unpack(received, format, dst),
        }
    }
}

/// A phase's schedule: for `(rank, step, world_size)`, the shard that rank sends at that
/// step and the one it receives ([`reduce_scatter_step`](crate::ring_steps::reduce_scatter_step)
/// or [`all_gather_step`](crate::ring_steps::all_gather_step)).
pub(crate) type Schedule = fn(usize, usize, usize) -> (usize, usize);

/// The received words `words` of a step's shard, to finish into that shard's elements
/// `words` (indices in words, from the shard's start).
pub(crate) type FinishWords<'a> = dyn FnMut(Range<usize>, &[u16]) + 'a;

/// One phase of the ring's sum in `format` over `data` (whose values are the format's): its
/// N−1 steps, every value on the wire as its 16 bits. Before each step the shard that
/// `schedule` sends is packed (it may be the one finished at the step before); then
/// `exchange(outgoing, incoming, finish_words)` sends the packed words to the right,
/// receives the shard it gets from the left into `incoming`, and hands what has arrived to
/// `finish_words`, at once or piece by piece as it arrives, which applies `finish`.
///
/// # Errors
/// The first error of `exchange`; the steps after it do not run.
pub(crate) fn packed_ring_phase<T: Element>(
    data: &mut [T],
    (rank, world_size): (usize, usize),
    schedule: Schedule,
    format: Format,
    finish: Finish,
    mut exchange: impl FnMut(&[u16], &mut [u16], &mut FinishWords<'_>) -> Result<()>,
) -> Result<()> {
    let len = data.len();
    let longest = shard_range(len, world_size, 0).len();
    let (mut outgoing, mut incoming) = (vec![0u16; longest], vec![0u16; longest]);
    for step in 0..world_size - 1 {
        let (send, recv) = schedule(rank, step, world_size);
        let send = shard_range(len, world_size, send);
        let recv = shard_range(len, world_size, recv);
        let out = &mut outgoing[..send.len()];
        pack(&data[send], format, out);
        let target = &mut data[recv.clone()];
        let mut finish_words = |words: Range<usize>, received: &[u16]| {
            finish.apply(format, &mut target[words], received);
        };
        exchange(out, &mut incoming[..recv.len()], &mut finish_words)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tl_numerics::Round;

    /// Every 16-bit pattern that is not a NaN, as a value of `format`.
    fn every_value(format: Format) -> impl Iterator<Item = (u16, f32)> {
        (0..=u16::MAX)
            .map(move |bits| (bits, from_bits::<f32>(bits, format)))
            .filter(|(_, x)| !x.is_nan())
    }

    #[test]
    fn every_value_of_both_formats_survives_the_wire_bit_for_bit() {
        for format in Format::SIXTEEN_BIT {
            let mut count = 0;
            for (bits, x) in every_value(format) {
                assert_eq!(
                    x.round_to(format).to_bits(),
                    x.to_bits(),
                    "{format} {bits:#06x}"
                );
                assert_eq!(to_bits(x, format), bits, "{format} {x:e}");
                assert_eq!(to_bits(f64::from(x), format), bits, "{format} {x:e} as f64");
                assert_eq!(from_bits::<f64>(bits, format), f64::from(x));
                count += 1;
            }
            // Every pattern but the NaNs (the all-ones exponent with a nonzero fraction, of
            // either sign): 65536 − 2·(2^m − 1) for m fraction bits.
            let fraction_bits = format.precision_bits() - 1;
            assert_eq!(count, 65536 - 2 * ((1 << fraction_bits) - 1), "{format}");
        }
    }

    #[test]
    fn a_nan_stays_a_nan_on_the_wire_even_with_its_payload_in_the_low_half() {
        let low_payload = f32::from_bits(0x7f80_0001);
        assert!(low_payload.is_nan());
        for format in Format::SIXTEEN_BIT {
            for x in [f32::NAN, -f32::NAN, low_payload] {
                let back: f32 = from_bits(to_bits(x, format), format);
                assert!(back.is_nan(), "{format}");
                assert_eq!(back.is_sign_negative(), x.is_sign_negative(), "{format}");
            }
        }
        // The signed zeros keep their signs.
        assert_eq!(to_bits(-0.0f32, Format::Bf16), 0x8000);
        assert_eq!(to_bits(-0.0f64, Format::Fp16), 0x8000);
    }

    #[test]
    fn a_hop_adds_the_received_bits_and_rounds() {
        let mut dst = [1.0f32, 1.0, 65504.0];
        let half_step = to_bits(2f32.powi(-8), Format::Bf16);
        let received = [half_step, to_bits(2f32.powi(-7), Format::Bf16), 0];
        reduce_packed(Format::Bf16, &mut dst[..2], &received[..2]);
        assert_eq!(dst[..2], [1.0, 1.0078125]); // a tie to the even 1; an exact sum
        reduce_packed(
            Format::Fp16,
            &mut dst[2..],
            &[to_bits(16.0f32, Format::Fp16)],
        );
        assert_eq!(dst[2], f32::INFINITY); // 65520 and up overflows fp16
        let mut values = [0u16; 3];
        pack(&[1.5f64, -2.0, 0.0], Format::Fp16, &mut values);
        let mut back = [0.0f64; 3];
        unpack(&values, Format::Fp16, &mut back);
        assert_eq!(back, [1.5, -2.0, 0.0]);
    }
}
