//! Loading what the command line names: the model (a GGUF file, a lesson's JSON table, or the
//! embedded default) on the backend `--backend` picks, with its tokenizer and chat template: the
//! library's [`Loaded`], which every subcommand runs on.

use std::path::{Path, PathBuf};

use clap::Args;

use nexttoken::backend::BackendRequest;
use nexttoken::cpu::{kernels::Isa, Precision};
use nexttoken::gguf::Gguf;
use nexttoken::load::{on_native_backend, CpuSettings, GgufVocab, Loaded};
use nexttoken::model::{Model, Storage};
use nexttoken::table::TableModel;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{Error, Result};

#[derive(Args, Clone)]
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
    #[arg(long, default_value_t = 4096, allow_negative_numbers = true)]
    pub(crate) context: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    pub(crate) json: bool,
    /// CPU backend: use the exact reference path (f32 activations, one thread) instead of the fast
    /// one (Q8 activations for quantised weights, SIMD, threads).
    #[arg(long)]
    pub(crate) exact: bool,
    /// CPU backend: threads (0 = every core).
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub(crate) threads: usize,
    /// CPU backend, fast path: the kernels' instruction set (scalar, avx2, avx512vnni, neon; default: the best
    /// this machine has). `--isa scalar` computes what the wasm build does, up to summation order.
    #[arg(long)]
    pub(crate) isa: Option<String>,
}

impl ModelArgs {
    /// The model's file name ("default.gguf" for the embedded one), for records of a run.
    pub(crate) fn describe(&self) -> String {
        self.model.as_deref().map_or_else(|| "default.gguf".into(), file_name)
    }
}

/// A path's last part (the whole path when it has none), as text.
pub(crate) fn file_name(path: &Path) -> String {
    path.file_name().unwrap_or(path.as_os_str()).to_string_lossy().into_owned()
}

/// The model `args` names on the backend `--backend` picks, with its tokenizer and chat
/// template.
pub(crate) fn load(args: &ModelArgs) -> Result<Loaded> {
    if args.context == 0 {
        return Err(Error::Input("--context 0: the context must hold at least one token".into()));
    }
    let model = match &args.model {
        None => default_model()?,
        Some(path) if path.extension().is_some_and(|e| e == "json") => {
            let table = TableModel::from_json(&read_text(path, "table model")?)?;
            return Ok(Loaded::table(table));
        }
        Some(path) => Model::open(path)?,
    };
    // The metadata the tokenizer and the chat template read (`Model` keeps only what the forward
    // pass needs), from the bytes the model already holds.
    let header = Gguf::parse(&model.storage)?;
    let text = GgufVocab::with_tokenizer(&header, load_tokenizer(args, &header)?)
        .fitting(model.config.n_vocab)?;
    let request = args.backend.parse::<BackendRequest>()?;
    let cpu = CpuSettings {
        precision: if args.exact { Precision::Exact } else { Precision::Fast },
        threads: if args.exact { 1 } else { cpu_threads(args.threads)? },
        isa: args.isa.as_deref().map(Isa::by_name).transpose()?,
    };
    let (model, backend) =
        nexttoken::lm::block_on(on_native_backend(model, request, cpu, args.context))?;
    eprintln!("backend: {backend}");
    Ok(Loaded::transformer(model, text, backend))
}

/// The `--draft` model of `sampling`, if any, loaded as `args` loads the main model (the same
/// backend choice, context, precision and threads; its own tokenizer is not needed: it shares
/// the model's, which the generation checks by vocabulary size and BOS).
pub(crate) fn load_draft(
    sampling: &super::generate::SamplingArgs,
    args: &ModelArgs,
) -> Result<Option<Loaded>> {
    let Some(path) = &sampling.draft else { return Ok(None) };
    if path.extension().is_some_and(|e| e == "json") {
        return Err(Error::Input(format!(
            "--draft {}: a draft model is a GGUF file (table models have nothing to speed up)",
            path.display()
        )));
    }
    eprint!("draft model {}: ", path.display());
    load(&ModelArgs { model: Some(path.clone()), tokenizer: None, ..args.clone() }).map(Some)
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
        return embedded_tokenizer();
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

/// The project's own model (see www/models/README.md), compiled in so the CLI works with no
/// files and no network.
const DEFAULT_GGUF: &[u8] = include_bytes!("../../www/models/default.gguf");
const DEFAULT_TOKENIZER: &[u8] = include_bytes!("../../www/models/default-tokenizer.json");

pub(crate) fn default_model() -> Result<Model> {
    eprintln!("model: embedded default (www/models/default.gguf, KJV Bible, 2M parameters)");
    embedded_model()
}

/// The embedded model, without the note.
pub(crate) fn embedded_model() -> Result<Model> {
    Model::from_storage(Storage::Static(DEFAULT_GGUF))
}

/// The embedded model's tokenizer.
pub(crate) fn embedded_tokenizer() -> Result<HfTokenizer> {
    HfTokenizer::from_bytes(DEFAULT_TOKENIZER)
}

/// The text of a JSON file the user named (a table model, a conversation): a regular file of at
/// most 64 MiB, so a FIFO or `/dev/zero` gets a message instead of a hang.
pub(crate) fn read_text(path: &Path, what: &str) -> Result<String> {
    nexttoken::files::read_text_capped(path, what, 64 << 20)
}
