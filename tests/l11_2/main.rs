//! The course tests of L11.2, one per row of the chapter's test table
//! (docs/course/L11.2.md §5), under the chapter's names. They are the course's view of the
//! ring's steps (`crates/tl-collective/src/ring_steps.rs`): the schedule by hand, the
//! collectives on a ring of channels, and the same functions inside the socket ring's real
//! collectives. tl-collective's own tests are what the grade measures.

mod collectives;
mod schedule;
mod sockets;
