//! Structured output: at each step only the tokens that keep the output valid may be sampled.
//!
//! The constraint engine is llguidance (the one behind Guidance and many inference servers): it
//! compiles a JSON Schema, a regular expression or a Lark-style grammar, and for the text so far
//! computes the set of tokens that can extend it, walking a trie of every token's bytes. This
//! module gives it our tokenizers' bytes ([`ConstraintVocab`], built once per tokenizer and
//! model), and wraps its matcher as a [`Constraint`]: the allowed set for the next token
//! ([`AllowedSet`]: one bit per token, the layout the GPU's top-k kernel reads), then the chosen
//! token consumed.
//!
//! How generation uses it (`generate/`): the set is applied to the logits before the sampler
//! sees them (disallowed tokens get `-inf`, so greedy, temperature, top-k/p, min-p, the
//! repetition penalty and beam search all choose among allowed tokens only). The model's end
//! tokens are allowed exactly when the output is complete; when nothing can follow, generation
//! stops on its own ([`StopReason::ConstraintComplete`]); when `max_tokens` or the context runs
//! out first, it stops with [`StopReason::Incomplete`], never as a normal finish.
//!
//! [`StopReason::ConstraintComplete`]: crate::generate::StopReason::ConstraintComplete
//! [`StopReason::Incomplete`]: crate::generate::StopReason::Incomplete

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use toktrie::{ApproximateTokEnv, TokRxInfo, TokTrie};

use crate::error::{Error, Result};

/// What the output must be. Serialised as JS and the CLI's files write it (internally tagged by
/// `type`):
///
/// - `{"type": "json_schema", "schema": {...}}`: one JSON value valid against the schema
///   (llguidance's JSON Schema support: types, properties, required, additionalProperties,
///   items and prefixItems, min/max items and lengths, enum, const, anyOf, allOf, local `$ref`,
///   pattern, common formats, numeric bounds and multipleOf; `oneOf` when its alternatives
///   cannot overlap; a keyword it does not implement, such as `uniqueItems`, is an error naming
///   it). Between JSON tokens only [`JSON_WHITESPACE`] may appear (a space or two, or a
///   newline and indentation), so a model cannot loop on whitespace; a schema's own
///   `"x-guidance"` object (llguidance's JSON options: `whitespace_pattern`,
///   `whitespace_flexible`, `item_separator`, `key_separator`, ...) replaces that default;
/// - `{"type": "json_object"}`: any JSON object (whitespace as above);
/// - `{"type": "regex", "pattern": "..."}`: text the regular expression matches as a whole
///   (Rust `regex` syntax, anchored at both ends);
/// - `{"type": "grammar", "lark": "..."}`: a sentence of the Lark-style grammar (llguidance's
///   dialect: rules, `%import common.*`, regex terminals, `%json {...}` for embedded schemas),
///   starting at its `start` rule.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ConstraintSpec {
    JsonSchema { schema: serde_json::Value },
    JsonObject,
    Regex { pattern: String },
    Grammar { lark: String },
}

impl ConstraintSpec {
    /// What it is, for messages: "JSON schema", "regex", ...
    pub fn kind(&self) -> &'static str {
        match self {
            ConstraintSpec::JsonSchema { .. } => "JSON schema",
            ConstraintSpec::JsonObject => "JSON object",
            ConstraintSpec::Regex { .. } => "regex",
            ConstraintSpec::Grammar { .. } => "grammar",
        }
    }

    fn grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            ConstraintSpec::JsonSchema { schema } => {
                let mut schema = match schema {
                    serde_json::Value::Object(_) => schema.clone(),
                    // `true` admits any JSON value; `false` none.
                    serde_json::Value::Bool(true) => serde_json::json!({}),
                    serde_json::Value::Bool(false) => {
                        return Err(Error::Constraint(
                            "invalid JSON schema: the schema `false` admits no value".into(),
                        ))
                    }
                    other => {
                        return Err(Error::Constraint(format!(
                            "invalid JSON schema: a schema is an object (or true/false), not {}",
                            json_kind(other)
                        )))
                    }
                };
                with_json_defaults(&mut schema);
                TopLevelGrammar::from_json_schema(schema)
            }
            ConstraintSpec::JsonObject => {
                let mut schema = serde_json::json!({"type": "object"});
                with_json_defaults(&mut schema);
                TopLevelGrammar::from_json_schema(schema)
            }
            ConstraintSpec::Regex { pattern } => {
                if pattern.len() > MAX_SPEC_BYTES {
                    return Err(Error::Constraint(format!(
                        "the regex is {} bytes; at most {MAX_SPEC_BYTES}",
                        pattern.len()
                    )));
                }
                // regex-syntax's own message points at the offending character; llguidance
                // would report the same error about its rewrite of the pattern.
                if let Err(e) = regex_syntax::Parser::new().parse(pattern) {
                    return Err(Error::Constraint(format!("invalid regex:\n{e}")));
                }
                TopLevelGrammar::from_regex(pattern)
            }
            ConstraintSpec::Grammar { lark } => {
                if lark.trim().is_empty() {
                    return Err(Error::Constraint("invalid grammar: it is empty".into()));
                }
                check_grammar_shape(lark)?;
                TopLevelGrammar::from_lark(lark.clone())
            }
        })
    }
}

/// The largest regex or grammar (bytes) and the deepest chain of rules a grammar may reach from
/// its start rule. llguidance compiles a rule by compiling the rules it refers to first, one
/// level of recursion each: a chain of 3,000 rules (`r0: r1`, `r1: r2`, ...) overflowed the
/// native 8 MB stack and killed the process, and a browser's stack is smaller. Real grammars are
/// a few kilobytes and a few dozen levels deep; llguidance itself limits bracket nesting.
pub const MAX_SPEC_BYTES: usize = 256 << 10;
pub const MAX_RULE_DEPTH: usize = 400;

/// Refuse a Lark grammar whose size or chain of rule references exceeds the limits above,
/// before llguidance compiles it. The references are found by a light reading of the text
/// (definitions start a line: `name:` or `NAME:`, with Lark's `?`/`!` prefixes, priorities and
/// parameters; names inside strings, regexes and comments do not count), which is all a bound
/// on the compiler's recursion needs: the deepest path of first visits from `start`.
fn check_grammar_shape(lark: &str) -> Result<()> {
    if lark.len() > MAX_SPEC_BYTES {
        return Err(Error::Constraint(format!(
            "the grammar is {} bytes; at most {MAX_SPEC_BYTES}",
            lark.len()
        )));
    }
    // Definitions: (name, the words its body refers to).
    let mut defs: Vec<(String, Vec<String>)> = Vec::new();
    for line in lark.lines() {
        let code = strip_literals(line);
        let starts_definition = !line.starts_with(char::is_whitespace) && !line.starts_with('%');
        let head = code.split(':').next().unwrap_or("");
        let name = head.trim_start_matches(['?', '!']).split(['.', '{', ' ', '\t']).next();
        match name {
            Some(n) if starts_definition && code.contains(':') && is_name(n) => {
                let body = &code[code.find(':').map_or(code.len(), |i| i + 1)..];
                defs.push((n.to_string(), words(body)));
            }
            _ => {
                if let Some(last) = defs.last_mut() {
                    last.1.extend(words(&code));
                }
            }
        }
    }
    let index = |name: &str| defs.iter().position(|(n, _)| *n == name);
    let Some(start) = index("start").or((!defs.is_empty()).then_some(0)) else { return Ok(()) };
    // Depth-first, each definition expanded at its first visit (as the compiler does).
    let mut visited = vec![false; defs.len()];
    visited[start] = true;
    let mut stack = vec![(start, 0usize)];
    let mut deepest = 1;
    while let Some(&mut (def, ref mut next)) = stack.last_mut() {
        let refs = &defs[def].1;
        match refs.get(*next) {
            None => {
                stack.pop();
            }
            Some(word) => {
                *next += 1;
                if let Some(d) = index(word).filter(|&d| !visited[d]) {
                    visited[d] = true;
                    stack.push((d, 0));
                    deepest = deepest.max(stack.len());
                    if deepest > MAX_RULE_DEPTH {
                        return Err(Error::Constraint(format!(
                            "the grammar's rules refer to each other more than {MAX_RULE_DEPTH} \
                             levels deep (from start through {word}): it cannot be compiled \
                             safely"
                        )));
                    }
                }
            }
        }
    }
    Ok(())
}

/// `line` without its string literals, regexes and `//` comment (each replaced by a space).
fn strip_literals(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '"' | '/' if c == '/' && chars.peek() == Some(&'/') => break,
            '"' | '/' => {
                // To the closing quote or slash, skipping escaped characters.
                while let Some(d) = chars.next() {
                    if d == '\\' {
                        chars.next();
                    } else if d == c {
                        break;
                    }
                }
                out.push(' ');
            }
            _ => out.push(c),
        }
    }
    out
}

fn is_name(word: &str) -> bool {
    let mut chars = word.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// The names in `code`, in order.
fn words(code: &str) -> Vec<String> {
    let names = code.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'));
    names.filter(|w| is_name(w)).map(str::to_string).collect()
}

/// Whitespace allowed between two JSON tokens (llguidance's `whitespace_pattern`): one or two
/// spaces or tabs (`{"a": 1, "b": 2}`), or a newline and up to 20 of them (pretty-printed JSON,
/// ten levels deep at two spaces). llguidance's own default allows any amount, which a small
/// model can fill for hundreds of tokens (a SentencePiece vocabulary spends one token per space).
pub const JSON_WHITESPACE: &str = r"(?:[\x20\x09]{1,2}|\r?\n[\x20\x09]{0,20})";

/// `schema` with our JSON options unless it brings its own `"x-guidance"`.
pub(crate) fn with_json_defaults(schema: &mut serde_json::Value) {
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({ "whitespace_pattern": JSON_WHITESPACE }));
    }
}

fn json_kind(v: &serde_json::Value) -> &'static str {
    match v {
        serde_json::Value::Null => "null",
        serde_json::Value::Bool(_) => "a boolean",
        serde_json::Value::Number(_) => "a number",
        serde_json::Value::String(_) => "a string",
        serde_json::Value::Array(_) => "an array",
        serde_json::Value::Object(_) => "an object",
    }
}

/// The prefix byte of a special token's bytes (toktrie's convention): no UTF-8 text contains
/// 0xFF, so no grammar over text can ever allow a special token.
pub const SPECIAL: u8 = TokTrie::SPECIAL_TOKEN_MARKER;

/// A model's vocabulary as llguidance sees it: each token's bytes in a trie, and the grammar
/// compiler with its per-vocabulary precomputation. Building it walks the whole vocabulary (tens
/// of milliseconds for 150k tokens), so it is made once per tokenizer and model
/// ([`Vocab::constraint_vocab`](crate::Vocab::constraint_vocab) keeps it) and shared by every
/// constraint on them.
pub struct ConstraintVocab {
    factory: ParserFactory,
    n_vocab: usize,
}

impl std::fmt::Debug for ConstraintVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ConstraintVocab({} tokens)", self.n_vocab)
    }
}

impl ConstraintVocab {
    /// From each token's bytes (`token_bytes[id]`; special tokens start with [`SPECIAL`]) for a
    /// model with `n_vocab` logits. Ids the tokenizer does not have (a model's padding rows) are
    /// special tokens that nothing allows.
    pub fn new(mut token_bytes: Vec<Vec<u8>>, n_vocab: usize) -> Result<ConstraintVocab> {
        if token_bytes.len() > n_vocab {
            return Err(Error::Constraint(format!(
                "the tokenizer has {} tokens but the model only {n_vocab} logits",
                token_bytes.len()
            )));
        }
        if n_vocab >= u32::MAX as usize {
            return Err(Error::Constraint(format!("a vocabulary of {n_vocab} is too large")));
        }
        while token_bytes.len() < n_vocab {
            let id = token_bytes.len();
            token_bytes.push(special_name(&format!("<[{id}]>")));
        }
        // One more token past the model's: the trie's end-of-sequence, which llguidance allows
        // exactly when the output is complete. Generation reads that bit and allows the model's
        // own end tokens then (whichever they are: EOS, a chat template's end of turn).
        token_bytes.push(special_name("<|nexttoken:end|>"));
        let info = TokRxInfo::new(token_bytes.len() as u32, n_vocab as u32);
        let trie = TokTrie::from(&info, &token_bytes);
        // Greedy tokenisation by the trie, marked non-canonical: llguidance then never forces
        // tokens on its own (it only would for a tokenizer it can call), it only masks.
        let env: toktrie::TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| Error::Constraint(format!("cannot index the vocabulary: {e}")))?;
        factory.quiet();
        // One sentence per error, not the parser's state and the whole grammar after it.
        factory.limits_mut().verbose_errors = false;
        Ok(ConstraintVocab { factory, n_vocab })
    }

    /// The model's logits this vocabulary covers.
    pub fn n_vocab(&self) -> usize {
        self.n_vocab
    }

    /// The bytes of token `id` (special tokens with their [`SPECIAL`] prefix).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.factory.tok_env().tok_trie().token(id)
    }

    /// Token `id` as text, for messages (lossy; special tokens as their name).
    pub fn token_text(&self, id: u32) -> String {
        let bytes = self.token_bytes(id);
        let bytes = bytes.strip_prefix(&[SPECIAL]).unwrap_or(bytes);
        String::from_utf8_lossy(bytes).into_owned()
    }
}

fn special_name(name: &str) -> Vec<u8> {
    let mut bytes = vec![SPECIAL];
    bytes.extend_from_slice(name.as_bytes());
    bytes
}

/// A set of token ids as bits: token `id` is bit `id % 32` of word `id / 32`. The GPU's top-k
/// kernel reads the words as they are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AllowedSet {
    words: Vec<u32>,
    n: usize,
}

impl AllowedSet {
    /// No token of `n` allowed.
    pub fn none(n: usize) -> AllowedSet {
        AllowedSet { words: vec![0; n.div_ceil(32)], n }
    }

    /// Every token of `n` allowed.
    pub fn all(n: usize) -> AllowedSet {
        let mut set = AllowedSet { words: vec![u32::MAX; n.div_ceil(32)], n };
        set.clear_past_end();
        set
    }

    /// The tokens `ids` of `n` (ids past `n` are ignored).
    pub fn from_ids(n: usize, ids: &[u32]) -> AllowedSet {
        let mut set = AllowedSet::none(n);
        for &id in ids {
            set.set(id, true);
        }
        set
    }

    /// The set of `n` tokens whose bits are `words` (bits past `n` are cleared); `None` when
    /// `words` is not `n.div_ceil(32)` long.
    pub fn from_words(n: usize, words: Vec<u32>) -> Option<AllowedSet> {
        if words.len() != n.div_ceil(32) {
            return None;
        }
        let mut set = AllowedSet { words, n };
        set.clear_past_end();
        Some(set)
    }

    fn clear_past_end(&mut self) {
        if !self.n.is_multiple_of(32) {
            if let Some(last) = self.words.last_mut() {
                *last &= (1u32 << (self.n % 32)) - 1;
            }
        }
    }

    /// Tokens the set is over (allowed or not).
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    pub fn contains(&self, id: u32) -> bool {
        let i = id as usize;
        i < self.n && self.words[i / 32] & (1 << (i % 32)) != 0
    }

    pub fn set(&mut self, id: u32, allowed: bool) {
        let i = id as usize;
        if i >= self.n {
            return;
        }
        if allowed {
            self.words[i / 32] |= 1 << (i % 32);
        } else {
            self.words[i / 32] &= !(1 << (i % 32));
        }
    }

    /// How many tokens are allowed.
    pub fn count(&self) -> usize {
        self.words.iter().map(|w| w.count_ones() as usize).sum()
    }

    /// The allowed ids, in order.
    pub fn ids(&self) -> Vec<u32> {
        let mut ids = Vec::new();
        for (w, &word) in self.words.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                ids.push(w as u32 * 32 + bits.trailing_zeros());
                bits &= bits - 1;
            }
        }
        ids
    }

    /// The bits, `len().div_ceil(32)` words.
    pub fn words(&self) -> &[u32] {
        &self.words
    }

    /// `logits` with every token outside the set at `-inf` (the rows past the set too).
    pub fn mask(&self, logits: &[f32]) -> Vec<f32> {
        let mut masked = logits.to_vec();
        self.mask_in_place(&mut masked);
        masked
    }

    /// Sets every logit outside the set to `-inf`.
    pub fn mask_in_place(&self, logits: &mut [f32]) {
        for (w, chunk) in logits.chunks_mut(32).enumerate() {
            let word = self.words.get(w).copied().unwrap_or(0);
            if word == u32::MAX {
                continue;
            }
            for (b, logit) in chunk.iter_mut().enumerate() {
                if word & (1 << b) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
    }
}

/// A constraint in progress: the text consumed so far, and the set of tokens allowed next.
///
/// Clone it to fork (beam search keeps one per hypothesis).
#[derive(Clone)]
pub struct Constraint {
    vocab: Arc<ConstraintVocab>,
    matcher: Matcher,
    spec_kind: &'static str,
    /// Tokens that end generation (never consumed): allowed exactly when the output is complete.
    end_tokens: Vec<u32>,
    /// The allowed set for the next token, once computed.
    allowed: Option<Arc<AllowedSet>>,
    /// Tokens consumed.
    consumed: usize,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({}, {} tokens consumed)", self.spec_kind, self.consumed)
    }
}

impl Constraint {
    /// A constraint of `spec` over `vocab`. An invalid schema, regex or grammar is an
    /// [`Error::Constraint`] with llguidance's (or regex-syntax's) message, which names the
    /// problem and where.
    pub fn new(spec: &ConstraintSpec, vocab: Arc<ConstraintVocab>) -> Result<Constraint> {
        let grammar = spec.grammar()?;
        let compile = || vocab.factory.create_parser(grammar);
        let parser = crate::untrusted::on_own_stack(compile)?.map_err(|e| {
            Error::Constraint(format!("invalid {}: {}", spec.kind(), first_lines(&e.to_string())))
        })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(Error::Constraint(format!("invalid {}: {}", spec.kind(), first_lines(&e))));
        }
        Ok(Constraint {
            vocab,
            matcher,
            spec_kind: spec.kind(),
            end_tokens: Vec::new(),
            allowed: None,
            consumed: 0,
        })
    }

    /// The tokens that end generation (the model's end tokens, a chat template's end of turn):
    /// allowed exactly when the output is complete, and never consumed.
    pub fn with_end_tokens(mut self, ids: &[u32]) -> Constraint {
        self.end_tokens = ids.iter().copied().filter(|&id| (id as usize) < self.n()).collect();
        self.allowed = None;
        self
    }

    pub fn vocab(&self) -> &Arc<ConstraintVocab> {
        &self.vocab
    }

    fn n(&self) -> usize {
        self.vocab.n_vocab
    }

    /// "JSON schema", "regex", ...
    pub fn kind(&self) -> &'static str {
        self.spec_kind
    }

    /// Tokens consumed so far.
    pub fn consumed(&self) -> usize {
        self.consumed
    }

    pub fn is_end_token(&self, id: u32) -> bool {
        self.end_tokens.contains(&id)
    }

    /// The tokens allowed next, computed once per step (this is the per-step cost of a
    /// constraint). Empty when nothing may follow and the end tokens are not allowed either
    /// (see [`is_finished`](Constraint::is_finished)).
    pub fn allowed(&mut self) -> Result<Arc<AllowedSet>> {
        if let Some(set) = &self.allowed {
            return Ok(set.clone());
        }
        let n = self.n();
        let (mut set, complete) = if self.matcher.is_stopped() {
            (AllowedSet::none(n), self.accepting()?)
        } else {
            match self.matcher.compute_mask() {
                Ok(vob) => {
                    let complete = vob.is_allowed(n as u32);
                    let words = vob.as_slice()[..n.div_ceil(32)].to_vec();
                    let set = AllowedSet::from_words(n, words).expect("the mask covers n tokens");
                    (set, complete)
                }
                // Nothing can extend the text: llguidance stops the matcher. Complete or not
                // is what decides whether this is the end or a dead end.
                Err(_) if self.matcher.is_stopped() && !self.matcher.is_error() => {
                    (AllowedSet::none(n), self.accepting()?)
                }
                Err(e) => return Err(self.failure(&e.to_string())),
            }
        };
        for &id in &self.end_tokens {
            set.set(id, complete);
        }
        let set = Arc::new(set);
        self.allowed = Some(set.clone());
        Ok(set)
    }

    /// Whether the text so far is complete: it matches the schema, regex or grammar as it is.
    pub fn is_complete(&mut self) -> bool {
        self.accepting().unwrap_or(false)
    }

    fn accepting(&mut self) -> Result<bool> {
        if self.matcher.is_error() {
            return Err(self.failure(&self.matcher.get_error().unwrap_or_default()));
        }
        self.matcher.is_accepting().map_err(|e| self.failure(&e.to_string()))
    }

    /// Whether nothing more may follow: the text is complete and cannot be extended (a JSON
    /// object's closing brace, the end of a fixed-length pattern), or no token can extend it.
    /// Computes the next allowed set if it is not known yet.
    pub fn is_finished(&mut self) -> Result<bool> {
        let allowed = self.allowed()?;
        Ok(self.matcher.is_stopped()
            || allowed.count() == self.end_tokens.iter().filter(|&&e| allowed.contains(e)).count())
    }

    /// Take `id` as the next token of the output. An error when the constraint does not allow it
    /// (naming the token and how far the output had got), or when it is an end token.
    pub fn consume(&mut self, id: u32) -> Result<()> {
        if self.is_end_token(id) {
            return Err(Error::Constraint(format!(
                "token {id} ends the text; it is not part of the {}",
                self.spec_kind
            )));
        }
        let allowed = self.allowed()?;
        if !allowed.contains(id) {
            return Err(Error::Constraint(format!(
                "token {id} ({:?}) is not allowed by the {} after {} tokens of output",
                self.vocab.token_text(id),
                self.spec_kind,
                self.consumed
            )));
        }
        self.matcher.consume_token(id).map_err(|e| self.failure(&e.to_string()))?;
        self.consumed += 1;
        self.allowed = None;
        Ok(())
    }

    fn failure(&self, why: &str) -> Error {
        // llguidance's way of saying that no token can extend the output (and it is not complete).
        if why.contains("NoExtensionBias") {
            let what = if self.consumed == 0 { "start" } else { "continue" };
            return Error::Constraint(format!(
                "the {} admits no output: no text can {what} it{}",
                self.spec_kind,
                if self.consumed == 0 {
                    String::new()
                } else {
                    format!(" after {} tokens", self.consumed)
                }
            ));
        }
        Error::Constraint(format!(
            "the {} matcher failed after {} tokens: {}",
            self.spec_kind,
            self.consumed,
            first_lines(why)
        ))
    }
}

/// The message of an llguidance error: its first lines (its verbose form appends the parser
/// state and the whole grammar), without the `<non-verbose/>` marker of the short form.
fn first_lines(msg: &str) -> String {
    let lines: Vec<&str> = msg.lines().filter(|l| l.trim() != "<non-verbose/>").take(6).collect();
    let mut out = lines.join("\n");
    if msg.lines().filter(|l| l.trim() != "<non-verbose/>").count() > lines.len() {
        out.push_str("\n...");
    }
    out
}
