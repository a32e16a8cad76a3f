//! The `nexttoken` command line: generate, score and inspect models natively.

use std::path::PathBuf;
use std::process::ExitCode;

mod cli;

use clap::{Parser, Subcommand};

use cli::chat::{chat_with, ChatArgs};
use cli::generate::{generate_with, GenerateArgs};
use cli::info::run_info;
use cli::load::{load, load_draft, read_text};
use cli::score::{score_with, ScoreArgs};
use cli::{bench, synth};

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

fn main() -> ExitCode {
    quiet_device_select();
    let cli = Cli::parse();
    let result = match cli.command {
        // The sampling options are checked before the model loads: a typo fails at once.
        Command::Generate(args) => args
            .sampling
            .options()
            .and_then(|_| Ok((load(&args.model)?, load_draft(&args.sampling, &args.model)?)))
            .and_then(|(m, d)| {
                generate_with(&*m.model, d.as_ref().map(|d| &*d.model), &*m.vocab, &args)
            }),
        Command::Chat(args) => args
            .sampling
            .options()
            .and_then(|_| Ok((load(&args.model)?, load_draft(&args.sampling, &args.model)?)))
            .and_then(|(m, d)| {
                let draft = d.as_ref().map(|d| &*d.model);
                chat_with(&*m.model, draft, &*m.vocab, &args, m.template()?.clone())
            }),
        Command::Score(args) => {
            load(&args.model).and_then(|m| score_with(&*m.model, &*m.vocab, &args))
        }
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
