//! Command-line-only modules (`main.rs` is the argument glue).

pub mod bench;
pub mod synth;
