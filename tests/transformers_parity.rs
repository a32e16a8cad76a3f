//! The CPU reference path against Hugging Face transformers: logits at every prompt position and
//! greedy continuations, for tiny random-weight llama / qwen2 / gpt2 models converted to GGUF by
//! llama.cpp's own tools, and for the real stories260K model. Fixtures: `tools/make_fixtures.py`.
//!
//! Each quantised variant's reference was computed by transformers on the weights the GGUF file
//! actually holds (dequantised by gguf-py), so the only difference left is float rounding order:
//! the same tolerance holds for every tensor type.

mod common;

use nexttoken::cpu::{CpuModel, Precision};
use nexttoken::model::Model;
use nexttoken::LanguageModel;
use serde_json::Value;

/// Max abs logit error vs transformers, for every weight type (f32 activations throughout).
const LOGIT_TOLERANCE: f32 = 1e-4;

fn check_variant(
    path: &std::path::Path,
    prompt: &[u32],
    want_logits: &[Vec<f32>],
    want_greedy: &[u32],
) {
    let name = path.file_name().unwrap().to_string_lossy().to_string();
    // The exact path (f32 activations): the fast path's Q8 activations would not hold 1e-4;
    // tests/cpu_kernels.rs bounds the fast path against this one instead.
    let model = CpuModel::new(Model::open(path).unwrap()).with_precision(Precision::Exact);
    let vocab = model.vocab_size();
    let mut state = model.new_state();
    let got = model.forward(&mut state, prompt, true).unwrap();
    // The fixture may hold logits for the first rows only.
    let mut worst = 0f32;
    for (pos, want) in want_logits.iter().enumerate() {
        assert_eq!(want.len(), vocab, "{name}: fixture vocab size");
        let row = &got[pos * vocab..(pos + 1) * vocab];
        for (g, w) in row.iter().zip(want) {
            worst = worst.max((g - w).abs());
        }
    }
    eprintln!("{name}: max abs logit error {worst:.2e} over {} positions", want_logits.len());
    assert!(worst <= LOGIT_TOLERANCE, "{name}: max abs logit error {worst} > {LOGIT_TOLERANCE}");
    let ours = common::greedy(&model, prompt, want_greedy.len());
    assert_eq!(ours, want_greedy, "{name}: greedy continuation differs from transformers");
}

fn check_fixture(dir: &str) {
    let dir = common::fixtures().join(dir);
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let prompt = common::ids(&reference["prompt_ids"]);
    let variants = reference["variants"].as_object().unwrap();
    assert!(!variants.is_empty());
    for (_, v) in variants {
        let file = dir.join(v["file"].as_str().unwrap());
        check_variant(&file, &prompt, &common::rows(&v["logits"]), &common::ids(&v["greedy_ids"]));
    }
}

#[test]
fn llama_all_tensor_types() {
    check_fixture("llama");
}

#[test]
fn llama_tied_embeddings_and_rope_theta() {
    check_fixture("llama_tied");
}

#[test]
fn qwen2_with_qkv_bias() {
    check_fixture("qwen2");
}

#[test]
fn gpt2() {
    check_fixture("gpt2");
}

/// The real TinyStories model: greedy from "Once upon a time" matches transformers token for
/// token for 200 tokens, from both the f32 and the q8_0 GGUF.
#[test]
fn stories260k_greedy_matches_transformers() {
    let Some(shared) = common::shared() else { return };
    let dir = shared.join("models/stories260K");
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixtures().join("stories260k/reference.json")).unwrap(),
    )
    .unwrap();
    let prompt = common::ids(&reference["prompt_ids"]);
    assert_eq!(prompt, [1, 403, 407, 261, 378], "tokenizer of 'Once upon a time'");
    check_variant(
        &dir.join("stories260K-f32.gguf"),
        &prompt,
        &common::rows(&reference["logits"]),
        &common::ids(&reference["greedy_ids"]),
    );
    let q8 = &reference["q8_0"];
    check_variant(
        &dir.join("stories260K-q8_0.gguf"),
        &prompt,
        &common::rows(&q8["logits"]),
        &common::ids(&q8["greedy_ids"]),
    );
}

/// Prompt ids from our tokenizer wrapper equal the ids transformers fed its model.
#[test]
fn fixture_prompts_tokenize_identically() {
    use nexttoken::tokenizer::HfTokenizer;
    use nexttoken::Vocab;
    for dir in ["llama", "llama_tied", "qwen2", "gpt2"] {
        let dir = common::fixtures().join(dir);
        let reference: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let tok = HfTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
        let prompt = common::ids(&reference["prompt_ids"]);
        let text = reference["prompt"].as_str().unwrap();
        let encoded = tok.encode(text).unwrap();
        assert!(
            prompt.ends_with(&encoded) && prompt.len() - encoded.len() <= 1,
            "{dir:?}: {encoded:?} vs {prompt:?}"
        );
    }
}
