//! being written.
