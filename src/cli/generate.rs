//! `nexttoken generate`: the prompt, then its continuation streamed token by token (or the
//! best beam), as text or `--json` lines; the sampling, stopping and structured-output options
//! `chat` shares.

use std::io::Write;
use std::path::PathBuf;

use clap::Args;
use serde_json::json;

use nexttoken::constraint::ConstraintSpec;
use nexttoken::generate::speculative::DEFAULT_MAX_DRAFT;
use nexttoken::generate::{
    self, prompt_ids, BeamOptions, DraftSource, GenerateOptions, Generation, GenerationSummary,
    SpeculationStats, SpeculativeOptions, StopReason, TokenEvent,
};
use nexttoken::sampling::{fresh_seed, SamplerConfig, FRONT_END_TEMPERATURE};
use nexttoken::{Error, LanguageModel, Result, Vocab};

use super::load::{file_name, read_text, ModelArgs};

#[derive(Args)]
pub(crate) struct GenerateArgs {
    #[command(flatten)]
    pub(crate) model: ModelArgs,
    #[arg(long, default_value = "")]
    pub(crate) prompt: String,
    #[command(flatten)]
    pub(crate) sampling: SamplingArgs,
    /// Beam search with this many beams (1 = off); the best beam is printed.
    #[arg(long, default_value_t = 1, allow_negative_numbers = true)]
    pub(crate) beams: usize,
    /// Divide a beam's log P by its length when ranking beams.
    #[arg(long)]
    pub(crate) length_normalise: bool,
}

/// The sampling and stopping options `generate` and `chat` share.
#[derive(Args)]
pub(crate) struct SamplingArgs {
    #[arg(long, default_value_t = GenerateOptions::default().max_tokens, allow_negative_numbers = true)]
    pub(crate) max_tokens: usize,
    /// Divides the logits before the draw: below 1 sharpens, above 1 flattens; 0 is greedy
    /// (always the most likely token). The default is the page's and the element's.
    #[arg(long, default_value_t = FRONT_END_TEMPERATURE, allow_negative_numbers = true)]
    pub(crate) temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = SamplerConfig::default().top_k, allow_negative_numbers = true)]
    pub(crate) top_k: usize,
    /// Keep the smallest set of tokens whose probabilities sum to P (1 = off).
    #[arg(long, default_value_t = SamplerConfig::default().top_p, allow_negative_numbers = true)]
    pub(crate) top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long, default_value_t = SamplerConfig::default().min_p, allow_negative_numbers = true)]
    pub(crate) min_p: f32,
    /// Penalise tokens seen in the last --repeat-window tokens (1 = off).
    #[arg(long, default_value_t = SamplerConfig::default().repeat_penalty, allow_negative_numbers = true)]
    pub(crate) repeat_penalty: f32,
    #[arg(long, default_value_t = SamplerConfig::default().repeat_window, allow_negative_numbers = true)]
    pub(crate) repeat_window: usize,
    /// Fixes the draws: the same seed and options give the same text. Default: a fresh seed each
    /// run (printed with the stats, so a run can be repeated).
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Stop when the text contains this string (repeatable; not with a constraint).
    #[arg(long = "stop")]
    pub(crate) stop: Vec<String>,
    #[command(flatten)]
    pub(crate) constraint: ConstraintArgs,
    /// Speculative decoding by prompt lookup: guess the next tokens from what followed the last
    /// few where they occurred before (in the prompt or the text so far) and verify the guesses
    /// in one forward pass. The output is what it would be without (token for token with the
    /// same seed); only the number of passes changes.
    #[arg(long)]
    pub(crate) lookup: bool,
    /// Speculative decoding with a draft model: a smaller GGUF with the same tokenizer guesses
    /// ahead and the model verifies its guesses in one pass (greedy: the same output; sampling:
    /// guesses judged by the rejection rule, so the output is distributed as the model's).
    #[arg(long, value_name = "FILE", conflicts_with = "lookup")]
    pub(crate) draft: Option<PathBuf>,
    /// Speculative decoding: the most guesses one pass verifies (adapted to how many are kept).
    #[arg(long, default_value_t = DEFAULT_MAX_DRAFT, allow_negative_numbers = true)]
    pub(crate) draft_max: usize,
}

/// Structured output: at most one of these. Only tokens that keep the output valid are sampled;
/// output that runs out of --max-tokens (or context) before it is complete is an error.
#[derive(Args, Clone)]
#[group(multiple = false)]
pub(crate) struct ConstraintArgs {
    /// The output is one JSON value valid against the JSON Schema in FILE.
    #[arg(long, value_name = "FILE")]
    pub(crate) json_schema: Option<PathBuf>,
    /// The output is a JSON object (any keys and values).
    #[arg(long)]
    pub(crate) json_object: bool,
    /// The whole output matches the regular expression RE (Rust regex syntax).
    #[arg(long, value_name = "RE")]
    pub(crate) regex: Option<String>,
    /// The output is a sentence of the Lark-style grammar in FILE (llguidance's dialect: rules,
    /// regex terminals, %import common, %json; generation starts at `start`).
    #[arg(long, value_name = "FILE")]
    pub(crate) grammar: Option<PathBuf>,
}

impl ConstraintArgs {
    pub(crate) fn spec(&self) -> Result<Option<ConstraintSpec>> {
        if let Some(path) = &self.json_schema {
            let text = read_text(path, "JSON schema")?;
            let schema = serde_json::from_str(&text).map_err(|e| {
                Error::Constraint(format!("invalid JSON schema: {}: not JSON: {e}", path.display()))
            })?;
            return Ok(Some(ConstraintSpec::JsonSchema { schema }));
        }
        if self.json_object {
            return Ok(Some(ConstraintSpec::JsonObject));
        }
        if let Some(pattern) = &self.regex {
            return Ok(Some(ConstraintSpec::Regex { pattern: pattern.clone() }));
        }
        if let Some(path) = &self.grammar {
            return Ok(Some(ConstraintSpec::Grammar { lark: read_text(path, "grammar")? }));
        }
        Ok(None)
    }
}

/// An error for constrained output that ran out of tokens or context before it was complete
/// (after it has been shown, so the user sees how far it got).
pub(crate) fn check_complete(stop: StopReason, max_tokens: usize) -> Result<()> {
    if stop == StopReason::Incomplete {
        return Err(Error::Constraint(format!(
            "the output does not match the constraint: --max-tokens {max_tokens} or the context \
             ran out before it was complete, so it is not valid output"
        )));
    }
    Ok(())
}

impl SamplingArgs {
    /// The options, checked (an error names the flag), so nothing is printed before an option
    /// is refused.
    pub(crate) fn options(&self) -> Result<GenerateOptions> {
        let opts = GenerateOptions {
            max_tokens: self.max_tokens,
            sampler: SamplerConfig {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repeat_penalty: self.repeat_penalty,
                repeat_window: self.repeat_window,
                seed: self.seed.unwrap_or_else(fresh_seed),
                ..SamplerConfig::default()
            },
            stop_strings: self.stop.clone(),
            constraint: self.constraint.spec()?,
            speculative: self.speculative()?,
            ..GenerateOptions::default()
        };
        opts.sampler.validate_as(|field| format!("--{}", field.replace('_', "-")))?;
        Ok(opts)
    }

    /// `--lookup` or `--draft`, with `--draft-max`.
    fn speculative(&self) -> Result<Option<SpeculativeOptions>> {
        let source = match (self.lookup, &self.draft) {
            (true, _) => DraftSource::lookup(),
            (false, Some(_)) => DraftSource::DraftModel,
            (false, None) => return Ok(None),
        };
        let spec = SpeculativeOptions { source, max_draft: self.draft_max };
        spec.validate().map_err(|e| Error::Input(format!("--draft-max: {e}")))?;
        Ok(Some(spec))
    }
}

/// A token's speculative decoding, for `--json`: the pass, the row, its guesses (as the JS API
/// gives them: id and text) and whether this row's guess was kept.
pub(crate) fn speculated_json(vocab: &dyn Vocab, ev: &TokenEvent) -> serde_json::Value {
    match &ev.speculated {
        None => serde_json::Value::Null,
        Some(s) => json!({
            "pass": s.pass,
            "row": s.row,
            "drafted": s.drafted.iter().map(|&id| json!({"id": id, "piece": vocab.decode(&[id])})).collect::<Vec<_>>(),
            "outcome": s.outcome.name(),
        }),
    }
}

/// What speculative decoding did, for `--json` summaries.
pub(crate) fn speculation_json(s: &GenerationSummary) -> serde_json::Value {
    match &s.speculation {
        None => serde_json::Value::Null,
        Some(st) => json!({
            "drafter": st.source,
            "passes": st.passes,
            "drafted": st.drafted,
            "accepted": st.accepted,
            "acceptance": st.acceptance_rate(),
            "decode_passes": st.decode_passes,
            "tokens_per_pass": st.tokens_per_pass(s.generated_tokens),
            "draft_ms": st.draft_ms,
        }),
    }
}

/// The decoding options of a run, for `--json` summaries.
fn options_json(s: &SamplingArgs) -> serde_json::Value {
    json!({
        "max_tokens": s.max_tokens,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repeat_penalty": s.repeat_penalty,
        "lookup": s.lookup,
        "draft": s.draft.as_ref().map(|p| file_name(p)),
    })
}

/// What speculative decoding did, for the stats line on stderr ("" when it was off).
pub(crate) fn speculation_note(s: &GenerationSummary) -> String {
    let Some(st): Option<&SpeculationStats> = s.speculation.as_ref() else {
        return String::new();
    };
    format!(
        "; speculative ({}): {:.2} tokens per pass, {} of {} guesses kept ({:.0}%)",
        st.source,
        st.tokens_per_pass(s.generated_tokens),
        st.accepted,
        st.drafted,
        100.0 * st.acceptance_rate()
    )
}

fn top_json(vocab: &dyn Vocab, top: &[(u32, f32)]) -> serde_json::Value {
    top.iter().map(|&(id, p)| json!({"id": id, "token": vocab.token_text(id), "prob": p})).collect()
}

/// Stdout that remembers whether its last line is unfinished (streamed text), so that an error
/// can end the line first instead of running into the text.
pub(crate) struct Lines<W: Write> {
    pub(crate) out: W,
    pub(crate) open: bool,
}

impl<W: Write> Lines<W> {
    pub(crate) fn new(out: W) -> Self {
        Lines { out, open: false }
    }

    /// `result`, after ending an unfinished line if it is an error.
    pub(crate) fn end_line_if_err<T>(&mut self, result: Result<T>) -> Result<T> {
        if result.is_err() && self.open {
            self.open = false;
            let _ = writeln!(self.out).and_then(|()| self.out.flush());
        }
        result
    }
}

impl<W: Write> Write for Lines<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.out.write(buf)?;
        if n > 0 {
            self.open = buf[n - 1] != b'\n';
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// `generate`, with `draft` the `--draft` model when there is one.
pub(crate) fn generate_with<M: LanguageModel>(
    model: &M,
    draft: Option<&M>,
    vocab: &dyn Vocab,
    args: &GenerateArgs,
) -> Result<()> {
    let mut out = Lines::new(std::io::stdout().lock());
    let result = generate_to(model, draft, vocab, args, &mut out);
    out.end_line_if_err(result)
}

fn generate_to<M: LanguageModel>(
    model: &M,
    draft: Option<&M>,
    vocab: &dyn Vocab,
    args: &GenerateArgs,
    out: &mut impl Write,
) -> Result<()> {
    let ids = prompt_ids(model.bos_token(), vocab, &args.prompt)?;
    let write_err = |e: std::io::Error| Error::Io { path: "stdout".into(), source: e };

    // 0 beams goes to the search too, which refuses it (it is not a quiet "1").
    if args.beams != 1 {
        let opts = BeamOptions {
            beams: args.beams,
            max_tokens: args.sampling.max_tokens,
            length_normalise: args.length_normalise,
        };
        let spec = args.sampling.constraint.spec()?;
        let constraint = spec.as_ref().map(|spec| (vocab, spec));
        let beams = generate::beam_search_constrained(model, &ids, opts, constraint)?;
        if args.model.json {
            let list: Vec<_> = beams
                .iter()
                .map(|b| json!({"ids": b.ids, "text": continuation(vocab, &ids, &b.ids), "logprob": b.logprob, "score": b.score, "finished": b.finished, "stop_reason": format!("{:?}", b.stop_reason)}))
                .collect();
            writeln!(out, "{}", json!({"prompt_tokens": ids.len(), "beams": list}))
                .map_err(write_err)?;
        } else {
            let best = beams
                .first()
                .ok_or_else(|| Error::Input("beam search found no continuation".into()))?;
            writeln!(out, "{}{}", args.prompt, continuation(vocab, &ids, &best.ids))
                .map_err(write_err)?;
            eprintln!("beam log P = {:.4}, P = {:.4}", best.logprob, best.logprob.exp());
        }
        if let Some(best) = beams.first() {
            check_complete(best.stop_reason, args.sampling.max_tokens)?;
        }
        return Ok(());
    }

    let opts = args.sampling.options()?;
    let seed = (!opts.sampler.is_greedy()).then_some(opts.sampler.seed);
    // Made (options and constraint checked) before the prompt is echoed: an error comes alone.
    let mut generation = Generation::new(model, vocab, &ids, opts)?;
    if let Some(draft) = draft {
        generation = generation.with_draft_model(draft)?;
    }
    if !args.model.json {
        write!(out, "{}", args.prompt).map_err(write_err)?;
        out.flush().map_err(write_err)?;
    }
    while let Some(ev) = generation.step()? {
        if args.model.json {
            let mut line = json!({"id": ev.id, "token": vocab.token_text(ev.id), "text": ev.text, "prob": ev.prob, "logprob": ev.logprob, "top": top_json(vocab, &ev.top)});
            if generation.is_constrained() {
                line["removed"] = top_json(vocab, &ev.removed);
            }
            if ev.speculated.is_some() {
                line["speculated"] = speculated_json(vocab, &ev);
            }
            writeln!(out, "{line}").map_err(write_err)?;
        } else {
            write!(out, "{}", ev.text).map_err(write_err)?;
        }
        out.flush().map_err(write_err)?;
    }
    let s = generation.summary().expect("generation has stopped");
    if args.model.json {
        let summary = json!({
            "prompt_tokens": s.prompt_tokens,
            "generated_tokens": s.generated_tokens,
            "prefill_tok_s": s.prefill_tokens_per_second(),
            "decode_tok_s": s.decode_tokens_per_second(),
            "ttft_ms": s.ttft_ms,
            "stop_reason": format!("{:?}", s.stop_reason),
            "seed": seed,
            "speculation": speculation_json(&s),
            "text": s.text,
            // What a recording needs to say what it is (<next-token replay> plays these lines).
            "prompt": args.prompt,
            "model": args.model.describe(),
            "options": options_json(&args.sampling),
        });
        writeln!(out, "{summary}").map_err(write_err)?;
    } else {
        writeln!(out).map_err(write_err)?;
        let seed = seed.map(|seed| format!("; seed {seed}")).unwrap_or_default();
        eprintln!(
            "{} prompt tokens, {} generated; prefill {:.1} tok/s, decode {:.1} tok/s{seed}{}{}",
            s.prompt_tokens,
            s.generated_tokens,
            s.prefill_tokens_per_second(),
            s.decode_tokens_per_second(),
            speculation_note(&s),
            constrained_note(&generation, &s),
        );
        if !generation.is_constrained() {
            eprintln!("stopped: {}", s.stop_reason.describe());
        }
    }
    check_complete(s.stop_reason, args.sampling.max_tokens)
}

/// The constraint's share of the time and why generation stopped, for stderr.
fn constrained_note<M: LanguageModel>(generation: &Generation<M>, s: &GenerationSummary) -> String {
    if !generation.is_constrained() {
        return String::new();
    }
    let (ms, steps) = generation.constraint_time();
    format!(
        "; constraint: built in {:.1} ms, then {:.2} ms per token; stop: {:?} ({})",
        generation.constraint_build_ms(),
        ms / steps.max(1) as f64,
        s.stop_reason,
        s.stop_reason.describe()
    )
}

/// Text the generated ids add after the prompt (decoded together so joins come out right).
pub(crate) fn continuation(vocab: &dyn Vocab, prompt: &[u32], generated: &[u32]) -> String {
    let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    let full = vocab.decode(&all);
    let head = vocab.decode(prompt);
    full.strip_prefix(&head).map(str::to_owned).unwrap_or_else(|| vocab.decode(generated))
}
