//! A Hugging Face `tokenizers::Tokenizer` assembled from a GGUF file's `tokenizer.ggml.*`
//! metadata, the way transformers' GGUF converters (`integrations/ggml.py`) do it, so the ids
//! are those of the tokenizer the model was converted from. Two kinds of vocabulary
//! (`tokenizer.ggml.model`):
//!
//! - `llama`: SentencePiece BPE. The file keeps each piece's score but no merges. SentencePiece
//!   merges the adjacent pair whose merged piece scores highest, which is BPE with the merges
//!   ranked by the merged piece's score; they are derived here as transformers'
//!   `SentencePieceExtractor` derives them. Text is normalised as SentencePiece does (a `▁` in
//!   front, spaces to `▁`); pieces missing from the vocabulary fall back to `<0xXX>` byte tokens.
//! - `gpt2`: byte-level BPE. Merges are in the file; the pre-tokenizer's regex is named by
//!   `tokenizer.ggml.pre` (llama.cpp's names: GPT-2's, SmolLM's, Llama 3's, Qwen2's and the names
//!   llama.cpp treats as theirs), since the same byte-level scheme splits words differently for
//!   each model family.
//!
//! Control and unknown tokens (`token_type` 3 and 2) become special added tokens: matched whole
//! in text and dropped by `decode(skip_special = true)`. User-defined tokens (4) are what
//! llama.cpp's converter writes for a Hugging Face added token that is *not* special, so they
//! are added as such: matched whole, but decoded as text (llama.cpp prints them too).

use std::collections::{HashMap, HashSet};

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{Merges, Vocab as BpeVocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence, NFC};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{
    AddedToken, DecoderWrapper, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior,
    Tokenizer,
};

use super::SpecialTokens;
use crate::error::{Error, Result};
use crate::gguf::{Gguf, Value};

/// llama.cpp's `llama_token_type` values (`tokenizer.ggml.token_type`).
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const NORMAL: i64 = 1;

/// SentencePiece's word-boundary mark, which stands for a space inside pieces.
const SPM_SPACE: &str = "\u{2581}";

/// Llama 3's pre-tokenizer (`tokenizer.ggml.pre` "llama-bpe"), as its `tokenizer.json` writes it
/// (llama.cpp spells the case-insensitive contractions out as `'[sS]|...`).
const LLAMA3_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen2's: Llama 3's with single digits.
const QWEN2_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

fn err(msg: impl Into<String>) -> Error {
    Error::Tokenizer(msg.into())
}

/// A metadata accessor's error (wrong type, ...) as a tokenizer error.
fn meta(e: Error) -> Error {
    match e {
        Error::Gguf(m) => Error::Tokenizer(m),
        other => other,
    }
}

fn hf(what: &str) -> impl Fn(tokenizers::Error) -> Error + '_ {
    move |e| err(format!("cannot build the tokenizer from the GGUF metadata ({what}): {e}"))
}

pub(super) fn build(g: &Gguf) -> Result<(Tokenizer, SpecialTokens)> {
    let model = match g.get("tokenizer.ggml.model") {
        None => {
            return Err(err(
                "the GGUF file has no tokenizer metadata (no tokenizer.ggml.model); give a tokenizer.json",
            ))
        }
        Some(v) => v.as_str().ok_or_else(|| {
            err(format!("tokenizer.ggml.model is a {}, not a string", v.type_name()))
        })?,
    };
    let tokens = g.str_array("tokenizer.ggml.tokens").map_err(meta)?.ok_or_else(|| {
        err(format!("tokenizer.ggml.model is {model:?} but tokenizer.ggml.tokens is missing"))
    })?;
    if tokens.is_empty() {
        return Err(err("tokenizer.ggml.tokens is empty"));
    }
    let n = tokens.len();
    let types = match g.int_array("tokenizer.ggml.token_type").map_err(meta)? {
        Some(t) if t.len() != n => return Err(lengths("token_type", t.len(), n)),
        Some(t) => t,
        None => vec![NORMAL; n],
    };
    let special = SpecialTokens::from_gguf(g, n);
    let mut tokenizer = match model {
        "llama" => sentencepiece(g, &tokens, &types, &special)?,
        "gpt2" => byte_level(g, &tokens)?,
        other => {
            return Err(err(format!(
                "unsupported tokenizer.ggml.model {other:?} (supported: \"llama\", SentencePiece; \"gpt2\", byte-level BPE)"
            )))
        }
    };
    add_tokens(&mut tokenizer, &tokens, &types)?;
    Ok((tokenizer, special))
}

fn lengths(key: &str, got: usize, tokens: usize) -> Error {
    err(format!("tokenizer.ggml.{key} has {got} entries but tokenizer.ggml.tokens has {tokens}"))
}

/// Token -> id. A piece listed twice keeps its last id, as in llama.cpp and transformers.
fn lookup<'t>(tokens: &[&'t str]) -> HashMap<&'t str, u32> {
    tokens.iter().enumerate().map(|(i, &t)| (t, i as u32)).collect()
}

fn bpe_vocab(lookup: &HashMap<&str, u32>) -> BpeVocab {
    lookup.iter().map(|(&t, &id)| (t.to_owned(), id)).collect()
}

fn sentencepiece(
    g: &Gguf,
    tokens: &[&str],
    types: &[i64],
    special: &SpecialTokens,
) -> Result<Tokenizer> {
    let scores = g.f32_array("tokenizer.ggml.scores").map_err(meta)?.ok_or_else(|| {
        err("tokenizer.ggml.scores is missing: SentencePiece merges are ranked by them")
    })?;
    if scores.len() != tokens.len() {
        return Err(lengths("scores", scores.len(), tokens.len()));
    }
    let ids = lookup(tokens);
    let merges = spm_merges(tokens, &scores, &ids);
    let mut bpe =
        BPE::builder().vocab_and_merges(bpe_vocab(&ids), merges).fuse_unk(true).byte_fallback(true);
    let unk = special.unk.or_else(|| types.iter().position(|&t| t == UNKNOWN).map(|i| i as u32));
    if let Some(unk) = unk {
        bpe = bpe.unk_token(tokens[unk as usize].to_owned());
    }
    let mut t = Tokenizer::new(bpe.build().map_err(hf("SentencePiece BPE"))?);

    // llama.cpp's `add_space_prefix` (true unless the file says otherwise): SentencePiece's
    // "▁" in front of the text, which decoding strips again.
    let prefix = g.get("tokenizer.ggml.add_space_prefix").and_then(Value::as_bool).unwrap_or(true);
    let mut normalizers: Vec<NormalizerWrapper> = Vec::new();
    if prefix {
        normalizers.push(Prepend::new(SPM_SPACE.into()).into());
    }
    normalizers.push(Replace::new(" ", SPM_SPACE).map_err(hf("normaliser"))?.into());
    t.with_normalizer(Some(NormalizerSequence::new(normalizers))).map_err(hf("normaliser"))?;

    let mut decoders: Vec<DecoderWrapper> = vec![
        Replace::new(SPM_SPACE, " ").map_err(hf("decoder"))?.into(),
        ByteFallback::new().into(),
        Fuse::new().into(),
    ];
    if prefix {
        decoders.push(Strip::new(' ', 1, 0).into());
    }
    t.with_decoder(Some(DecoderSequence::new(decoders)));
    Ok(t)
}

/// SentencePiece's merges as transformers' `SentencePieceExtractor` (`generate_merges`) derives
/// them: every split of every piece into two pieces of the vocabulary (per piece in order of the
/// halves' ids), then all of them ranked by the merged piece's score, longer left and then right
/// halves first, stable otherwise. Lengths are in characters, as Python counts them.
///
/// One addition: pieces of equal score rank by id (lower first) before the halves' lengths are
/// compared. Real SentencePiece scores are distinct, so nothing changes there; but llama.cpp's
/// converter writes -1000 for every piece of a vocabulary that came from a `tokenizer.json`
/// rather than a SentencePiece model, and then the ids, which BPE trainers hand out in merge
/// order, are the only rank left (with transformers' order such files tokenize differently from
/// their own tokenizer.json: `tests/tokenizer_parity.rs` checks the fixture that has one).
fn spm_merges(tokens: &[&str], scores: &[f32], ids: &HashMap<&str, u32>) -> Merges {
    struct Candidate<'t> {
        left: &'t str,
        right: &'t str,
        score: f32,
        id: u32,
    }
    let mut candidates: Vec<Candidate> = Vec::new();
    let mut seen = HashSet::new();
    for &piece in tokens {
        // A duplicated piece is visited once, with the score of the id it maps to (a Python
        // dict keeps the first position and the last value).
        if !seen.insert(piece) {
            continue;
        }
        let id = ids[piece];
        let score = scores[id as usize];
        let mut local: Vec<(u32, u32, Candidate)> = piece
            .char_indices()
            .skip(1)
            .filter_map(|(at, _)| {
                let (left, right) = piece.split_at(at);
                Some((*ids.get(left)?, *ids.get(right)?, Candidate { left, right, score, id }))
            })
            .collect();
        local.sort_by_key(|&(l, r, _)| (l, r));
        candidates.extend(local.into_iter().map(|(_, _, c)| c));
    }
    let chars = |s: &str| s.chars().count();
    candidates.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then_with(|| a.id.cmp(&b.id))
            .then_with(|| chars(b.left).cmp(&chars(a.left)))
            .then_with(|| chars(b.right).cmp(&chars(a.right)))
    });
    candidates.into_iter().map(|c| (c.left.to_owned(), c.right.to_owned())).collect()
}

/// How a byte-level vocabulary cuts text into words before BPE.
enum WordSplit {
    /// GPT-2's regex, built into `ByteLevel`.
    Gpt2,
    /// Every digit a word of its own, then GPT-2's regex.
    DigitsThenGpt2,
    /// This regex, then the byte-level mapping.
    Regex(&'static str),
}

fn byte_level(g: &Gguf, tokens: &[&str]) -> Result<Tokenizer> {
    let pre = match g.get("tokenizer.ggml.pre") {
        None => {
            return Err(err(
                "tokenizer.ggml.pre is missing: which pre-tokenizer this byte-level BPE vocabulary needs is unknown (give a tokenizer.json)",
            ))
        }
        Some(v) => v.as_str().ok_or_else(|| {
            err(format!("tokenizer.ggml.pre is a {}, not a string", v.type_name()))
        })?,
    };
    // (split, NFC first, ignore merges) per llama.cpp pre-tokenizer name; the values are those
    // of each family's tokenizer.json. The other names of a row are those llama.cpp's
    // `llama_vocab::impl::load` gives the same regexes and no flag that changes the ids.
    let (split, nfc, ignore_merges) = match pre {
        "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "jina-v2-es" | "jina-v2-de" | "gigachat"
        | "a.x-4.0" | "mellum" | "modern-bert" | "exaone4" | "mpt" | "olmo" | "jais"
        | "trillion" | "granite-docling" => (WordSplit::Gpt2, false, false),
        // SmolLM's tokenizer.json: `Sequence[Digits(individual_digits), ByteLevel]`, which is
        // llama.cpp's `\p{N}` then GPT-2's regex.
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b"
        | "mellum2" => (WordSplit::DigitsThenGpt2, false, false),
        // Llama 3 looks a whole word up in the vocabulary before merging.
        "llama-bpe" | "llama3" | "llama-v3" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
        | "lfm2" | "jina-v5-nano" => (WordSplit::Regex(LLAMA3_REGEX), false, true),
        "qwen2" | "deepseek-r1-qwen" => (WordSplit::Regex(QWEN2_REGEX), true, false),
        other => {
            return Err(err(format!(
                "unsupported tokenizer.ggml.pre {other:?} (supported: gpt-2, smollm, llama-bpe, qwen2 and their aliases); give a tokenizer.json"
            )))
        }
    };

    let raw = g.str_array("tokenizer.ggml.merges").map_err(meta)?.ok_or_else(|| {
        err("tokenizer.ggml.merges is missing: a byte-level BPE vocabulary needs its merges")
    })?;
    let ids = lookup(tokens);
    let mut merges: Merges = Vec::with_capacity(raw.len());
    for (i, m) in raw.iter().enumerate() {
        // "left right", split at the first space after the first character, as llama.cpp does
        // (byte-level pieces have no spaces: "Ġ" stands for one).
        let at = m.char_indices().skip(1).find(|&(_, c)| c == ' ').map(|(at, _)| at);
        let Some(at) = at else {
            return Err(err(format!("tokenizer.ggml.merges[{i}] = {m:?} is not two pieces")));
        };
        let (left, right) = (&m[..at], &m[at + 1..]);
        // The tokenizers crate would refuse a piece outside the vocabulary (or panic on a
        // merged piece longer than every token), so check all three here.
        for piece in [left, right, &format!("{left}{right}")] {
            if !ids.contains_key(piece) {
                return Err(err(format!(
                    "tokenizer.ggml.merges[{i}] = {m:?}: {piece:?} is not in the vocabulary"
                )));
            }
        }
        merges.push((left.to_owned(), right.to_owned()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(bpe_vocab(&ids), merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(hf("byte-level BPE"))?;
    let mut t = Tokenizer::new(bpe);
    if nfc {
        t.with_normalizer(Some(NFC)).map_err(hf("normaliser"))?;
    }
    let pre_tokenizer: PreTokenizerWrapper = match split {
        WordSplit::Gpt2 => ByteLevel::new(false, true, true).into(),
        WordSplit::DigitsThenGpt2 => PreSequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ])
        .into(),
        WordSplit::Regex(regex) => {
            let split = Split::new(
                SplitPattern::Regex(regex.into()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(hf("pre-tokenizer regex"))?;
            PreSequence::new(vec![split.into(), ByteLevel::new(false, true, false).into()]).into()
        }
    };
    t.with_pre_tokenizer(Some(pre_tokenizer));
    t.with_decoder(Some(ByteLevel::default()));
    Ok(t)
}

/// Control and unknown tokens as special added tokens, user-defined ones as plain added tokens
/// (see the module comment). Both match the raw text (not normalised), as llama.cpp matches them.
fn add_tokens(t: &mut Tokenizer, tokens: &[&str], types: &[i64]) -> Result<()> {
    let added = |wanted: &[i64], special: bool| -> Vec<AddedToken> {
        tokens
            .iter()
            .zip(types)
            .filter(|&(tok, ty)| wanted.contains(ty) && !tok.is_empty())
            .map(|(tok, _)| AddedToken::from(*tok, special).normalized(false))
            .collect()
    };
    t.add_special_tokens(added(&[CONTROL, UNKNOWN], true)).map_err(hf("special tokens"))?;
    t.add_tokens(added(&[USER_DEFINED], false)).map_err(hf("user-defined tokens"))?;
    Ok(())
}
