//! `nexttoken chat`: a conversation through the model's own chat template, interactive or one
//! reply to `--messages`, with the KV cache of earlier turns reused.

use std::io::{BufRead, IsTerminal, Write};
use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use nexttoken::chat::{Chat, ChatTemplate, Message, Overflow};
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
}

/// `chat`, with `draft` the `--draft` model when there is one.
pub(crate) fn chat_with<M: LanguageModel>(
    model: &M,
    draft: Option<&M>,
    vocab: &dyn Vocab,
    args: &ChatArgs,
    template: ChatTemplate,
) -> Result<()> {
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
        let result = chat_turn(model, draft, vocab, &mut chat, args, &mut out);
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
        let result = chat_turn(model, draft, vocab, &mut chat, args, &mut out);
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
    out: &mut impl Write,
) -> Result<()> {
    let write_err = |e: std::io::Error| Error::Io { path: "stdout".into(), source: e };
    let (mut generation, stats) = chat.start_reply(model, vocab, args.sampling.options()?)?;
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
    if args.model.json {
        let line = json!({
            "role": "assistant",
            "content": text,
            "ids": ids,
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": s.reused_tokens,
            "generated_tokens": s.generated_tokens,
            "stop_reason": format!("{:?}", s.stop_reason),
            "speculation": speculation_json(&s),
        });
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
