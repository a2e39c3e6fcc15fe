//! Point-to-point messages on the ring's two connections.
//!
//! A message from rank `a` to its right neighbour `a + 1` goes over the connection the
//! collectives send on, `a`'s right one; a message to its left neighbour goes back over the
//! left one, which the collectives only receive on. (In a ring of 2 the right neighbour is
//! also the left one: every message then takes the right connection.) The ring joins a rank
//! to its neighbours only, which is what a pipeline needs: stage `s` talks to `s − 1` and
//! `s + 1`, and in the interleaved layout the last rank to the first, its right neighbour.
//!
//! **Buffered sends.** A send copies the frame and the values into the connection's queue
//! and returns; the connection's writer thread (`writer.rs`) writes them while this rank
//! computes. So two stages that send each other a message, then receive, never deadlock,
//! whatever the size: neither waits for the other to read (the 1F1B steady state, where
//! stage `s` sends an activation forward while stage `s + 1` sends a gradient back).
//!
//! **Sharing the connection with the collectives.** The messages queued on the right
//! connection go out before the next collective's bytes (the collective waits for the
//! writer to drain); the right neighbour, starting the
//! same collective, reads them (into its [`Inbox`]) before the collective's header. While
//! a collective runs, no rank sends a message, so nothing else can come between its bytes.
//! A rank that waits for a message but finds a collective's header instead fails with
//! [`CollectiveError::MessageMismatch`]: the two ranks' programs disagree.

use crate::element::{Slice, SliceMut};
use crate::error::{CollectiveError, Result};
use crate::p2p::{self, Inbox, Message, SEND_OP};
use crate::ring::RingComm;
use crate::ring::header::{HEADER_LEN, decode, encode};
use crate::ring::link::{Flow, Side};
use crate::ring::writer::Drained;

/// What a [`Frames`] reads up to.
pub(crate) enum Until<'a> {
    /// The message with `tag`, whose values go into `into` (`len` values of `element`).
    Message {
        tag: u32,
        element: &'static str,
        len: usize,
        into: &'a mut [u8],
    },
    /// The next collective's header, into `into` (of [`HEADER_LEN`] bytes).
    Header { into: &'a mut [u8] },
}

/// Where the bytes being read go.
enum Body {
    /// A frame header.
    Header,
    /// The values of the awaited message, `done` bytes in.
    Awaited { done: usize },
    /// The values of another message, for the inbox.
    Kept {
        tag: u32,
        message: Message,
        done: usize,
    },
}

/// Reads the frames that come on one connection (from rank `from`) until the one it waits
/// for, keeping the others in the inbox, while sending `out` right (once `after` says the
/// messages queued before it are written).
pub(crate) struct Frames<'a> {
    out: &'a [u8],
    out_done: usize,
    after: Option<Drained>,
    from: usize,
    inbox: &'a mut Inbox,
    until: Until<'a>,
    header: [u8; HEADER_LEN],
    header_done: usize,
    body: Body,
    outcome: Option<Result<()>>,
}

impl<'a> Frames<'a> {
    pub(crate) fn new(out: &'a [u8], from: usize, inbox: &'a mut Inbox, until: Until<'a>) -> Self {
        Frames {
            out,
            out_done: 0,
            after: None,
            from,
            inbox,
            until,
            header: [0; HEADER_LEN],
            header_done: 0,
            body: Body::Header,
            outcome: None,
        }
    }

    /// Holds `out` back until `writer` has written what it holds.
    pub(crate) fn after(mut self, writer: Drained) -> Self {
        self.after = Some(writer);
        self
    }

    /// What reading found: an error if the frames did not fit what was awaited.
    pub(crate) fn outcome(&mut self) -> Result<()> {
        self.outcome.take().unwrap_or(Ok(()))
    }

    /// A frame header has come whole.
    fn header_read(&mut self) {
        let header = decode(&self.header);
        self.header_done = 0;
        if header.op != SEND_OP {
            self.outcome = Some(match &mut self.until {
                Until::Header { into } => {
                    into.copy_from_slice(&self.header);
                    Ok(())
                }
                Until::Message { tag, .. } => Err(CollectiveError::MessageMismatch {
                    from: self.from,
                    tag: *tag,
                    reason: format!(
                        "rank {} began {} (its call #{}) instead of sending it",
                        self.from, header.op, header.seq
                    ),
                }),
            });
            return;
        }
        let tag = header.root as u32;
        let size = match header.element {
            "f32" => 4,
            "f64" => 8,
            other => {
                self.outcome = Some(Err(CollectiveError::MessageMismatch {
                    from: self.from,
                    tag,
                    reason: format!("its frame is garbled (element {other})"),
                }));
                return;
            }
        };
        if let Until::Message {
            tag: awaited,
            element,
            len,
            into,
        } = &mut self.until
            && *awaited == tag
        {
            if header.element != *element || header.len != *len {
                self.outcome = Some(Err(CollectiveError::MessageMismatch {
                    from: self.from,
                    tag,
                    reason: format!(
                        "it holds {} {} values and the receive's buffer {len} {element}",
                        header.len, header.element
                    ),
                }));
            } else if into.is_empty() {
                self.outcome = Some(Ok(()));
            } else {
                self.body = Body::Awaited { done: 0 };
            }
            return;
        }
        let message = Message {
            element: header.element,
            len: header.len,
            bytes: vec![0; header.len * size],
        };
        if message.bytes.is_empty() {
            self.inbox.keep(self.from, tag, message);
        } else {
            self.body = Body::Kept {
                tag,
                message,
                done: 0,
            };
        }
    }
}

impl Flow for Frames<'_> {
    fn pending(&self) -> &[u8] {
        if self.after.as_ref().is_some_and(|writer| !writer.done()) {
            return &[];
        }
        &self.out[self.out_done..]
    }

    fn sent(&mut self, n: usize) {
        self.out_done += n;
    }

    fn send_done(&self) -> bool {
        self.out_done == self.out.len()
    }

    fn space(&mut self) -> &mut [u8] {
        if self.outcome.is_some() {
            return &mut [];
        }
        match &mut self.body {
            Body::Header => &mut self.header[self.header_done..],
            Body::Awaited { done } => match &mut self.until {
                Until::Message { into, .. } => &mut into[*done..],
                Until::Header { .. } => unreachable!("a header awaits no values"),
            },
            Body::Kept { message, done, .. } => &mut message.bytes[*done..],
        }
    }

    fn received(&mut self, n: usize) {
        match &mut self.body {
            Body::Header => {
                self.header_done += n;
                if self.header_done == HEADER_LEN {
                    self.header_read();
                }
            }
            Body::Awaited { done } => {
                *done += n;
                if matches!(&self.until, Until::Message { into, .. } if *done == into.len()) {
                    self.body = Body::Header;
                    self.outcome = Some(Ok(()));
                }
            }
            Body::Kept { done, message, .. } => {
                *done += n;
                if *done == message.bytes.len() {
                    let Body::Kept { tag, message, .. } =
                        std::mem::replace(&mut self.body, Body::Header)
                    else {
                        unreachable!("matched above")
                    };
                    self.inbox.keep(self.from, tag, message);
                }
            }
        }
    }
}

impl RingComm {
    /// The connection a message to `to` leaves by.
    fn side_to(&self, to: usize) -> Side {
        if to == (self.rank + 1) % self.world_size {
            Side::Right
        } else {
            Side::Left
        }
    }

    /// The connection a message from `from` comes by (the sender's [`side_to`] us).
    fn side_from(&self, from: usize) -> Side {
        if self.rank == (from + 1) % self.world_size {
            Side::Left
        } else {
            Side::Right
        }
    }

    /// Checks what a send or receive could get wrong alone; a misuse closes the
    /// communicator, as it does for a collective.
    fn check_message(
        &mut self,
        op: &'static str,
        peer: usize,
        tag: u32,
        shape: bool,
    ) -> Result<()> {
        if self.closed {
            return Err(CollectiveError::Closed);
        }
        let check = p2p::check_peer(op, self.rank, peer, self.world_size, tag, true);
        let check = match check {
            Ok(()) if shape => Err(CollectiveError::ShapeOnly { op }),
            other => other,
        };
        self.local_check(check)
    }

    pub(super) fn send_message(&mut self, data: Slice<'_>, to: usize, tag: u32) -> Result<()> {
        self.check_message(SEND_OP, to, tag, data.is_shape())?;
        let frame = p2p::frame(&data, tag, self.sends);
        self.sends += 1;
        if to == self.rank {
            p2p::to_self(&mut self.inbox, self.rank, &data, tag);
            return Ok(());
        }
        let side = self.side_to(to);
        let link = self.link.as_mut().expect("a ring of 2 or more has a link");
        let mut bytes = Vec::with_capacity(HEADER_LEN + data.byte_len());
        bytes.extend_from_slice(&encode(&frame));
        bytes.extend_from_slice(data.bytes().expect("checked: not shape-only"));
        let outcome = link.writers[side as usize].push(SEND_OP, bytes);
        if outcome.is_err() {
            self.close();
        }
        outcome
    }

    pub(super) fn recv_message(
        &mut self,
        mut data: SliceMut<'_>,
        from: usize,
        tag: u32,
    ) -> Result<()> {
        self.check_message("recv", from, tag, data.is_shape())?;
        let outcome = match self.inbox.take(from, tag) {
            Some(message) => p2p::deliver(from, tag, &message, &mut data),
            None if from == self.rank => Err(p2p::never_sent(from, tag)),
            None => {
                let side = self.side_from(from);
                let (element, len) = (data.element(), data.len());
                let into = data.bytes_mut().expect("checked: not shape-only");
                let link = self.link.as_mut().expect("a ring of 2 or more has a link");
                let until = Until::Message {
                    tag,
                    element,
                    len,
                    into,
                };
                let mut flow = Frames::new(&[], from, &mut self.inbox, until);
                link.transfer("recv", &mut flow, side)
                    .and_then(|()| flow.outcome())
            }
        };
        match outcome {
            Ok(()) => self.receives += 1,
            Err(_) => self.close(),
        }
        outcome
    }

    pub(super) fn flush_messages(&mut self) -> Result<()> {
        if self.closed {
            return Err(CollectiveError::Closed);
        }
        let Some(link) = self.link.as_mut() else {
            return Ok(());
        };
        let outcome = (link.writers.iter()).try_for_each(|writer| writer.drained("flush"));
        if outcome.is_err() {
            self.close();
        }
        outcome
    }

    /// Point-to-point messages that came before their receive and wait for it (none, once
    /// a step whose every send has its receive is done).
    pub fn messages_waiting(&self) -> usize {
        self.inbox.len()
    }
}
