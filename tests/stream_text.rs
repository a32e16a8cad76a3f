//! Streamed text is the final text: for random prompts and sampling settings, on byte-fallback
//! (SentencePiece: Llama 2's vocabulary, stories260K) and byte-level BPE vocabularies (GPT-2,
//! Llama 3, Qwen2), with CJK, accented and emoji text, the token events' texts concatenated equal
//! the summary's text byte for byte, and both say what the generated tokens' bytes say: exactly
//! when they are valid UTF-8 (a regex's output always is), and with invalid runs left out
//! otherwise (a decoder may replace one byte, the run or the rest of it), no character shown
//! twice. The reference is independent of the
//! decoding under test: each token's bytes (`HfTokenizer::token_bytes`; special tokens, which
//! decode to no text, left out) joined and read as UTF-8.

mod common;

use nexttoken::constraint::ConstraintSpec;
use nexttoken::cpu::CpuModel;
use nexttoken::generate::{generate, prompt_ids, GenerateOptions};
use nexttoken::gguf::Gguf;
use nexttoken::model::{Arch, Model};
use nexttoken::quant::GgmlType;
use nexttoken::sampling::SamplerConfig;
use nexttoken::synthetic::{self, Spec, VocabMeta};
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::LanguageModel;

/// A small random model carrying the vocabulary of `vocab_gguf` (llama.cpp's vocabulary-only
/// files), and its tokenizer.
fn model_with_vocab(vocab_gguf: &std::path::Path, arch: Arch) -> (CpuModel, HfTokenizer) {
    let bytes = std::fs::read(vocab_gguf).unwrap();
    let meta = VocabMeta::from_gguf(&Gguf::parse(&bytes).unwrap()).unwrap();
    let spec =
        Spec { weight_type: GgmlType::Q8_0, seed: 5, ..Spec::new(arch, 0, 64, 1, 2, 96, 256) }
            .with_vocab(meta);
    let file = synthetic::write(&spec).unwrap();
    let tokenizer = HfTokenizer::from_gguf(&Gguf::parse(&file).unwrap()).unwrap();
    (CpuModel::new(Model::from_bytes(file).unwrap()), tokenizer)
}

/// `text` without U+FFFD.
fn clean(text: &str) -> String {
    text.chars().filter(|&c| c != '\u{FFFD}').collect()
}

const PROMPTS: [&str; 5] = [
    "Once upon a time",
    "日本語のテキストと中文",
    "Café, naïve, façade: résumé",
    "Emoji 🙂🚀 and more 🎉",
    "x",
];

const CONSTRAINTS: [&str; 3] = ["(🙂|🚀|é|中|文| ){6,12}", "[一-龥]{4,8}", "(ü|ß|ø|ñ|€|😀){5}"];

/// Generate under every prompt, several seeds and temperatures (and a few multi-byte regexes)
/// and check each stream against the tokens' bytes.
fn check_streams(name: &str, model: &CpuModel, tok: &HfTokenizer) {
    let bytes = tok.token_bytes().unwrap();
    let mut runs = 0;
    let mut exact = 0;
    let mut multibyte = 0;
    for (p, prompt) in PROMPTS.iter().enumerate() {
        let ids = prompt_ids(model.bos_token(), tok, prompt).unwrap();
        let mut settings: Vec<(f32, Option<&str>)> =
            vec![(0.0, None), (1.0, None), (3.0, None), (8.0, None)];
        settings.extend(CONSTRAINTS.iter().map(|c| (2.0, Some(*c))));
        for (s, (temperature, regex)) in settings.into_iter().enumerate() {
            let opts = GenerateOptions {
                max_tokens: 40,
                stop_at_eos: false,
                sampler: SamplerConfig {
                    temperature,
                    seed: (p * 31 + s) as u64,
                    ..SamplerConfig::default()
                },
                constraint: regex.map(|pattern| ConstraintSpec::Regex { pattern: pattern.into() }),
                ..GenerateOptions::default()
            };
            let mut streamed = String::new();
            let mut generated = Vec::new();
            let summary = generate(model, tok, &ids, opts, |e| {
                streamed.push_str(&e.text);
                generated.push(e.id);
                true
            })
            .unwrap();
            let what =
                format!("{name}, prompt {prompt:?}, temperature {temperature}, regex {regex:?}");
            assert_eq!(streamed, summary.text, "{what}: the stream is not the final text");
            // Special tokens (their bytes marked with a leading 0xFF) decode to no text.
            let joined: Vec<u8> = generated
                .iter()
                .map(|&id| &bytes[id as usize])
                .filter(|b| b.first() != Some(&0xFF))
                .flatten()
                .copied()
                .collect();
            match String::from_utf8(joined.clone()) {
                Ok(want) => {
                    assert_eq!(summary.text, want, "{what}: the text is not the tokens' bytes");
                    exact += 1;
                }
                Err(_) => {
                    // Invalid runs: decoders replace one byte, the run or the rest of it; what
                    // is left must come from the bytes in order, nothing twice, nothing invented.
                    let want = String::from_utf8_lossy(&joined);
                    let (got, want) = (clean(&summary.text), clean(&want));
                    let mut rest = want.chars();
                    assert!(
                        got.chars().all(|c| rest.any(|w| w == c)),
                        "{what}: {got:?} is not the tokens' text {want:?} with invalid runs left out"
                    );
                    assert!(regex.is_none(), "{what}: a regex's output is valid UTF-8");
                }
            }
            multibyte += summary.text.chars().filter(|c| c.len_utf8() > 1).count();
            runs += 1;
        }
    }
    eprintln!(
        "{name}: {runs} streams equal their final text, {exact} of them valid UTF-8 equal to the \
         tokens' bytes ({multibyte} multi-byte characters)"
    );
    assert!(
        multibyte > 20,
        "{name}: too few multi-byte characters were generated to test anything"
    );
    assert!(exact >= runs / 2, "{name}: too few runs of valid UTF-8 to compare exactly");
}

#[test]
fn streams_equal_the_final_text_on_byte_fallback_and_byte_level_vocabularies() {
    let Some(shared) = common::shared() else { return };
    let tests = shared.join("tokenizer-tests");
    for (folder, arch) in [
        ("llama-spm", Arch::Llama),
        ("gpt-2", Arch::Gpt2),
        ("llama-bpe", Arch::Llama),
        ("qwen2", Arch::Qwen2),
    ] {
        let gguf = std::fs::read_dir(tests.join(folder))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "gguf"))
            .unwrap();
        let (model, tok) = model_with_vocab(&gguf, arch);
        check_streams(folder, &model, &tok);
    }
    // A trained model on a byte-fallback vocabulary (issue: '🙂{3}' printed six).
    let dir = shared.join("models/stories260K");
    let model = CpuModel::new(Model::open(&dir.join("stories260K-q8_0.gguf")).unwrap());
    let tok = HfTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    check_streams("stories260K", &model, &tok);
}
