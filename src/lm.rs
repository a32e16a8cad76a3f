//! The interface between "a thing that predicts the next token" and everything that uses it:
//! the generation loop, the samplers, beam search and the scorer. A transformer (CPU or GPU) and
//! a lesson's table model both implement it, so the same loop runs them all.

use std::future::Future;
use std::sync::Arc;

use crate::constraint::{AllowedSet, ConstraintVocab};
use crate::error::{Error, Result};
pub use crate::sampling::{AllowedTop, TopK};

/// A model of P(x_t | x_<t): given the tokens so far (held in `State`), the logits of the next.
///
/// The model itself is immutable (weights); everything that changes while generating lives in
/// `State` (the KV cache and the position). Beam search clones states to fork hypotheses.
///
/// The forward passes are asynchronous, because a GPU's must be awaited in the browser (it
/// cannot block). The CPU and table models compute inside the future and answer at once; the
/// blocking forms ([`forward`](LanguageModel::forward) and its kin) run a pass to its end on
/// this thread ([`block_on`]), which is how the CLI and the tests call every model. The drivers
/// ([`Generation`](crate::generate::Generation), [`BeamSearch`](crate::generate::BeamSearch),
/// [`score`](crate::generate::score)) are written once, against the asynchronous passes.
pub trait LanguageModel {
    type State: Clone;

    fn vocab_size(&self) -> usize;
    /// Longest sequence (prompt + generated) the model accepts.
    fn context_length(&self) -> usize;
    /// Token the prompt starts with, if the model uses one.
    fn bos_token(&self) -> Option<u32>;
    /// Tokens that end generation.
    fn eos_tokens(&self) -> &[u32];

    /// An empty state: no tokens seen yet.
    fn new_state(&self) -> Self::State;
    /// How many tokens the state holds (the position the next token will take).
    fn position(&self, state: &Self::State) -> usize;

    /// Forget every token after the first `len`: the state becomes what it was after those `len`
    /// tokens, so a conversation can keep the KV cache of the prefix it shares with its next
    /// prompt and run only the rest (`chat::reuse_prefix`). Errors (and leaves `state` unchanged)
    /// when `len` is more than the state holds.
    fn truncate(&self, state: &mut Self::State, len: usize) -> Result<()>;

    /// Append `tokens` to `state` in one pass (prefill when there are many, a decode step when
    /// there is one) and return logits. With `all_logits` the result holds `tokens.len()` rows of
    /// `vocab_size()` (row i predicts the token after `tokens[i]`); otherwise only the last row.
    /// Errors (and leaves `state` unchanged) when the tokens would not fit in the context or an
    /// id is outside the vocabulary.
    fn forward_async(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        all_logits: bool,
    ) -> impl Future<Output = Result<Vec<f32>>>;

    /// Append `tokens` like [`forward_async`](LanguageModel::forward_async) and return only the
    /// `k` most likely next tokens and the log-sum-exp of all the logits: all that beam search
    /// needs. This default reads the whole logits row; a backend that can rank on its own device
    /// (the GPU's top-k kernel) overrides it so only the k pairs come back.
    fn forward_top_async(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        k: usize,
    ) -> impl Future<Output = Result<TopK>> {
        async move { Ok(TopK::from_logits(&self.forward_async(state, tokens, false).await?, k)) }
    }

    /// Append `tokens` like [`forward_async`](LanguageModel::forward_async) and rank for a
    /// constrained step: the `k` most likely tokens of the `allowed` set, and the `shown` most
    /// likely of all (what the model itself believed, so a view can show what the constraint
    /// removed), both with the log-sum-exp of all the logits. This default reads the whole
    /// logits row; the GPU masks in its top-k kernel so only the pairs come back.
    fn forward_top_allowed_async(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        k: usize,
        shown: usize,
        allowed: &AllowedSet,
    ) -> impl Future<Output = Result<AllowedTop>> {
        async move {
            let logits = self.forward_async(state, tokens, false).await?;
            Ok(AllowedTop::from_logits(&logits, k, shown, allowed))
        }
    }

    /// The largest k for which [`forward_top_async`](LanguageModel::forward_top_async) ranks on
    /// the model's own device (so a generation step whose sampler needs only the top tokens
    /// reads back those and not the whole row); `None` (the default) when it would read the
    /// whole row anyway.
    fn top_on_device(&self) -> Option<usize> {
        None
    }

    /// The most tokens a scoring pass gives the model at once (each returns a row of logits per
    /// token). Unlimited by default; the GPU keeps its read-back to a few rows however long the
    /// text.
    fn score_chunk(&self) -> usize {
        usize::MAX
    }

    /// Whether the forward passes answer at once (the future is ready when first polled): true
    /// for the models that compute on the CPU. The browser steps those without awaiting.
    fn answers_at_once(&self) -> bool {
        true
    }

    /// [`forward_async`](LanguageModel::forward_async), run to its end on this thread.
    fn forward(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<Vec<f32>> {
        block_on(self.forward_async(state, tokens, all_logits))
    }

    /// [`forward_top_async`](LanguageModel::forward_top_async), run to its end on this thread.
    fn forward_top(&self, state: &mut Self::State, tokens: &[u32], k: usize) -> Result<TopK> {
        block_on(self.forward_top_async(state, tokens, k))
    }

    /// [`forward_top_allowed_async`](LanguageModel::forward_top_allowed_async), run to its end
    /// on this thread.
    fn forward_top_allowed(
        &self,
        state: &mut Self::State,
        tokens: &[u32],
        k: usize,
        shown: usize,
        allowed: &AllowedSet,
    ) -> Result<AllowedTop> {
        block_on(self.forward_top_allowed_async(state, tokens, k, shown, allowed))
    }
}

/// Run `future` to its end on this thread: the one place the library blocks. A future that is
/// ready when first polled (a CPU model's pass) costs nothing more. Natively one that waits (the
/// GPU's) parks the thread until it is woken (pollster); the browser cannot block, so there a
/// future that waits is an error that says to await it.
pub fn block_on<T>(future: impl Future<Output = Result<T>>) -> Result<T> {
    let mut future = std::pin::pin!(future);
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    match future.as_mut().poll(&mut context) {
        std::task::Poll::Ready(value) => value,
        #[cfg(not(target_arch = "wasm32"))]
        std::task::Poll::Pending => pollster::block_on(future),
        #[cfg(target_arch = "wasm32")]
        std::task::Poll::Pending => Err(Error::Input(
            "this model computes asynchronously in the browser (WebGPU): await it".into(),
        )),
    }
}

/// The error of [`LanguageModel::truncate`] when a state holding `held` tokens is asked to keep
/// `len`.
pub fn check_truncate(held: usize, len: usize) -> Result<()> {
    if len > held {
        return Err(crate::error::Error::Input(format!(
            "cannot keep {len} tokens of a state that holds {held}"
        )));
    }
    Ok(())
}

/// Turns text into token ids and back. Tokenizer-backed for transformers, word lists for tables.
pub trait Vocab {
    /// Ids of `text` without special tokens (the caller adds BOS).
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// Text of a sequence of ids. Decoding a whole sequence (not token by token) matters for
    /// byte-fallback and multi-byte characters; the streaming loop diffs successive decodes.
    fn decode(&self, ids: &[u32]) -> String;
    /// Display form of one token (for probability views), e.g. "▁cat" or "<0x0A>".
    fn token_text(&self, id: u32) -> String;

    /// The id of the token whose text is exactly `token` (e.g. a special token such as
    /// `<|im_end|>`), if the vocabulary has one. This default encodes `token` and accepts a
    /// single id that displays as `token`; tokenizers with a lookup table override it.
    fn token_id(&self, token: &str) -> Option<u32> {
        match self.encode(token).ok()?.as_slice() {
            &[id] if self.token_text(id) == token => Some(id),
            _ => None,
        }
    }

    /// Every token's bytes, as structured output needs them
    /// ([`constraint`](crate::constraint)), for a model with `n_vocab` logits: built on first
    /// use and kept. This default has none (a lesson's word list is not a byte-level
    /// vocabulary).
    fn constraint_vocab(&self, n_vocab: usize) -> Result<Arc<ConstraintVocab>> {
        let _ = n_vocab;
        Err(Error::Constraint(
            "structured output needs a tokenizer whose tokens are bytes (a GGUF model's); \
             this vocabulary has none"
                .into(),
        ))
    }
}

/// A vocabulary for runs whose text nobody reads (benchmarks, tests on random-weight models):
/// each id shows as its number. It encodes no text.
pub struct IdsOnly;

impl Vocab for IdsOnly {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Err(Error::Input(format!("this vocabulary has no text to encode {text:?} with")))
    }
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|id| format!("{id} ")).collect()
    }
    fn token_text(&self, id: u32) -> String {
        id.to_string()
    }
}
