//! Test utilities (finite-difference gradient checks): being written.
