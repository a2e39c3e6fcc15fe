//! Losses (mse, cross_entropy): being written.
