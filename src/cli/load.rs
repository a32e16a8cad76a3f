//! Loading what the command line names: the model (a GGUF file, a lesson's JSON table, or the
//! embedded default) on the backend `--backend` picks, its tokenizer and chat template; and
//! `DynModel`, the one "any model" type the subcommands run on.

use std::path::{Path, PathBuf};

use clap::Args;

use nexttoken::backend::{self, BackendChoice, BackendRequest};
use nexttoken::chat::ChatTemplate;
use nexttoken::cpu::{kernels::Isa, CpuModel, Precision};
use nexttoken::gguf::Gguf;
use nexttoken::gpu::GpuModel;
use nexttoken::model::{Model, Storage};
use nexttoken::table::TableModel;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{Error, LanguageModel, Result, Vocab};

use super::chat::{chat_with, ChatArgs};
use super::generate::{generate_with, GenerateArgs};
use super::score::{score_with, ScoreArgs};

#[derive(Args)]
pub(crate) struct ModelArgs {
    /// A GGUF file, or a table model (.json). Default: the embedded model (www/models/default.gguf).
    #[arg(long)]
    pub(crate) model: Option<PathBuf>,
    /// tokenizer.json (default: tokenizer.json beside the model, else the tokenizer the GGUF's
    /// own metadata describes). Table models need none.
    #[arg(long)]
    pub(crate) tokenizer: Option<PathBuf>,
    /// Where the forward pass runs: gpu (wgpu: Vulkan/Metal/DX12), cpu, or auto (the faster of
    /// the two for this model, measured at load after the GPU's check against the CPU; never a
    /// software adapter such as lavapipe).
    #[arg(long, default_value = "auto", value_parser = ["auto", "cpu", "gpu"])]
    pub(crate) backend: String,
    /// Longest sequence (prompt + generated) to allocate the KV cache for; capped by the model's
    /// own context. Real models advertise contexts of 32k-128k tokens that a demo never needs.
    #[arg(long, default_value_t = 4096)]
    pub(crate) context: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// CPU backend: use the exact reference path (f32 activations, one thread) instead of the fast
    /// one (Q8 activations for quantised weights, SIMD, threads).
    #[arg(long)]
    pub(crate) exact: bool,
    /// CPU backend: threads (0 = every core).
    #[arg(long, default_value_t = 0)]
    pub(crate) threads: usize,
    /// CPU backend, fast path: the kernels' instruction set (scalar, avx2, avx512vnni, neon; default: the best
    /// this machine has). `--isa scalar` computes what the wasm build does, up to summation order.
    #[arg(long)]
    pub(crate) isa: Option<String>,
}

/// Load the model named by `args` on the chosen backend and hand it to `f`, with its tokenizer
/// and its GGUF header (the metadata: `None` for a table model).
pub(crate) fn with_model(
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
pub(crate) fn cpu_threads(threads: usize) -> Result<usize> {
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
pub(crate) fn load_chat_template(header: Option<&Gguf>, vocab: &dyn Vocab) -> Result<ChatTemplate> {
    match header {
        Some(header) => ChatTemplate::from_gguf_with_vocab(header, Some(vocab)),
        None => Err(Error::Template("table models have no chat template; use generate".into())),
    }
}

/// The project's own model (see www/models/README.md), compiled in so the CLI works with no
/// files and no network.
const DEFAULT_GGUF: &[u8] = include_bytes!("../../www/models/default.gguf");
const DEFAULT_TOKENIZER: &[u8] = include_bytes!("../../www/models/default-tokenizer.json");

pub(crate) fn default_model() -> Result<Model> {
    eprintln!("model: embedded default (www/models/default.gguf, KJV Bible, 2M parameters)");
    Model::from_storage(Storage::Static(DEFAULT_GGUF))
}

/// Object-safe view of a `LanguageModel` so the CLI can hold either kind behind one reference;
/// each command is generic and is instantiated per concrete model in `DynModel` impls.
pub(crate) trait DynModel {
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

pub(crate) fn run_generate(
    model: &dyn DynModel,
    vocab: &dyn Vocab,
    args: &GenerateArgs,
) -> Result<()> {
    model.generate(vocab, args)
}

pub(crate) fn run_score(model: &dyn DynModel, vocab: &dyn Vocab, args: &ScoreArgs) -> Result<()> {
    model.score(vocab, args)
}

/// The text of a JSON file the user named (a table model, a conversation): a regular file of at
/// most 64 MiB, so a FIFO or `/dev/zero` gets a message instead of a hang.
pub(crate) fn read_text(path: &Path, what: &str) -> Result<String> {
    nexttoken::files::read_text_capped(path, what, 64 << 20)
}
