//! Layers and the Module trait: being written.
