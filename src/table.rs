//! The lessons' "table model": a bigram language model written out as a JSON table, small enough
//! to check every number by hand, yet a real [`LanguageModel`] and [`Vocab`], so the generation
//! loop, the samplers, beam search and the scorer run on it unchanged.
//!
//! ```json
//! {
//!   "name": "lesson-toy",
//!   "description": "Four sentences about a cat and a dog.",
//!   "vocab": ["<s>", "the", "cat", "dog", "sat", "ran", "</s>"],
//!   "bos": "<s>",
//!   "eos": "</s>",
//!   "context_length": 64,
//!   "next": {
//!     "<s>": { "the": 1.0 },
//!     "the": { "cat": 0.6, "dog": 0.4 },
//!     "cat": { "sat": 0.7, "ran": 0.3 },
//!     "dog": { "sat": 0.2, "ran": 0.8 },
//!     "sat": { "</s>": 1.0 },
//!     "ran": { "</s>": 1.0 }
//!   }
//! }
//! ```
//!
//! - `vocab`: the words, in id order (word i has id i). No duplicates, no whitespace inside;
//!   at most [`MAX_TABLE_WORDS`] (4096).
//! - `bos` / `eos`: the start and end words (both in `vocab`).
//! - `next[w]`: P(next word | w), over words of `vocab`; words left out have probability 0.
//!   Every row sums to 1 (within 1e-6). Every word except `eos` needs a row; after `eos`, if it
//!   has no row, only `eos` follows (generation has ended, the chain stays there).
//! - `context_length` (optional, default 64) and `description` (optional).
//!
//! Only the last word matters (a bigram model), so the state is the position and the last id.
//! Logits are ln P, with `-inf` for impossible words: softmax gives back P exactly.

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::lm::{LanguageModel, Vocab};

const DEFAULT_CONTEXT_LENGTH: usize = 64;
const ROW_SUM_TOLERANCE: f64 = 1e-6;
/// The most words a table may have. Lessons use a handful; a table is written and checked by
/// hand, and a bigger one is not a lesson (each forward pass still builds a full row of logits).
pub const MAX_TABLE_WORDS: usize = 4096;

/// The JSON as written; `TableModel::from_json` checks it and turns it into sparse rows.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TableFile {
    name: String,
    #[serde(default)]
    description: String,
    vocab: Vec<String>,
    bos: String,
    eos: String,
    context_length: Option<usize>,
    next: BTreeMap<String, BTreeMap<String, f64>>,
}

#[derive(Clone, Debug)]
pub struct TableModel {
    name: String,
    description: String,
    words: Vec<String>,
    ids: HashMap<String, u32>,
    bos: u32,
    eos: [u32; 1],
    context_length: usize,
    /// Row `prev` lists (next, ln P(next | prev)) for the words that can follow, by id; every
    /// other word has probability 0 (logit `-inf`). Sparse: a table's rows are short.
    rows: Vec<Vec<(u32, f32)>>,
}

/// Where a table model is in a sequence. The last word is all a bigram model uses; the state
/// keeps the whole sequence so it can be cut back to a prefix ([`LanguageModel::truncate`]).
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct TableState {
    pub tokens: Vec<u32>,
}

impl TableState {
    pub fn position(&self) -> usize {
        self.tokens.len()
    }
    pub fn last(&self) -> Option<u32> {
        self.tokens.last().copied()
    }
}

fn model_err<T>(message: String) -> Result<T> {
    Err(Error::Model(format!("table model: {message}")))
}

impl TableModel {
    pub fn from_json(json: &str) -> Result<TableModel> {
        let file: TableFile = serde_json::from_str(json)
            .map_err(|e| Error::Model(format!("table model: bad JSON: {e}")))?;

        if file.vocab.is_empty() {
            return model_err("vocab is empty".into());
        }
        if file.vocab.len() > MAX_TABLE_WORDS {
            return model_err(format!(
                "vocab has {} words; a table model may have at most {MAX_TABLE_WORDS}",
                file.vocab.len()
            ));
        }
        let mut ids = HashMap::new();
        for (i, word) in file.vocab.iter().enumerate() {
            if word.is_empty() || word.contains(char::is_whitespace) {
                return model_err(format!(
                    "vocab word {word:?} is empty or contains whitespace (text is split into words at whitespace)"
                ));
            }
            if ids.insert(word.clone(), i as u32).is_some() {
                return model_err(format!("{word:?} appears twice in vocab"));
            }
        }
        let id_of = |word: &str, what: &str| match ids.get(word) {
            Some(&id) => Ok(id),
            None => model_err(format!("{what} {word:?} is not in vocab")),
        };
        let bos = id_of(&file.bos, "bos")?;
        let eos = id_of(&file.eos, "eos")?;

        let mut rows = vec![Vec::new(); file.vocab.len()];
        for (prev, row) in &file.next {
            let prev_id = id_of(prev, "next has a row for")? as usize;
            let mut sum = 0.0;
            for (next, &p) in row {
                let next_id = id_of(next, &format!("next[{prev:?}] gives a probability to"))?;
                if !(0.0..=1.0).contains(&p) {
                    return model_err(format!(
                        "next[{prev:?}][{next:?}] = {p} is not a probability"
                    ));
                }
                sum += p;
                if p > 0.0 {
                    rows[prev_id].push((next_id, p.ln() as f32));
                }
            }
            rows[prev_id].sort_unstable_by_key(|&(next, _)| next);
            if (sum - 1.0).abs() > ROW_SUM_TOLERANCE {
                return model_err(format!("next[{prev:?}] sums to {sum}, not 1"));
            }
        }
        for (id, word) in file.vocab.iter().enumerate() {
            if file.next.contains_key(word) {
                continue;
            }
            if id as u32 != eos {
                return model_err(format!(
                    "next has no row for {word:?}: every word except eos needs a next-word distribution"
                ));
            }
            rows[id] = vec![(id as u32, 0.0)]; // after the end comes the end: ln 1
        }

        Ok(TableModel {
            name: file.name,
            description: file.description,
            words: file.vocab,
            ids,
            bos,
            eos: [eos],
            context_length: file.context_length.unwrap_or(DEFAULT_CONTEXT_LENGTH),
            rows,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn description(&self) -> &str {
        &self.description
    }

    /// The vocabulary, in id order.
    pub fn words(&self) -> &[String] {
        &self.words
    }

    pub fn id(&self, word: &str) -> Option<u32> {
        self.ids.get(word).copied()
    }

    /// P(next | prev) straight from the table (0 for an id outside the vocabulary).
    pub fn prob(&self, prev: u32, next: u32) -> f64 {
        let row = self.rows.get(prev as usize).map_or(&[][..], Vec::as_slice);
        row.binary_search_by_key(&next, |&(id, _)| id).map_or(0.0, |at| (row[at].1 as f64).exp())
    }

    /// Append the logits of the word after `prev` (a known id) to `out`: a full row.
    fn push_row(&self, prev: u32, out: &mut Vec<f32>) {
        let start = out.len();
        out.resize(start + self.words.len(), f32::NEG_INFINITY);
        for &(next, logit) in &self.rows[prev as usize] {
            out[start + next as usize] = logit;
        }
    }
}

impl LanguageModel for TableModel {
    type State = TableState;

    fn vocab_size(&self) -> usize {
        self.words.len()
    }

    fn context_length(&self) -> usize {
        self.context_length
    }

    fn bos_token(&self) -> Option<u32> {
        Some(self.bos)
    }

    fn eos_tokens(&self) -> &[u32] {
        &self.eos
    }

    fn new_state(&self) -> TableState {
        TableState::default()
    }

    fn position(&self, state: &TableState) -> usize {
        state.position()
    }

    fn truncate(&self, state: &mut TableState, len: usize) -> Result<()> {
        crate::lm::check_truncate(state.position(), len)?;
        state.tokens.truncate(len);
        Ok(())
    }

    async fn forward_async(
        &self,
        state: &mut TableState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        let end = state.position() + tokens.len();
        if end > self.context_length {
            return Err(Error::Input(format!(
                "{} tokens at position {} would not fit in the context of {}",
                tokens.len(),
                state.position(),
                self.context_length
            )));
        }
        if let Some(&bad) = tokens.iter().find(|&&id| id as usize >= self.words.len()) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary of {} words",
                self.words.len()
            )));
        }
        if tokens.is_empty() {
            return Ok(Vec::new());
        }

        // A bigram model needs no work per token: each row is a lookup.
        let rows = if all_logits { tokens } else { &tokens[tokens.len() - 1..] };
        let mut out = Vec::with_capacity(rows.len() * self.words.len());
        for &id in rows {
            self.push_row(id, &mut out);
        }
        state.tokens.extend_from_slice(tokens);
        Ok(out)
    }
}

impl Vocab for TableModel {
    /// Words separated by whitespace; an unknown word is an error that lists the vocabulary.
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.split_whitespace()
            .map(|word| {
                self.id(word).ok_or_else(|| {
                    Error::Input(format!(
                        "{:?} is not a word of the {} model, which knows: {}",
                        word,
                        self.name,
                        self.words.join(" ")
                    ))
                })
            })
            .collect()
    }

    /// The words joined by single spaces, without the start and end markers. Decoding one more
    /// word adds " word", which is what the streaming loop emits.
    fn decode(&self, ids: &[u32]) -> String {
        let mut text = String::new();
        for &id in ids {
            if id == self.bos || id == self.eos[0] {
                continue;
            }
            if !text.is_empty() {
                text.push(' ');
            }
            match self.words.get(id as usize) {
                Some(word) => text.push_str(word),
                None => text.push_str(&format!("<{id}?>")),
            }
        }
        text
    }

    fn token_text(&self, id: u32) -> String {
        self.words.get(id as usize).cloned().unwrap_or_else(|| format!("<{id}?>"))
    }
}
