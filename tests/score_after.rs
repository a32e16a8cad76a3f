//! `score(text, {after: prompt})` scores exactly what generation produced: greedy `generate`
//! reports each token's log-probability; scoring its text as the continuation of the same prompt
//! (`generate::continuation_ids`, what the page's `score(text, {after})` uses) gives the same
//! tokens and the same total, on a SentencePiece vocabulary (stories260K, the default model: the
//! leading "▁" a continuation tokenised alone would get is the bug this catches) and a
//! byte-level BPE one (GPT-2's, a generation emitting a text's own tokens).

mod common;

use nexttoken::cpu::CpuModel;
use nexttoken::generate::{continuation_ids, generate, prompt_ids, score, GenerateOptions};
use nexttoken::model::Model;
use nexttoken::sampling::SamplerConfig;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{LanguageModel, Vocab};

/// Greedy `n` tokens after `prompt`, then the generated text scored after `prompt`: the same
/// ids and log-probabilities (1e-3 relative on the total). Returns false, checking nothing, when
/// the text's own tokenisation is not the generated ids (a model may spell a word in pieces
/// its tokenizer would not): then no scorer of text can reproduce them.
fn check(name: &str, model: &CpuModel, tok: &HfTokenizer, prompt: &str, n: usize) -> bool {
    check_with(name, model, tok, prompt, n, Vec::new())
}

/// [`check`] of a generation that emits `forced` (its tokens, each with the model's probability).
fn check_forced(
    name: &str,
    model: &CpuModel,
    tok: &HfTokenizer,
    prompt: &str,
    forced: &[u32],
) -> bool {
    check_with(name, model, tok, prompt, forced.len(), forced.to_vec())
}

fn check_with(
    name: &str,
    model: &CpuModel,
    tok: &HfTokenizer,
    prompt: &str,
    n: usize,
    forced: Vec<u32>,
) -> bool {
    let ids = prompt_ids(model.bos_token(), tok, prompt).unwrap();
    let opts = GenerateOptions {
        max_tokens: n,
        stop_at_eos: false,
        sampler: SamplerConfig::greedy(),
        forced,
        ..GenerateOptions::default()
    };
    let mut events = Vec::new();
    let summary = generate(model, tok, &ids, opts, |e| {
        events.push((e.id, e.logprob as f64));
        true
    })
    .unwrap();
    let (all, context) = continuation_ids(model.bos_token(), tok, prompt, &summary.text).unwrap();
    let generated: Vec<u32> = events.iter().map(|e| e.0).collect();
    if all[context..] != generated[..] {
        assert_ne!(
            tok.encode(&format!("{prompt}{}", summary.text)).unwrap(),
            [&ids[usize::from(model.bos_token().is_some())..], &generated[..]].concat(),
            "{name}: the joined text tokenises to the generated ids, but they were not found"
        );
        return false;
    }
    assert_eq!(context, ids.len(), "{name}: the context is not the prompt's tokens");
    let scored = score(model, &all).unwrap();
    let mine = &scored.token_logprobs[context - 1..];
    let want: f64 = events.iter().map(|e| e.1).sum();
    let got: f64 = mine.iter().sum();
    assert!(
        (got - want).abs() <= 1e-3 * want.abs().max(1.0),
        "{name}, {prompt:?}: scored {got} against the generated tokens' {want} ({:?})",
        summary.text
    );
    for (i, (g, e)) in mine.iter().zip(&events).enumerate() {
        assert!((g - e.1).abs() < 1e-3, "{name}: token {i}: {g} vs generation's {}", e.1);
    }
    true
}

#[test]
fn scoring_after_a_prompt_scores_the_tokens_generation_produced() {
    let fixtures = common::fixtures();
    let default = CpuModel::new(
        Model::from_bytes(std::fs::read(common::repo().join("www/models/default.gguf")).unwrap())
            .unwrap(),
    );
    let default_tok =
        HfTokenizer::from_file(&common::repo().join("www/models/default-tokenizer.json")).unwrap();
    for prompt in ["In the beginning", "And the LORD said unto Moses,", "Blessed"] {
        assert!(check("default model", &default, &default_tok, prompt, 24));
    }
    // Byte-level BPE: a tiny random model spells words in pieces its tokenizer would not, so
    // generation is given the text's own tokens to emit (forced tokens carry the probability the
    // model gives them) and scoring must report the same.
    let gpt2 = CpuModel::new(Model::open(&fixtures.join("gpt2/gpt2-f32.gguf")).unwrap());
    let gpt2_tok = HfTokenizer::from_file(&fixtures.join("gpt2/tokenizer.json")).unwrap();
    for (prompt, text) in [
        ("Beautiful is", " better than ugly."),
        ("import", " os, sys"),
        ("Errors should never", " pass silently"),
    ] {
        let prompt_len = gpt2_tok.encode(prompt).unwrap().len();
        let forced = gpt2_tok.encode(&format!("{prompt}{text}")).unwrap()[prompt_len..].to_vec();
        assert!(check_forced("gpt2", &gpt2, &gpt2_tok, prompt, &forced));
    }
    let Some(shared) = common::shared() else { return };
    let dir = shared.join("models/stories260K");
    let stories = CpuModel::new(Model::open(&dir.join("stories260K-f32.gguf")).unwrap());
    let tok = HfTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    // The case: 20 tokens starting with ",", which alone would tokenise as "▁,".
    for prompt in ["Once upon a time", "Lily saw a big", "One day"] {
        assert!(check("stories260K", &stories, &tok, prompt, 20));
    }
}

#[test]
fn a_continuation_that_adds_nothing_is_an_error() {
    let tok =
        HfTokenizer::from_file(&common::repo().join("www/models/default-tokenizer.json")).unwrap();
    let e = continuation_ids(Some(1), &tok, "In the beginning", "").unwrap_err();
    assert!(e.to_string().contains("nothing to score"), "{e}");
}
