//! nexttoken: autoregressive text generation with GGUF models, on a CPU path (an exact reference
//! and fast int8 kernels) and on the GPU through wgpu (WebGPU in the browser, Vulkan/Metal/DX12
//! natively). Read in this order: `gguf` (the file), `quant` (tensor types), `model` (the
//! description: config + weights), `cpu` (the forward pass), `gpu` (the same on the GPU), `lm`
//! (the interface every model implements), `sampling`, `constraint` (structured output: the
//! tokens a JSON schema, regex or grammar allows), `generate` (the loop, beam search, scoring),
//! `table` (the lesson models), `tokenizer`, `chat` (chat templates, multi-turn KV reuse),
//! `untrusted` (where the programs a file carries run).
//! `load` (one loader: `Loaded`, `AnyModel`), `backend` and `timing` hold what the front ends
//! share: the command line (`main.rs`, `cli/`) and the browser API (`web/`).

pub mod backend;
pub mod chat;
pub mod constraint;
pub mod cpu;
pub mod error;
#[cfg(not(target_arch = "wasm32"))]
pub mod files;
pub mod generate;
pub mod gguf;
pub mod gpu;
pub mod lm;
pub mod load;
pub mod model;
pub mod preflight;
pub mod quant;
pub mod sampling;
pub mod synthetic;
pub mod table;
pub mod tensor_names;
pub mod timing;
pub mod tokenizer;
pub mod tools;
pub mod untrusted;
#[cfg(target_arch = "wasm32")]
pub mod web;

pub use error::{Error, Result};
pub use lm::{LanguageModel, Vocab};
