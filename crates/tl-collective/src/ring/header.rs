//! The header every ring collective starts with, and its all-gather round the ring.

use crate::error::{CallHeader, CollectiveError, Result};
use crate::p2p::Inbox;
use crate::ring::link::{Exchange, Link, Side};
use crate::ring::messages::{Frames, Until};
use crate::ring_steps::all_gather_step;
use crate::shard::split_pair;

/// Bytes of one encoded header (its fields and the magic word).
pub(crate) const HEADER_LEN: usize = 40;
const MAGIC: u64 = 0x746c_5f68_6472_3031; // "tl_hdr01"

/// Every collective's name, by wire code: a sum in a 16-bit format is a collective of its
/// own, so that ranks that disagree on the format (or on summing in one) fail with a
/// mismatch. The fp8 sums are refused before any header goes out, and have codes only so
/// that every name a reduction can take has one.
const OPS: [&str; 16] = [
    "all_reduce_sum",
    "all_reduce_max",
    "reduce_scatter_sum",
    "reduce_scatter_max",
    "all_gather",
    "broadcast",
    "barrier",
    "all_reduce_sum_bf16",
    "all_reduce_sum_fp16",
    "reduce_scatter_sum_bf16",
    "reduce_scatter_sum_fp16",
    "all_reduce_sum_e4m3",
    "all_reduce_sum_e5m2",
    "reduce_scatter_sum_e4m3",
    "reduce_scatter_sum_e5m2",
    // Not a collective: the frame header of a point-to-point message.
    crate::p2p::SEND_OP,
];
const ELEMENTS: [&str; 3] = ["f32", "f64", "-"];

fn code(table: &[&'static str], name: &str) -> u8 {
    table.iter().position(|&t| t == name).expect("a known name") as u8
}

pub(crate) fn encode(header: &CallHeader) -> [u8; HEADER_LEN] {
    let mut out = [0u8; HEADER_LEN];
    out[0] = code(&OPS, header.op);
    out[1] = code(&ELEMENTS, header.element);
    out[8..16].copy_from_slice(&(header.len as u64).to_le_bytes());
    out[16..24].copy_from_slice(&(header.root as u64).to_le_bytes());
    out[24..32].copy_from_slice(&header.seq.to_le_bytes());
    out[32..40].copy_from_slice(&MAGIC.to_le_bytes());
    out
}

fn word(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

pub(crate) fn decode(bytes: &[u8]) -> CallHeader {
    let known = word(bytes, 32) == MAGIC;
    let name = |table: &[&'static str], i: u8| {
        table
            .get(usize::from(i))
            .copied()
            .filter(|_| known)
            .unwrap_or("<garbled>")
    };
    CallHeader {
        op: name(&OPS, bytes[0]),
        element: name(&ELEMENTS, bytes[1]),
        len: word(bytes, 8) as usize,
        root: word(bytes, 16) as usize,
        seq: word(bytes, 24),
    }
}

/// The header as five words (op and element, len, root, seq, magic), for backends that gather words.
#[cfg(any(test, feature = "mpi"))]
pub(crate) fn to_words(header: &CallHeader) -> [u64; 5] {
    let bytes = encode(header);
    [
        u64::from(bytes[0]) | (u64::from(bytes[1]) << 8),
        header.len as u64,
        header.root as u64,
        header.seq,
        MAGIC,
    ]
}

/// The inverse of [`to_words`].
#[cfg(any(test, feature = "mpi"))]
pub(crate) fn from_words(words: &[u64]) -> CallHeader {
    let mut bytes = [0u8; HEADER_LEN];
    bytes[0] = words[0] as u8;
    bytes[1] = (words[0] >> 8) as u8;
    bytes[8..16].copy_from_slice(&words[1].to_le_bytes());
    bytes[16..24].copy_from_slice(&words[2].to_le_bytes());
    bytes[24..32].copy_from_slice(&words[3].to_le_bytes());
    bytes[32..40].copy_from_slice(&words[4].to_le_bytes());
    decode(&bytes)
}

/// Gathers every rank's header round the ring; identical headers pass, anything else is a
/// [`CollectiveError::Mismatch`] listing them all (the same error on every rank).
///
/// The left neighbour's own header, the first received, may come after point-to-point
/// messages it sent before this call: those go to `inbox` for their receives.
pub(crate) fn exchange_headers(
    link: &mut Link,
    inbox: &mut Inbox,
    rank: usize,
    n: usize,
    own: CallHeader,
) -> Result<()> {
    let mut all = vec![0u8; HEADER_LEN * n];
    all[rank * HEADER_LEN..(rank + 1) * HEADER_LEN].copy_from_slice(&encode(&own));
    for step in 0..n - 1 {
        let (send, recv) = all_gather_step(rank, step, n);
        let span = |r: usize| r * HEADER_LEN..(r + 1) * HEADER_LEN;
        let (out, into) = split_pair(&mut all, span(send), span(recv));
        if step == 0 {
            // Our header goes after the messages queued on the right connection.
            let right = link.writers[Side::Right as usize].watch();
            let mut flow =
                Frames::new(out, link.left_rank, inbox, Until::Header { into }).after(right);
            link.pump(own.op, &mut flow)?;
            flow.outcome()?;
        } else {
            link.pump(own.op, &mut Exchange::new(out, into))?;
        }
    }
    let calls: Vec<CallHeader> = all.chunks(HEADER_LEN).map(decode).collect();
    if calls.iter().any(|c| *c != calls[0]) {
        return Err(CollectiveError::Mismatch { calls });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip() {
        let header = CallHeader {
            op: "broadcast",
            element: "f64",
            len: 12345,
            root: 3,
            seq: 7,
        };
        assert_eq!(decode(&encode(&header)), header);
        assert_eq!(from_words(&to_words(&header)), header);
        assert_eq!(decode(&[0xff; HEADER_LEN]).op, "<garbled>");
    }

    #[test]
    fn every_reduction_has_a_code_of_its_own() {
        use crate::element::{ReduceOp, reduce_name};
        use tl_numerics::Format;
        let ops = [ReduceOp::Sum, ReduceOp::Max]
            .into_iter()
            .chain(Format::SIXTEEN_BIT.map(ReduceOp::SumIn))
            .chain(Format::FP8.map(ReduceOp::SumIn));
        for op in ops {
            for base in ["all_reduce", "reduce_scatter"] {
                let name = reduce_name(base, op);
                let header = CallHeader {
                    op: name,
                    element: "f32",
                    len: 3,
                    root: 0,
                    seq: 1,
                };
                assert_eq!(decode(&encode(&header)).op, name);
            }
        }
        let mut sorted = OPS.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), OPS.len());
    }
}
