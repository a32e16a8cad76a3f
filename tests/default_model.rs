//! The shipped default model (`www/models/default.gguf`, Q8_0, trained by
//! `tools/train_default_model.py`) against Hugging Face transformers: logits at every prompt
//! position and a 40-token greedy continuation, plus the tokenizer's prompt ids.
//!
//! The reference (`tests/fixtures/default_model/reference.json`) was computed by transformers on
//! the weights the GGUF file actually holds (Q8_0 dequantised by gguf-py), so only float rounding
//! order differs.

mod common;

use nexttoken::cpu::CpuModel;
use nexttoken::model::Model;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{LanguageModel, Vocab};
use serde_json::Value;

/// Max abs logit error vs transformers (f32 activations throughout).
const LOGIT_TOLERANCE: f32 = 1e-4;

fn reference() -> Value {
    let path = common::fixtures().join("default_model/reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn open_model() -> CpuModel {
    CpuModel::new(Model::open(&common::repo().join("www/models/default.gguf")).unwrap())
}

fn tokenizer() -> HfTokenizer {
    HfTokenizer::from_file(&common::repo().join("www/models/default-tokenizer.json")).unwrap()
}

#[test]
fn default_model_logits_match_transformers() {
    let reference = reference();
    let prompt = common::ids(&reference["prompt_ids"]);
    let want = common::rows(&reference["logits"]);
    assert_eq!(want.len(), prompt.len(), "fixture has logits for every prompt position");
    let model = open_model();
    let vocab = model.vocab_size();
    assert_eq!(vocab, 2048);
    let mut state = model.new_state();
    let got = model.forward(&mut state, &prompt, true).unwrap();
    assert_eq!(got.len(), prompt.len() * vocab);
    let mut worst = 0f32;
    for (pos, row) in want.iter().enumerate() {
        assert_eq!(row.len(), vocab, "fixture vocab size");
        for (g, w) in got[pos * vocab..(pos + 1) * vocab].iter().zip(row) {
            worst = worst.max((g - w).abs());
        }
    }
    eprintln!("default.gguf: max abs logit error {worst:.2e} over {} positions", want.len());
    assert!(worst <= LOGIT_TOLERANCE, "max abs logit error {worst} > {LOGIT_TOLERANCE}");
}

#[test]
fn default_model_greedy_matches_transformers() {
    let reference = reference();
    let prompt = common::ids(&reference["prompt_ids"]);
    let want = common::ids(&reference["greedy_ids"]);
    assert_eq!(want.len(), 40);
    let ours = common::greedy(&open_model(), &prompt, want.len());
    assert_eq!(ours, want, "greedy continuation differs from transformers");
}

/// `HfTokenizer` (which leaves BOS to the caller) gives the ids transformers fed the model, after
/// BOS; decoding the greedy sequence gives the fixture's text.
#[test]
fn default_tokenizer_matches_fixture() {
    let reference = reference();
    let tok = tokenizer();
    assert_eq!(tok.vocab_size(), 2048);
    let prompt = common::ids(&reference["prompt_ids"]);
    let encoded = tok.encode(reference["prompt"].as_str().unwrap()).unwrap();
    assert_eq!(prompt[0], 1, "BOS");
    assert_eq!(&prompt[1..], &encoded[..], "prompt ids");
    let mut all = prompt.clone();
    all.extend(common::ids(&reference["greedy_ids"]));
    assert_eq!(tok.decode(&all), reference["greedy_text"].as_str().unwrap());
}

/// The GPU path on the shipped file: logits within the GPU-vs-CPU tolerance of transformers' (f32
/// KV cache) and the same 40 greedy tokens.
#[test]
fn default_model_on_the_gpu_matches_transformers() {
    use nexttoken::gpu::{GpuModel, GpuOptions};
    let Some(ctx) = common::gpu_context() else { return };
    let reference = reference();
    let prompt = common::ids(&reference["prompt_ids"]);
    let model = Model::open(&common::repo().join("www/models/default.gguf")).unwrap();
    let gpu = pollster::block_on(GpuModel::with_options(ctx, model, GpuOptions::f32())).unwrap();
    let vocab = gpu.vocab_size();
    let mut state = gpu.new_state();
    let got = gpu.forward(&mut state, &prompt, true).unwrap();
    let mut worst = 0f32;
    for (pos, row) in common::rows(&reference["logits"]).iter().enumerate() {
        for (g, w) in got[pos * vocab..(pos + 1) * vocab].iter().zip(row) {
            worst = worst.max((g - w).abs());
        }
    }
    eprintln!("default.gguf on the GPU: max abs logit error {worst:.2e}");
    assert!(worst <= 1e-3, "GPU max abs logit error {worst} > 1e-3");
    let want = common::ids(&reference["greedy_ids"]);
    assert_eq!(
        common::greedy(&gpu, &prompt, want.len()),
        want,
        "GPU greedy continuation differs from transformers"
    );
}
