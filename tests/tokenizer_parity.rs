//! llama.cpp's tokenizer test vectors (ids from Hugging Face's Python tokenizers) must come out
//! identical through our wrapper of the Rust `tokenizers` crate.

mod common;

use nexttoken::tokenizer::HfTokenizer;
use nexttoken::Vocab;

fn check(folder: &str) {
    let Some(shared) = common::shared() else { return };
    let dir = shared.join("tokenizer-tests").join(folder);
    let tok = HfTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    let inp = std::fs::read_to_string(dir.join("tests.inp")).unwrap();
    let out = std::fs::read_to_string(dir.join("tests.out")).unwrap();
    let texts: Vec<&str> = inp.split("\n__ggml_vocab_test__\n").collect();
    let expected: Vec<&str> = out.lines().collect();
    // The .inp file ends with a separator, so the split leaves one empty string at the end.
    let texts = &texts[..expected.len()];
    assert!(texts.len() >= 40, "{folder}: only {} vectors found", texts.len());
    let mut failures = Vec::new();
    for (text, want) in texts.iter().zip(&expected) {
        let want: Vec<u32> = want.split_whitespace().map(|s| s.parse().unwrap()).collect();
        let got = tok.encode(text).unwrap();
        if got != want {
            failures.push(format!("{text:?}: got {got:?}, want {want:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{folder}: {} of {} differ:\n{}",
        failures.len(),
        texts.len(),
        failures.join("\n")
    );
}

#[test]
fn gpt2_vectors() {
    check("gpt-2");
}

#[test]
fn llama_spm_vectors() {
    check("llama-spm");
}

#[test]
fn qwen2_vectors() {
    check("qwen2");
}
