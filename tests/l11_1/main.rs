//! The course tests of L11.1, one per row of the chapter's test table, under the chapter's
//! names. They are the course's view of tl-precision and tl-recompute; each crate's own tests
//! are what the mutation grade measures.

mod composition;
mod precision;
mod recompute;
