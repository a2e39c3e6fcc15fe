//! Optimizers (Sgd, AdamW) and gradient clipping: being written.
