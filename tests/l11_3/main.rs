//! The course tests of L11.3, one per row of the chapter's test table, under the chapter's
//! names. They are the course's view of tl-parallel's data parallelism: the learner's
//! functions run inside the reference's DDP and ZeRO stages, on ranks that are threads of
//! this process talking over a ring on localhost. tl-parallel's own tests are what the
//! mutation grade measures.

mod batch;
mod bucket;
mod common;
mod ddp;
mod zero;
mod zero3;
