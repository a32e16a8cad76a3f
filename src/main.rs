//! The `nexttoken` command line: generate, score and inspect models natively.

use std::io::{BufRead, IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

mod cli;

use clap::{Args, Parser, Subcommand};
use serde_json::json;

use cli::{bench, synth};
use nexttoken::backend::{self, BackendChoice, BackendRequest};
use nexttoken::chat::{Chat, ChatTemplate, Message, Overflow};
use nexttoken::constraint::ConstraintSpec;
use nexttoken::cpu::{kernels::Isa, CpuModel, Precision};
use nexttoken::generate::{
    self, prompt_ids, BeamOptions, GenerateOptions, Generation, GenerationSummary, StopReason,
};
use nexttoken::gguf::Gguf;
use nexttoken::gpu::GpuModel;
use nexttoken::model::{Model, Storage};
use nexttoken::sampling::SamplerConfig;
use nexttoken::table::TableModel;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{Error, LanguageModel, Result, Vocab};

#[derive(Parser)]
#[command(name = "nexttoken", version, about = "Autoregressive text generation with GGUF models")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print the prompt, then stream its continuation token by token.
    Generate(GenerateArgs),
    /// Chat with an instruct model through its own chat template (tokenizer.chat_template in the
    /// GGUF): interactive (one user message per stdin line, `/clear` starts over, EOF quits; the
    /// KV cache is reused between turns), or one reply to --messages.
    Chat(ChatArgs),
    /// Score a text with the chain rule: each token's probability, log P and perplexity.
    Score(ScoreArgs),
    /// Describe a model file: architecture, shapes, parameters, tensor types and bytes.
    Info {
        /// Default: the embedded model.
        #[arg(long)]
        model: Option<PathBuf>,
    },
    /// Write a GGUF with random weights of a real model's shapes (from its Hugging Face
    /// config.json), loadable by nexttoken and llama.cpp, for benchmarks.
    Synth {
        /// Hugging Face config.json (llama, qwen2 or gpt2).
        #[arg(long)]
        config: PathBuf,
        /// Weight type of the matrices: q8_0, q4_0, q5_0, q5_1, f16 or f32.
        #[arg(long = "type", default_value = "q8_0")]
        ty: String,
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Copy the tokenizer (every tokenizer.* key) from this GGUF, e.g. a llama.cpp
        /// ggml-vocab-*.gguf, instead of writing a placeholder vocabulary; its token count
        /// becomes the vocabulary size. The file then needs no tokenizer.json.
        #[arg(long)]
        vocab_from: Option<PathBuf>,
        /// Write this file's text as the model's chat template (`tokenizer.chat_template`).
        #[arg(long)]
        chat_template: Option<PathBuf>,
        /// Write the model in N parts as llama.cpp's gguf-split does: OUT-00001-of-0000N.gguf, ...
        /// (OUT without its .gguf), loaded by giving the first part as --model.
        #[arg(long, default_value_t = 1)]
        split: usize,
    },
    /// Measure load time, prefill and decode speed, bandwidth and peak memory.
    Bench(bench::BenchOptions),
}

#[derive(Args)]
struct ModelArgs {
    /// A GGUF file, or a table model (.json). Default: the embedded model (www/models/default.gguf).
    #[arg(long)]
    model: Option<PathBuf>,
    /// tokenizer.json (default: tokenizer.json beside the model, else the tokenizer the GGUF's
    /// own metadata describes). Table models need none.
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Where the forward pass runs: gpu (wgpu: Vulkan/Metal/DX12), cpu, or auto (the faster of
    /// the two for this model, measured at load after the GPU's check against the CPU; never a
    /// software adapter such as lavapipe).
    #[arg(long, default_value = "auto", value_parser = ["auto", "cpu", "gpu"])]
    backend: String,
    /// Longest sequence (prompt + generated) to allocate the KV cache for; capped by the model's
    /// own context. Real models advertise contexts of 32k-128k tokens that a demo never needs.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
    /// CPU backend: use the exact reference path (f32 activations, one thread) instead of the fast
    /// one (Q8 activations for quantised weights, SIMD, threads).
    #[arg(long)]
    exact: bool,
    /// CPU backend: threads (0 = every core).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// CPU backend, fast path: the kernels' instruction set (scalar, avx2, avx512vnni, neon; default: the best
    /// this machine has). `--isa scalar` computes what the wasm build does, up to summation order.
    #[arg(long)]
    isa: Option<String>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value = "")]
    prompt: String,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Beam search with this many beams (1 = off); the best beam is printed.
    #[arg(long, default_value_t = 1)]
    beams: usize,
    /// Divide a beam's log P by its length when ranking beams.
    #[arg(long)]
    length_normalise: bool,
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// System message the conversation starts with (when --messages has none).
    #[arg(long)]
    system: Option<String>,
    /// A conversation as JSON, OpenAI-style: [{"role": "user", "content": "..."}, ...]. Prints
    /// the assistant's next reply and exits.
    #[arg(long)]
    messages: Option<PathBuf>,
    /// When the conversation outgrows the context, drop the oldest turns (keeping the system
    /// message) instead of stopping with an error.
    #[arg(long)]
    drop_oldest: bool,
}

/// The sampling and stopping options `generate` and `chat` share.
#[derive(Args)]
struct SamplingArgs {
    #[arg(long, default_value_t = GenerateOptions::default().max_tokens)]
    max_tokens: usize,
    /// 0 means greedy (always the most likely token).
    #[arg(long, default_value_t = SamplerConfig::default().temperature)]
    temperature: f32,
    /// Keep only the K most likely tokens (0 = off).
    #[arg(long, default_value_t = SamplerConfig::default().top_k)]
    top_k: usize,
    /// Keep the smallest set of tokens whose probabilities sum to P (1 = off).
    #[arg(long, default_value_t = SamplerConfig::default().top_p)]
    top_p: f32,
    /// Drop tokens less likely than P times the most likely one (0 = off).
    #[arg(long, default_value_t = SamplerConfig::default().min_p)]
    min_p: f32,
    /// Penalise tokens seen in the last --repeat-window tokens (1 = off).
    #[arg(long, default_value_t = SamplerConfig::default().repeat_penalty)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = SamplerConfig::default().repeat_window)]
    repeat_window: usize,
    #[arg(long, default_value_t = SamplerConfig::default().seed)]
    seed: u64,
    /// Stop when the text contains this string (repeatable; not with a constraint).
    #[arg(long = "stop")]
    stop: Vec<String>,
    #[command(flatten)]
    constraint: ConstraintArgs,
}

/// Structured output: at most one of these. Only tokens that keep the output valid are sampled;
/// output that runs out of --max-tokens (or context) before it is complete is an error.
#[derive(Args, Clone)]
#[group(multiple = false)]
struct ConstraintArgs {
    /// The output is one JSON value valid against the JSON Schema in FILE.
    #[arg(long, value_name = "FILE")]
    json_schema: Option<PathBuf>,
    /// The output is a JSON object (any keys and values).
    #[arg(long)]
    json_object: bool,
    /// The whole output matches the regular expression RE (Rust regex syntax).
    #[arg(long, value_name = "RE")]
    regex: Option<String>,
    /// The output is a sentence of the Lark-style grammar in FILE (llguidance's dialect: rules,
    /// regex terminals, %import common, %json; generation starts at `start`).
    #[arg(long, value_name = "FILE")]
    grammar: Option<PathBuf>,
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
fn check_complete(stop: StopReason, max_tokens: usize) -> Result<()> {
    if stop == StopReason::Incomplete {
        return Err(Error::Constraint(format!(
            "the output does not match the constraint: --max-tokens {max_tokens} or the context \
             ran out before it was complete, so it is not valid output"
        )));
    }
    Ok(())
}

impl SamplingArgs {
    fn options(&self) -> Result<GenerateOptions> {
        Ok(GenerateOptions {
            max_tokens: self.max_tokens,
            sampler: SamplerConfig {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repeat_penalty: self.repeat_penalty,
                repeat_window: self.repeat_window,
                seed: self.seed,
                ..SamplerConfig::default()
            },
            stop_strings: self.stop.clone(),
            constraint: self.constraint.spec()?,
            ..GenerateOptions::default()
        })
    }
}

#[derive(Args)]
struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long)]
    text: String,
}

fn main() -> ExitCode {
    quiet_device_select();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => with_model(&args.model, |m, v, _| run_generate(m, v, &args)),
        Command::Chat(args) => {
            with_model(&args.model, |m, v, header| m.chat(v, &args, load_chat_template(header, v)?))
        }
        Command::Score(args) => with_model(&args.model, |m, v, _| run_score(m, v, &args)),
        Command::Info { model } => run_info(model.as_deref()),
        Command::Synth { config, ty, out, seed, vocab_from, chat_template, split } => chat_template
            .map(|path| read_text(&path, "chat template"))
            .transpose()
            .and_then(|template| {
                synth::run(&config, &ty, &out, seed, vocab_from.as_deref(), template, split)
            }),
        Command::Bench(options) => bench::run(&options),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Mesa's Vulkan device-select layer asks the Wayland compositor which GPU drives the display,
/// and without a session (`XDG_RUNTIME_DIR` unset: ssh, CI, containers) libwayland prints
/// `error: XDG_RUNTIME_DIR is invalid or not set` at every adapter enumeration, though nothing
/// failed. With no session there is no display to ask, so the layer is switched off
/// (`NODEVICE_SELECT=1`, its own switch) unless the user set that already; wgpu ranks the
/// adapters itself either way. Done first thing, while no other thread reads the environment.
fn quiet_device_select() {
    let has_session =
        std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| d.to_string_lossy().starts_with('/'));
    if !has_session && std::env::var_os("NODEVICE_SELECT").is_none() {
        std::env::set_var("NODEVICE_SELECT", "1");
    }
}

/// Load the model named by `args` on the chosen backend and hand it to `f`, with its tokenizer
/// and its GGUF header (the metadata: `None` for a table model).
fn with_model(
    args: &ModelArgs,
    f: impl FnOnce(&dyn DynModel, &dyn Vocab, Option<&Gguf>) -> Result<()>,
) -> Result<()> {
    if args.context == 0 {
        return Err(Error::Input("--context 0: the context must hold at least one token".into()));
    }
    let model = match &args.model {
        None => default_model()?,
        Some(path) if path.extension().is_some_and(|e| e == "json") => {
            let table = TableModel::from_json(&read_text(path, "table model")?)?;
            return f(&table, &table, None);
        }
        Some(path) => Model::open(path)?,
    };
    // The metadata the tokenizer and the chat template read (`Model` keeps only what the forward
    // pass needs), from the bytes the model already holds.
    let header = Gguf::parse(&model.storage)?;
    let tokenizer = load_tokenizer(args, &header)?;
    tokenizer.check_fits(model.config.n_vocab)?;
    let header = Some(&header);
    let request = args.backend.parse::<BackendRequest>()?;
    let choice = backend::choose_native(request)?;
    let cpu_model = |model: Model| -> Result<CpuModel> {
        let cpu = if args.exact {
            CpuModel::new(model)
        } else {
            let threads = cpu_threads(args.threads)?;
            let fast = CpuModel::new(model).with_precision(Precision::Fast).with_threads(threads);
            match &args.isa {
                None => fast,
                Some(name) => fast.with_isa(Isa::by_name(name)?),
            }
        };
        Ok(cpu.with_max_seq(args.context))
    };
    let context = match choice {
        BackendChoice::Gpu { context, reason } if request == BackendRequest::Gpu => {
            eprintln!("backend: {reason}");
            let gpu = nexttoken::lm::block_on(GpuModel::with_context(context, model))?;
            return f(&gpu.with_max_seq(args.context), &tokenizer, header);
        }
        BackendChoice::Gpu { context, .. } => context,
        BackendChoice::Cpu { reason } => {
            eprintln!("backend: {reason}");
            return f(&cpu_model(model)?, &tokenizer, header);
        }
    };
    // auto on a real GPU: the GPU checked against the CPU oracle, then both timed on this model.
    let cpu = cpu_model(model.share())?;
    let gpu =
        nexttoken::lm::block_on(GpuModel::with_context(context, model))?.with_max_seq(args.context);
    let verdict = nexttoken::lm::block_on(backend::verdict(&gpu, || {
        Ok((backend::cpu_decode_ms(&cpu)?, false))
    }));
    match verdict {
        Ok(v) if v.gpu => {
            eprintln!("backend: gpu, {} ({})", gpu.context().describe(), v.reason);
            f(&gpu, &tokenizer, header)
        }
        Ok(v) => {
            eprintln!("backend: cpu ({})", v.reason);
            drop(gpu);
            f(&cpu, &tokenizer, header)
        }
        Err(e) => {
            eprintln!("backend: cpu ({e})");
            drop(gpu);
            f(&cpu, &tokenizer, header)
        }
    }
}

/// The most `--threads`: more than any CPU has cores (the largest have a few hundred hardware
/// threads), and far below what the OS allows, so a typo (`--threads 100000`) is an error
/// rather than a pool of 100000 threads.
const MAX_THREADS: usize = 1024;

/// The CPU threads `--threads` asks for: 0 is every core; above [`MAX_THREADS`] is an error;
/// more than the machine has is every core, with a note (threads beyond the cores only take
/// turns: `--threads 1024` on 2 cores decoded 10,000 times slower).
fn cpu_threads(threads: usize) -> Result<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    if threads == 0 {
        return Ok(cores);
    }
    if threads > MAX_THREADS {
        return Err(Error::Input(format!(
            "--threads {threads}: at most {MAX_THREADS} (0 uses every core)"
        )));
    }
    if threads > cores {
        eprintln!("note: --threads {threads}: this machine has {cores} cores; using {cores}");
        return Ok(cores);
    }
    Ok(threads)
}

/// The tokenizer of the model `args` names, whose GGUF header is `header`: `--tokenizer` if
/// given, else (a file) `<stem>-tokenizer.json` or `tokenizer.json` beside the model (as
/// www/models/ has `default.gguf` and `default-tokenizer.json`) or (the embedded model) its own
/// tokenizer.json, else the one the GGUF's metadata describes.
fn load_tokenizer(args: &ModelArgs, header: &Gguf) -> Result<HfTokenizer> {
    if let Some(file) = &args.tokenizer {
        return HfTokenizer::from_file(file);
    }
    let Some(path) = &args.model else {
        return HfTokenizer::from_bytes(DEFAULT_TOKENIZER);
    };
    let stem = path.file_stem().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    let candidates = [
        path.with_file_name(format!("{stem}-tokenizer.json")),
        path.with_file_name("tokenizer.json"),
    ];
    if let Some(beside) = candidates.iter().find(|p| p.exists()) {
        return HfTokenizer::from_file(beside);
    }
    HfTokenizer::from_gguf(header).map_err(|e| {
        let why = match e {
            Error::Tokenizer(m) => m,
            other => other.to_string(),
        };
        Error::Tokenizer(format!(
            "no tokenizer: neither {} nor {} exists, and the model's own is unusable: {why} (pass --tokenizer PATH)",
            candidates[0].display(),
            candidates[1].display()
        ))
    })
}

/// The chat template in the GGUF header `header` (`None`: a table model, which has none), with
/// `vocab` for the token strings the file lacks.
fn load_chat_template(header: Option<&Gguf>, vocab: &dyn Vocab) -> Result<ChatTemplate> {
    match header {
        Some(header) => ChatTemplate::from_gguf_with_vocab(header, Some(vocab)),
        None => Err(Error::Template("table models have no chat template; use generate".into())),
    }
}

/// The project's own model (see www/models/README.md), compiled in so the CLI works with no
/// files and no network.
const DEFAULT_GGUF: &[u8] = include_bytes!("../www/models/default.gguf");
const DEFAULT_TOKENIZER: &[u8] = include_bytes!("../www/models/default-tokenizer.json");

fn default_model() -> Result<Model> {
    eprintln!("model: embedded default (www/models/default.gguf, KJV Bible, 2M parameters)");
    Model::from_storage(Storage::Static(DEFAULT_GGUF))
}

/// Object-safe view of a `LanguageModel` so the CLI can hold either kind behind one reference;
/// each command is generic and is instantiated per concrete model in `DynModel` impls.
trait DynModel {
    fn generate(&self, vocab: &dyn Vocab, args: &GenerateArgs) -> Result<()>;
    fn score(&self, vocab: &dyn Vocab, args: &ScoreArgs) -> Result<()>;
    fn chat(&self, vocab: &dyn Vocab, args: &ChatArgs, template: ChatTemplate) -> Result<()>;
}

impl<M: LanguageModel> DynModel for M {
    fn generate(&self, vocab: &dyn Vocab, args: &GenerateArgs) -> Result<()> {
        generate_with(self, vocab, args)
    }
    fn score(&self, vocab: &dyn Vocab, args: &ScoreArgs) -> Result<()> {
        score_with(self, vocab, args)
    }
    fn chat(&self, vocab: &dyn Vocab, args: &ChatArgs, template: ChatTemplate) -> Result<()> {
        chat_with(self, vocab, args, template)
    }
}

fn run_generate(model: &dyn DynModel, vocab: &dyn Vocab, args: &GenerateArgs) -> Result<()> {
    model.generate(vocab, args)
}

fn run_score(model: &dyn DynModel, vocab: &dyn Vocab, args: &ScoreArgs) -> Result<()> {
    model.score(vocab, args)
}

fn top_json(vocab: &dyn Vocab, top: &[(u32, f32)]) -> serde_json::Value {
    top.iter().map(|&(id, p)| json!({"id": id, "token": vocab.token_text(id), "prob": p})).collect()
}

/// Stdout that remembers whether its last line is unfinished (streamed text), so that an error
/// can end the line first instead of running into the text.
struct Lines<W: Write> {
    out: W,
    open: bool,
}

impl<W: Write> Lines<W> {
    fn new(out: W) -> Self {
        Lines { out, open: false }
    }

    /// `result`, after ending an unfinished line if it is an error.
    fn end_line_if_err<T>(&mut self, result: Result<T>) -> Result<T> {
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

fn generate_with<M: LanguageModel>(
    model: &M,
    vocab: &dyn Vocab,
    args: &GenerateArgs,
) -> Result<()> {
    let mut out = Lines::new(std::io::stdout().lock());
    let result = generate_to(model, vocab, args, &mut out);
    out.end_line_if_err(result)
}

fn generate_to<M: LanguageModel>(
    model: &M,
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
    if !args.model.json {
        write!(out, "{}", args.prompt).map_err(write_err)?;
        out.flush().map_err(write_err)?;
    }
    let mut generation = Generation::new(model, vocab, &ids, opts)?;
    while let Some(ev) = generation.step()? {
        if args.model.json {
            let mut line = json!({"id": ev.id, "text": ev.text, "prob": ev.prob, "logprob": ev.logprob, "top": top_json(vocab, &ev.top)});
            if generation.is_constrained() {
                line["removed"] = top_json(vocab, &ev.removed);
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
            "text": s.text,
        });
        writeln!(out, "{summary}").map_err(write_err)?;
    } else {
        writeln!(out).map_err(write_err)?;
        eprintln!(
            "{} prompt tokens, {} generated; prefill {:.1} tok/s, decode {:.1} tok/s{}",
            s.prompt_tokens,
            s.generated_tokens,
            s.prefill_tokens_per_second(),
            s.decode_tokens_per_second(),
            constrained_note(&generation, &s),
        );
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

fn chat_with<M: LanguageModel>(
    model: &M,
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
        let result = chat_turn(model, vocab, &mut chat, args, &mut out);
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
        let result = chat_turn(model, vocab, &mut chat, args, &mut out);
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
    vocab: &dyn Vocab,
    chat: &mut Chat<M::State>,
    args: &ChatArgs,
    out: &mut impl Write,
) -> Result<()> {
    let write_err = |e: std::io::Error| Error::Io { path: "stdout".into(), source: e };
    let (mut generation, stats) = chat.start_reply(model, vocab, args.sampling.options()?)?;
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
        });
        writeln!(out, "{line}").map_err(write_err)?;
    } else {
        writeln!(out).map_err(write_err)?;
    }
    eprintln!(
        "{} generated ({:?}); prefill {:.1} tok/s, decode {:.1} tok/s",
        s.generated_tokens,
        s.stop_reason,
        s.prefill_tokens_per_second(),
        s.decode_tokens_per_second(),
    );
    check_complete(s.stop_reason, args.sampling.max_tokens)
}

/// Text the generated ids add after the prompt (decoded together so joins come out right).
fn continuation(vocab: &dyn Vocab, prompt: &[u32], generated: &[u32]) -> String {
    let all: Vec<u32> = prompt.iter().chain(generated).copied().collect();
    let full = vocab.decode(&all);
    let head = vocab.decode(prompt);
    full.strip_prefix(&head).map(str::to_owned).unwrap_or_else(|| vocab.decode(generated))
}

fn score_with<M: LanguageModel>(model: &M, vocab: &dyn Vocab, args: &ScoreArgs) -> Result<()> {
    let ids = prompt_ids(model.bos_token(), vocab, &args.text)?;
    let score = generate::score(model, &ids)?;
    let tokens: Vec<_> = ids[1..]
        .iter()
        .zip(&score.token_logprobs)
        .map(|(&id, &lp)| (id, vocab.token_text(id), lp))
        .collect();
    if args.model.json {
        let list: Vec<_> = tokens
            .iter()
            .map(|(id, text, lp)| json!({"id": id, "token": text, "prob": lp.exp(), "logprob": lp}))
            .collect();
        println!(
            "{}",
            json!({"tokens": list, "logprob": score.total_logprob, "avg_nll": score.avg_nll, "perplexity": score.perplexity})
        );
    } else {
        for (id, text, lp) in &tokens {
            println!("{id:>7} {text:<20} p = {:.6}  log p = {lp:.4}", lp.exp());
        }
        println!("logprob {:.4}", score.total_logprob);
        println!("avg_nll {:.4}", score.avg_nll);
        println!("perplexity {:.4}", score.perplexity);
    }
    Ok(())
}

fn run_info(path: Option<&Path>) -> Result<()> {
    let model = match path {
        None => default_model()?,
        Some(path) if path.extension().is_some_and(|e| e == "json") => {
            let table = TableModel::from_json(&read_text(path, "table model")?)?;
            println!("table model: vocabulary of {} words", table.vocab_size());
            return Ok(());
        }
        Some(path) => Model::open(path)?,
    };
    let c = &model.config;
    println!("architecture   {}", c.arch.gguf_name());
    println!("vocab          {}", c.n_vocab);
    println!("embedding      {}", c.n_embd);
    println!("layers         {}", c.n_layer);
    println!(
        "heads          {} (key/value heads {}, head size {})",
        c.n_head, c.n_head_kv, c.head_dim
    );
    println!("feed-forward   {}", c.n_ff);
    println!("context        {}", c.n_ctx);
    println!("rope           {:?}, theta {}, {} dims", c.rope, c.rope_theta, c.rope_dims);
    println!("norm eps       {}", c.norm_eps);
    let ids = |ids: &[u32]| match ids {
        [] => "none".to_string(),
        _ => ids.iter().map(u32::to_string).collect::<Vec<_>>().join(", "),
    };
    println!(
        "bos / eos      {} (add bos: {}) / {}",
        ids(c.bos_token.as_slice()),
        c.add_bos,
        ids(&c.eos_tokens)
    );
    println!("parameters     {}", model.parameter_count());
    let parts = Gguf::parse(&model.storage)?.parts;
    if parts > 1 {
        println!("file           split in {parts} parts (gguf-split)");
    }
    let mut by_type: Vec<(&str, usize, usize)> = Vec::new();
    for t in &model.tensors {
        match by_type.iter_mut().find(|e| e.0 == t.ty.name()) {
            Some(e) => {
                e.1 += 1;
                e.2 += t.size_bytes;
            }
            None => by_type.push((t.ty.name(), 1, t.size_bytes)),
        }
    }
    let total: usize = model.tensors.iter().map(|t| t.size_bytes).sum();
    println!("tensor bytes   {total} ({:.2} MiB)", total as f64 / (1 << 20) as f64);
    for (ty, n, bytes) in by_type {
        println!("  {ty:<6} {n:>4} tensors {bytes:>12} bytes");
    }
    Ok(())
}

/// The text of a JSON file the user named (a table model, a conversation): a regular file of at
/// most 64 MiB, so a FIFO or `/dev/zero` gets a message instead of a hang.
fn read_text(path: &Path, what: &str) -> Result<String> {
    nexttoken::files::read_text_capped(path, what, 64 << 20)
}
