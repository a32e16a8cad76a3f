//! Scoring: the chain rule, P(sequence) = Π P(token | prefix), computed as a sum of logs.
//!
//! [`Scoring`] takes the sequence through the model in chunks with logits at every position, so
//! long texts need not read back every position's logits at once; [`score_async`] drives it
//! (and [`score`] blocks on that).

use crate::error::{Error, Result};
use crate::lm::LanguageModel;
use crate::sampling::{bad_logits, log_softmax_at};
use crate::Vocab;

use super::TextStream;

/// The text each scored token (`ids[1..]`; `ids[0]` is the unscored context) adds to the
/// scored text, as generation would stream it (a word's space included; "" for a byte that
/// only completes a character with a later token): the pieces, concatenated, are the text.
pub fn scored_pieces(vocab: &dyn Vocab, ids: &[u32]) -> Vec<String> {
    let Some(context) = ids.get(..1) else { return Vec::new() };
    let mut text = TextStream::new(vocab, context);
    (1..ids.len())
        .map(|i| {
            text.push(ids[i]);
            text.take(vocab, &[], i + 1 == ids.len()).0
        })
        .collect()
}

/// How probable a sequence is under a model, token by token. Everything is in log space: a
/// product of hundreds of probabilities underflows even f64, a sum of their logs does not.
#[derive(Clone, Debug, PartialEq)]
pub struct Score {
    /// ln P(token | prefix) for each scored token.
    pub token_logprobs: Vec<f64>,
    /// Their sum: ln P(sequence | its first token).
    pub total_logprob: f64,
    /// Average negative log-likelihood per token, in nats.
    pub avg_nll: f64,
    /// exp(avg_nll): the number of equally likely choices the model was, on average, torn
    /// between. 1 is certainty.
    pub perplexity: f64,
}

impl Score {
    /// From per-token log-probabilities. An empty list scores 0 nats, perplexity 1.
    pub fn from_logprobs(token_logprobs: Vec<f64>) -> Score {
        let total_logprob: f64 = token_logprobs.iter().sum();
        let n = token_logprobs.len();
        let avg_nll = if n == 0 { 0.0 } else { -total_logprob / n as f64 };
        Score { token_logprobs, total_logprob, avg_nll, perplexity: avg_nll.exp() }
    }

    /// From per-token probabilities (each is logged; they are never multiplied).
    pub fn from_probs(probs: &[f64]) -> Score {
        Score::from_logprobs(probs.iter().map(|p| p.ln()).collect())
    }

    /// P(sequence | its first token) = exp(total_logprob); 0 when that underflows.
    pub fn probability(&self) -> f64 {
        self.total_logprob.exp()
    }
}

/// A scoring in progress. `ids[0]` is the context start (usually BOS) and is not scored; each
/// later token is scored given all before it.
///
/// Drive it like [`Generation`](super::Generation): [`step_input`](Scoring::step_input) gives
/// the next chunk of tokens (`None` when all are in); run it on [`state_mut`](Scoring::state_mut)
/// with all logits on and hand them to [`step_output`](Scoring::step_output); then
/// [`finish`](Scoring::finish).
pub struct Scoring<S> {
    ids: Vec<u32>,
    vocab_size: usize,
    chunk: usize,
    state: S,
    /// Tokens fed to the model so far.
    fed: usize,
    token_logprobs: Vec<f64>,
}

impl<S> Scoring<S> {
    /// Score `ids` feeding at most `chunk` tokens per forward pass (each pass returns a row of
    /// `vocab_size` logits per token).
    pub fn new<M: LanguageModel<State = S>>(model: &M, ids: &[u32], chunk: usize) -> Result<Self> {
        if ids.len() < 2 {
            return Err(Error::Input(format!(
                "scoring needs a first token (the context) and at least one token to score; got {} ids",
                ids.len()
            )));
        }
        Ok(Scoring {
            ids: ids.to_vec(),
            vocab_size: model.vocab_size(),
            chunk: chunk.max(1),
            state: model.new_state(),
            fed: 0,
            token_logprobs: Vec::with_capacity(ids.len() - 1),
        })
    }

    /// The next chunk of tokens to run with all logits, or `None` when every token is in.
    pub fn step_input(&self) -> Option<Vec<u32>> {
        (self.fed < self.ids.len())
            .then(|| self.ids[self.fed..(self.fed + self.chunk).min(self.ids.len())].to_vec())
    }

    /// The model state the tokens of [`step_input`](Scoring::step_input) go into.
    pub fn state_mut(&mut self) -> &mut S {
        &mut self.state
    }

    /// The logits of the chunk from [`step_input`](Scoring::step_input), one row per token.
    pub fn step_output(&mut self, logits: &[f32]) -> Result<()> {
        let n = self.chunk.min(self.ids.len() - self.fed);
        if logits.len() != n * self.vocab_size {
            return Err(Error::Input(format!(
                "scoring a chunk of {n} tokens needs {n} rows of {} logits, got {} values",
                self.vocab_size,
                logits.len()
            )));
        }
        // Row i predicts the token after the chunk's i-th; the sequence's last predicts nothing.
        for (i, row) in logits.chunks_exact(self.vocab_size).enumerate() {
            if let Some(&next) = self.ids.get(self.fed + i + 1) {
                let logprob = log_softmax_at(row, next);
                // NaN exactly when the row holds NaN or +inf (see `logsumexp`).
                if logprob.is_nan() {
                    return Err(bad_logits(self.fed + i + 1));
                }
                self.token_logprobs.push(logprob);
            }
        }
        self.fed += n;
        Ok(())
    }

    pub fn is_done(&self) -> bool {
        self.fed == self.ids.len()
    }

    /// The score of the tokens scored so far (all of them once [`is_done`](Scoring::is_done)).
    pub fn finish(self) -> Score {
        Score::from_logprobs(self.token_logprobs)
    }
}

/// Score `ids`: `ids[0]` is the context start (usually BOS) and is not scored; each later token
/// is scored given all before it. The model's forward passes return logits at every position,
/// [`LanguageModel::score_chunk`] tokens at a time (one pass on the CPU).
pub async fn score_async<M: LanguageModel>(model: &M, ids: &[u32]) -> Result<Score> {
    let mut scoring = Scoring::new(model, ids, model.score_chunk())?;
    while let Some(tokens) = scoring.step_input() {
        let logits = model.forward_async(scoring.state_mut(), &tokens, true).await?;
        scoring.step_output(&logits)?;
    }
    Ok(scoring.finish())
}

/// [`score_async`], run to its end on this thread.
pub fn score<M: LanguageModel>(model: &M, ids: &[u32]) -> Result<Score> {
    crate::lm::block_on(score_async(model, ids))
}

/// The ids to score `text` as the continuation of `prefix`, and how many of them are the
/// prefix's (the context: the first continuation token is scored given all of them). The
/// continuation's tokens are the ones generation would have produced after `prefix`'s: the two
/// texts are tokenised together and split where `prefix`'s own tokens end. Tokenised alone,
/// a continuation gets what a text's start gets (SentencePiece's leading "▁", a first word
/// merged differently) and scores tokens generation never produced. Where the joined text's
/// tokens cross the boundary (a word cut in two by it), the context is the tokens the two
/// share, and the first scored token holds the end of `prefix` too.
pub fn continuation_ids(
    bos: Option<u32>,
    vocab: &dyn crate::lm::Vocab,
    prefix: &str,
    text: &str,
) -> Result<(Vec<u32>, usize)> {
    let context = super::prompt_ids(bos, vocab, prefix)?;
    let whole = super::prompt_ids(bos, vocab, &format!("{prefix}{text}"))?;
    let shared = context.iter().zip(&whole).take_while(|(a, b)| a == b).count();
    if shared == whole.len() {
        return Err(Error::Input(format!(
            "nothing to score: {text:?} adds no token after the prefix"
        )));
    }
    Ok((whole, shared.max(1)))
}
