//! Structured output (`nexttoken::constraint`, issue 16), checked by independent references:
//! every constrained output is parsed and validated by the `jsonschema` crate (JSON Schema), the
//! `regex` crate (regexes) or a small parser written here (grammars), never by llguidance, which
//! made it.
//!
//! The model is a synthetic llama with random weights (their near-uniform, high-entropy
//! distributions make the constraint do all the work) carrying GPT-2's real vocabulary of 50257
//! byte-level tokens from llama.cpp's vocabulary GGUF in `../shared` (skipped loudly without
//! it); the token-bytes property runs over every tokenizer there, `tokenizer.json` and GGUF.

mod common;

use std::sync::OnceLock;

use nexttoken::constraint::{AllowedSet, Constraint, ConstraintSpec, SPECIAL};
use nexttoken::cpu::{CpuModel, Precision};
use nexttoken::generate::{
    beam_search_constrained, BeamOptions, GenerateOptions, Generation, StopReason, TokenEvent,
};
use nexttoken::gguf::Gguf;
use nexttoken::model::Model;
use nexttoken::quant::GgmlType;
use nexttoken::sampling::SamplerConfig;
use nexttoken::synthetic::{self, VocabMeta};
use nexttoken::table::TableModel;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{Error, LanguageModel, Vocab};

use common::SplitMix64;

// ---------------------------------------------------------------------------------------------
// The model
// ---------------------------------------------------------------------------------------------

struct Fixture {
    model: CpuModel,
    tok: HfTokenizer,
    /// The GGUF file (for the GPU test).
    bytes: Vec<u8>,
}

/// A llama of tiny width (64, 2 layers) with GPT-2's vocabulary in its metadata and a context
/// of 1024, built once per test binary.
fn fixture() -> Option<&'static Fixture> {
    static FIXTURE: OnceLock<Option<Fixture>> = OnceLock::new();
    FIXTURE
        .get_or_init(|| {
            let shared = common::shared()?;
            let vocab = std::fs::read(shared.join("tokenizer-tests/gpt-2/ggml-vocab-gpt-2.gguf"))
                .expect("GPT-2 vocabulary GGUF");
            let meta = VocabMeta::from_gguf(&Gguf::parse(&vocab).unwrap()).unwrap();
            let spec = common::synth_spec("llama", GgmlType::Q8_0, 16).with_vocab(meta);
            let bytes = synthetic::write(&synthetic::Spec { n_ctx: 1024, ..spec }).unwrap();
            let tok = HfTokenizer::from_gguf_bytes(&bytes).unwrap();
            let model = CpuModel::new(Model::from_bytes(bytes.clone()).unwrap())
                .with_precision(Precision::Fast)
                .with_threads(1);
            Some(Fixture { model, tok, bytes })
        })
        .as_ref()
}

/// The same shape with the repository's default model's tokenizer (SentencePiece with byte
/// fallback, 2048 tokens): for the GPU, where a 50k-row output projection on lavapipe (a CPU
/// emulating a GPU) takes most of a second per token.
fn small_fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let path = common::repo().join("www/models/default-tokenizer.json");
        let tok = HfTokenizer::from_file(&path).unwrap();
        let spec = synthetic::Spec {
            n_vocab: tok.vocab_size(),
            n_ctx: 1024,
            ..common::synth_spec("llama", GgmlType::Q8_0, 17)
        };
        let bytes = synthetic::write(&spec).unwrap();
        let model = CpuModel::new(Model::from_bytes(bytes.clone()).unwrap());
        Fixture { model, tok, bytes }
    })
}

fn prompt(f: &Fixture, text: &str) -> Vec<u32> {
    nexttoken::generate::prompt_ids(f.model.bos_token(), &f.tok, text).unwrap()
}

/// Run a generation to its end: (events, text, stop reason).
fn run<M: LanguageModel>(
    model: &M,
    vocab: &dyn Vocab,
    prompt: &[u32],
    opts: GenerateOptions,
) -> nexttoken::Result<(Vec<TokenEvent>, String, StopReason)> {
    let mut g = Generation::new(model, vocab, prompt, opts)?;
    let mut events = Vec::new();
    while let Some(ev) = g.step()? {
        events.push(ev);
    }
    let text = g.text().to_string();
    Ok((events, text, g.stop_reason().unwrap()))
}

fn constrained(spec: ConstraintSpec, sampler: SamplerConfig, max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, sampler, constraint: Some(spec), ..GenerateOptions::default() }
}

fn schema(schema: serde_json::Value) -> ConstraintSpec {
    ConstraintSpec::JsonSchema { schema }
}

fn regex(pattern: &str) -> ConstraintSpec {
    ConstraintSpec::Regex { pattern: pattern.into() }
}

/// The samplers each schema runs with: greedy, plain sampling, and one of the filters in turn
/// (every filter and the repetition penalty meet ten schemas), seeded by the schema's index.
fn samplers(i: usize) -> Vec<SamplerConfig> {
    let seed = 1000 + i as u64;
    let d = SamplerConfig { seed, ..SamplerConfig::default() };
    let filtered = match i % 5 {
        0 => SamplerConfig { temperature: 0.8, top_k: 20, ..d.clone() },
        1 => SamplerConfig { temperature: 1.2, top_p: 0.9, ..d.clone() },
        2 => SamplerConfig { temperature: 1.0, min_p: 0.05, ..d.clone() },
        3 => SamplerConfig { temperature: 0.9, repeat_penalty: 1.3, ..d.clone() },
        _ => SamplerConfig { temperature: 1.5, ..d.clone() },
    };
    vec![SamplerConfig::greedy(), SamplerConfig { seed: seed + 7, ..d }, filtered]
}

// ---------------------------------------------------------------------------------------------
// Token bytes: decoding any ids equals the concatenation of their extracted bytes
// ---------------------------------------------------------------------------------------------

/// Checks `tok.token_bytes()` against `tok.decode` on every single token and on random
/// sequences: byte-level BPE decodes to the lossy UTF-8 of the concatenation exactly; a
/// SentencePiece decoder (byte fallback writes each byte of an invalid run as U+FFFD, where
/// lossy decoding writes one per run) is compared when the concatenation is valid UTF-8.
/// Special tokens must be marked and nothing else.
fn check_token_bytes(name: &str, tok: &HfTokenizer) {
    let bytes = tok.token_bytes().unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(bytes.len(), tok.vocab_size(), "{name}");
    // An anchor in front keeps the decoder's cosmetic first-space strip off the tokens tested.
    let anchor = tok.token_id("x").unwrap_or_else(|| panic!("{name}: no token 'x'"));
    assert_eq!(bytes[anchor as usize], b"x", "{name}");
    let special: Vec<bool> = (0..bytes.len() as u32)
        .map(|id| tok.decode(&[anchor, id]) == "x" && !bytes[id as usize].is_empty())
        .collect();
    let mut marked = 0;
    for (id, b) in bytes.iter().enumerate() {
        // A lone 0xFF is GPT-2's byte token for 0xFF, not a marker (toktrie reads it so too).
        let is_marked = b.len() > 1 && b[0] == SPECIAL;
        // Whatever decodes to nothing (skip_special_tokens) is marked, and only that.
        assert_eq!(is_marked, special[id], "{name}: token {id} {b:?}");
        marked += is_marked as usize;
    }
    // SentencePiece with byte fallback spells its byte tokens <0xNN>.
    let byte_level = !(0..bytes.len() as u32).any(|id| tok.token_text(id).starts_with("<0x"));
    let expect = |ids: &[u32]| -> Option<String> {
        let mut all = b"x".to_vec();
        for &id in ids {
            all.extend_from_slice(&bytes[id as usize]);
        }
        match String::from_utf8(all) {
            Ok(s) => Some(s),
            Err(e) if byte_level => Some(String::from_utf8_lossy(e.as_bytes()).into_owned()),
            Err(_) => None,
        }
    };
    let ordinary: Vec<u32> = (0..bytes.len() as u32).filter(|&id| !special[id as usize]).collect();
    let (mut checked, mut skipped) = (0, 0);
    for &id in &ordinary {
        match expect(&[id]) {
            Some(want) => {
                assert_eq!(tok.decode(&[anchor, id]), want, "{name}: token {id}");
                checked += 1;
            }
            None => skipped += 1,
        }
    }
    let mut rng = SplitMix64(0x5eed ^ bytes.len() as u64);
    for _ in 0..2000 {
        let n = 2 + rng.below(10) as usize;
        let ids: Vec<u32> =
            (0..n).map(|_| ordinary[rng.below(ordinary.len() as u64) as usize]).collect();
        let mut with_anchor = vec![anchor];
        with_anchor.extend(&ids);
        match expect(&ids) {
            Some(want) => {
                assert_eq!(tok.decode(&with_anchor), want, "{name}: {ids:?}");
                checked += 1;
            }
            None => skipped += 1,
        }
    }
    eprintln!(
        "{name}: {} tokens ({marked} special); {checked} decodes equal their bytes, {skipped} \
         invalid UTF-8 under byte fallback not compared",
        bytes.len()
    );
    assert!(checked > ordinary.len() / 2, "{name}: too few comparisons");
}

#[test]
fn token_bytes_concatenate_to_the_decoded_text() {
    let Some(shared) = common::shared() else { return };
    let t = shared.join("tokenizer-tests");
    for family in ["gpt-2", "llama-spm", "qwen2"] {
        let tok = HfTokenizer::from_file(&t.join(family).join("tokenizer.json")).unwrap();
        check_token_bytes(&format!("{family} tokenizer.json"), &tok);
    }
    for family in ["gpt-2", "llama-spm", "qwen2", "llama-bpe"] {
        let bytes =
            std::fs::read(t.join(family).join(format!("ggml-vocab-{family}.gguf"))).unwrap();
        let tok = HfTokenizer::from_gguf_bytes(&bytes).unwrap();
        check_token_bytes(&format!("{family} GGUF"), &tok);
    }
}

#[test]
fn token_bytes_of_the_default_model_and_known_tokens() {
    let tok =
        HfTokenizer::from_file(&common::repo().join("www/models/default-tokenizer.json")).unwrap();
    check_token_bytes("default model", &tok);
    let Some(f) = fixture() else { return };
    let bytes = f.tok.token_bytes().unwrap();
    // GPT-2: "Ġthe" is " the", "Ċ" a newline, <|endoftext|> special.
    let id = |s: &str| f.tok.token_id(s).unwrap() as usize;
    assert_eq!(bytes[id("Ġthe")], b" the");
    assert_eq!(bytes[id("Ċ")], b"\n");
    assert_eq!(bytes[id("<|endoftext|>")], b"\xff<|endoftext|>");
}

// ---------------------------------------------------------------------------------------------
// 50 JSON schemas, each with greedy decoding and two sampled runs, validated by `jsonschema`
// ---------------------------------------------------------------------------------------------

fn schemas() -> Vec<(String, serde_json::Value)> {
    let text = std::fs::read_to_string(common::fixtures().join("schemas.json")).unwrap();
    let all: serde_json::Value = serde_json::from_str(&text).unwrap();
    let list = all["schemas"].as_array().unwrap();
    list.iter().map(|s| (s["name"].as_str().unwrap().to_string(), s["schema"].clone())).collect()
}

/// Every output of `range` of the schemas parses and validates (formats included).
fn schemas_validate(range: std::ops::Range<usize>) {
    let Some(f) = fixture() else { return };
    let all = schemas();
    assert_eq!(all.len(), 50);
    let prompt = prompt(f, "Reply with JSON only.");
    for (i, (name, s)) in all.iter().enumerate().skip(range.start).take(range.len()) {
        let validator = jsonschema::options()
            .should_validate_formats(true)
            .build(s)
            .unwrap_or_else(|e| panic!("{name}: the fixture is not a valid schema: {e}"));
        for sampler in samplers(i) {
            let opts = constrained(schema(s.clone()), sampler.clone(), 400);
            let (events, text, stop) = run(&f.model, &f.tok, &prompt, opts)
                .unwrap_or_else(|e| panic!("{name} {sampler:?}: {e}"));
            assert!(
                matches!(stop, StopReason::ConstraintComplete | StopReason::Eos),
                "{name} {sampler:?}: stopped with {stop:?} after {} tokens: {text:?}",
                events.len()
            );
            let value: serde_json::Value = serde_json::from_str(&text)
                .unwrap_or_else(|e| panic!("{name} {sampler:?}: not JSON ({e}): {text:?}"));
            if let Err(e) = validator.validate(&value) {
                panic!("{name} {sampler:?}: {text:?} does not validate: {e}");
            }
        }
    }
}

#[test]
fn schemas_00_to_09_validate() {
    schemas_validate(0..10);
}

#[test]
fn schemas_10_to_19_validate() {
    schemas_validate(10..20);
}

#[test]
fn schemas_20_to_29_validate() {
    schemas_validate(20..30);
}

#[test]
fn schemas_30_to_39_validate() {
    schemas_validate(30..40);
}

#[test]
fn schemas_40_to_49_validate() {
    schemas_validate(40..50);
}

/// Any JSON object. A random model fills its free-length strings for hundreds of tokens, so its
/// runs end Incomplete (and say so); forced tokens spelling an object complete it, and an array
/// is refused.
#[test]
fn json_object_outputs_are_objects_or_incomplete() {
    let Some(f) = fixture() else { return };
    let prompt = prompt(f, "JSON:");
    for seed in 0..3 {
        let sampler = SamplerConfig { seed, temperature: 0.7, ..SamplerConfig::default() };
        let opts = constrained(ConstraintSpec::JsonObject, sampler, 60);
        let (_, text, stop) = run(&f.model, &f.tok, &prompt, opts).unwrap();
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(value) => assert!(value.is_object() && stop.is_complete(), "{text:?}"),
            Err(_) => assert_eq!(stop, StopReason::Incomplete, "{text:?}"),
        }
    }
    let object = r#"{"a": [1, true, "x"], "b": {"c": null}}"#;
    let forced = f.tok.encode(object).unwrap();
    let opts = GenerateOptions {
        forced: forced.clone(),
        ..constrained(ConstraintSpec::JsonObject, SamplerConfig::greedy(), 60)
    };
    let (events, text, stop) = run(&f.model, &f.tok, &prompt, opts).unwrap();
    assert_eq!((text.as_str(), stop), (object, StopReason::ConstraintComplete));
    assert_eq!(events.len(), forced.len());
    let opts = GenerateOptions {
        forced: f.tok.encode("[1]").unwrap(),
        ..constrained(ConstraintSpec::JsonObject, SamplerConfig::greedy(), 60)
    };
    let e = run(&f.model, &f.tok, &prompt, opts).unwrap_err().to_string();
    assert!(e.contains("forced token") && e.contains("not allowed"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Regexes, checked with the regex crate; grammars, checked by a parser written here
// ---------------------------------------------------------------------------------------------

const PATTERNS: &[&str] = &[
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{2,8}( [A-Z][a-z]{2,8}){0,2}",
    r"#[0-9a-f]{6}",
    r"[a-z]{1,10}@[a-z]{1,10}\.(com|org)",
    r"-?[0-9]{1,5}(\.[0-9]{1,3})?",
    r"(0|[1-9][0-9]{0,3})",
    r"[α-ω]{2,5}",
    r"(true|false)",
    r"[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    r"[^\n]{1,12}\n",
    r"(ab|cd){0,6}x",
];

#[test]
fn regex_outputs_match() {
    let Some(f) = fixture() else { return };
    let prompt = prompt(f, "Answer:");
    for (i, pattern) in PATTERNS.iter().enumerate() {
        let check = regex::Regex::new(&format!("^(?:{pattern})$")).unwrap();
        for sampler in samplers(i) {
            let opts = constrained(regex(pattern), sampler.clone(), 100);
            let (_, text, stop) = run(&f.model, &f.tok, &prompt, opts)
                .unwrap_or_else(|e| panic!("{pattern} {sampler:?}: {e}"));
            assert!(stop.is_complete(), "{pattern} {sampler:?}: {stop:?} {text:?}");
            assert!(check.is_match(&text), "{pattern} {sampler:?}: {text:?}");
        }
    }
}

/// Lists of numbers and words, nested by brackets, as a Lark grammar; checked by a recursive
/// descent parser.
const LIST_GRAMMAR: &str = r#"
start: list
list: "[" item ("," item)? ("," item)? "]"
item: NUMBER | WORD | list
NUMBER: /[0-9]{1,3}/
WORD: /[a-z]{1,6}/
"#;

/// Whether `s` is a `list` of [`LIST_GRAMMAR`], whole.
fn is_list(s: &str) -> bool {
    fn list(b: &[u8], mut i: usize, depth: usize) -> Option<usize> {
        if depth > 64 || b.get(i) != Some(&b'[') {
            return None;
        }
        i += 1;
        for n in 0..3 {
            if n > 0 {
                if b.get(i) == Some(&b']') {
                    return Some(i + 1);
                }
                if b.get(i) != Some(&b',') {
                    return None;
                }
                i += 1;
            }
            i = item(b, i, depth)?;
        }
        (b.get(i) == Some(&b']')).then_some(i + 1)
    }
    fn item(b: &[u8], i: usize, depth: usize) -> Option<usize> {
        let run = |f: fn(&u8) -> bool, max: usize| {
            let n = b[i..].iter().take_while(|c| f(c)).count();
            (1..=max).contains(&n).then_some(i + n)
        };
        match b.get(i)? {
            b'[' => list(b, i, depth + 1),
            c if c.is_ascii_digit() => run(u8::is_ascii_digit, 3),
            c if c.is_ascii_lowercase() => run(u8::is_ascii_lowercase, 6),
            _ => None,
        }
    }
    let b = s.as_bytes();
    list(b, 0, 0) == Some(b.len())
}

#[test]
fn grammar_outputs_parse() {
    let Some(f) = fixture() else { return };
    assert!(is_list("[1,ab,[2]]") && !is_list("[1,2,3,4]") && !is_list("[1234]"));
    let prompt = prompt(f, "List:");
    let spec = ConstraintSpec::Grammar { lark: LIST_GRAMMAR.into() };
    for i in 0..4 {
        for sampler in samplers(i) {
            let opts = constrained(spec.clone(), sampler.clone(), 200);
            let (_, text, stop) = run(&f.model, &f.tok, &prompt, opts).unwrap();
            assert!(stop.is_complete(), "{sampler:?}: {stop:?} {text:?}");
            assert!(is_list(&text), "{sampler:?}: {text:?}");
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The mask itself, greedy equivalence, what the events report
// ---------------------------------------------------------------------------------------------

/// Greedy decoding under a constraint that admits the unconstrained greedy text gives that text:
/// the exact text as a regex (then it stops by itself), and a regex admitting any text of up to
/// 200 characters.
#[test]
fn greedy_under_an_admitting_constraint_is_plain_greedy() {
    let Some(f) = fixture() else { return };
    let mut tried = 0;
    for text in ["The", "Once upon a time", "A", "In the"] {
        let prompt = prompt(f, text);
        let plain = GenerateOptions {
            max_tokens: 24,
            sampler: SamplerConfig::greedy(),
            stop_at_eos: false,
            ..GenerateOptions::default()
        };
        let (events, want, _) = run(&f.model, &f.tok, &prompt, plain.clone()).unwrap();
        if want.contains('\u{FFFD}') {
            continue; // a run of bytes that is not UTF-8: no regex over text admits it
        }
        tried += 1;
        let ids: Vec<u32> = events.iter().map(|e| e.id).collect();
        for (pattern, stop) in [
            (regex_syntax::escape(&want), StopReason::ConstraintComplete),
            (r"(?s:.{0,200})".to_string(), StopReason::MaxTokens),
        ] {
            let opts = GenerateOptions { constraint: Some(regex(&pattern)), ..plain.clone() };
            let (got, text, reason) = run(&f.model, &f.tok, &prompt, opts).unwrap();
            let got: Vec<u32> = got.iter().map(|e| e.id).collect();
            assert_eq!(got, ids, "{pattern}");
            assert_eq!(text, want);
            assert_eq!(reason, stop, "{pattern}");
        }
    }
    assert!(tried > 0, "every greedy text held invalid UTF-8");
}

/// At each step of a digits-only regex, the candidates the event keeps are all digit tokens and
/// what it reports removed are exactly the others among the model's most likely (checked on the
/// token bytes, not through llguidance).
#[test]
fn events_report_what_the_constraint_removed() {
    let Some(f) = fixture() else { return };
    let bytes = f.tok.token_bytes().unwrap();
    let digits = |id: u32| {
        let b = &bytes[id as usize];
        !b.is_empty() && b.iter().all(u8::is_ascii_digit)
    };
    let opts = GenerateOptions {
        keep_candidates: 64,
        stop_at_eos: false,
        ..constrained(regex("[0-9]{40}"), SamplerConfig { seed: 5, ..Default::default() }, 60)
    };
    let prompt = prompt(f, "Digits:");
    let mut g = Generation::new(&f.model, &f.tok, &prompt, opts).unwrap();
    let mut steps = 0;
    while let Some(ev) = g.step().unwrap() {
        assert!(digits(ev.id), "{}", ev.id);
        assert!(!ev.candidates.is_empty());
        assert!(ev.candidates.iter().all(|&(id, _)| digits(id)), "{:?}", ev.candidates);
        // The model's own 64 most likely (plain distribution) minus the digit tokens.
        let mut state = f.model.new_state();
        let held = &g.held_ids().to_vec();
        let logits = f.model.forward(&mut state, &held[..ev.position], false).unwrap();
        let top = nexttoken::sampling::top_n(&logits, 64);
        let want: Vec<u32> = top.iter().map(|&(id, _)| id).filter(|&id| !digits(id)).collect();
        let got: Vec<u32> = ev.removed.iter().map(|&(id, _)| id).collect();
        assert_eq!(got, want, "step {steps}");
        let probs = nexttoken::sampling::softmax(&logits);
        for &(id, p) in &ev.removed {
            assert!((p - probs[id as usize]).abs() < 1e-6);
        }
        // The model's own alternatives, allowed or not.
        assert_eq!(ev.top[0].0, top[0].0);
        steps += 1;
        if steps == 4 {
            break;
        }
    }
    assert_eq!(steps, 4);
}

/// The allowed set against the token bytes directly: under `[0-9]{3}` after "12", exactly the
/// tokens that are one digit or the end are allowed.
#[test]
fn allowed_set_is_what_the_bytes_allow() {
    let Some(f) = fixture() else { return };
    let n = f.model.vocab_size();
    let vocab = f.tok.constraint_vocab(n).unwrap();
    // The model's EOS and another end token (as a chat template's end of turn would be): allowed
    // only once the output is complete, whatever their bytes.
    let hello = f.tok.token_id("hello").unwrap();
    let mut ends = f.model.eos_tokens().to_vec();
    ends.push(hello);
    let mut c = Constraint::new(&regex("[0-9]{3}"), vocab).unwrap().with_end_tokens(&ends);
    let bytes = f.tok.token_bytes().unwrap();
    let digit_runs = |len: usize| -> Vec<u32> {
        let ok = |b: &Vec<u8>| b.len() <= len && !b.is_empty() && b.iter().all(u8::is_ascii_digit);
        (0..n as u32).filter(|&id| ok(&bytes[id as usize])).collect()
    };
    assert_eq!(c.allowed().unwrap().ids(), digit_runs(3));
    c.consume(f.tok.token_id("12").unwrap()).unwrap();
    assert_eq!(c.allowed().unwrap().ids(), digit_runs(1));
    assert!(!c.is_complete());
    c.consume(f.tok.token_id("7").unwrap()).unwrap();
    assert!(c.is_complete());
    assert!(c.is_finished().unwrap());
    ends.sort();
    assert_eq!(c.allowed().unwrap().ids(), ends);
    let err = c.consume(f.tok.token_id("1").unwrap()).unwrap_err().to_string();
    assert!(err.contains("not allowed") || err.contains("ends the text"), "{err}");
    // The bit layout the GPU reads.
    let set = AllowedSet::from_ids(70, &[0, 31, 32, 69]);
    assert_eq!(set.words(), &[1 | 1 << 31, 1, 1 << 5][..]);
    assert_eq!(set.count(), 4);
    assert_eq!(set.ids(), vec![0, 31, 32, 69]);
}

// ---------------------------------------------------------------------------------------------
// Beam search, stop reasons, errors
// ---------------------------------------------------------------------------------------------

#[test]
fn beam_search_finds_valid_output() {
    let Some(f) = fixture() else { return };
    let all = schemas();
    let prompt = prompt(f, "JSON:");
    for i in [0, 5, 12, 22] {
        let (name, s) = &all[i];
        let opts = BeamOptions { beams: 3, max_tokens: 120, length_normalise: false };
        let spec = schema(s.clone());
        let beams = beam_search_constrained(&f.model, &prompt, opts, Some((&f.tok, &spec)))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let best = &beams[0];
        assert!(best.stop_reason.is_complete(), "{name}: {:?}", best.stop_reason);
        let text = f.tok.decode(&best.ids);
        let value: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: {e}: {text:?}"));
        let validator = jsonschema::options().should_validate_formats(true).build(s).unwrap();
        assert!(validator.is_valid(&value), "{name}: {text:?}");
        // Ranked by the model's own log P: the best beam's tokens add up to it.
        let sum: f64 = best.tokens.iter().map(|t| t.logprob).sum();
        assert!((sum - best.logprob).abs() < 1e-9);
    }
}

#[test]
fn running_out_of_tokens_is_incomplete_never_a_normal_finish() {
    let Some(f) = fixture() else { return };
    let s = serde_json::json!({"type": "object", "properties": {"name": {"type": "string",
        "minLength": 20, "maxLength": 30}}, "required": ["name"], "additionalProperties": false});
    let prompt = prompt(f, "JSON:");
    let (_, text, stop) =
        run(&f.model, &f.tok, &prompt, constrained(schema(s.clone()), SamplerConfig::greedy(), 3))
            .unwrap();
    assert_eq!(stop, StopReason::Incomplete, "{text:?}");
    assert!(!stop.is_complete());
    assert!(stop.describe().contains("does not match"));
    assert!(serde_json::from_str::<serde_json::Value>(&text).is_err());
    // The context, likewise.
    let small = CpuModel::new(Model::from_bytes(f.bytes.clone()).unwrap()).with_max_seq(6);
    let (_, _, stop) =
        run(&small, &f.tok, &prompt, constrained(schema(s.clone()), SamplerConfig::greedy(), 50))
            .unwrap();
    assert_eq!(stop, StopReason::Incomplete);
    // max_tokens 0: nothing is no valid output either.
    let (_, _, stop) =
        run(&f.model, &f.tok, &prompt, constrained(schema(s), SamplerConfig::greedy(), 0)).unwrap();
    assert_eq!(stop, StopReason::Incomplete);
    // A regex that an empty output matches is complete at once.
    let (_, _, stop) =
        run(&f.model, &f.tok, &prompt, constrained(regex("a*"), SamplerConfig::greedy(), 0))
            .unwrap();
    assert_eq!(stop, StopReason::MaxTokens);
}

fn constraint_error(f: &Fixture, spec: ConstraintSpec) -> String {
    let opts = constrained(spec.clone(), SamplerConfig::greedy(), 10);
    match Generation::new(&f.model, &f.tok as &dyn Vocab, &prompt(f, "x"), opts) {
        Err(e @ Error::Constraint(_)) => e.to_string(),
        Err(e) => panic!("{spec:?}: not a constraint error: {e}"),
        Ok(_) => panic!("{spec:?}: accepted"),
    }
}

#[test]
fn bad_schemas_regexes_and_grammars_are_named_errors() {
    let Some(f) = fixture() else { return };
    let e = constraint_error(f, schema(serde_json::json!({"type": "strng"})));
    assert!(e.contains("invalid JSON schema") && e.contains("strng"), "{e}");
    let e = constraint_error(f, schema(serde_json::json!([1, 2])));
    assert!(e.contains("invalid JSON schema") && e.contains("an array"), "{e}");
    let e = constraint_error(f, schema(serde_json::json!({"$ref": "#/$defs/missing"})));
    assert!(e.contains("invalid JSON schema") && e.contains("missing"), "{e}");
    let e = constraint_error(
        f,
        schema(serde_json::json!({"type": "integer", "minimum": 5, "maximum": 1})),
    );
    assert!(e.contains("invalid JSON schema"), "{e}");
    let unique = serde_json::json!({"type": "array", "uniqueItems": true});
    let e = constraint_error(f, schema(unique));
    assert!(e.contains("invalid JSON schema") && e.contains("uniqueItems"), "{e}");
    // The regex's error points at the character.
    let e = constraint_error(f, regex("ab(c"));
    assert!(e.contains("invalid regex") && e.contains("unclosed group"), "{e}");
    assert!(e.contains("ab(c") && e.contains('^'), "{e}");
    let e = constraint_error(f, regex("[z-a]"));
    assert!(e.contains("invalid regex") && e.contains("range"), "{e}");
    // The grammar's error names the line.
    let bad = "start: item\nitem: \"a\" | \n  | ( \"b\"\n";
    let e = constraint_error(f, ConstraintSpec::Grammar { lark: bad.into() });
    assert!(e.contains("invalid grammar") && e.contains('3'), "{e}");
    let e = constraint_error(f, ConstraintSpec::Grammar { lark: "start: nope\n".into() });
    assert!(e.contains("invalid grammar") && e.contains("nope"), "{e}");
    let e = constraint_error(f, ConstraintSpec::Grammar { lark: " ".into() });
    assert!(e.contains("empty"), "{e}");
}

#[test]
fn constraints_refuse_what_they_cannot_follow() {
    let Some(f) = fixture() else { return };
    let p = prompt(f, "Number:");
    // A forced token outside the constraint.
    let word = f.tok.token_id("hello").unwrap();
    let opts = GenerateOptions {
        forced: vec![word],
        ..constrained(regex("[0-9]+"), SamplerConfig::greedy(), 5)
    };
    let mut g = Generation::new(&f.model, &f.tok as &dyn Vocab, &p, opts).unwrap();
    let e = g.step().unwrap_err().to_string();
    assert!(e.contains("forced token") && e.contains("hello") && e.contains("not allowed"), "{e}");
    assert!(g.step().unwrap().is_none());
    // A forced token it allows is emitted.
    let seven = f.tok.token_id("7").unwrap();
    let opts = GenerateOptions {
        forced: vec![seven],
        ..constrained(regex("[0-9]{2}"), SamplerConfig::greedy(), 5)
    };
    let (events, text, stop) = run(&f.model, &f.tok, &p, opts).unwrap();
    assert_eq!(events[0].id, seven);
    assert!(text.starts_with('7') && text.len() == 2 && stop == StopReason::ConstraintComplete);
    // Stop strings would cut the output: refused.
    let opts = GenerateOptions {
        stop_strings: vec!["}".into()],
        ..constrained(ConstraintSpec::JsonObject, SamplerConfig::greedy(), 5)
    };
    let e = Generation::new(&f.model, &f.tok as &dyn Vocab, &p, opts).err().unwrap().to_string();
    assert!(e.contains("stop strings"), "{e}");
    // A lesson table has no byte vocabulary.
    let table = TableModel::from_json(
        &std::fs::read_to_string(common::repo().join("www/models/lesson-toy.json")).unwrap(),
    )
    .unwrap();
    let opts = constrained(ConstraintSpec::JsonObject, SamplerConfig::greedy(), 5);
    let e = Generation::new(&table, &table as &dyn Vocab, &[0], opts).err().unwrap().to_string();
    assert!(e.contains("tokenizer whose tokens are bytes"), "{e}");
}

/// A branch of a constrained generation: the prompt holds the tokens generated before the branch
/// point, which the constraint consumes first (`constraint_prefix`); a prefix it refuses is an
/// error naming the token.
#[test]
fn constraint_prefix_continues_a_branch() {
    let Some(f) = fixture() else { return };
    let p = prompt(f, "Date:");
    let spec = regex("[0-9]{4}-[0-9]{2}-[0-9]{2}");
    let opts = constrained(spec.clone(), SamplerConfig::greedy(), 30);
    let (events, text, _) = run(&f.model, &f.tok, &p, opts.clone()).unwrap();
    assert!(regex::Regex::new("^[0-9]{4}-[0-9]{2}-[0-9]{2}$").unwrap().is_match(&text));
    // Branch after the first two tokens, forcing the third the greedy run took: same output.
    let mut branched = p.clone();
    branched.extend(events[..2].iter().map(|e| e.id));
    let opts2 =
        GenerateOptions { constraint_prefix: 2, forced: vec![events[2].id], ..opts.clone() };
    let (rest, _, stop) = run(&f.model, &f.tok, &branched, opts2).unwrap();
    let ids: Vec<u32> = rest.iter().map(|e| e.id).collect();
    let want: Vec<u32> = events[2..].iter().map(|e| e.id).collect();
    assert_eq!(ids, want);
    assert_eq!(stop, StopReason::ConstraintComplete);
    // A prefix the constraint refuses.
    let mut bad = p.clone();
    bad.push(f.tok.token_id("hello").unwrap());
    let opts3 = GenerateOptions { constraint_prefix: 1, ..opts };
    let e = Generation::new(&f.model, &f.tok as &dyn Vocab, &bad, opts3).err().unwrap().to_string();
    assert!(e.contains("refuses prompt token"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// The GPU path (lavapipe in CI): the allowed set applied in the top-k kernel
// ---------------------------------------------------------------------------------------------

/// Constrained generation on the GPU, whose greedy and top-k steps upload the allowed set and
/// read back only the picks: the CPU exact path's tokens, and every output valid.
#[test]
fn gpu_constrained_generation_matches_the_cpu() {
    let f = small_fixture();
    let Some(ctx) = common::gpu_context() else { return };
    use nexttoken::gpu::{GpuModel, GpuOptions};
    let model = Model::from_bytes(f.bytes.clone()).unwrap();
    let gpu = pollster::block_on(GpuModel::with_options(ctx, model, GpuOptions::f32()))
        .unwrap()
        .with_max_seq(512);
    let cpu = CpuModel::new(Model::from_bytes(f.bytes.clone()).unwrap()).with_max_seq(512);
    let all = schemas();
    let prompt = prompt(f, "JSON:");
    // Compact JSON (the schema's own llguidance options replace the default whitespace): a
    // random model with a tokenizer whose whitespace tokens are single bytes would fill every
    // gap's whitespace, hundreds of tokens at the speed of lavapipe.
    let compact = |s: &serde_json::Value| {
        let mut s = s.clone();
        s["x-guidance"] = serde_json::json!({"whitespace_flexible": false});
        schema(s)
    };
    let mut specs: Vec<(String, ConstraintSpec)> =
        [0, 11, 13, 29, 36, 44].iter().map(|&i| (all[i].0.clone(), compact(&all[i].1))).collect();
    specs.push(("phone".into(), regex(PATTERNS[0])));
    specs.push(("greek".into(), regex(PATTERNS[7])));
    specs.push(("list".into(), ConstraintSpec::Grammar { lark: LIST_GRAMMAR.into() }));
    for (k, (name, spec)) in specs.iter().enumerate() {
        for sampler in [
            SamplerConfig::greedy(),
            SamplerConfig { top_k: 16, temperature: 0.9, seed: k as u64, ..Default::default() },
        ] {
            let opts = GenerateOptions {
                keep_candidates: 8,
                ..constrained(spec.clone(), sampler.clone(), 300)
            };
            let (on_cpu, text, stop) = run(&cpu, &f.tok, &prompt, opts.clone()).unwrap();
            let mut g = Generation::new(&gpu, &f.tok as &dyn Vocab, &prompt, opts).unwrap();
            let mut on_gpu = Vec::new();
            while let Some(ev) = g.step().unwrap() {
                // Only the two rankings come back, never the logits row.
                assert!(gpu.stats().readback_bytes_last <= 2 * (2 + 2 * 64) * 4);
                on_gpu.push(ev);
            }
            let ids = |evs: &[TokenEvent]| evs.iter().map(|e| e.id).collect::<Vec<_>>();
            assert_eq!(ids(&on_gpu), ids(&on_cpu), "{name} {sampler:?}");
            assert_eq!(g.text(), text);
            assert_eq!(g.stop_reason(), Some(stop));
            for (a, b) in on_cpu.iter().zip(&on_gpu) {
                assert!((a.prob - b.prob).abs() < 1e-3, "{name}: {} vs {}", a.prob, b.prob);
                let removed = |e: &TokenEvent| e.removed.iter().map(|r| r.0).collect::<Vec<_>>();
                assert_eq!(removed(a), removed(b), "{name}");
                let cands = |e: &TokenEvent| e.candidates.iter().map(|r| r.0).collect::<Vec<_>>();
                assert_eq!(cands(a), cands(b), "{name}");
            }
            assert!(stop.is_complete(), "{name}: {stop:?} {text:?}");
            match spec {
                ConstraintSpec::JsonSchema { schema } => {
                    let value: serde_json::Value = serde_json::from_str(&text).unwrap();
                    assert!(jsonschema::is_valid(schema, &value), "{name}: {text:?}");
                }
                ConstraintSpec::Regex { pattern } => {
                    let re = regex::Regex::new(&format!("^(?:{pattern})$")).unwrap();
                    assert!(re.is_match(&text), "{name}: {text:?}");
                }
                _ => assert!(is_list(&text), "{text:?}"),
            }
        }
    }
    // Beam search on the GPU ranks among the allowed tokens too: the CPU's beams.
    let spec = schema(all[0].1.clone());
    let opts = BeamOptions { beams: 3, max_tokens: 40, length_normalise: false };
    let a = beam_search_constrained(&cpu, &prompt, opts, Some((&f.tok, &spec))).unwrap();
    let b = beam_search_constrained(&gpu, &prompt, opts, Some((&f.tok, &spec))).unwrap();
    assert_eq!(
        a.iter().map(|x| &x.ids).collect::<Vec<_>>(),
        b.iter().map(|x| &x.ids).collect::<Vec<_>>()
    );
}

/// The option shape JS and files give (`ConstraintSpec`'s serde form), and its errors.
#[test]
fn constraint_spec_reads_the_documented_shapes() {
    use serde_json::json;
    let read = |v: serde_json::Value| serde_json::from_value::<ConstraintSpec>(v);
    let s = json!({"type": "object"});
    assert_eq!(
        read(json!({"type": "json_schema", "schema": s})).unwrap(),
        ConstraintSpec::JsonSchema { schema: s }
    );
    assert_eq!(read(json!({"type": "json_object"})).unwrap(), ConstraintSpec::JsonObject);
    assert_eq!(read(json!({"type": "regex", "pattern": "a+"})).unwrap(), regex("a+"));
    assert_eq!(
        read(json!({"type": "grammar", "lark": "start: \"a\""})).unwrap(),
        ConstraintSpec::Grammar { lark: "start: \"a\"".into() }
    );
    let e = read(json!({"type": "jsonschema"})).unwrap_err().to_string();
    assert!(e.contains("unknown variant `jsonschema`") && e.contains("json_schema"), "{e}");
    let e = read(json!({"type": "regex"})).unwrap_err().to_string();
    assert!(e.contains("missing field `pattern`"), "{e}");
    let e = read(json!({"pattern": "a"})).unwrap_err().to_string();
    assert!(e.contains("missing field `type`"), "{e}");
}

/// A model of fixed logits, ranking on its "device" or not: for the edge cases of a constrained
/// step whatever the model.
struct Fixed {
    logits: Vec<f32>,
    on_device: bool,
}

impl LanguageModel for Fixed {
    type State = usize;
    fn vocab_size(&self) -> usize {
        self.logits.len()
    }
    fn context_length(&self) -> usize {
        64
    }
    fn bos_token(&self) -> Option<u32> {
        None
    }
    fn eos_tokens(&self) -> &[u32] {
        &[2]
    }
    fn new_state(&self) -> usize {
        0
    }
    fn position(&self, state: &usize) -> usize {
        *state
    }
    fn truncate(&self, state: &mut usize, len: usize) -> nexttoken::Result<()> {
        *state = len;
        Ok(())
    }
    async fn forward_async(
        &self,
        state: &mut usize,
        tokens: &[u32],
        _: bool,
    ) -> nexttoken::Result<Vec<f32>> {
        *state += tokens.len();
        Ok(self.logits.clone())
    }
    fn top_on_device(&self) -> Option<usize> {
        self.on_device.then_some(64)
    }
}

/// When every token the constraint allows has a `-inf` logit there is nothing to choose: an
/// error saying so on both paths (the full row, and the ranking a device returns), never a
/// disallowed token; NaN logits stay the NaN error.
#[test]
fn nothing_allowed_with_probability_is_an_error() {
    let tok =
        HfTokenizer::from_file(&common::repo().join("www/models/default-tokenizer.json")).unwrap();
    let bytes = tok.token_bytes().unwrap();
    let digits: Vec<bool> =
        bytes.iter().map(|b| !b.is_empty() && b.iter().all(u8::is_ascii_digit)).collect();
    assert!(digits.iter().any(|&d| d));
    let logits: Vec<f32> = digits
        .iter()
        .enumerate()
        .map(|(i, &d)| if d { f32::NEG_INFINITY } else { i as f32 / 100.0 })
        .collect();
    for on_device in [false, true] {
        for sampler in [SamplerConfig::greedy(), SamplerConfig { top_k: 5, ..Default::default() }] {
            let model = Fixed { logits: logits.clone(), on_device };
            let opts = constrained(regex("[0-9]+"), sampler.clone(), 4);
            let e = run(&model, &tok, &[5], opts).unwrap_err().to_string();
            assert!(e.contains("probability 0"), "{on_device} {sampler:?}: {e}");
            let mut nan = logits.clone();
            nan[7] = f32::NAN;
            let model = Fixed { logits: nan, on_device };
            let opts = constrained(regex("[0-9]+"), sampler.clone(), 4);
            let e = run(&model, &tok, &[5], opts).unwrap_err().to_string();
            assert!(e.contains("NaN"), "{on_device} {sampler:?}: {e}");
        }
    }
}

/// A grammar, regex or schema from a stranger never takes the process down: a chain of 3,000
/// rules (which overflowed the stack and aborted), deep nesting and huge specs end in one-line
/// errors naming the limit; chains within it compile (on a stack of their own natively, so a
/// test thread's 2 MB is not the limit); unsatisfiable specs say so in one sentence.
#[test]
fn hostile_grammars_regexes_and_schemas_end_in_clean_errors() {
    let f = small_fixture();
    let grammar = |lark: String| ConstraintSpec::Grammar { lark };
    let chain = |n: usize| {
        let mut g = String::from("start: r0\n");
        for i in 0..n {
            g.push_str(&format!("r{i}: r{}\n", i + 1));
        }
        g + &format!("r{n}: \"z\"\n")
    };
    let e = constraint_error(f, grammar(chain(3000)));
    assert!(e.contains("more than 400 levels deep") && !e.contains('\n'), "{e}");
    // Within the limit it compiles and generates the one sentence it allows.
    let opts = constrained(grammar(chain(300)), SamplerConfig::greedy(), 8);
    let (_, text, _) = run(&f.model, &f.tok, &prompt(f, "x"), opts).unwrap();
    assert_eq!(text, "z");
    // Terminals chain too (UPPERCASE definitions).
    let mut terms = String::from("start: T0\n");
    for i in 0..1000 {
        terms.push_str(&format!("T{i}: T{}\n", i + 1));
    }
    terms.push_str("T1000: \"q\"\n");
    assert!(constraint_error(f, grammar(terms)).contains("levels deep"));
    // Names inside strings, regexes and comments are not references.
    let quoted = format!("start: \"{}\" /r[0-9]+/ // {}\n", "r1 ".repeat(500), "r2 ".repeat(500));
    let opts = constrained(grammar(quoted), SamplerConfig::greedy(), 1);
    run(&f.model, &f.tok, &prompt(f, "x"), opts).unwrap();
    // Deep brackets: llguidance's own limit, one line.
    let deep = format!("start: {}\"z\"{}\n", "(".repeat(3000), ")".repeat(3000));
    let e = constraint_error(f, grammar(deep));
    assert!(e.contains("invalid grammar") && e.contains("nested"), "{e}");
    // Too large.
    let big = format!("start: \"{}\"\n", "a".repeat(300 << 10));
    assert!(constraint_error(f, grammar(big)).contains("at most 262144"));
    assert!(constraint_error(f, regex(&"a".repeat(300 << 10))).contains("at most 262144"));
    let e = constraint_error(f, regex(&format!("{}a{}", "(".repeat(1000), ")".repeat(1000))));
    assert!(e.contains("invalid regex") && e.contains("nest"), "{e}");
    // Nothing can match: one sentence, not the parser's state.
    for spec in [regex(r"[^\s\S]"), schema(serde_json::json!({"$ref": "#"}))] {
        let e = constraint_error(f, spec);
        assert!(e.contains("admits no output") && !e.contains('\n'), "{e}");
    }
    // Random regexes (nested groups, counted repetition, alternation, classes) and JSON schemas
    // (nesting, $ref cycles, combinators, enums): each compiles or is a clean error.
    let vocab = f.tok.constraint_vocab(f.model.vocab_size()).unwrap();
    let clean = |what: String, r: nexttoken::Result<Constraint>| {
        if let Err(e) = r {
            let e = e.to_string();
            assert!(e.starts_with("constraint: ") && e.lines().count() <= 7, "{what}: {e}");
        }
    };
    let mut rng = SplitMix64(45);
    for case in 0..150 {
        let mut re = String::from("a");
        for _ in 0..1 + rng.below(12) {
            re = match rng.below(6) {
                0 => format!("({re})"),
                1 => format!("(?:{re}){{{},{}}}", rng.below(3), 1 + rng.below(1000)),
                2 => format!("{re}|[a-z{}]+", rng.below(10)),
                3 => format!("{re}*"),
                4 => format!("(x|{re}|é){{{}}}", rng.below(50)),
                _ => format!("{re}\\d{{0,{}}}", rng.below(100)),
            };
        }
        clean(format!("regex {case}: {re}"), Constraint::new(&regex(&re), vocab.clone()));
        let mut schema = serde_json::json!({"type": "string", "maxLength": rng.below(100)});
        for _ in 0..1 + rng.below(30) {
            schema = match rng.below(6) {
                0 => {
                    serde_json::json!({"type": "object", "properties": {"a": schema}, "required": ["a"]})
                }
                1 => {
                    serde_json::json!({"type": "array", "items": schema, "maxItems": rng.below(5)})
                }
                2 => serde_json::json!({"anyOf": [schema, {"type": "integer"}]}),
                3 => serde_json::json!({"$defs": {"n": schema}, "$ref": "#/$defs/n"}),
                4 => {
                    serde_json::json!({"$defs": {"n": {"anyOf": [schema, {"$ref": "#/$defs/n"}]}}, "$ref": "#/$defs/n"})
                }
                _ => {
                    serde_json::json!({"enum": (0..rng.below(2000)).map(|i| format!("v{i}")).collect::<Vec<_>>()})
                }
            };
        }
        let spec = ConstraintSpec::JsonSchema { schema };
        clean(format!("schema {case}"), Constraint::new(&spec, vocab.clone()));
    }

    // Random grammars: references forward and back, cycles, parentheses, repetition; each
    // compiles or is a clean error.
    let mut rng = SplitMix64(44);
    for case in 0..120 {
        let rules = 1 + rng.below(600) as usize;
        let mut g = String::from("start: r0\n");
        for i in 0..rules {
            let refs: Vec<String> = (0..1 + rng.below(3))
                .map(|_| match rng.below(4) {
                    0 => format!("r{}", i + 1),
                    1 => format!("r{}", rng.below(rules as u64 + 1)),
                    2 => format!("(\"{}\" r{})*", i % 7, rng.below(rules as u64 + 1)),
                    _ => format!("\"{}\"", (b'a' + (i % 26) as u8) as char),
                })
                .collect();
            g.push_str(&format!("r{i}: {} | \"e\"\n", refs.join(" ")));
        }
        g.push_str(&format!("r{rules}: \"z\"\n"));
        let spec = grammar(g);
        match Constraint::new(&spec, f.tok.constraint_vocab(f.model.vocab_size()).unwrap()) {
            Ok(_) => {}
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.starts_with("constraint: ") && e.lines().count() <= 7,
                    "case {case}: {e}"
                );
            }
        }
    }
}
