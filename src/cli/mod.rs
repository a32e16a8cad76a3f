//! The command line, one module per subcommand (`main.rs` is the argument glue): `load` turns
//! `--model`, `--tokenizer` and `--backend` into the library's `Loaded`, which any subcommand runs;
//! `generate` also holds the sampling and structured-output options `chat` and `bench` share.

pub mod bench;
pub mod chat;
pub mod generate;
pub mod info;
pub mod load;
pub mod score;
pub mod synth;
