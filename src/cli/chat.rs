//! `nexttoken chat`: a conversation through the model's own chat template, interactive or one
//! reply to `--messages`, with the KV cache of earlier turns reused.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use nexttoken::chat::{Chat, ChatTemplate, Message, Overflow};
use nexttoken::constraint::ConstraintSpec;
use nexttoken::tools::{offer, parse_reply, ForcedCall, ToolFormat};
use nexttoken::{Error, LanguageModel, Result, Vocab};

use super::generate::{check_complete, speculation_json, speculation_note, Lines, SamplingArgs};
use super::load::{read_text, ModelArgs};

#[derive(Args)]
pub(crate) struct ChatArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    /// System message the conversation starts with (when --messages has none).
    #[arg(long)]
    pub(crate) system: Option<String>,
    /// A conversation as JSON, OpenAI-style: [{"role": "user", "content": "..."}, ...]. Prints
    /// the assistant's next reply and exits.
    #[arg(long)]
    pub(crate) messages: Option<PathBuf>,
    /// When the conversation outgrows the context, drop the oldest turns (keeping the system
    /// message) instead of stopping with an error.
    #[arg(long)]
    pub(crate) drop_oldest: bool,
    /// Tools the model may call, OpenAI-style: a JSON file of [{"type": "function", "function":
    /// {"name", "description", "parameters": JSON schema}}, ...], given to the model's chat
    /// template. The reply's calls are read out of its text (--json: `tool_calls`).
    #[arg(long, value_name = "FILE")]
    pub(crate) tools: Option<PathBuf>,
    /// With --tools: "auto" (the model decides), "none" (no tools offered), "required" (the
    /// reply is a call of one of them) or a tool's name (a call of that one). Forced calls are
    /// generated under a grammar: their arguments always parse and match the tool's schema.
    #[arg(long, value_name = "CHOICE", default_value = "auto")]
    pub(crate) tool_choice: String,
    /// With a forced call: exactly one call (OpenAI's parallel_tool_calls: false), not one to 8.
    #[arg(long)]
    pub(crate) no_parallel_tool_calls: bool,
}

/// What `--tools` and `--tool-choice` ask of each reply: the calls' format, and the constraint
/// of a forced call.
struct ToolUse {
    format: ToolFormat,
    forced: Option<ConstraintSpec>,
}

impl ToolUse {
    /// The tools of `args` on `template` (which then offers them), or `None` without --tools or
    /// with --tool-choice none.
    fn from_args(args: &ChatArgs, template: &mut ChatTemplate) -> Result<Option<ToolUse>> {
        let Some(path) = &args.tools else {
            if args.tool_choice != "auto" {
                return Err(Error::Input("--tool-choice needs --tools".into()));
            }
            return Ok(None);
        };
        let tools: Vec<serde_json::Value> = serde_json::from_str(&read_text(path, "tools")?)
            .map_err(|e| {
                Error::Input(format!(
                    "{}: not a list of tools ([{{\"type\": \"function\", \"function\": {{...}}}}]): {e}",
                    path.display()
                ))
            })?;
        let forced = match args.tool_choice.as_str() {
            "none" => return Ok(None),
            "auto" => None,
            "required" => Some(ForcedCall::Any),
            name => Some(ForcedCall::Named(name.to_string())),
        };
        let parallel = !args.no_parallel_tool_calls;
        let (offered, format, forced) = offer(template.clone(), tools, forced.as_ref(), parallel)?;
        *template = offered;
        Ok(Some(ToolUse { format, forced }))
    }
}

/// `chat`, with `draft` the `--draft` model when there is one.
pub(crate) fn chat_with<M: LanguageModel>(
    model: &M,
    draft: Option<&M>,
    vocab: &dyn Vocab,
    args: &ChatArgs,
    mut template: ChatTemplate,
) -> Result<()> {
    let tools = ToolUse::from_args(args, &mut template)?;
    let tools = tools.as_ref();
    let overflow =
        Overflow::for_reply(args.drop_oldest, args.sampling.max_tokens, model.context_length());
    let mut chat: Chat<M::State> =
        Chat::new(template, args.system.as_deref()).with_overflow(overflow);
    let mut out = Lines::new(std::io::stdout().lock());

    if let Some(path) = &args.messages {
        let messages: Vec<Message> = serde_json::from_str(&read_text(path, "conversation")?)
            .map_err(|e| {
                Error::Input(format!(
                    "{}: not a conversation ([{{\"role\": ..., \"content\": ...}}, ...]): {e}",
                    path.display()
                ))
            })?;
        if messages.first().is_some_and(|m| m.role == "system") {
            chat.messages.clear();
        }
        chat.messages.extend(messages);
        let result = chat_turn(model, draft, vocab, &mut chat, args, tools, &mut out);
        return out.end_line_if_err(result);
    }

    let interactive = std::io::stdin().is_terminal();
    if interactive {
        eprintln!("chat: one message per line; /clear starts over; end with Ctrl-D");
    }
    let mut lines = std::io::stdin().lock().lines();
    loop {
        if interactive {
            eprint!("> ");
        }
        let Some(line) = lines.next() else { break };
        let line = line.map_err(|source| Error::Io { path: "stdin".into(), source })?;
        let text = line.trim_end_matches(['\r', '\n']);
        if text.trim().is_empty() {
            continue;
        }
        if text.trim() == "/clear" {
            chat.clear();
            eprintln!("(conversation cleared)");
            continue;
        }
        chat.push(Message::user(text));
        let result = chat_turn(model, draft, vocab, &mut chat, args, tools, &mut out);
        if let Err(e) = out.end_line_if_err(result) {
            // The message that could not be answered is not part of the conversation.
            chat.messages.pop();
            eprintln!("error: {e}");
        }
    }
    Ok(())
}

/// One assistant reply to `chat`, streamed to `out`; the reuse and speed go to stderr.
fn chat_turn<M: LanguageModel>(
    model: &M,
    draft: Option<&M>,
    vocab: &dyn Vocab,
    chat: &mut Chat<M::State>,
    args: &ChatArgs,
    tools: Option<&ToolUse>,
    out: &mut impl Write,
) -> Result<()> {
    let write_err = |e: std::io::Error| Error::Io { path: "stdout".into(), source: e };
    let mut opts = args.sampling.options()?;
    if let Some(ToolUse { forced: Some(forced), .. }) = tools {
        if opts.constraint.is_some() {
            return Err(Error::Input(
                "a forced tool call is its own constraint: drop --json-schema, --regex or --grammar"
                    .into(),
            ));
        }
        opts.constraint = Some(forced.clone());
    }
    let (mut generation, stats) = chat.start_reply(model, vocab, opts)?;
    if let Some(draft) = draft {
        generation = generation.with_draft_model(draft)?;
    }
    eprintln!("{stats}");
    while let Some(ev) = generation.step()? {
        if !args.model.json {
            write!(out, "{}", ev.text).map_err(write_err)?;
            out.flush().map_err(write_err)?;
        }
    }
    let s = generation.summary().expect("generation has stopped");
    let ids = generation.generated_ids().to_vec();
    let text = chat.finish_reply(generation);
    // The calls in the reply, kept in the conversation as calls (the next turn's template
    // renders them as such).
    let parsed = tools.map(|t| parse_reply(t.format, &text));
    let calls = parsed.as_ref().map_or(&[][..], |p| &p.tool_calls[..]);
    if let (Some(parsed), Some(last)) = (&parsed, chat.messages.last_mut()) {
        if !parsed.tool_calls.is_empty() {
            last.content = parsed.content.clone();
            last.tool_calls = parsed.tool_calls.clone();
        }
    }
    for call in calls {
        eprintln!("tool call {}: {}({})", call.id, call.function.name, call.function.arguments);
    }
    if args.model.json {
        // OpenAI's shapes: the arguments as a string of JSON, no content beside calls as null.
        let tool_calls: Vec<serde_json::Value> = calls
            .iter()
            .map(|c| {
                json!({"id": c.id, "type": "function",
                    "function": {"name": c.function.name, "arguments": c.function.arguments.to_string()}})
            })
            .collect();
        let content = match &parsed {
            Some(p) if !p.tool_calls.is_empty() => {
                if p.content.is_empty() {
                    serde_json::Value::Null
                } else {
                    p.content.clone().into()
                }
            }
            _ => text.clone().into(),
        };
        let mut line = json!({
            "role": "assistant",
            "content": content,
            "tool_calls": tool_calls,
            "text": text,
            "ids": ids,
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": s.reused_tokens,
            "generated_tokens": s.generated_tokens,
            "stop_reason": format!("{:?}", s.stop_reason),
            "speculation": speculation_json(&s),
        });
        if calls.is_empty() {
            line.as_object_mut().expect("an object").remove("tool_calls");
        }
        writeln!(out, "{line}").map_err(write_err)?;
    } else {
        writeln!(out).map_err(write_err)?;
    }
    eprintln!(
        "{} generated ({:?}); prefill {:.1} tok/s, decode {:.1} tok/s{}",
        s.generated_tokens,
        s.stop_reason,
        s.prefill_tokens_per_second(),
        s.decode_tokens_per_second(),
        speculation_note(&s),
    );
    check_complete(s.stop_reason, args.sampling.max_tokens)
}
