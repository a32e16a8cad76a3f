//! Text to token ids and back through Hugging Face's `tokenizers` crate (the same build natively
//! and in wasm, so ids match Python's everywhere), from either of two sources:
//!
//! - a `tokenizer.json` ([`HfTokenizer::from_bytes`], [`HfTokenizer::from_file`]);
//! - the GGUF file's own `tokenizer.ggml.*` metadata ([`HfTokenizer::from_gguf`]): the same kind
//!   of `tokenizers::Tokenizer`, assembled from the vocabulary llama.cpp's converter wrote (see
//!   `tokenizer/gguf.rs`), so a GGUF file alone is enough.

use crate::error::{Error, Result};
use crate::gguf::{Gguf, Value};
use crate::lm::Vocab;
use crate::model::Arch;

mod gguf;

pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialTokens,
}

/// The special token ids a GGUF file names (`tokenizer.ggml.*_token_id`) and whether prompts
/// start with BOS / end with EOS. A `tokenizer.json` leaves these empty: there the model file's
/// metadata decides (`model::Config`, which reads them through [`SpecialTokens::from_gguf`] too).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn (chat models), which ends generation like EOS.
    pub eot: Option<u32>,
    pub pad: Option<u32>,
    pub unk: Option<u32>,
    /// Prompts start with `bos` (never true without one).
    pub add_bos: bool,
    /// Encoded texts end with `eos` (never true without one).
    pub add_eos: bool,
}

impl SpecialTokens {
    /// The ids and flags of `g`'s metadata; ids at or past `n_vocab` are ignored.
    ///
    /// Without `tokenizer.ggml.add_bos_token` the default is the architecture's (as the model
    /// has always decided: Llama adds BOS, Qwen2 and GPT-2 do not), or for a file with no known
    /// architecture llama.cpp's default for the tokenizer type (SentencePiece adds it, BPE not).
    pub fn from_gguf(g: &Gguf, n_vocab: usize) -> SpecialTokens {
        let id = |name: &str| {
            g.get(&format!("tokenizer.ggml.{name}_token_id"))
                .and_then(Value::as_u64)
                .filter(|&v| v < n_vocab as u64)
                .map(|v| v as u32)
        };
        let flag = |name: &str| {
            g.get(&format!("tokenizer.ggml.add_{name}_token")).and_then(Value::as_bool)
        };
        let arch = g.get("general.architecture").and_then(Value::as_str);
        let add_bos_default = match arch.and_then(|a| Arch::from_gguf_name(a).ok()) {
            Some(arch) => arch.adds_bos_by_default(),
            None => g.get("tokenizer.ggml.model").and_then(Value::as_str) == Some("llama"),
        };
        let (bos, eos) = (id("bos"), id("eos"));
        SpecialTokens {
            bos,
            eos,
            eot: id("eot"),
            pad: id("padding"),
            unk: id("unknown"),
            add_bos: flag("bos").unwrap_or(add_bos_default) && bos.is_some(),
            add_eos: flag("eos").unwrap_or(false) && eos.is_some(),
        }
    }

    /// The token a prompt starts with: BOS when there is one and it is wanted.
    pub fn prompt_start(&self) -> Option<u32> {
        self.bos.filter(|_| self.add_bos)
    }

    /// The tokens that end generation: EOS and EOT, each once.
    pub fn end_tokens(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eos.into_iter().chain(self.eot).collect();
        ids.dedup();
        ids
    }
}

impl HfTokenizer {
    pub fn from_bytes(bytes: &[u8]) -> Result<HfTokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| Error::Tokenizer(format!("cannot read tokenizer.json: {e}")))?;
        Ok(HfTokenizer { inner, special: SpecialTokens::default() })
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_file(path: &std::path::Path) -> Result<HfTokenizer> {
        let bytes = std::fs::read(path)
            .map_err(|source| Error::Io { path: path.display().to_string(), source })?;
        HfTokenizer::from_bytes(&bytes)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
    }

    /// The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata (a vocabulary-only
    /// file without tensors is fine). Errors name what is missing or unsupported.
    pub fn from_gguf(g: &Gguf) -> Result<HfTokenizer> {
        let (inner, special) = gguf::build(g)?;
        Ok(HfTokenizer { inner, special })
    }

    /// [`from_gguf`](HfTokenizer::from_gguf) on a whole GGUF file's bytes.
    pub fn from_gguf_bytes(bytes: &[u8]) -> Result<HfTokenizer> {
        HfTokenizer::from_gguf(&Gguf::parse(bytes)?)
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Special ids and BOS/EOS flags (from the GGUF metadata; empty for a `tokenizer.json`).
    pub fn special(&self) -> &SpecialTokens {
        &self.special
    }
}

impl Vocab for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(format!("cannot encode text: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    fn decode(&self, ids: &[u32]) -> String {
        self.inner.decode(ids, true).unwrap_or_default()
    }

    fn token_text(&self, id: u32) -> String {
        self.inner.id_to_token(id).unwrap_or_else(|| format!("<{id}>"))
    }

    fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}
