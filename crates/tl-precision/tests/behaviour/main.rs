//! Behaviour tests of tl-precision: the chapter's worked examples first, then property and
//! differential tests of each tool. These are the tests the mutation grade runs.

// Exact binary fractions such as 1.00390625 = 1 + 2^-8 are written out in full.
#![allow(clippy::excessive_precision)]

mod accumulate;
mod autocast;
mod common;
mod hand_examples;
mod scaler;
mod scaler_state;
mod tensor_core;
mod train_step;
