//! Hostile and broken JSON inputs: `tokenizer.json` files and lesson table models. Each must
//! load with an error that says what is wrong, or load and then work; never panic (the
//! `tokenizers` crate panics on some settings, which `HfTokenizer` checks first) and never
//! allocate without bound.

mod common;

use nexttoken::generate::{generate, score, GenerateOptions};
use nexttoken::sampling::SamplerConfig;
use nexttoken::table::TableModel;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::Vocab;
use proptest::prelude::*;
use serde_json::{json, Value};

fn gpt2_json() -> Value {
    let path = common::fixtures().join("gpt2/tokenizer.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

const TEXT: &str = "Hello world, héllo ##wörld 123 and a much longer tail of words";

/// Load a tokenizer from `bytes`; if it loads, encode `TEXT` and decode odd ids. The load or
/// encode error, or the ids. A panic inside `tokenizers` that `HfTokenizer` caught fails the
/// test too: in wasm it would have aborted, so every known case must be checked beforehand.
fn load_and_use(bytes: &[u8]) -> Result<Vec<u32>, String> {
    let contained = |e: nexttoken::Error| {
        let msg = e.to_string();
        assert!(!msg.contains("the tokenizers crate failed"), "a panic was caught: {msg}");
        msg
    };
    let tok = HfTokenizer::from_bytes(bytes).map_err(contained)?;
    let ids = tok.encode(TEXT).map_err(contained)?;
    tok.decode(&ids);
    tok.decode(&[0, 1, 2, 3, 100, 255, 256, 1000, u32::MAX]);
    Ok(ids)
}

#[track_caller]
fn expect_err(json: &Value, needles: &[&str]) {
    match load_and_use(json.to_string().as_bytes()) {
        Ok(_) => panic!("expected an error mentioning {needles:?}"),
        Err(msg) => {
            for n in needles {
                assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
            }
        }
    }
}

#[test]
fn truncated_inside_the_decoder() {
    let text = gpt2_json().to_string();
    let at = text.find("\"decoder\"").unwrap();
    for cut in at..at + 80 {
        let err = load_and_use(&text.as_bytes()[..cut]).unwrap_err();
        assert!(err.contains("EOF while parsing"), "cut at {cut}: {err}");
    }
}

/// Found by the fuzzer: an escape that is not a character (a lone surrogate) inside the decoder
/// reached an `expect` in `tokenizers`.
#[test]
fn a_lone_surrogate_in_the_decoder() {
    let text = gpt2_json().to_string();
    let bad = text.replacen("\"decoder\":{\"", "\"decoder\":{\"\\ud800", 1);
    assert_ne!(bad, text);
    let err = load_and_use(bad.as_bytes()).unwrap_err();
    assert!(
        err.starts_with("tokenizer: cannot read tokenizer.json") && err.contains("escape"),
        "{err}"
    );
}

#[test]
fn deeply_nested_decoders() {
    for depth in [63, 64, 100, 1000] {
        let mut decoder = json!({"type": "ByteLevel"});
        for _ in 0..depth {
            decoder = json!({"type": "Sequence", "decoders": [decoder]});
        }
        let mut t = gpt2_json();
        t["decoder"] = decoder;
        expect_err(&t, &["nest", "at most 32"]);
    }
    // Far deeper, as text (a tree that deep would overflow the stack of this test itself).
    let deep = format!("{{\"decoder\": {}{}}}", "[".repeat(100_000), "]".repeat(100_000));
    let err = load_and_use(deep.as_bytes()).unwrap_err();
    assert!(err.contains("nest 100001 deep"), "{err}");
    // A shallow sequence is fine: the same ids as the plain ByteLevel decoder's file.
    let mut t = gpt2_json();
    let plain = t["decoder"].clone();
    t["decoder"] =
        json!({"type": "Sequence", "decoders": [{"type": "Sequence", "decoders": [plain]}]});
    let want = load_and_use(gpt2_json().to_string().as_bytes()).unwrap();
    assert_eq!(load_and_use(t.to_string().as_bytes()).unwrap(), want);
}

#[test]
fn continuing_subword_prefix_missing_from_the_merges() {
    let mut t = gpt2_json();
    t["model"]["continuing_subword_prefix"] = json!("##");
    expect_err(&t, &["continuing_subword_prefix", "\"##\""]);
    // A multi-byte prefix the merges lack: tokenizers would cut through a character.
    t["model"]["continuing_subword_prefix"] = json!("é");
    expect_err(&t, &["continuing_subword_prefix"]);
}

/// A tiny BPE whose merges do use the prefix: "a" + "##b" makes "ab", by hand.
#[test]
fn continuing_subword_prefix_that_fits_its_merges() {
    let t = json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
        "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": "##", "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": {"a": 0, "##b": 1, "ab": 2, "b": 3}, "merges": [["a", "##b"]]}
    });
    let tok = HfTokenizer::from_bytes(t.to_string().as_bytes()).unwrap();
    assert_eq!(tok.encode("ab a").unwrap(), vec![2, 0]);
}

/// Truncation and padding are dropped: a prompt is never cut or padded, whatever the file says
/// (and the settings that make `tokenizers` panic or allocate gigabytes do nothing).
#[test]
fn truncation_and_padding_are_ignored() {
    let want = load_and_use(gpt2_json().to_string().as_bytes()).unwrap();
    assert!(want.len() > 4);
    for stride in [0, 2, 3, 100] {
        let mut t = gpt2_json();
        t["truncation"] = json!({"direction": "Right", "max_length": 2, "strategy": "LongestFirst", "stride": stride});
        assert_eq!(load_and_use(t.to_string().as_bytes()).unwrap(), want, "stride {stride}");
    }
    let mut t = gpt2_json();
    t["padding"] = json!({"strategy": {"Fixed": 100_000_000}, "direction": "Right",
        "pad_to_multiple_of": null, "pad_id": 0, "pad_type_id": 0, "pad_token": "!"});
    assert_eq!(load_and_use(t.to_string().as_bytes()).unwrap(), want);
}

#[test]
fn not_json_at_all() {
    for bytes in [&b""[..], b"\xff\xfe", b"<html>", b"[1, 2", b"null"] {
        assert!(load_and_use(bytes).is_err(), "{bytes:?} loaded");
    }
}

// ---------------------------------------------------------------------------------------------
// Lesson table models.
// ---------------------------------------------------------------------------------------------

fn lesson_json() -> Value {
    let path = common::repo().join("www/models/lesson-toy.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// A table of `n` words, each followed by the next (the last by the end word).
fn chain_table(n: usize) -> String {
    let vocab: Vec<String> = (0..n).map(|i| format!("w{i}")).collect();
    let mut next = serde_json::Map::new();
    for i in 0..n - 1 {
        next.insert(vocab[i].clone(), json!({ &vocab[i + 1]: 1.0 }));
    }
    json!({"name": "chain", "vocab": vocab, "bos": "w0", "eos": vocab[n - 1], "next": next})
        .to_string()
}

#[test]
fn table_vocabulary_is_capped() {
    let err = TableModel::from_json(&chain_table(70_000)).unwrap_err().to_string();
    assert!(err.contains("70000 words") && err.contains("4096"), "{err}");
    // The largest allowed works, and follows the chain: w0 w1 w2 ...
    let table = TableModel::from_json(&chain_table(4096)).unwrap();
    assert_eq!(table.prob(7, 8), 1.0);
    assert_eq!(table.prob(7, 9), 0.0);
    let ids = [0, 1, 2, 3];
    let s = score(&table, &ids).unwrap();
    assert_eq!(s.total_logprob, 0.0);
}

/// Load a table; if it loads, generate a few tokens and score what came out.
fn use_table(json: &str) {
    let Ok(table) = TableModel::from_json(json) else { return };
    let bos = nexttoken::LanguageModel::bos_token(&table);
    let ids: Vec<u32> = bos.into_iter().collect();
    if ids.is_empty() {
        return;
    }
    let opts = GenerateOptions {
        max_tokens: 8,
        sampler: SamplerConfig::default(),
        ..GenerateOptions::default()
    };
    if let Ok(summary) = generate(&table, &table, &ids, opts, |_| true) {
        let _ = summary.text;
    }
    let _ = score(&table, &[ids[0], 0, 1]);
}

// ---------------------------------------------------------------------------------------------
// Fuzzing: random damage to the JSON tree and to its bytes.
// ---------------------------------------------------------------------------------------------

/// Values that break assumptions: wrong types, extremes, empty and odd strings, deep nesting.
fn hostile_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        Just(json!(-1)),
        Just(json!(0)),
        Just(json!(1e300)),
        Just(json!(u64::MAX)),
        Just(json!(100_000_000)),
        Just(json!(0.5)),
        Just(json!("")),
        Just(json!("##")),
        Just(json!("é")),
        Just(json!(" ")),
        Just(json!(true)),
        Just(json!([])),
        Just(json!({})),
        Just(json!({"type": "Sequence", "decoders": []})),
        Just(json!({"Fixed": 100_000_000})),
        (1usize..200).prop_map(|d| (0..d).fold(json!(0), |v, _| json!([v]))),
        "[a-zA-Z#é ]{0,6}".prop_map(Value::String),
    ]
}

/// Every node's path (object keys and array indices), skipping the elements of the big
/// vocabulary and merge lists (the containers themselves are kept).
fn paths(v: &Value, at: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    out.push(at.clone());
    let skip_children =
        matches!(at.last().map(String::as_str), Some("vocab" | "merges")) && at.len() > 1;
    if skip_children {
        return;
    }
    let children: Vec<(String, &Value)> = match v {
        Value::Object(m) => m.iter().map(|(k, c)| (k.clone(), c)).collect(),
        Value::Array(a) => a.iter().enumerate().map(|(i, c)| (i.to_string(), c)).collect(),
        _ => Vec::new(),
    };
    for (key, child) in children {
        at.push(key);
        paths(child, at, out);
        at.pop();
    }
}

fn node_mut<'v>(v: &'v mut Value, path: &[String]) -> &'v mut Value {
    path.iter().fold(v, |v, key| match v {
        Value::Object(m) => m.get_mut(key).unwrap(),
        Value::Array(a) => &mut a[key.parse::<usize>().unwrap()],
        _ => unreachable!("paths only lead through containers"),
    })
}

#[derive(Debug, Clone)]
enum Damage {
    /// Replace the node at this fraction of the node list.
    Replace(f64, Value),
    /// Overwrite one byte of the text.
    Byte(f64, u8),
    /// Cut the text here.
    Truncate(f64),
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        4 => (0.0..1.0f64, hostile_value()).prop_map(|(at, v)| Damage::Replace(at, v)),
        2 => (0.0..1.0f64, any::<u8>()).prop_map(|(at, b)| Damage::Byte(at, b)),
        1 => (0.0..1.0f64).prop_map(Damage::Truncate),
    ]
}

/// `base` with the tree damages applied, as text, then the byte damages.
fn damaged(base: &Value, damages: &[Damage]) -> Vec<u8> {
    let mut v = base.clone();
    for d in damages {
        if let Damage::Replace(at, value) = d {
            let mut all = Vec::new();
            paths(&v, &mut Vec::new(), &mut all);
            let path = &all[((at * all.len() as f64) as usize).min(all.len() - 1)];
            *node_mut(&mut v, path) = value.clone();
        }
    }
    let mut bytes = v.to_string().into_bytes();
    for d in damages {
        let pos = |f: f64, n: usize| ((f * n as f64) as usize).min(n.saturating_sub(1));
        match *d {
            Damage::Byte(at, b) if !bytes.is_empty() => {
                let p = pos(at, bytes.len());
                bytes[p] = b;
            }
            Damage::Truncate(at) => bytes.truncate(pos(at, bytes.len() + 1)),
            _ => {}
        }
    }
    bytes
}

proptest! {
    // 256 cases each run in a few seconds; NEXTTOKEN_FUZZ_CASES=100000 for a long soak.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("NEXTTOKEN_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn damaged_tokenizers_never_panic(damages in proptest::collection::vec(damage(), 1..4)) {
        thread_local! { static BASE: Value = gpt2_json(); }
        let bytes = BASE.with(|b| damaged(b, &damages));
        let _ = load_and_use(&bytes);
    }

    #[test]
    fn damaged_tables_never_panic(damages in proptest::collection::vec(damage(), 1..4)) {
        let bytes = damaged(&lesson_json(), &damages);
        if let Ok(text) = std::str::from_utf8(&bytes) {
            use_table(text);
        }
    }
}

/// A WordPiece model (where the prefix belongs) with odd prefixes, decoded by the WordPiece
/// decoder: loads and runs, or says why not.
#[test]
fn wordpiece_with_odd_prefixes() {
    for prefix in ["##", "", "é", "a", "##########"] {
        let t = json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
            "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": null,
            "decoder": {"type": "WordPiece", "prefix": prefix, "cleanup": true},
            "model": {"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": prefix,
                      "max_input_chars_per_word": 100,
                      "vocab": {"[UNK]": 0, "a": 1, "##b": 2, "éb": 3, "ab": 4, "b": 5}}
        });
        let _ = load_and_use(t.to_string().as_bytes());
    }
}
