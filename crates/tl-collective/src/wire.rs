//! The wire of a sum in a 16-bit format ([`ReduceOp::SumIn`](crate::ReduceOp::SumIn)):
//! every value a rank sends is a value of the format, so it travels as its 16 bits, as a
//! GPU's bf16 or fp16 all-reduce moves it, and the bytes a collective counts are the
//! hardware's.
//!
//! bf16 is the top half of an f32 with the same value: its bits are the f32's shifted right
//! by 16, and back. fp16 goes through the `half` crate, whose f32 conversions are exact for
//! the values fp16 holds (tl-numerics cross-checks them). An f64 buffer goes through f32,
//! which holds every value of both formats exactly.

use half::f16;
use tl_numerics::Format;

use crate::element::{Element, sum_in};

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
