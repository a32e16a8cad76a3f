//! The model description shared by every backend: hyperparameters from GGUF metadata and the
//! weight tensors by role. The CPU and GPU forward passes differ only in where the math runs.
//!
//! GGUF conventions that matter here (llama.cpp's):
//! - a weight matrix of GGUF shape `[in, out]` is `out` rows of `in` elements; `y = W x` is one
//!   dot product per row;
//! - `llama` files store q/k rows permuted so RoPE rotates adjacent pairs (2i, 2i+1)
//!   ("interleaved"); `qwen2` keeps Hugging Face's order and rotates (i, i + d/2) ("half split");
//! - a missing `output.weight` means the output projection is tied to `token_embd.weight`.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::gguf::{Gguf, TensorInfo, Value};
use crate::quant::GgmlType;
use crate::tensor_names as names;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    /// Llama 2/3, SmolLM2, TinyLlama, stories: RMSNorm, RoPE, SiLU-gated MLP.
    Llama,
    /// Llama plus biases on q, k, v and half-split RoPE.
    Qwen2,
    /// Learned positions, LayerNorm with bias, fused qkv, GELU MLP.
    Gpt2,
}

impl Arch {
    pub fn from_gguf_name(name: &str) -> Result<Arch> {
        match name {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "gpt2" => Ok(Arch::Gpt2),
            other => Err(Error::Model(format!(
                "unsupported architecture {other:?} (supported: llama, qwen2, gpt2)"
            ))),
        }
    }
    /// Whether prompts start with BOS when the file does not say (`tokenizer.ggml.add_bos_token`):
    /// Llama's models were trained with it, Qwen2's and GPT-2's without.
    pub fn adds_bos_by_default(self) -> bool {
        self == Arch::Llama
    }
    pub fn gguf_name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Gpt2 => "gpt2",
        }
    }
}

/// How RoPE pairs up the dimensions of a head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotate (2i, 2i+1): llama.cpp's "norm" rope, used for `llama` GGUF files.
    Interleaved,
    /// Rotate (i, i + d/2): "neox" rope, used for `qwen2`.
    HalfSplit,
    /// No rotary embedding (GPT-2 learns absolute positions instead).
    None,
}

impl RopeStyle {
    /// The two dimensions of a head that rotated pair `i` of `pairs` moves.
    pub fn pair(self, i: usize, pairs: usize) -> (usize, usize) {
        match self {
            RopeStyle::Interleaved | RopeStyle::None => (2 * i, 2 * i + 1),
            RopeStyle::HalfSplit => (i, i + pairs),
        }
    }
}

/// The RoPE table every backend rotates with: `out` is filled as rows of `2 * inv_freq.len()`
/// floats, (cos, sin) per rotated pair, one row per position from `pos0` on; computed in f32
/// from the f32 inverse frequencies, the same arithmetic everywhere.
pub fn cos_sin_table(inv_freq: &[f32], pos0: usize, out: &mut [f32]) {
    if inv_freq.is_empty() {
        return;
    }
    for (p, cs) in out.chunks_exact_mut(2 * inv_freq.len()).enumerate() {
        for (i, &f) in inv_freq.iter().enumerate() {
            let (sin, cos) = ((pos0 + p) as f32 * f).sin_cos();
            cs[2 * i] = cos;
            cs[2 * i + 1] = sin;
        }
    }
}

/// How a block normalises its input.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Norm {
    /// x / rms(x) * weight (llama, qwen2).
    Rms,
    /// (x - mean) / std * weight + bias (gpt2).
    Layer,
}

/// The feed-forward block's shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mlp {
    /// down(silu(gate(x)) * up(x)) (llama, qwen2).
    GatedSilu,
    /// down(gelu(up(x))), GELU's tanh approximation (gpt2).
    Gelu,
}

/// RoPE as this model applies it: which dimensions pair up, and each pair's inverse frequency.
/// Every backend rotates with the table [`Rope::fill_cos_sin`] writes, so they agree bit for bit.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    pub style: RopeStyle,
    /// theta^(-2i/d) per rotated pair, divided by Llama 3's `rope_freqs` where the file has them.
    pub inv_freq: Vec<f32>,
}

impl Rope {
    /// Rotated pairs per head (0 without RoPE).
    pub fn pairs(&self) -> usize {
        self.inv_freq.len()
    }

    /// (cos, sin) of every rotated pair at positions `pos0..` (see [`cos_sin_table`]).
    pub fn fill_cos_sin(&self, pos0: usize, out: &mut [f32]) {
        cos_sin_table(&self.inv_freq, pos0, out);
    }

    /// Rotate every head of one token's q or k vector by `cs`, one row of the table.
    pub fn apply(&self, x: &mut [f32], head_dim: usize, cs: &[f32]) {
        let pairs = self.pairs();
        if self.style == RopeStyle::None {
            return;
        }
        for head in x.chunks_exact_mut(head_dim) {
            for i in 0..pairs {
                let (cos, sin) = (cs[2 * i], cs[2 * i + 1]);
                let (a, b) = self.style.pair(i, pairs);
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * cos - x1 * sin;
                head[b] = x0 * sin + x1 * cos;
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub arch: Arch,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_ctx: usize,
    pub norm: Norm,
    pub mlp: Mlp,
    pub rope: RopeStyle,
    pub rope_theta: f32,
    /// Number of head dimensions RoPE rotates (usually all of them).
    pub rope_dims: usize,
    pub norm_eps: f32,
    pub bos_token: Option<u32>,
    /// Whether prompts start with BOS (`tokenizer.ggml.add_bos_token`, per-architecture default).
    pub add_bos: bool,
    pub eos_tokens: Vec<u32>,
}

impl Config {
    pub fn q_dim(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.n_head_kv * self.head_dim
    }
    /// Whether `tokens` can be appended at position `pos` of a sequence of at most `max_seq`
    /// tokens: the same rule for every backend, so each refuses the same input the same way.
    pub fn check_tokens(&self, pos: usize, tokens: &[u32], max_seq: usize) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        if pos + tokens.len() > max_seq {
            return Err(Error::Input(format!(
                "{} tokens after {pos} would exceed the context of {max_seq} tokens",
                tokens.len()
            )));
        }
        if let Some(bad) = tokens.iter().find(|&&t| t as usize >= self.n_vocab) {
            return Err(Error::Input(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.n_vocab
            )));
        }
        Ok(())
    }

    /// The token a prompt starts with: BOS when the model has one and wants it prepended.
    pub fn prompt_start(&self) -> Option<u32> {
        self.bos_token.filter(|_| self.add_bos)
    }
}

/// One tensor: where its bytes are in the model file and how to read them.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub ty: GgmlType,
    /// Elements per row (GGUF `dims[0]`).
    pub cols: usize,
    pub rows: usize,
    pub offset: usize,
    pub size_bytes: usize,
}

impl Tensor {
    fn from_info(t: &TensorInfo) -> Tensor {
        Tensor {
            name: t.name.clone(),
            ty: t.ty,
            cols: t.cols(),
            rows: t.rows(),
            offset: t.offset,
            size_bytes: t.size_bytes,
        }
    }
    pub fn row_bytes(&self) -> usize {
        self.ty.row_bytes(self.cols)
    }
}

/// A projection `y = W x (+ b)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Linear<T = Tensor> {
    pub weight: T,
    pub bias: Option<T>,
}

/// A norm's scale and, for LayerNorm, its shift.
#[derive(Debug, Clone, PartialEq)]
pub struct NormWeights<T = Tensor> {
    pub weight: T,
    pub bias: Option<T>,
}

/// How a block projects its input to queries, keys and values.
#[derive(Debug, Clone, PartialEq)]
pub enum Qkv<T = Tensor> {
    /// One projection each (llama, qwen2; qwen2's have biases).
    Separate { q: Linear<T>, k: Linear<T>, v: Linear<T> },
    /// One projection whose output rows are q, then k, then v (gpt2).
    Fused(Linear<T>),
}

/// The feed-forward weights; the variant follows [`Config::mlp`].
#[derive(Debug, Clone, PartialEq)]
pub enum Ffn<T = Tensor> {
    GatedSilu { gate: Linear<T>, up: Linear<T>, down: Linear<T> },
    Gelu { up: Linear<T>, down: Linear<T> },
}

/// The weights of one transformer block. `T` is a tensor in the file ([`Tensor`]) or, once a
/// backend has uploaded it, that backend's handle (see [`LayerWeights::try_map`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LayerWeights<T = Tensor> {
    pub attn_norm: NormWeights<T>,
    pub qkv: Qkv<T>,
    pub attn_output: Linear<T>,
    pub ffn_norm: NormWeights<T>,
    pub ffn: Ffn<T>,
}

/// Every weight of the model by role.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights<T = Tensor> {
    pub token_embd: T,
    /// Learned absolute positions (gpt2).
    pub pos_embd: Option<T>,
    pub layers: Vec<LayerWeights<T>>,
    pub output_norm: NormWeights<T>,
    /// The output projection; `token_embd` itself when the embeddings are tied.
    pub output: T,
}

impl<T> Linear<T> {
    fn try_map<U>(&self, f: &mut impl FnMut(&T) -> Result<U>) -> Result<Linear<U>> {
        Ok(Linear { weight: f(&self.weight)?, bias: self.bias.as_ref().map(&mut *f).transpose()? })
    }
    fn tensors(&self) -> impl Iterator<Item = &T> {
        std::iter::once(&self.weight).chain(&self.bias)
    }
}

impl<T> NormWeights<T> {
    fn try_map<U>(&self, f: &mut impl FnMut(&T) -> Result<U>) -> Result<NormWeights<U>> {
        let bias = self.bias.as_ref().map(&mut *f).transpose()?;
        Ok(NormWeights { weight: f(&self.weight)?, bias })
    }
}

impl<T> LayerWeights<T> {
    /// The same layer with every tensor turned into `f(tensor)` (a backend's upload).
    pub fn try_map<U>(&self, f: &mut impl FnMut(&T) -> Result<U>) -> Result<LayerWeights<U>> {
        Ok(LayerWeights {
            attn_norm: self.attn_norm.try_map(f)?,
            qkv: match &self.qkv {
                Qkv::Separate { q, k, v } => {
                    Qkv::Separate { q: q.try_map(f)?, k: k.try_map(f)?, v: v.try_map(f)? }
                }
                Qkv::Fused(qkv) => Qkv::Fused(qkv.try_map(f)?),
            },
            attn_output: self.attn_output.try_map(f)?,
            ffn_norm: self.ffn_norm.try_map(f)?,
            ffn: match &self.ffn {
                Ffn::GatedSilu { gate, up, down } => Ffn::GatedSilu {
                    gate: gate.try_map(f)?,
                    up: up.try_map(f)?,
                    down: down.try_map(f)?,
                },
                Ffn::Gelu { up, down } => Ffn::Gelu { up: up.try_map(f)?, down: down.try_map(f)? },
            },
        })
    }

    /// Every projection of the layer (not the norms).
    pub fn projections(&self) -> Vec<&Linear<T>> {
        let mut out = match &self.qkv {
            Qkv::Separate { q, k, v } => vec![q, k, v],
            Qkv::Fused(qkv) => vec![qkv],
        };
        out.push(&self.attn_output);
        match &self.ffn {
            Ffn::GatedSilu { gate, up, down } => out.extend([gate, up, down]),
            Ffn::Gelu { up, down } => out.extend([up, down]),
        }
        out
    }

    /// Every tensor of the layer.
    pub fn tensors(&self) -> Vec<&T> {
        let norms = [&self.attn_norm, &self.ffn_norm];
        let mut out: Vec<&T> =
            norms.iter().flat_map(|n| std::iter::once(&n.weight).chain(&n.bias)).collect();
        out.extend(self.projections().into_iter().flat_map(Linear::tensors));
        out
    }
}

impl<T> Weights<T> {
    /// The same weights with every tensor turned into `f(tensor)` (a backend's upload; `f` sees
    /// a tied output projection twice).
    pub fn try_map<U>(&self, mut f: impl FnMut(&T) -> Result<U>) -> Result<Weights<U>> {
        Ok(Weights {
            token_embd: f(&self.token_embd)?,
            pos_embd: self.pos_embd.as_ref().map(&mut f).transpose()?,
            layers: self.layers.iter().map(|l| l.try_map(&mut f)).collect::<Result<_>>()?,
            output_norm: self.output_norm.try_map(&mut f)?,
            output: f(&self.output)?,
        })
    }
}

/// The bytes of a model file: mapped natively, owned in the browser. Never copied, except into
/// huge pages for the fast CPU path ([`Model::into_huge_pages`]), which then drops the mapping.
pub enum Storage {
    Owned(Vec<u8>),
    /// Bytes compiled into the binary (the embedded default model).
    Static(&'static [u8]),
    #[cfg(not(target_arch = "wasm32"))]
    Mapped(memmap2::Mmap),
    /// Not held here: the weights are on the GPU (uploaded, then released; or streamed there
    /// from the download and never held). Only the file's length is kept. Derefs to no bytes.
    Elsewhere {
        len: usize,
    },
}

impl std::ops::Deref for Storage {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Storage::Owned(v) => v,
            Storage::Static(s) => s,
            #[cfg(not(target_arch = "wasm32"))]
            Storage::Mapped(m) => m,
            Storage::Elsewhere { .. } => &[],
        }
    }
}

impl Storage {
    /// The file's length, whether its bytes are held or not.
    pub fn file_len(&self) -> usize {
        match self {
            Storage::Elsewhere { len } => *len,
            held => held.len(),
        }
    }
}

/// A loaded model: its description and the file bytes the tensors point into.
pub struct Model {
    pub config: Config,
    pub weights: Weights,
    pub rope: Rope,
    pub storage: Arc<Storage>,
    /// Every tensor of the file, for `info`.
    pub tensors: Vec<Tensor>,
}

impl Model {
    /// Describe the model in `bytes`: a whole GGUF file, or the parts of a split one end to end.
    pub fn from_storage(storage: Storage) -> Result<Model> {
        Model::describe(storage, None)
    }

    /// [`Model::from_bytes`] with the header already parsed from `bytes` (by a caller that read
    /// the tokenizer and chat template from it), so it is not parsed a second time.
    pub fn from_bytes_parsed(bytes: Vec<u8>, gguf: Gguf) -> Result<Model> {
        Model::describe_parsed(Storage::Owned(bytes), &gguf, None)
    }

    /// [`Model::from_storage`], and when `parts` is given, the file must be split in that many.
    fn describe(storage: Storage, parts: Option<usize>) -> Result<Model> {
        let gguf = Gguf::parse(&storage)?;
        Model::describe_parsed(storage, &gguf, parts)
    }

    fn describe_parsed(storage: Storage, gguf: &Gguf, parts: Option<usize>) -> Result<Model> {
        if let Some(parts) = parts.filter(|&p| p != gguf.parts) {
            return Err(Error::Model(format!(
                "the file names say {parts} parts, but part 1 says the model has {}",
                gguf.parts
            )));
        }
        let (mut model, rope_freqs) = Model::describe_header(gguf, storage.file_len())?;
        if let Some(t) = rope_freqs {
            model.set_rope_freqs(&storage[t.offset..][..t.size_bytes]);
        }
        model.storage = Arc::new(storage);
        Ok(model)
    }

    /// The model a GGUF header describes, without its bytes (`Storage::Elsewhere`: a loader that
    /// streams the file's tensors to the GPU as they arrive, `gpu::GpuStream`), and Llama 3's
    /// `rope_freqs` tensor when the file has one: until its bytes are given to
    /// [`Model::set_rope_freqs`], RoPE uses the plain frequencies.
    pub fn describe_header(gguf: &Gguf, file_len: usize) -> Result<(Model, Option<Tensor>)> {
        let config = read_config(gguf)?;
        let (weights, rope_freqs) = read_weights(gguf, &config)?;
        let rope = read_rope(&config, None);
        let tensors = gguf.tensors.iter().map(Tensor::from_info).collect();
        let storage = Arc::new(Storage::Elsewhere { len: file_len });
        Ok((Model { config, weights, rope, storage, tensors }, rope_freqs))
    }

    /// Llama 3's per-pair RoPE factors: the bytes of the `rope_freqs` tensor (F32, checked by
    /// [`Model::describe_header`]).
    pub fn set_rope_freqs(&mut self, bytes: &[u8]) {
        self.rope = read_rope(&self.config, Some(bytes));
    }

    /// The same description without the file's bytes (a GPU model keeps only this once its
    /// weights are on the GPU): the bytes are freed unless another handle shares them.
    pub fn release_bytes(self) -> Model {
        let len = self.storage.file_len();
        Model { storage: Arc::new(Storage::Elsewhere { len }), ..self }
    }

    /// Linux: a mapped file's bytes moved into anonymous memory backed by transparent huge pages
    /// (`MADV_HUGEPAGE`), and the file's mapping dropped, so the process still holds one copy.
    /// Decode reads every weight once per token: through the page cache's 4 KiB pages that is a
    /// TLB miss every 4 KiB, through 2 MiB pages almost none (measured on an AMD EPYC, 2 threads:
    /// Qwen2.5-0.5B and Llama-3.2-1B Q4_0 decode ~10-20 % faster). The cost is at load, mostly
    /// the kernel finding and clearing 2 MiB pages: 0.1-0.5 s per 265 MB on that virtual machine.
    /// Anything else (owned bytes, bytes another handle shares, THP switched off in the kernel,
    /// an allocation that fails) keeps the model as it is.
    #[cfg(target_os = "linux")]
    pub fn into_huge_pages(self) -> Model {
        let Storage::Mapped(map) = &*self.storage else { return self };
        if Arc::strong_count(&self.storage) > 1 {
            return self;
        }
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled");
        if !thp.is_ok_and(|mode| mode.contains("[always]") || mode.contains("[madvise]")) {
            return self;
        }
        let Ok(mut copy) = memmap2::MmapOptions::new().len(map.len()).map_anon() else {
            return self;
        };
        // Advised before the first touch, so the copy faults in whole 2 MiB pages.
        if copy.advise(memmap2::Advice::HugePage).is_err() {
            return self;
        }
        // In pieces, each of the file's pages given back once copied, so the two copies never
        // sit in memory whole at once (the peak was twice the file): the model's memory is the
        // copy plus one piece.
        const PIECE: usize = 8 << 20;
        let mut at = 0;
        while at < map.len() {
            let len = PIECE.min(map.len() - at);
            // The piece's pages mapped in one call rather than a fault per 4 KiB.
            let _ = map.advise_range(memmap2::Advice::PopulateRead, at, len);
            copy[at..at + len].copy_from_slice(&map[at..at + len]);
            // SAFETY: `map` is a read-only mapping of the file that only this model holds
            // (checked above) and that the copy replaces: dropping its pages can change no data
            // (a later read would fault them in again from the file), and nothing reads them.
            let _ =
                unsafe { map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, at, len) };
            at += len;
        }
        match copy.make_read_only() {
            Ok(copy) => Model { storage: Arc::new(Storage::Mapped(copy)), ..self },
            Err(_) => self,
        }
    }

    /// Bytes of the model file, whether they are held here or not.
    pub fn file_len(&self) -> usize {
        self.storage.file_len()
    }

    /// Bytes of the file this model holds in memory (0 once they are on the GPU only).
    pub fn held_bytes(&self) -> usize {
        self.storage.len()
    }

    /// Bytes of weights one decode step reads: every layer's tensors, the output projection, the
    /// output norm, one embedding row (and one position row).
    pub fn weight_bytes_per_token(&self) -> usize {
        let w = &self.weights;
        let norm = &w.output_norm;
        let mut total = w.output.size_bytes + w.token_embd.row_bytes() + norm.weight.size_bytes;
        total += w.pos_embd.as_ref().map_or(0, |t| t.row_bytes());
        total += norm.bias.as_ref().map_or(0, |t| t.size_bytes);
        for l in &w.layers {
            total += l.tensors().iter().map(|t| t.size_bytes).sum::<usize>();
        }
        total
    }

    pub fn from_bytes(bytes: Vec<u8>) -> Result<Model> {
        Model::from_storage(Storage::Owned(bytes))
    }

    /// Map and describe the GGUF file at `path`. The first part of a model split by llama.cpp's
    /// `gguf-split` (`NAME-00001-of-0000N.gguf`) brings the other parts beside it: all N are read
    /// into one buffer, in order (see [`Gguf::parse`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(path: &std::path::Path) -> Result<Model> {
        let name = path.file_name().and_then(|n| n.to_str());
        if let Some((prefix, n)) = name.and_then(crate::gguf::first_split_part) {
            let paths: Vec<_> = (1..=n)
                .map(|k| path.with_file_name(crate::gguf::split_file_name(prefix, k, n)))
                .collect();
            return Model::describe(Storage::Owned(read_parts(&paths)?), Some(n));
        }
        crate::files::regular_file_len(path, "model file")?;
        let io = |source| Error::Io { path: path.display().to_string(), source };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; a file changed underneath us while it runs gives wrong
        // numbers, not memory unsafety in our code (which only reads bytes).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Model::from_storage(Storage::Mapped(map))
    }

    /// A second handle on the same model: the bytes are shared, not copied (the browser keeps one
    /// while the GPU model is being made, so the CPU can take over if that fails).
    pub fn share(&self) -> Model {
        Model {
            config: self.config.clone(),
            weights: self.weights.clone(),
            rope: self.rope.clone(),
            storage: self.storage.clone(),
            tensors: self.tensors.clone(),
        }
    }

    /// The raw bytes of a tensor. Panics for a model whose bytes are not held here (a GPU
    /// model's description, [`Storage::Elsewhere`]): only the CPU path reads them.
    pub fn bytes(&self, t: &Tensor) -> &[u8] {
        self.storage.get(t.offset..t.offset + t.size_bytes).unwrap_or_else(|| {
            panic!(
                "tensor {}: the model's bytes are not held in memory (they are on the GPU)",
                t.name
            )
        })
    }

    pub fn parameter_count(&self) -> usize {
        self.tensors.iter().map(|t| t.rows * t.cols).sum()
    }
}

/// The files at `paths` laid end to end in one buffer, allocated once; a missing one is an
/// error naming it.
#[cfg(not(target_arch = "wasm32"))]
fn read_parts(paths: &[std::path::PathBuf]) -> Result<Vec<u8>> {
    use std::io::Read;
    let n = paths.len();
    let mut files = Vec::with_capacity(n);
    let mut total = 0u64;
    for (k, path) in paths.iter().enumerate() {
        let io = move |source| Error::Io {
            path: format!("{} (part {} of {n} of a split model)", path.display(), k + 1),
            source,
        };
        crate::files::regular_file_len(path, "model file").map_err(|e| match e {
            Error::Io { source, .. } => io(source),
            other => other,
        })?;
        let file = std::fs::File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        if len == 0 {
            // Read on, the next part would be taken for this one.
            return Err(Error::Model(format!(
                "{} (part {} of {n} of a split model) is empty: 0 bytes",
                path.display(),
                k + 1
            )));
        }
        total += len;
        files.push((file, io));
    }
    let mut buf = Vec::new();
    buf.try_reserve_exact(total as usize).map_err(|_| {
        Error::Model(format!("out of memory: cannot allocate {total} bytes for the split model"))
    })?;
    for (mut file, io) in files {
        file.read_to_end(&mut buf).map_err(io)?;
    }
    Ok(buf)
}

fn read_config(g: &Gguf) -> Result<Config> {
    let arch = Arch::from_gguf_name(g.architecture().map_err(|e| Error::Model(e.to_string()))?)?;
    let a = arch.gguf_name();
    let key = |k: &str| format!("{a}.{k}");
    let req = |k: &str| -> Result<usize> {
        let full = key(k);
        match g.get(&full).and_then(Value::as_u64) {
            Some(v) if v > 0 && v <= 1 << 24 => Ok(v as usize),
            Some(v) => Err(Error::Model(format!("{full} = {v} is out of range"))),
            None => Err(Error::Model(format!("missing or non-integer metadata {full}"))),
        }
    };

    let token_embd = g
        .tensor(names::TOKEN_EMBD)
        .ok_or_else(|| Error::Model(format!("missing tensor {}", names::TOKEN_EMBD)))?;
    let n_embd = req("embedding_length")?;
    let n_vocab = token_embd.rows();
    let n_head = req("attention.head_count")?;
    let n_head_kv = match g.get(&key("attention.head_count_kv")) {
        None => n_head,
        Some(_) => req("attention.head_count_kv")?,
    };
    if n_embd % n_head != 0 && g.get(&key("attention.key_length")).is_none() {
        return Err(Error::Model(format!(
            "embedding length {n_embd} is not a multiple of {n_head} heads"
        )));
    }
    let head_dim = match g.get(&key("attention.key_length")) {
        None => n_embd / n_head,
        Some(_) => req("attention.key_length")?,
    };
    if n_head % n_head_kv != 0 {
        return Err(Error::Model(format!(
            "{n_head} attention heads cannot be shared by {n_head_kv} key/value heads"
        )));
    }
    // Each architecture's choices, made here once: every backend branches on these fields.
    let (rope, norm, mlp) = match arch {
        Arch::Llama => (RopeStyle::Interleaved, Norm::Rms, Mlp::GatedSilu),
        Arch::Qwen2 => (RopeStyle::HalfSplit, Norm::Rms, Mlp::GatedSilu),
        Arch::Gpt2 => (RopeStyle::None, Norm::Layer, Mlp::Gelu),
    };
    let norm_eps_key = match norm {
        Norm::Rms => "attention.layer_norm_rms_epsilon",
        Norm::Layer => "attention.layer_norm_epsilon",
    };
    let rope_dims = match g.get(&key("rope.dimension_count")) {
        None => head_dim,
        Some(_) => req("rope.dimension_count")?,
    };
    if rope != RopeStyle::None && (rope_dims > head_dim || rope_dims % 2 != 0) {
        return Err(Error::Model(format!(
            "rope dimension count {rope_dims} does not fit head size {head_dim}"
        )));
    }
    // BOS, EOS and whether prompts start with BOS: one decision, shared with the tokenizer built
    // from the same metadata (`HfTokenizer::from_gguf`).
    check_special_ids(g, n_vocab)?;
    let special = SpecialTokens::from_gguf(g, n_vocab);

    let config = Config {
        arch,
        n_vocab,
        n_embd,
        n_layer: req("block_count")?,
        n_head,
        n_head_kv,
        head_dim,
        n_ff: req("feed_forward_length")?,
        n_ctx: req("context_length")?,
        norm,
        mlp,
        rope,
        rope_theta: checked_f(g, &key("rope.freq_base"), 10000.0, "at least 1", |v| v >= 1.0)?,
        rope_dims,
        norm_eps: checked_f(g, &key(norm_eps_key), 1e-5, "positive and below 1", |v| {
            v > 0.0 && v < 1.0
        })?,
        bos_token: special.bos,
        add_bos: special.add_bos,
        eos_tokens: special.end_tokens(),
    };
    if config.n_layer > 1024 {
        return Err(Error::Model(format!("block_count {} is absurd", config.n_layer)));
    }
    check_layer_count(g, &key("block_count"), config.n_layer)?;
    Ok(config)
}

/// The float at `key` (`default` when absent): a number, finite and `sane` (described by `what`),
/// or an error naming the key. llama.cpp refuses files whose numbers make no sense; an infinite
/// epsilon or a RoPE base of 1e-45 would otherwise run and print nonsense.
fn checked_f(
    g: &Gguf,
    key: &str,
    default: f64,
    what: &str,
    sane: impl Fn(f64) -> bool,
) -> Result<f32> {
    let Some(value) = g.get(key) else { return Ok(default as f32) };
    match value.as_f64() {
        Some(v) if v.is_finite() && sane(v) && (v as f32).is_finite() => Ok(v as f32),
        Some(v) => Err(Error::Model(format!("{key} = {v}: it must be finite and {what}"))),
        None => Err(Error::Model(format!("{key} is {value:?}, not a number"))),
    }
}

/// `block_count` against the tensors: every layer below it has tensors (checked as they are
/// read), and none above it does: a file that says 1 layer and holds 5 would run one of them.
fn check_layer_count(g: &Gguf, key: &str, n_layer: usize) -> Result<()> {
    let layer_of = |name: &str| name.strip_prefix("blk.")?.split('.').next()?.parse::<usize>().ok();
    match g.tensors.iter().filter_map(|t| layer_of(&t.name)).max() {
        Some(top) if top >= n_layer => Err(Error::Model(format!(
            "{key} = {n_layer}, but the file has tensors of {} layers (blk.0 to blk.{top})",
            top + 1
        ))),
        _ => Ok(()),
    }
}

/// The special tokens generation uses (BOS, EOS, EOT), when the file names them: an id inside
/// the vocabulary, or an error naming the key (a BOS that is dropped silently changes every
/// prompt; a string or -1 is no id).
fn check_special_ids(g: &Gguf, n_vocab: usize) -> Result<()> {
    for name in ["bos", "eos", "eot"] {
        let key = format!("tokenizer.ggml.{name}_token_id");
        let Some(value) = g.get(&key) else { continue };
        match value.as_u64() {
            Some(id) if id < n_vocab as u64 => {}
            Some(id) => {
                return Err(Error::Model(format!(
                    "{key} = {id} is outside the vocabulary of {n_vocab} tokens"
                )))
            }
            None => return Err(Error::Model(format!("{key} is {value:?}, not a token id"))),
        }
    }
    Ok(())
}

/// The weights by role, and Llama 3's `rope_freqs` (which only [`read_rope`] reads).
fn read_weights(g: &Gguf, c: &Config) -> Result<(Weights, Option<Tensor>)> {
    // Look a tensor up and check its shape: `[cols, rows]` as GGUF writes it.
    let get = |name: &str, cols: usize, rows: usize| -> Result<Option<Tensor>> {
        let Some(info) = g.tensor(name) else { return Ok(None) };
        let t = Tensor::from_info(info);
        if t.cols != cols || t.rows != rows {
            return Err(Error::Model(format!(
                "tensor {name} has shape {:?}, expected [{cols}, {rows}]",
                info.dims
            )));
        }
        Ok(Some(t))
    };
    let req = |name: &str, cols: usize, rows: usize| -> Result<Tensor> {
        get(name, cols, rows)?.ok_or_else(|| Error::Model(format!("missing tensor {name}")))
    };
    let vector = |name: &str, n: usize| -> Result<Option<Tensor>> {
        let t = get(name, n, 1)?;
        match &t {
            Some(t) if t.ty != GgmlType::F32 => Err(Error::Model(format!(
                "tensor {name} is {}; norms and biases must be F32",
                t.ty.name()
            ))),
            _ => Ok(t),
        }
    };
    let req_vector = |name: &str, n: usize| -> Result<Tensor> {
        vector(name, n)?.ok_or_else(|| Error::Model(format!("missing tensor {name}")))
    };

    let (e, q, kv, ff) = (c.n_embd, c.q_dim(), c.kv_dim(), c.n_ff);
    // LayerNorm models (gpt2) have biases on their norms and projections.
    let biased = c.norm == Norm::Layer;
    let mut layers = Vec::with_capacity(c.n_layer);
    for i in 0..c.n_layer {
        let n = |name: &str| names::block(i, name);
        let bias = |name: &str, len: usize| if biased { vector(&n(name), len) } else { Ok(None) };
        let linear = |w: &str, b: Option<&str>, cols: usize, rows: usize| -> Result<Linear> {
            let bias = match b {
                Some(b) => bias(b, rows)?,
                None => None,
            };
            Ok(Linear { weight: req(&n(w), cols, rows)?, bias })
        };
        let norm = |w: &str, b: &str| -> Result<NormWeights> {
            Ok(NormWeights { weight: req_vector(&n(w), e)?, bias: bias(b, e)? })
        };
        let qkv = match get(&n(names::ATTN_QKV), e, q + 2 * kv)? {
            Some(weight) => {
                let bias = vector(&n(names::ATTN_QKV_BIAS), q + 2 * kv)?;
                Qkv::Fused(Linear { weight, bias })
            }
            None => {
                // Biases are optional here for every architecture (qwen2 requires them).
                let proj = |w: &str, b: &str, rows: usize| -> Result<Linear> {
                    let weight = get(&n(w), e, rows)?.ok_or_else(|| {
                        Error::Model(format!(
                            "layer {i}: missing tensor {} (and no fused attn_qkv)",
                            n(w)
                        ))
                    })?;
                    let bias = vector(&n(b), rows)?;
                    if c.arch == Arch::Qwen2 && bias.is_none() {
                        return Err(Error::Model(format!(
                            "qwen2 layer {i} is missing its q/k/v biases"
                        )));
                    }
                    Ok(Linear { weight, bias })
                };
                Qkv::Separate {
                    q: proj(names::ATTN_Q, names::ATTN_Q_BIAS, q)?,
                    k: proj(names::ATTN_K, names::ATTN_K_BIAS, kv)?,
                    v: proj(names::ATTN_V, names::ATTN_V_BIAS, kv)?,
                }
            }
        };
        let up = || linear(names::FFN_UP, Some(names::FFN_UP_BIAS), e, ff);
        let down = || linear(names::FFN_DOWN, Some(names::FFN_DOWN_BIAS), ff, e);
        let ffn = match c.mlp {
            Mlp::GatedSilu => {
                let gate = linear(names::FFN_GATE, None, e, ff)?;
                Ffn::GatedSilu { gate, up: up()?, down: down()? }
            }
            Mlp::Gelu => Ffn::Gelu { up: up()?, down: down()? },
        };
        layers.push(LayerWeights {
            attn_norm: norm(names::ATTN_NORM, names::ATTN_NORM_BIAS)?,
            qkv,
            attn_output: linear(names::ATTN_OUTPUT, Some(names::ATTN_OUTPUT_BIAS), q, e)?,
            ffn_norm: norm(names::FFN_NORM, names::FFN_NORM_BIAS)?,
            ffn,
        });
    }

    let token_embd = req(names::TOKEN_EMBD, e, c.n_vocab)?;
    let output = get(names::OUTPUT, e, c.n_vocab)?.unwrap_or_else(|| token_embd.clone());
    let learned_positions = c.rope == RopeStyle::None;
    let weights = Weights {
        pos_embd: if learned_positions {
            Some(req(names::POSITION_EMBD, e, c.n_ctx)?)
        } else {
            None
        },
        token_embd,
        layers,
        output_norm: NormWeights {
            weight: req_vector(names::OUTPUT_NORM, e)?,
            bias: if biased { vector(names::OUTPUT_NORM_BIAS, e)? } else { None },
        },
        output,
    };
    Ok((weights, vector(names::ROPE_FREQS, c.rope_dims / 2)?))
}

/// RoPE's inverse frequencies: theta^(-2i/d), divided by Llama 3's per-pair factors
/// (`rope_freqs`, F32 bytes) when the file has them; computed in f64, used in f32.
fn read_rope(c: &Config, rope_freqs: Option<&[u8]>) -> Rope {
    let pairs = if c.rope == RopeStyle::None { 0 } else { c.rope_dims / 2 };
    let factor = |i: usize| {
        rope_freqs.map_or(1.0, |b| {
            f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]) as f64
        })
    };
    let inv_freq = (0..pairs)
        .map(|i| {
            let f = (c.rope_theta as f64).powf(-((2 * i) as f64) / c.rope_dims as f64);
            (f / factor(i)) as f32
        })
        .collect();
    Rope { style: c.rope, inv_freq }
}

/// The special token ids a GGUF file names (`tokenizer.ggml.*_token_id`) and whether prompts
/// start with BOS / end with EOS. A `tokenizer.json` leaves these empty: there the model file's
/// metadata decides (`model::Config`, which reads them through [`SpecialTokens::from_gguf`] too).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    /// End of turn (chat models), which ends generation like EOS.
    pub eot: Option<u32>,
    pub pad: Option<u32>,
    pub unk: Option<u32>,
    /// Prompts start with `bos` (never true without one).
    pub add_bos: bool,
    /// Encoded texts end with `eos` (never true without one).
    pub add_eos: bool,
}

impl SpecialTokens {
    /// The ids and flags of `g`'s metadata; ids at or past `n_vocab` are ignored.
    ///
    /// Without `tokenizer.ggml.add_bos_token` the default is the architecture's (as the model
    /// has always decided: Llama adds BOS, Qwen2 and GPT-2 do not), or for a file with no known
    /// architecture llama.cpp's default for the tokenizer type (SentencePiece adds it, BPE not).
    pub fn from_gguf(g: &Gguf, n_vocab: usize) -> SpecialTokens {
        let id = |name: &str| {
            g.get(&format!("tokenizer.ggml.{name}_token_id"))
                .and_then(Value::as_u64)
                .filter(|&v| v < n_vocab as u64)
                .map(|v| v as u32)
        };
        let flag = |name: &str| {
            g.get(&format!("tokenizer.ggml.add_{name}_token")).and_then(Value::as_bool)
        };
        let arch = g.get("general.architecture").and_then(Value::as_str);
        let add_bos_default = match arch.and_then(|a| Arch::from_gguf_name(a).ok()) {
            Some(arch) => arch.adds_bos_by_default(),
            None => g.get("tokenizer.ggml.model").and_then(Value::as_str) == Some("llama"),
        };
        let (bos, eos) = (id("bos"), id("eos"));
        SpecialTokens {
            bos,
            eos,
            eot: id("eot"),
            pad: id("padding"),
            unk: id("unknown"),
            add_bos: flag("bos").unwrap_or(add_bos_default) && bos.is_some(),
            add_eos: flag("eos").unwrap_or(false) && eos.is_some(),
        }
    }

    /// The token a prompt starts with: BOS when there is one and it is wanted.
    pub fn prompt_start(&self) -> Option<u32> {
        self.bos.filter(|_| self.add_bos)
    }

    /// The tokens that end generation: EOS and EOT, each once.
    pub fn end_tokens(&self) -> Vec<u32> {
        let mut ids: Vec<u32> = self.eos.into_iter().chain(self.eot).collect();
        ids.dedup();
        ids
    }
}
