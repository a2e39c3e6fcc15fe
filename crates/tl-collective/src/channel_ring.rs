//! A ring of in-process links over channels: the transport L11.2's tests give the ring's
//! steps ([`ring_steps`](crate::ring_steps)) when they run ranks on threads without
//! sockets. Each link hands the received shard on in pieces of a chosen number of elements,
//! as the socket ring does with the bytes that have arrived, so that a step which reduces a
//! piece at the wrong place is seen with small buffers too.

use std::ops::Range;
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender, channel};
use std::time::Duration;

use crate::element::Element;
use crate::error::{CollectiveError, Result};
use crate::ring_steps::RingLink;

/// One rank's two ends of a [`channel_ring`].
#[derive(Debug)]
pub struct ChannelLink {
    rank: usize,
    world_size: usize,
    right: Sender<Vec<u8>>,
    left: Receiver<Vec<u8>>,
    piece: usize,
    timeout: Duration,
    /// Bytes this rank has sent.
    pub bytes_sent: u64,
    /// Exchanges (ring steps) this rank has made.
    pub steps: u64,
}

/// The links of a ring of `world_size` ranks, in rank order: rank r's sends arrive at rank
/// r + 1. A link hands what it receives on in pieces of `piece` elements (at least 1), and a
/// receive that waits longer than `timeout` fails with [`CollectiveError::Timeout`].
///
/// ```
/// use std::time::Duration;
/// use tl_collective::{ReduceOp, channel_ring, reference_all_reduce, ring_all_reduce};
///
/// let inputs = [vec![1.0f32, 10.0, 100.0], vec![2.0, 20.0, 200.0]];
/// let links = channel_ring(2, 1, Duration::from_secs(10));
/// let results: Vec<Vec<f32>> = std::thread::scope(|s| {
///     let handles: Vec<_> = links
///         .into_iter()
///         .zip(&inputs)
///         .enumerate()
///         .map(|(rank, (mut link, x))| {
///             s.spawn(move || {
///                 let mut data = x.clone();
///                 ring_all_reduce(&mut link, rank, 2, &mut data, ReduceOp::Sum).unwrap();
///                 data
///             })
///         })
///         .collect();
///     handles.into_iter().map(|h| h.join().unwrap()).collect()
/// });
/// assert_eq!(results, [vec![3.0, 30.0, 300.0], vec![3.0, 30.0, 300.0]]);
/// ```
///
/// # Panics
/// If `world_size` is 0.
pub fn channel_ring(world_size: usize, piece: usize, timeout: Duration) -> Vec<ChannelLink> {
    assert!(world_size > 0, "channel_ring: a ring of no ranks");
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..world_size).map(|_| channel()).unzip();
    // Channel r carries what rank r − 1 sends to rank r.
    let mut receivers: Vec<Option<Receiver<Vec<u8>>>> = receivers.into_iter().map(Some).collect();
    (0..world_size)
        .map(|rank| ChannelLink {
            rank,
            world_size,
            right: senders[(rank + 1) % world_size].clone(),
            left: receivers[rank].take().expect("each receiver once"),
            piece: piece.max(1),
            timeout,
            bytes_sent: 0,
            steps: 0,
        })
        .collect()
}

/// Runs `rank_program(link, rank)` for each of `world_size` ranks on threads joined by a
/// [`channel_ring`], and returns what each returned, in rank order. A rank that panics drops
/// its link, so its neighbours fail at once instead of waiting out `timeout`.
///
/// # Panics
/// If a rank panics (with its message), or `world_size` is 0.
pub fn on_channel_ring<R: Send>(
    world_size: usize,
    piece: usize,
    timeout: Duration,
    rank_program: impl Fn(&mut ChannelLink, usize) -> R + Sync,
) -> Vec<R> {
    let links = channel_ring(world_size, piece, timeout);
    std::thread::scope(|s| {
        let handles: Vec<_> = links
            .into_iter()
            .enumerate()
            .map(|(rank, mut link)| {
                let rank_program = &rank_program;
                s.spawn(move || rank_program(&mut link, rank))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a rank panicked"))
            .collect()
    })
}

impl RingLink for ChannelLink {
    fn exchange<T: Element>(
        &mut self,
        out: &[T],
        into: &mut [T],
        arrived: &mut dyn FnMut(Range<usize>, &[T]),
    ) -> Result<()> {
        let bytes: &[u8] = bytemuck::cast_slice(out);
        self.bytes_sent += bytes.len() as u64;
        self.steps += 1;
        let (right_rank, left_rank) = (
            (self.rank + 1) % self.world_size,
            (self.rank + self.world_size - 1) % self.world_size,
        );
        let exited = |rank| CollectiveError::PeerExited {
            rank,
            op: "ring step",
        };
        // A receiver lives as long as its rank's link: a send fails only once it is gone.
        self.right
            .send(bytes.to_vec())
            .map_err(|_| exited(right_rank))?;
        let received = self.left.recv_timeout(self.timeout).map_err(|e| match e {
            RecvTimeoutError::Timeout => CollectiveError::Timeout {
                op: "ring step",
                peer: left_rank,
                bound: self.timeout,
            },
            RecvTimeoutError::Disconnected => exited(left_rank),
        })?;
        let want = std::mem::size_of_val(into);
        if received.len() != want {
            return Err(CollectiveError::MessageMismatch {
                from: left_rank,
                tag: 0,
                reason: format!(
                    "{} bytes came at this ring step, {want} were expected",
                    received.len()
                ),
            });
        }
        let size = std::mem::size_of::<T>();
        for start in (0..into.len()).step_by(self.piece) {
            let end = (start + self.piece).min(into.len());
            into[start..end]
                .copy_from_slice(bytemuck::cast_slice(&received[start * size..end * size]));
            arrived(start..end, &into[start..end]);
        }
        Ok(())
    }
}
