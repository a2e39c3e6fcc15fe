//! The crate's own tests of checkpointing: the node, stacks on a schedule, replayed dropout,
//! verified mode and memory. (The schedule's own tests live beside it in `src/schedule/`.)

mod common;
mod dropout;
mod grad_hook;
mod kept;
mod memory;
mod node;
mod sequential;
mod split;
mod verified;
