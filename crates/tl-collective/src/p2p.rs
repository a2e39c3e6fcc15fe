//! Point-to-point messages: what every backend shares of [`send`](crate::Communicator::send)
//! and [`recv`](crate::Communicator::recv).
//!
//! A message is a 40-byte frame header (the collectives' header, with the op `send`, the
//! element type, the length, the tag in the root's place and the sender's count of messages)
//! followed by the values. Messages are matched by sender and tag, not by order: one that
//! arrives before its receive is kept in an [`Inbox`] until its receive asks for it, as MPI
//! keeps unexpected messages. Two messages with the same sender and tag are received in the
//! order they were sent (MPI's non-overtaking rule).
//!
//! The receiver checks the frame against its buffer: another element type or length is a
//! [`CollectiveError::MessageMismatch`] naming both, never a misread buffer.

use std::collections::{HashMap, VecDeque};

use crate::element::{Slice, SliceMut};
use crate::error::{CallHeader, CollectiveError, Result};

/// The op a message's frame header carries.
pub(crate) const SEND_OP: &str = "send";

/// The largest tag every backend takes: the least `MPI_TAG_UB` the MPI standard allows.
pub const MAX_TAG: u32 = 32_767;

/// One message received before its receive asked for it.
#[derive(Debug)]
pub(crate) struct Message {
    pub(crate) element: &'static str,
    pub(crate) len: usize,
    /// The values' bytes (empty for a shape-only message of a planner).
    pub(crate) bytes: Vec<u8>,
}

/// Messages that arrived before their receive, by sender and tag, oldest first.
#[derive(Debug, Default)]
pub(crate) struct Inbox {
    waiting: HashMap<(usize, u32), VecDeque<Message>>,
}

impl Inbox {
    /// Keeps a message of `from` with `tag` for its receive.
    pub(crate) fn keep(&mut self, from: usize, tag: u32, message: Message) {
        self.waiting
            .entry((from, tag))
            .or_default()
            .push_back(message);
    }

    /// The oldest message of `from` with `tag`, if one came.
    pub(crate) fn take(&mut self, from: usize, tag: u32) -> Option<Message> {
        let queue = self.waiting.get_mut(&(from, tag))?;
        let message = queue.pop_front();
        if queue.is_empty() {
            self.waiting.remove(&(from, tag));
        }
        message
    }

    /// How many messages wait for their receive.
    pub(crate) fn len(&self) -> usize {
        self.waiting.values().map(VecDeque::len).sum()
    }
}

/// The frame header of a message of `data` with `tag`, the sender's `count`-th.
pub(crate) fn frame(data: &Slice<'_>, tag: u32, count: u64) -> CallHeader {
    CallHeader {
        op: SEND_OP,
        element: data.element(),
        len: data.len(),
        root: tag as usize,
        seq: count,
    }
}

/// Checks a send's or receive's peer and tag before anything moves: `neighbours_only` for the
/// ring, whose connections join a rank to the ranks next to it.
pub(crate) fn check_peer(
    op: &'static str,
    rank: usize,
    peer: usize,
    world_size: usize,
    tag: u32,
    neighbours_only: bool,
) -> Result<()> {
    if peer >= world_size {
        return Err(CollectiveError::InvalidRank {
            what: if op == SEND_OP {
                "destination"
            } else {
                "source"
            },
            value: peer,
            world_size,
        });
    }
    if tag > MAX_TAG {
        return Err(CollectiveError::BadBuffer {
            op,
            reason: format!("tag {tag} is over {MAX_TAG}, the largest MPI guarantees"),
        });
    }
    let next = (rank + 1) % world_size;
    let previous = (rank + world_size - 1) % world_size;
    if neighbours_only && peer != rank && peer != next && peer != previous {
        return Err(CollectiveError::NotNeighbour {
            op,
            rank,
            peer,
            world_size,
        });
    }
    Ok(())
}

/// Checks that a message of `from` with `tag` fits the receive's buffer.
pub(crate) fn check_fits(
    from: usize,
    tag: u32,
    element: &'static str,
    len: usize,
    into: &SliceMut<'_>,
) -> Result<()> {
    if element != into.element() || len != into.len() {
        return Err(CollectiveError::MessageMismatch {
            from,
            tag,
            reason: format!(
                "it holds {len} {element} values and the receive's buffer {} {}",
                into.len(),
                into.element()
            ),
        });
    }
    Ok(())
}

/// Copies a kept message into the receive's buffer (nothing when either is shape-only).
pub(crate) fn deliver(
    from: usize,
    tag: u32,
    message: &Message,
    into: &mut SliceMut<'_>,
) -> Result<()> {
    check_fits(from, tag, message.element, message.len, into)?;
    if let Some(bytes) = into.bytes_mut()
        && message.bytes.len() == bytes.len()
    {
        bytes.copy_from_slice(&message.bytes);
    }
    Ok(())
}

/// A message a rank sends itself: kept at once, since nothing moves.
pub(crate) fn to_self(inbox: &mut Inbox, rank: usize, data: &Slice<'_>, tag: u32) {
    inbox.keep(
        rank,
        tag,
        Message {
            element: data.element(),
            len: data.len(),
            bytes: data.bytes().map(<[u8]>::to_vec).unwrap_or_default(),
        },
    );
}

/// A receive from this rank itself whose message was never sent: it would wait forever.
pub(crate) fn never_sent(rank: usize, tag: u32) -> CollectiveError {
    CollectiveError::MessageMismatch {
        from: rank,
        tag,
        reason: "a rank's message to itself must be sent before it is received".into(),
    }
}
