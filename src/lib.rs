//! nexttoken: autoregressive text generation with GGUF models, on a CPU reference path and (later)
//! WebGPU. Read in this order: `gguf` (the file), `quant` (tensor types), `model` (the
//! description: config + weights), `cpu` (the forward pass), `sampling`, `generate` (the loop,
//! beam search, scoring), `table` (the lesson models), `tokenizer`.

pub mod cpu;
pub mod error;
pub mod generate;
pub mod gguf;
pub mod gpu;
pub mod lm;
pub mod model;
pub mod quant;
pub mod sampling;
pub mod synthetic;
pub mod table;
pub mod tensor_names;
pub mod tokenizer;
#[cfg(target_arch = "wasm32")]
pub mod web;

pub use error::{Error, Result};
pub use lm::{LanguageModel, Vocab};
