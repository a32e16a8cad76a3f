//! Chat: a conversation rendered into a prompt by the model's own chat template, and continued
//! turn after turn on one KV cache.
//!
//! A chat model is still a next-token predictor; what makes it chat is the text it was trained
//! on: turns wrapped in markers (`<|im_start|>user\n...<|im_end|>`), written by a Jinja template
//! that the GGUF carries (`tokenizer.chat_template`). [`ChatTemplate`] renders it with a real Jinja
//! engine (minijinja) configured as transformers configures Jinja2 (`trim_blocks`,
//! `lstrip_blocks`, Python string methods, `raise_exception`, `strftime_now`, a Python-style
//! `tojson`), so the prompt is byte for byte the one the model was trained on.
//!
//! Each turn re-renders the whole conversation, and the new prompt starts with the tokens the
//! state already holds (the previous prompt and reply). [`reuse_prefix`] keeps the keys and values
//! of the longest common prefix and [`Generation::resume`] prefills only the rest: a long
//! conversation costs one short prefill per turn instead of the whole history. [`Chat`] ties the
//! two together, and drops the oldest turns when asked to make a conversation fit the context.

use std::borrow::Borrow;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::generate::{GenerateOptions, Generation};
use crate::gguf::{Gguf, Value};
use crate::lm::{LanguageModel, Vocab};

/// One message of a conversation, as OpenAI's API and transformers' `apply_chat_template` take
/// them: `{"role": "user", "content": "Hello!"}`; an assistant's calls of tools
/// (`tool_calls`), and a tool's answer (`{"role": "tool", "tool_call_id", "name", "content"}`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// "system", "user", "assistant" or "tool" (templates may know others).
    pub role: String,
    /// OpenAI's `null` (an assistant message that only calls tools) is "".
    #[serde(default, deserialize_with = "null_as_empty")]
    pub content: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<crate::tools::ToolCall>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<String, D::Error> {
    Ok(Option::<String>::deserialize(d)?.unwrap_or_default())
}

impl Message {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
        }
    }
    pub fn system(content: impl Into<String>) -> Message {
        Message::new("system", content)
    }
    pub fn user(content: impl Into<String>) -> Message {
        Message::new("user", content)
    }
    pub fn assistant(content: impl Into<String>) -> Message {
        Message::new("assistant", content)
    }
}

/// Markers that end a turn in common chat formats (ChatML, Llama 3, Phi-3, Gemma, GPT-style end
/// of text). Each is a stop token when the vocabulary has it and the template writes it.
pub const END_OF_TURN_MARKERS: &[&str] = &[
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
];

/// A model's chat template, compiled, with the special tokens it refers to.
#[derive(Clone)]
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
    stop_tokens: Vec<u32>,
    /// The tools the template is given (`tools`), when a conversation offers some.
    tools: Option<Vec<serde_json::Value>>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("stop_tokens", &self.stop_tokens)
            .finish_non_exhaustive()
    }
}

const TEMPLATE_NAME: &str = "chat_template";

/// The budget of one rendering, in minijinja's fuel: one per instruction, plus one per 64 bytes
/// of text and data made. The real templates of ../shared/chat-templates (SmolLM2, Qwen2.5,
/// TinyLlama) spend 25-32 thousand to render 200 messages of 2 KB and 250-320 thousand for 2,000
/// (4 MB of text, far past any context); this ends a template that loops without end in well
/// under a second and one that doubles a string at some 128 MB of data.
pub const TEMPLATE_FUEL: u64 = 2_000_000;
const GGUF_TEMPLATE_KEY: &str = "tokenizer.chat_template";

impl ChatTemplate {
    /// Compile `source` (Jinja). `bos_token` and `eos_token` are the strings the template sees
    /// under those names (e.g. `<s>` and `</s>`). Stop tokens: none until
    /// [`with_stop_tokens`](ChatTemplate::with_stop_tokens). A syntax error is an
    /// [`Error::Template`] with minijinja's message and line.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<ChatTemplate> {
        let source = source.into();
        let mut env = minijinja::Environment::new();
        // transformers renders with Jinja2's ImmutableSandboxedEnvironment(trim_blocks=True,
        // lstrip_blocks=True) and keep_trailing_newline left off, as here.
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| template_err(&e))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // A template is a program from the file: its steps and the data it makes are budgeted
        // (minijinja's fuel counts both), so a loop without end or a string that doubles ends
        // in an error instead of minutes or gigabytes.
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned(TEMPLATE_NAME, source.clone()).map_err(|e| template_err(&e))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            stop_tokens: Vec::new(),
            tools: None,
        })
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), its BOS and EOS strings (from
    /// `tokenizer.ggml.tokens` at `tokenizer.ggml.bos_token_id` / `eos_token_id`), and its stop
    /// tokens: the EOS and EOT ids, and the [`END_OF_TURN_MARKERS`] that the token list has and
    /// the template writes. A file without a template is an error that says so.
    pub fn from_gguf(gguf: &Gguf) -> Result<ChatTemplate> {
        ChatTemplate::from_gguf_with_vocab(gguf, None)
    }

    /// Like [`from_gguf`](ChatTemplate::from_gguf), with `vocab` (the tokenizer the text will be
    /// encoded with) consulted for the token strings and markers the GGUF's token list lacks (a
    /// file without `tokenizer.ggml.tokens`, used with a `tokenizer.json`).
    pub fn from_gguf_with_vocab(gguf: &Gguf, vocab: Option<&dyn Vocab>) -> Result<ChatTemplate> {
        let source = match gguf.get(GGUF_TEMPLATE_KEY) {
            Some(Value::String(source)) => source,
            Some(other) => {
                let kind = match other {
                    Value::Array(items) => format!("a list of {} items", items.len()),
                    Value::Bool(_) => "a boolean".to_string(),
                    _ => "a number".to_string(),
                };
                return Err(Error::Template(format!(
                    "{GGUF_TEMPLATE_KEY} is {kind}, not a template (text)"
                )));
            }
            None => {
                return Err(Error::Template(format!(
                    "the model has no chat template (no {GGUF_TEMPLATE_KEY} in the GGUF \
                     metadata); use a chat/instruct model, or `generate` with a plain prompt"
                )))
            }
        };
        let tokens: Option<&[Value]> = match gguf.get("tokenizer.ggml.tokens") {
            Some(Value::Array(list)) => Some(list),
            _ => None,
        };
        let id_of = |key: &str| gguf.get(key).and_then(Value::as_u64).map(|v| v as u32);
        let text_of = |id: u32| -> Option<String> {
            match tokens {
                Some(list) => list.get(id as usize).and_then(Value::as_str).map(str::to_owned),
                None => vocab.map(|v| v.token_text(id)),
            }
        };
        let bos = id_of("tokenizer.ggml.bos_token_id").and_then(text_of).unwrap_or_default();
        let eos = id_of("tokenizer.ggml.eos_token_id").and_then(text_of).unwrap_or_default();

        let mut stop: Vec<u32> = ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"]
            .iter()
            .filter_map(|k| id_of(k))
            .collect();
        for marker in END_OF_TURN_MARKERS.iter().filter(|m| source.contains(*m)) {
            let id = match tokens {
                Some(list) => {
                    list.iter().position(|t| t.as_str() == Some(marker)).map(|i| i as u32)
                }
                None => vocab.and_then(|v| v.token_id(marker)),
            };
            stop.extend(id);
        }
        let mut template = ChatTemplate::new(source, bos, eos)?;
        template.add_stop_tokens(&stop);
        Ok(template)
    }

    /// Replace the stop tokens.
    pub fn with_stop_tokens(mut self, ids: &[u32]) -> ChatTemplate {
        self.stop_tokens.clear();
        self.add_stop_tokens(ids);
        self
    }

    fn add_stop_tokens(&mut self, ids: &[u32]) {
        for &id in ids {
            if !self.stop_tokens.contains(&id) {
                self.stop_tokens.push(id);
            }
        }
    }

    /// Ids that end the assistant's turn: pass them to [`GenerateOptions::stop_tokens`].
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    pub fn source(&self) -> &str {
        &self.source
    }

    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }

    /// This template offering `tools` (OpenAI's `[{type: "function", function: {name,
    /// description, parameters}}]`) to every conversation it renders. A template that takes no
    /// tools (it never mentions them) is an error: the model would never hear of them.
    pub fn with_tools(mut self, tools: Vec<serde_json::Value>) -> Result<ChatTemplate> {
        if tools.len() > crate::tools::MAX_TOOLS {
            return Err(Error::Template(format!(
                "{} tools; at most {}",
                tools.len(),
                crate::tools::MAX_TOOLS
            )));
        }
        for tool in &tools {
            crate::tools::tool_signature(tool)?;
        }
        if self.tool_format().is_none() {
            return Err(Error::Template(
                "this model's chat template takes no tools (it never mentions them): it cannot \
                 be offered any"
                    .into(),
            ));
        }
        self.tools = Some(tools);
        Ok(self)
    }

    /// How the model writes tool calls, as its template teaches it; `None` when it takes no
    /// tools.
    pub fn tool_format(&self) -> Option<crate::tools::ToolFormat> {
        crate::tools::ToolFormat::detect(&self.source)
    }

    /// The tools this template offers (see [`with_tools`](ChatTemplate::with_tools)).
    pub fn tools(&self) -> Option<&[serde_json::Value]> {
        self.tools.as_deref()
    }

    /// The prompt text of `messages`, with the opening of the assistant's turn after them when
    /// `add_generation_prompt`. The template sees what transformers' `apply_chat_template` passes:
    /// `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, the functions
    /// `raise_exception` and `strftime_now`, and `tools` when the template offers some
    /// ([`with_tools`](ChatTemplate::with_tools)); `documents` is left undefined. A template
    /// that fails (or calls `raise_exception`) is an [`Error::Template`] with the message and
    /// line.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        let template = self.env.get_template(TEMPLATE_NAME).map_err(|e| template_err(&e))?;
        let tools = match &self.tools {
            Some(tools) => minijinja::Value::from(minijinja::value::Serde(tools)),
            None => minijinja::Value::UNDEFINED,
        };
        let context = minijinja::context! {
            messages => minijinja::Value::from(minijinja::value::Serde(messages)),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            tools => tools,
        };
        crate::untrusted::on_own_stack(|| template.render(context))?.map_err(|e| template_err(&e))
    }

    /// The token ids of the rendered conversation: the text encoded with its special tokens
    /// recognised, after `bos` (the model's [`LanguageModel::bos_token`]: it is `Some` only when
    /// the model wants prompts to start with it, as llama.cpp does) unless the template already
    /// wrote it.
    pub fn prompt_ids(
        &self,
        vocab: &dyn Vocab,
        bos: Option<u32>,
        messages: &[Message],
    ) -> Result<Vec<u32>> {
        encode_prompt(vocab, bos, &self.render(messages, true)?)
    }
}

/// The ids of a rendered prompt (see [`ChatTemplate::prompt_ids`]).
fn encode_prompt(vocab: &dyn Vocab, bos: Option<u32>, text: &str) -> Result<Vec<u32>> {
    let ids = vocab.encode(text)?;
    Ok(match bos {
        Some(bos) if ids.first() != Some(&bos) => std::iter::once(bos).chain(ids).collect(),
        _ => ids,
    })
}

fn template_err(e: &minijinja::Error) -> Error {
    if e.kind() == minijinja::ErrorKind::OutOfFuel {
        return Error::Template(format!(
            "rendering stopped: the template used up its budget of {TEMPLATE_FUEL} steps (a step \
             also pays for 64 bytes of the text and data it makes); it loops or grows without end{}",
            e.line().map(|l| format!(" (line {l})")).unwrap_or_default()
        ));
    }
    let mut message = e.kind().to_string();
    if let Some(detail) = e.detail() {
        message = format!("{message}: {detail}");
    }
    if let Some(line) = e.line() {
        message = format!("{message} (line {line})");
    }
    Error::Template(message)
}

/// `raise_exception(message)`: templates call it to reject a conversation they cannot render
/// (e.g. roles that do not alternate).
fn raise_exception(message: String) -> std::result::Result<String, minijinja::Error> {
    Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
}

/// `tojson` as transformers defines it: Python's `json.dumps(value, ensure_ascii=False)` (", " and
/// ": " separators, non-ASCII kept), or with `indent` the same with newlines. (minijinja's own
/// `tojson` escapes `<`, `>`, `&` and `'` for HTML, which would change the prompt.)
fn tojson(
    state: &minijinja::State,
    value: minijinja::Value,
    indent: Option<usize>,
) -> std::result::Result<String, minijinja::Error> {
    // Paid for as it is written (minijinja charges for a filter's result only once it exists,
    // and a list doubled 40 times is a view of 2^40 items that costs nothing to make).
    let mut out = Fueled { state, bytes: Vec::new(), charged: 0, out_of_fuel: None };
    let result = match indent {
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            value.serialize(&mut ser)
        }
        Some(n) => {
            let pad = vec![b' '; n];
            let formatter = serde_json::ser::PrettyFormatter::with_indent(&pad);
            let mut ser = serde_json::Serializer::with_formatter(&mut out, formatter);
            value.serialize(&mut ser)
        }
    };
    if let Some(e) = out.out_of_fuel {
        return Err(e);
    }
    result.map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    String::from_utf8(out.bytes)
        .map_err(|e| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string()))
}

/// `tojson`'s output, charging the template's fuel as it grows, a step per 4 bytes (minijinja's
/// own serialising filters pay 16 times what plain data does: walking a value costs more than
/// copying bytes), failing the write once the fuel is out.
struct Fueled<'s, 'e> {
    state: &'s minijinja::State<'s, 'e>,
    bytes: Vec<u8>,
    /// Bytes paid for so far.
    charged: usize,
    out_of_fuel: Option<minijinja::Error>,
}

impl std::io::Write for Fueled<'_, '_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.bytes.extend_from_slice(buf);
        let unpaid = self.bytes.len() - self.charged;
        if unpaid >= 4096 {
            if let Err(e) = self.state.consume_fuel((unpaid / 4) as u64) {
                self.out_of_fuel = Some(e);
                return Err(std::io::Error::other("out of fuel"));
            }
            self.charged += unpaid / 4 * 4;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// serde_json's compact output with Python's default separators.
struct PythonFormatter;

/// Python's item separator, before every item but the first.
fn python_separator<W: ?Sized + std::io::Write>(w: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        w.write_all(b", ")
    }
}

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        python_separator(w, first)
    }
    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        python_separator(w, first)
    }
    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// `strftime_now(format)`: the current date and time (UTC) in a C `strftime` format; Llama 3's
/// templates write today's date with `strftime_now("%d %b %Y")`.
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    strftime(&format, unix_seconds_now())
}

#[cfg(not(target_arch = "wasm32"))]
fn unix_seconds_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

#[cfg(target_arch = "wasm32")]
fn unix_seconds_now() -> i64 {
    (js_sys::Date::now() / 1000.0) as i64
}

/// `format` at `secs` seconds after 1970-01-01 00:00:00 UTC (C `strftime` specifiers, through
/// chrono). An unknown specifier is an error, not a panic.
pub fn strftime(format: &str, secs: i64) -> std::result::Result<String, minijinja::Error> {
    use chrono::format::{Item, StrftimeItems};
    use std::fmt::Write;
    let fail = |why: String| minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, why);
    let items: Vec<Item> = StrftimeItems::new(format).collect();
    if items.iter().any(|i| matches!(i, Item::Error)) {
        return Err(fail(format!("strftime_now: unsupported format {format:?}")));
    }
    let when = chrono::DateTime::from_timestamp(secs, 0)
        .ok_or_else(|| fail(format!("strftime_now: {secs} s is out of range")))?;
    let mut out = String::new();
    write!(out, "{}", when.format_with_items(items.into_iter()))
        .map_err(|_| fail(format!("strftime_now: cannot format {format:?}")))?;
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// KV reuse between turns
// ---------------------------------------------------------------------------------------------

/// Length of the longest common prefix of `a` and `b`.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Make `state`, which holds the keys and values of `held`, ready to continue into `prompt`:
/// keep the longest prefix the two share (at most all of `prompt` but its last token, so the
/// prefill still has a token to run and gives the next token's logits) and forget the rest.
/// Returns how many tokens were kept: [`Generation::resume`] then prefills only
/// `prompt[kept..]`, and the logits are those of running all of `prompt` from an empty state.
pub fn reuse_prefix<M: LanguageModel>(
    model: &M,
    state: &mut M::State,
    held: &[u32],
    prompt: &[u32],
) -> Result<usize> {
    if model.position(state) != held.len() {
        return Err(Error::Input(format!(
            "the state holds {} tokens but {} ids were given for it",
            model.position(state),
            held.len()
        )));
    }
    let keep = common_prefix(held, prompt).min(prompt.len().saturating_sub(1));
    model.truncate(state, keep)?;
    Ok(keep)
}

/// What happens when a conversation does not fit the model's context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overflow {
    /// An error that says so.
    Error,
    /// Drop the oldest turns (a user message and the replies after it), keeping the system
    /// message and the last user message, until the prompt leaves `reply_room` tokens free.
    DropOldest { reply_room: usize },
}

impl Overflow {
    /// The front ends' rule: with `drop_oldest`, keep room for a whole reply of `max_tokens`,
    /// but never more than half the `context` (a conversation must keep some of its past).
    pub fn for_reply(drop_oldest: bool, max_tokens: usize, context: usize) -> Overflow {
        if drop_oldest {
            Overflow::DropOldest { reply_room: max_tokens.min(context / 2) }
        } else {
            Overflow::Error
        }
    }
}

/// What a turn's prompt cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TurnStats {
    /// Tokens of the rendered conversation.
    pub prompt_tokens: usize,
    /// Of those, tokens whose keys and values were kept from the previous turns.
    pub reused_tokens: usize,
    /// Messages dropped to fit the context ([`Overflow::DropOldest`]).
    pub dropped_messages: usize,
}

impl std::fmt::Display for TurnStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "reused {} of {} prompt tokens", self.reused_tokens, self.prompt_tokens)?;
        if self.dropped_messages > 0 {
            write!(f, " ({} oldest messages dropped to fit the context)", self.dropped_messages)?;
        }
        Ok(())
    }
}

/// The most bytes one token stands for in the vocabularies we load (runs of spaces in code
/// models' are the longest, well under this): a rendering longer than this many per token of
/// context cannot fit.
pub const MAX_TOKEN_BYTES: usize = 256;

/// The prompt ids of `messages` (see [`ChatTemplate::prompt_ids`]), fitted to a context of
/// `context` tokens: with [`Overflow::Error`] a prompt that leaves no room for a reply is an
/// error; with [`Overflow::DropOldest`] the oldest turns are removed from `messages` until it
/// fits. Returns the ids and how many messages were dropped.
pub fn fit_prompt(
    template: &ChatTemplate,
    vocab: &dyn Vocab,
    bos: Option<u32>,
    messages: &mut Vec<Message>,
    context: usize,
    overflow: Overflow,
) -> Result<(Vec<u32>, usize)> {
    let mut dropped = 0;
    let max_bytes = context.saturating_mul(MAX_TOKEN_BYTES);
    loop {
        // A rendering longer than the context can hold in any tokenisation is not tokenised (a
        // template can write megabytes; tokenising 10 MB took 8 s and 800 MB).
        let text = template.render(messages, true)?;
        let ids = match text.len() <= max_bytes {
            true => Some(encode_prompt(vocab, bos, &text)?),
            false => None,
        };
        let room = match overflow {
            Overflow::Error => 1,
            Overflow::DropOldest { reply_room } => reply_room.clamp(1, context.max(1)),
        };
        if let Some(ids) = ids.as_ref().filter(|ids| ids.len() + room <= context) {
            return Ok((ids.clone(), dropped));
        }
        let first = messages.iter().position(|m| m.role != "system");
        let last_user = messages.iter().rposition(|m| m.role == "user");
        let droppable = matches!(overflow, Overflow::DropOldest { .. })
            && matches!((first, last_user), (Some(f), Some(l)) if f < l);
        if !droppable {
            let advice = match overflow {
                Overflow::Error => "drop the oldest turns or start a new conversation",
                Overflow::DropOldest { .. } => {
                    "the system message and the last user message alone are too long"
                }
            };
            let size = match &ids {
                Some(ids) => format!("is {} tokens", ids.len()),
                None => format!(
                    "renders to {} bytes (more than {context} tokens of at most \
                     {MAX_TOKEN_BYTES} bytes can hold)",
                    text.len()
                ),
            };
            return Err(Error::Input(format!(
                "the conversation {size} and needs {room} more for the reply, but the model's \
                 context is {context} tokens: {advice}"
            )));
        }
        // Remove the oldest turn: the first non-system message and everything up to the next
        // user message (templates often insist that user and assistant alternate).
        let f = first.expect("droppable");
        let mut end = f + 1;
        while end < messages.len() && messages[end].role != "user" {
            end += 1;
        }
        dropped += end - f;
        messages.drain(f..end);
    }
}

/// A conversation on one model: its messages, and the model state (KV cache) with the ids it
/// holds, kept between turns so each prompt prefills only what is new.
///
/// Per turn: [`push`](Chat::push) the user's message, [`start_reply`](Chat::start_reply) (renders,
/// fits, reuses the cache; gives a [`Generation`] to step), then [`finish_reply`](Chat::finish_reply)
/// with that generation (stores the reply and takes the state back).
pub struct Chat<S> {
    pub template: ChatTemplate,
    pub messages: Vec<Message>,
    pub overflow: Overflow,
    /// The state and the ids it holds; `None` before the first turn (or after a failed one).
    cache: Option<(S, Vec<u32>)>,
}

impl<S> Chat<S> {
    /// A conversation that starts with `system` as its system message, if given.
    pub fn new(template: ChatTemplate, system: Option<&str>) -> Chat<S> {
        Chat {
            template,
            messages: system.map(Message::system).into_iter().collect(),
            overflow: Overflow::Error,
            cache: None,
        }
    }

    pub fn with_overflow(mut self, overflow: Overflow) -> Chat<S> {
        self.overflow = overflow;
        self
    }

    pub fn push(&mut self, message: Message) {
        self.messages.push(message);
    }

    /// Forget every message but the system message. The cache stays: the next prompt shares
    /// the system part with it, and only what differs is recomputed.
    pub fn clear(&mut self) {
        self.messages.retain(|m| m.role == "system");
    }

    /// The ids the kept state holds (empty before the first turn).
    pub fn cached_ids(&self) -> &[u32] {
        self.cache.as_ref().map_or(&[], |(_, ids)| ids)
    }

    /// Render the conversation (which should end with a user message), fit it to the model's
    /// context, keep the cached prefix it shares with the previous turns, and start the
    /// assistant's reply. `opts.stop_tokens` gets the template's stop tokens added.
    pub fn start_reply<'m, M: LanguageModel<State = S>>(
        &mut self,
        model: &'m M,
        vocab: &'m dyn Vocab,
        opts: GenerateOptions,
    ) -> Result<(Generation<'m, M>, TurnStats)> {
        self.start_reply_with_handles(model, vocab, opts)
    }

    /// Like [`start_reply`](Chat::start_reply), with the model and vocabulary held through `R`
    /// and `V` (e.g. `Rc<M>` and `Rc<dyn Vocab>`), as [`Generation::with_handles`].
    pub fn start_reply_with_handles<'m, M, R, V>(
        &mut self,
        model: R,
        vocab: V,
        mut opts: GenerateOptions,
    ) -> Result<(Generation<'m, M, R, V>, TurnStats)>
    where
        M: LanguageModel<State = S>,
        R: Borrow<M>,
        V: Borrow<dyn Vocab + 'm>,
    {
        let m: &M = model.borrow();
        let (ids, dropped) = fit_prompt(
            &self.template,
            vocab.borrow(),
            m.bos_token(),
            &mut self.messages,
            m.context_length(),
            self.overflow,
        )?;
        let (mut state, held) = self.cache.take().unwrap_or_else(|| (m.new_state(), Vec::new()));
        let reused = reuse_prefix(m, &mut state, &held, &ids)?;
        for &id in self.template.stop_tokens() {
            if !opts.stop_tokens.contains(&id) {
                opts.stop_tokens.push(id);
            }
        }
        let generation = Generation::resume_with_handles(model, vocab, state, &ids, opts)?;
        let stats = TurnStats {
            prompt_tokens: ids.len(),
            reused_tokens: reused,
            dropped_messages: dropped,
        };
        Ok((generation, stats))
    }

    /// End the turn begun by [`start_reply`](Chat::start_reply): the reply's text becomes an
    /// assistant message and the generation's state is kept for the next turn.
    pub fn finish_reply<'m, M, R, V>(&mut self, generation: Generation<'m, M, R, V>) -> String
    where
        M: LanguageModel<State = S>,
        R: Borrow<M>,
        V: Borrow<dyn Vocab + 'm>,
    {
        let text = generation.text().to_owned();
        let held = generation.held_ids().to_vec();
        self.cache = Some((generation.into_state(), held));
        self.messages.push(Message::assistant(text.clone()));
        text
    }
}
