//! Shared helpers of the course tests (see `l11_1/`).
