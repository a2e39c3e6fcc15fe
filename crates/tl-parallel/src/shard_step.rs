//! The pieces of ZeRO's sharded step: which runs of which parameters a rank's shard holds,
//! ZeRO-1's intake of the weights and gradients into the shard before the update, and
//! ZeRO-2's release of each full gradient once it is in a bucket (docs/course/L11.3.md § 2,
//! *The three stages*).
//!
//! The parameters, flattened in their order and laid end to end, form one long vector; a
//! rank's shard is a contiguous range of it ([`shard_range`](tl_collective::shard_range)),
//! which may cut a parameter in two. The rank keeps a *master* copy of each piece, a 1-D
//! tensor that its own AdamW updates: the moments exist for the shard only.

use std::ops::Range;

use tl_tensor::ndarray::ArrayD;
use tl_tensor::{Element, Tensor};

use crate::bucket::Segment;
use crate::runs::{read_run, set_grad_with};

/// The pieces of `runs` that lie in `shard`. `runs` are laid end to end, in order, into one
/// flat vector (run `i` starting where run `i − 1` ends), and `shard` is a range of that
/// vector; the result is, in the same order, one [`Segment`] per run that overlaps the
/// shard: the run's parameter, the first element of the piece *in that parameter*, and the
/// piece's length. The pieces tile the shard from its start with no gap, so piece `k` sits
/// in the shard at the sum of the lengths before it. See docs/course/L11.3.md § 2, *The
/// three stages*.
///
/// ZeRO-1 and ZeRO-3 pass the parameters whole (`{param: i, start: 0, len: numel_i}`, over
/// the model or over a unit); ZeRO-2 passes one bucket's segments and the rank's chunk of
/// the bucket. Parameters 0..3 of 4, 0 and 6 elements, cut into two shards of 5: rank 0
/// holds all of parameter 0 and element 0 of parameter 2, rank 1 its elements 1..6.
///
/// ```text
/// let runs = [seg(0, 0, 4), seg(1, 0, 0), seg(2, 0, 6)];
/// assert_eq!(shard_pieces(&runs, 0..5), [seg(0, 0, 4), seg(2, 0, 1)]);
/// assert_eq!(shard_pieces(&runs, 5..10), [seg(2, 1, 5)]);
/// ```
pub(crate) fn shard_pieces(runs: &[Segment], shard: Range<usize>) -> Vec<Segment> {
    let mut pieces = Vec::new();
    let mut offset = 0;
    for run in runs {
        let own = offset.max(shard.start)..(offset + run.len).min(shard.end);
        if !own.is_empty() {
            pieces.push(Segment {
                param: run.param,
                start: run.start + own.start - offset,
                len: own.len(),
            });
        }
        offset += run.len;
    }
    pieces
}

/// ZeRO-1, just before this rank's AdamW updates its shard: gives each master copy
/// `masters[k]` (a 1-D tensor of `pieces[k].len` elements) the current values of its piece
/// `pieces[k]` of the parameters, and the piece of the parameter's reduced gradient as its
/// gradient (none if the parameter has none); then drops every parameter's full gradient,
/// this rank's pieces of it taken. `pieces` are [`shard_pieces`] of the whole parameters,
/// so each parameter has at most one. See docs/course/L11.3.md § 2, *The three stages*.
///
/// The master copies start from the replicated weights at every step, so they can never
/// drift from them (a load or a broadcast between steps is picked up). The full gradient
/// of a parameter is dropped as soon as its piece is taken, not after the loop: the step's
/// peak holds the gradients and one piece, not both in full. For
/// [meta](tl_tensor::meta) parameters only the gradients' shapes are made
/// ([`set_grad_with`]).
pub(crate) fn take_pieces<E: Element>(
    params: &[Tensor<E>],
    pieces: &[Segment],
    masters: &[Tensor<E>],
) {
    let mut taken = pieces.iter().zip(masters).peekable();
    for (index, param) in params.iter().enumerate() {
        if let Some((piece, master)) = taken.next_if(|(p, _)| p.param == index) {
            if !param.is_meta() {
                master.update_value(|v| {
                    read_run(&param.value(), piece.start, v.as_slice_mut().expect("1-D"));
                });
            }
            if param.with_grad(|grad| grad.is_none()) {
                master.set_grad(None);
            } else {
                set_grad_with(master, || {
                    let mut run = ArrayD::zeros(vec![piece.len]);
                    param.with_grad(|grad| {
                        let grad = grad.expect("a gradient");
                        read_run(grad, piece.start, run.as_slice_mut().expect("1-D"));
                    });
                    run
                });
            }
        }
        param.zero_grad();
    }
}

/// ZeRO-2, once a bucket's gradients are copied into its buffer: counts each of the
/// bucket's `segments` off its parameter's `remaining` (the parameter's segments not yet
/// copied in this step) and drops the full gradient of a parameter whose last segment this
/// was. A parameter split across two buckets keeps its gradient until the second has been
/// copied. So during backward a rank holds only the gradients not yet reduced, and after
/// it only its shard of them. See docs/course/L11.3.md § 2, *The three stages*.
pub(crate) fn release_copied<E: Element>(
    params: &[Tensor<E>],
    segments: &[Segment],
    remaining: &mut [usize],
) {
    for s in segments {
        let param = &params[s.param];
        remaining[s.param] -= 1;
        if remaining[s.param] == 0 && param.with_grad(|g| g.is_some()) {
            param.set_grad(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(param: usize, start: usize, len: usize) -> Segment {
        Segment { param, start, len }
    }

    #[test]
    fn a_shard_boundary_cuts_a_parameter_in_two() {
        let runs = [seg(0, 0, 4), seg(1, 0, 0), seg(2, 0, 6)];
        assert_eq!(shard_pieces(&runs, 0..5), [seg(0, 0, 4), seg(2, 0, 1)]);
        assert_eq!(shard_pieces(&runs, 5..10), [seg(2, 1, 5)]);
        assert_eq!(shard_pieces(&runs, 4..4), []);
    }

    #[test]
    fn pieces_of_a_bucket_keep_their_place_in_the_parameter() {
        // A bucket holding elements 3..7 of parameter 5 then 0..2 of parameter 4, cut in
        // chunks of 3: 3..6 of parameter 5; 6 of it and 0..2 of parameter 4.
        let bucket = [seg(5, 3, 4), seg(4, 0, 2)];
        assert_eq!(shard_pieces(&bucket, 0..3), [seg(5, 3, 3)]);
        assert_eq!(shard_pieces(&bucket, 3..6), [seg(5, 6, 1), seg(4, 0, 2)]);
    }
}
