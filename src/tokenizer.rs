//! Text to token ids and back through Hugging Face's `tokenizers` crate (the same build natively
//! and in wasm, so ids match Python's everywhere), from either of two sources:
//!
//! - a `tokenizer.json` ([`HfTokenizer::from_bytes`], [`HfTokenizer::from_file`]);
//! - the GGUF file's own `tokenizer.ggml.*` metadata ([`HfTokenizer::from_gguf`]): the same kind
//!   of `tokenizers::Tokenizer`, assembled from the vocabulary llama.cpp's converter wrote (see
//!   `tokenizer/gguf.rs`), so a GGUF file alone is enough.

use std::sync::{Arc, Mutex};

use crate::constraint::{ConstraintVocab, SPECIAL};
use crate::error::{Error, Result};
use crate::gguf::Gguf;
use crate::lm::Vocab;
pub use crate::model::SpecialTokens;

mod gguf;

pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
    /// The byte vocabulary structured output uses, once built (for the model size it was built
    /// for).
    constraint: Mutex<Option<Arc<ConstraintVocab>>>,
}

/// The largest `tokenizer.json` read from disk. The biggest real ones (Gemma's, 256k tokens) are
/// about 35 MB; a file far larger is not a tokenizer, and `/dev/zero` would never end.
pub const MAX_TOKENIZER_JSON_BYTES: u64 = 64 << 20;

/// Deepest nesting of arrays and objects in a `tokenizer.json`. Real files nest under 10 levels;
/// `tokenizers` re-reads a decoder through a buffer whose recursion limit (128) would turn a
/// deeply nested `Sequence` into a panic, so anything past this is refused before it gets there.
const MAX_JSON_DEPTH: usize = 32;

impl HfTokenizer {
    /// A tokenizer from the bytes of a `tokenizer.json`.
    ///
    /// The `tokenizers` crate panics on some inputs (a syntax error inside `"decoder"`, deep
    /// nesting, a BPE `continuing_subword_prefix` its merges lack), which in wasm would abort
    /// the module; those are checked here first ([`check_json`]). Its truncation and padding
    /// settings are dropped: they shape fixed-size training batches, never a prompt (the
    /// context limit gives an error instead of a silent cut), and their bad values panic or
    /// allocate gigabytes per encode. Anything else that panics is caught natively
    /// ([`contained`]).
    pub fn from_bytes(bytes: &[u8]) -> Result<HfTokenizer> {
        check_json(bytes)
            .map_err(|e| Error::Tokenizer(format!("cannot read tokenizer.json: {e}")))?;
        let mut inner = contained("reading tokenizer.json", || {
            tokenizers::Tokenizer::from_bytes(bytes)
                .map_err(|e| Error::Tokenizer(format!("cannot read tokenizer.json: {e}")))
        })?;
        inner.with_truncation(None).map_err(|e| Error::Tokenizer(e.to_string()))?;
        inner.with_padding(None);
        Ok(HfTokenizer::with(inner, SpecialTokens::default()))
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_file(path: &std::path::Path) -> Result<HfTokenizer> {
        let bytes = crate::files::read_capped(path, "tokenizer.json", MAX_TOKENIZER_JSON_BYTES)?;
        HfTokenizer::from_bytes(&bytes)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata (a vocabulary-only
    /// file without tensors is fine). Errors name what is missing or unsupported.
    pub fn from_gguf(g: &Gguf) -> Result<HfTokenizer> {
        let (inner, special) = gguf::build(g)?;
        Ok(HfTokenizer::with(inner, special))
    }

    /// [`from_gguf`](HfTokenizer::from_gguf) on a whole GGUF file's bytes.
    pub fn from_gguf_bytes(bytes: &[u8]) -> Result<HfTokenizer> {
        HfTokenizer::from_gguf(&Gguf::parse(bytes)?)
    }

    fn with(inner: tokenizers::Tokenizer, special: SpecialTokens) -> HfTokenizer {
        HfTokenizer { inner, special, constraint: Mutex::new(None) }
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Every token's bytes, indexed by id: what the tokenizer's decoder makes of the token
    /// alone, so that decoding any sequence of ordinary tokens gives the concatenation of their
    /// bytes (up to the decoder's cosmetic edits of the whole text: SentencePiece drops the
    /// first leading space, and invalid UTF-8 comes out as U+FFFD). Special tokens (added
    /// tokens marked special: BOS, EOS, `<|im_end|>`, ...) are their name after the byte
    /// [`SPECIAL`] (0xFF, which no UTF-8 text contains), so no constraint on text allows them.
    ///
    /// Two decoder families are understood, which cover GGUF's `llama` and `gpt2` tokenizers
    /// and the `tokenizer.json`s of byte-level BPE and SentencePiece models:
    /// - byte-level BPE (GPT-2, Llama 3, Qwen2, SmolLM): each character of a token stands for
    ///   one byte through GPT-2's byte-to-character table;
    /// - SentencePiece (`Metaspace`, or `Replace` of `▁` by a space, with or without
    ///   `ByteFallback`): `▁` is a space, `<0xNN>` pieces are the byte NN.
    ///
    /// Any other decoder (WordPiece, CTC, ...) is an error naming it.
    pub fn token_bytes(&self) -> Result<Vec<Vec<u8>>> {
        let decoding = PieceDecoding::of(self.inner.get_decoder())?;
        let n = self.vocab_size();
        let added = self.inner.get_added_tokens_decoder();
        let mut bytes = Vec::with_capacity(n);
        for id in 0..n as u32 {
            let piece = match added.get(&id) {
                Some(token) if token.special => {
                    let mut b = vec![SPECIAL];
                    b.extend_from_slice(token.content.as_bytes());
                    b
                }
                _ => match self.inner.id_to_token(id) {
                    Some(token) => decoding.bytes(&token),
                    // A hole in the ids: no text decodes to it.
                    None => format!("{}<[{id}]>", SPECIAL as char).into_bytes(),
                },
            };
            bytes.push(piece);
        }
        Ok(bytes)
    }

    /// An error unless every id of this tokenizer is a row of a model's `n_vocab` logits: a
    /// tokenizer with more tokens belongs to another model, and its ids past the end would
    /// fail only later, mid-generation.
    pub fn check_fits(&self, n_vocab: usize) -> Result<()> {
        let size = self.vocab_size();
        if size > n_vocab {
            return Err(Error::Tokenizer(format!(
                "it has {size} tokens but the model only {n_vocab}: are they from the same model?"
            )));
        }
        Ok(())
    }

    /// Special ids and BOS/EOS flags (from the GGUF metadata; empty for a `tokenizer.json`).
    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }
}

impl Vocab for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = contained("encoding", || {
            self.inner
                .encode(text, false)
                .map_err(|e| Error::Tokenizer(format!("cannot encode text: {e}")))
        })?;
        Ok(enc.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> String {
        contained("decoding", || Ok(self.inner.decode(ids, true).unwrap_or_default()))
            .unwrap_or_default()
    }

    fn token_text(&self, id: u32) -> String {
        self.inner.id_to_token(id).unwrap_or_else(|| format!("<{id}>"))
    }

    fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn constraint_vocab(&self, n_vocab: usize) -> Result<Arc<ConstraintVocab>> {
        let mut cached = self.constraint.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(vocab) = cached.as_ref().filter(|v| v.n_vocab() == n_vocab) {
            return Ok(vocab.clone());
        }
        let vocab = Arc::new(ConstraintVocab::new(self.token_bytes()?, n_vocab)?);
        *cached = Some(vocab.clone());
        Ok(vocab)
    }
}

/// How a tokenizer's decoder turns one token's string into bytes ([`HfTokenizer::token_bytes`]).
#[derive(Debug, Clone, Copy, PartialEq)]
enum PieceDecoding {
    /// Byte-level BPE: each character is a byte through GPT-2's table. A token with a character
    /// outside the table (an added token written as plain text) is its UTF-8, as `tokenizers`'
    /// `ByteLevel` decoder has it.
    ByteLevel,
    /// SentencePiece: `space` (`▁`) stands for a space; with `byte_fallback`, `<0xNN>` is byte NN.
    SentencePiece { space: char, byte_fallback: bool },
}

impl PieceDecoding {
    /// What the decoder does, read from its serialised form (the only way to see a `Replace`'s
    /// pattern).
    fn of(decoder: Option<&tokenizers::DecoderWrapper>) -> Result<PieceDecoding> {
        let unsupported = |what: &str| {
            Error::Constraint(format!(
                "structured output needs a byte-level BPE or SentencePiece tokenizer; this one's \
                 decoder is {what}"
            ))
        };
        let Some(decoder) = decoder else {
            return Err(unsupported("missing (tokens joined by spaces)"));
        };
        let json = serde_json::to_value(decoder).map_err(|e| unsupported(&e.to_string()))?;
        let parts = match json.get("decoders").and_then(|d| d.as_array()) {
            Some(list) => list.clone(),
            None => vec![json.clone()],
        };
        let (mut byte_level, mut byte_fallback, mut space) = (false, false, None);
        for part in &parts {
            let kind = part.get("type").and_then(|t| t.as_str()).unwrap_or("?");
            match kind {
                "ByteLevel" => byte_level = true,
                "ByteFallback" => byte_fallback = true,
                "Fuse" | "Strip" => {}
                "Metaspace" => {
                    space = part.get("replacement").and_then(|r| r.as_str()).and_then(one_char);
                }
                "Replace" if part.get("content").and_then(|c| c.as_str()) == Some(" ") => {
                    let pattern = part.pointer("/pattern/String").and_then(|p| p.as_str());
                    space = pattern.and_then(one_char);
                    if space.is_none() {
                        return Err(unsupported(&format!("a Replace of {}", part["pattern"])));
                    }
                }
                other => return Err(unsupported(&format!("{other} ({part})"))),
            }
        }
        match (byte_level, space) {
            (true, None) if !byte_fallback => Ok(PieceDecoding::ByteLevel),
            (false, Some(space)) => Ok(PieceDecoding::SentencePiece { space, byte_fallback }),
            (false, None) if byte_fallback => {
                Ok(PieceDecoding::SentencePiece { space: '\u{2581}', byte_fallback })
            }
            _ => Err(unsupported(&json.to_string())),
        }
    }

    fn bytes(self, token: &str) -> Vec<u8> {
        match self {
            PieceDecoding::ByteLevel => {
                let mapped: Option<Vec<u8>> = token.chars().map(byte_of_char).collect();
                mapped.unwrap_or_else(|| token.as_bytes().to_vec())
            }
            PieceDecoding::SentencePiece { space, byte_fallback } => {
                let hex = token.strip_prefix("<0x").and_then(|t| t.strip_suffix('>'));
                match hex.filter(|h| byte_fallback && h.len() == 2) {
                    Some(h) => match u8::from_str_radix(h, 16) {
                        Ok(b) => vec![b],
                        Err(_) => token.replace(space, " ").into_bytes(),
                    },
                    None => token.replace(space, " ").into_bytes(),
                }
            }
        }
    }
}

fn one_char(s: &str) -> Option<char> {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (Some(c), None) => Some(c),
        _ => None,
    }
}

/// GPT-2's byte-level table, inverted: the byte a character stands for. Printable bytes
/// (`!`..`~`, `¡`..`¬`, `®`..`ÿ`) stand for themselves; the other 68 bytes, in order, are the
/// characters from U+0100 on.
fn byte_of_char(c: char) -> Option<u8> {
    const fn self_mapped(b: u8) -> bool {
        matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF)
    }
    /// The bytes that do not stand for themselves, in order: U+0100 + k stands for `SHIFTED[k]`.
    const SHIFTED: [u8; 68] = {
        let mut out = [0u8; 68];
        let (mut b, mut k) = (0usize, 0usize);
        while b < 256 {
            if !self_mapped(b as u8) {
                out[k] = b as u8;
                k += 1;
            }
            b += 1;
        }
        out
    };
    match c as u32 {
        c @ 0..=0xFF => self_mapped(c as u8).then_some(c as u8),
        c => SHIFTED.get((c - 0x100) as usize).copied(),
    }
}

/// `f()`, with a panic inside `tokenizers` turned into an error (natively; wasm aborts on a
/// panic, which is why [`check_json`] catches the known cases before they get here).
fn contained<T>(doing: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let why = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_default();
        Err(Error::Tokenizer(format!("the tokenizers crate failed while {doing}: {why}")))
    })
}

/// The parts of a `tokenizer.json` checked before `tokenizers` reads it.
#[derive(serde::Deserialize)]
struct JsonShape {
    model: Option<ModelShape>,
    /// Read as a value so every string in it is checked (skipped strings are not: a lone
    /// surrogate `\ud800` would reach the decoder's `expect` in `tokenizers`).
    #[serde(rename = "decoder")]
    _decoder: Option<serde_json::Value>,
}

#[derive(serde::Deserialize)]
struct ModelShape {
    #[serde(rename = "type")]
    kind: Option<String>,
    continuing_subword_prefix: Option<String>,
    #[serde(default)]
    merges: Vec<Merge>,
}

/// A BPE merge: `"a b"` (the old format) or `["a", "b"]`.
#[derive(serde::Deserialize)]
#[serde(untagged)]
enum Merge {
    Joined(String),
    Pair(serde::de::IgnoredAny, String),
    Other(serde::de::IgnoredAny),
}

/// The checks [`HfTokenizer::from_bytes`] makes before `tokenizers` sees the bytes: they are
/// JSON (any error inside `"decoder"` makes `tokenizers` panic), nested at most
/// [`MAX_JSON_DEPTH`] deep, and a BPE model's `continuing_subword_prefix` starts the second
/// half of every merge (`tokenizers` slices it off unchecked: a panic, or worse, a cut through
/// a UTF-8 character).
fn check_json(bytes: &[u8]) -> std::result::Result<(), String> {
    let depth = json_depth(bytes);
    if depth > MAX_JSON_DEPTH {
        return Err(format!(
            "arrays and objects nest {depth} deep; at most {MAX_JSON_DEPTH} is supported"
        ));
    }
    let shape: JsonShape = serde_json::from_slice(bytes).map_err(|e| e.to_string())?;
    let Some(model) = shape.model else { return Ok(()) };
    let (Some("BPE"), Some(prefix)) = (model.kind.as_deref(), &model.continuing_subword_prefix)
    else {
        return Ok(());
    };
    for merge in &model.merges {
        let second = match merge {
            Merge::Joined(s) => s.split_once(' ').map(|(_, b)| b),
            Merge::Pair(_, b) => Some(b.as_str()),
            Merge::Other(_) => None,
        };
        if let Some(b) = second.filter(|b| !b.starts_with(prefix.as_str())) {
            return Err(format!(
                "the BPE model's continuing_subword_prefix {prefix:?} does not start the merge part {b:?}"
            ));
        }
    }
    Ok(())
}

/// How deep arrays and objects nest in JSON text (brackets inside strings do not count). Not a
/// parser: the bytes are parsed afterwards; this only bounds the recursion that parse needs.
fn json_depth(bytes: &[u8]) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for &b in bytes {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}
