//! Hugging Face `tokenizer.json` through the `tokenizers` crate (the same build natively and in
//! wasm, so ids match Python's everywhere).

use crate::error::{Error, Result};
use crate::lm::Vocab;

pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
}

impl HfTokenizer {
    pub fn from_bytes(bytes: &[u8]) -> Result<HfTokenizer> {
        let inner = tokenizers::Tokenizer::from_bytes(bytes)
            .map_err(|e| Error::Tokenizer(format!("cannot read tokenizer.json: {e}")))?;
        Ok(HfTokenizer { inner })
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_file(path: &std::path::Path) -> Result<HfTokenizer> {
        let bytes = std::fs::read(path)
            .map_err(|source| Error::Io { path: path.display().to_string(), source })?;
        HfTokenizer::from_bytes(&bytes)
            .map_err(|e| Error::Tokenizer(format!("{}: {e}", path.display())))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
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
