//! Loading a model onto the GPU from its file's bytes as they arrive, in pieces of any size,
//! without ever holding the file: the browser's download goes straight into GPU buffers.
//!
//! [`GpuStream`] buffers the first bytes until the GGUF header parses ([`Gguf::parse_header`]),
//! describes the model from it ([`Model::describe_header`]), makes every GPU buffer
//! ([`GpuModel::plan`]: the same plan an ordinary upload makes), and from then on writes each
//! piece of the file where it belongs ([`Filler`]): weights as they are (packed q|k|v and gate|up
//! at their offsets in one buffer), the small vectors (norms, biases) decoded to f32 once each is
//! whole, Llama 3's RoPE factors to the host. [`GpuStream::finish`] checks that every tensor
//! arrived and compiles the kernels. [`GpuModel::with_options`] is this path with the whole file
//! as one piece, so a streamed model is the same model: every constructor of [`GpuModel`] is
//! here, with the plan ([`GpuModel::plan`]) and the activations and kernels it ends with.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::context::{gpu_err, GpuContext};
use super::dispatch::{self, floats, AttentionShape, GpuTensor};
use super::kernels::{Kernel, Kernels, Tile, MATVEC_TOKENS, MAX_HEAD_DIM};
use super::model::{GpuModel, GpuOptions, LayerPlan, NormAt, Runtime, Scratch};
use crate::error::{Error, Result};
use crate::gguf::{Gguf, Header};
use crate::model::{Ffn, Mlp, Model, Norm, NormWeights, Qkv, Tensor, Weights};
use crate::quant::{dequantize_row, GgmlType};

/// The most bytes a GGUF header may take before the loader gives up on it. Real headers are a
/// few MB (a 150k-token vocabulary with its merges is about 8 MB).
pub const MAX_HEADER_BYTES: usize = 128 << 20;

/// Where one range of the file's bytes goes.
#[derive(Clone, Copy)]
pub(super) enum Dest {
    /// Into buffer `buf` (of the [`Filler`]) from byte `at`, as they are.
    Buffer { buf: usize, at: u64 },
    /// A small tensor of `n` elements of `ty`, decoded to f32 into buffer `buf` from float `at`
    /// once all of it has arrived (held on the host until then).
    Vector { buf: usize, at: usize, n: usize, ty: GgmlType },
    /// Llama 3's RoPE factors: kept on the host for the model's RoPE table.
    RopeFreqs,
}

struct Placement {
    name: String,
    start: usize,
    len: usize,
    dest: Dest,
}

impl Placement {
    fn end(&self) -> usize {
        self.start + self.len
    }
}

/// A word of a buffer of which some bytes are known: GPU writes are whole words (4 bytes), and
/// a tensor can start or end inside one (a packed buffer's second tensor, a Q8_0 row of an odd
/// number of blocks), or a piece of the file can.
#[derive(Default)]
struct Word {
    bytes: [u8; 4],
    /// Bit i: byte i is known.
    known: u8,
}

/// Writes the file's bytes, given in order and in pieces of any size, to where the plan put
/// each tensor. Holds on the host only the words a write leaves incomplete (a few bytes each)
/// and the small tensors that are decoded (vectors, while they arrive).
pub(super) struct Filler {
    ctx: Arc<GpuContext>,
    buffers: Vec<wgpu::Buffer>,
    /// Incomplete words by (buffer, word index).
    words: HashMap<(usize, u64), Word>,
    /// By start, once sealed.
    placements: Vec<Placement>,
    /// The first placement no byte of which has arrived.
    next: usize,
    /// Placements some of whose bytes have arrived, with what a decoded one holds so far.
    active: Vec<(usize, Vec<u8>)>,
    /// Bytes of the file seen so far.
    pos: usize,
    rope_freqs: Option<Vec<u8>>,
    /// Bytes written since the queue last took them (a submit lets it free its staging).
    unflushed: usize,
}

/// Let the queue take its staged writes after this many bytes.
const FLUSH_BYTES: usize = 64 << 20;

impl Filler {
    pub(super) fn new(ctx: Arc<GpuContext>) -> Filler {
        Filler {
            ctx,
            buffers: Vec::new(),
            words: HashMap::new(),
            placements: Vec::new(),
            next: 0,
            active: Vec::new(),
            pos: 0,
            rope_freqs: None,
            unflushed: 0,
        }
    }

    /// A buffer whose first `len` bytes the placements fill (the rest of its last word, and
    /// anything past it, stay zero); its index.
    pub(super) fn add_buffer(&mut self, buffer: wgpu::Buffer, len: usize) -> usize {
        let buf = self.buffers.len();
        self.buffers.push(buffer);
        if !len.is_multiple_of(4) {
            // The bytes after `len` in its last word are zeros no tensor writes.
            let known = (0xf << (len % 4)) & 0xf;
            self.words.insert((buf, (len / 4) as u64), Word { bytes: [0; 4], known });
        }
        buf
    }

    /// The file's bytes `start..start + len` (tensor `name`) go to `dest`.
    pub(super) fn place(&mut self, name: &str, start: usize, len: usize, dest: Dest) {
        self.placements.push(Placement { name: name.to_string(), start, len, dest });
    }

    /// Every placement made: in file order from now on.
    pub(super) fn seal(&mut self) {
        self.placements.sort_by_key(|p| p.start);
    }

    /// Bytes of the file seen so far.
    pub(super) fn position(&self) -> usize {
        self.pos
    }

    /// The next `bytes` of the file (after the ones fed before).
    pub(super) fn feed(&mut self, bytes: &[u8]) -> Result<()> {
        let (c0, c1) = (self.pos, self.pos + bytes.len());
        while self.next < self.placements.len() && self.placements[self.next].start < c1 {
            let p = &self.placements[self.next];
            let held = match p.dest {
                Dest::Buffer { .. } => Vec::new(),
                Dest::Vector { .. } | Dest::RopeFreqs => Vec::with_capacity(p.len),
            };
            self.active.push((self.next, held));
            self.next += 1;
        }
        let mut active = std::mem::take(&mut self.active);
        let mut i = 0;
        while i < active.len() {
            let (k, held) = &mut active[i];
            let p = &self.placements[*k];
            let (start, end, dest) = (p.start, p.end(), p.dest);
            let (a, b) = (start.max(c0), end.min(c1));
            if a < b {
                let piece = &bytes[a - c0..b - c0];
                match dest {
                    Dest::Buffer { buf, at } => self.write(buf, at + (a - start) as u64, piece),
                    Dest::Vector { .. } | Dest::RopeFreqs => held.extend_from_slice(piece),
                }
            }
            if end <= c1 {
                let (k, held) = active.swap_remove(i);
                self.complete(k, held);
            } else {
                i += 1;
            }
        }
        self.active = active;
        self.pos = c1;
        Ok(())
    }

    /// A decoded placement whose bytes have all arrived.
    fn complete(&mut self, k: usize, held: Vec<u8>) {
        match self.placements[k].dest {
            Dest::Buffer { .. } => {}
            Dest::Vector { buf, at, n, ty } => {
                let mut floats = vec![0f32; n];
                dequantize_row(ty, &held, &mut floats);
                let bytes: Vec<u8> = floats.iter().flat_map(|v| v.to_le_bytes()).collect();
                self.write(buf, (at * 4) as u64, &bytes);
            }
            Dest::RopeFreqs => self.rope_freqs = Some(held),
        }
    }

    /// `data` into buffer `buf` from byte `at`: the whole words at once, the bytes of a word
    /// that is not whole yet into `words` until it is.
    fn write(&mut self, buf: usize, mut at: u64, mut data: &[u8]) {
        let head = ((4 - at % 4) % 4) as usize;
        if head > 0 {
            let n = head.min(data.len());
            self.partial(buf, at, &data[..n]);
            at += n as u64;
            data = &data[n..];
        }
        let whole = data.len() / 4 * 4;
        if whole > 0 {
            self.ctx.queue.write_buffer(&self.buffers[buf], at, &data[..whole]);
            self.unflushed += whole;
            at += whole as u64;
            data = &data[whole..];
            if self.unflushed >= FLUSH_BYTES {
                self.flush();
            }
        }
        if !data.is_empty() {
            self.partial(buf, at, data);
        }
    }

    /// Let the queue take the writes so far, so its staging memory does not hold the whole
    /// model (natively: wait until it has; the browser's `writeBuffer` copies at once).
    fn flush(&mut self) {
        self.ctx.queue.submit([]);
        #[cfg(not(target_arch = "wasm32"))]
        let _ = self.ctx.device.poll(wgpu::PollType::wait_indefinitely());
        self.unflushed = 0;
    }

    /// Bytes inside one word.
    fn partial(&mut self, buf: usize, at: u64, data: &[u8]) {
        let key = (buf, at / 4);
        let word = self.words.entry(key).or_default();
        for (i, &b) in data.iter().enumerate() {
            let j = (at % 4) as usize + i;
            word.bytes[j] = b;
            word.known |= 1 << j;
        }
        if word.known == 0xf {
            let bytes = word.bytes;
            self.words.remove(&key);
            self.ctx.queue.write_buffer(&self.buffers[buf], key.1 * 4, &bytes);
        }
    }

    /// Whether every placement has been written; an error naming the first tensor that has not.
    pub(super) fn check_complete(&self) -> Result<()> {
        let missing = self.active.iter().map(|(k, _)| *k).chain(self.next..self.placements.len());
        if let Some(p) = missing.map(|k| &self.placements[k]).min_by_key(|p| p.start) {
            return Err(Error::Gguf(format!(
                "the file ended at byte {}, inside or before tensor {:?} (bytes {}..{}): it is truncated",
                self.pos,
                p.name,
                p.start,
                p.end()
            )));
        }
        if !self.words.is_empty() {
            return Err(gpu_err(format!(
                "{} words of the weights were never completed",
                self.words.len()
            )));
        }
        Ok(())
    }
}

/// A GPU model whose buffers exist and whose weights are being written (by `fill`, from the
/// file's bytes in order); [`Pending::finish`] makes it a [`GpuModel`].
pub(super) struct Pending {
    pub(super) ctx: Arc<GpuContext>,
    pub(super) opts: GpuOptions,
    pub(super) weights: Weights<Arc<GpuTensor>>,
    pub(super) plans: Vec<LayerPlan>,
    pub(super) vectors: wgpu::Buffer,
    pub(super) output_norm: NormAt,
    /// Every weight tensor once (views of packed buffers included).
    pub(super) tensors: Vec<Arc<GpuTensor>>,
    pub(super) fill: Filler,
    /// Catches running out of GPU memory while the buffers are made and written.
    pub(super) oom: Option<wgpu::ErrorScopeGuard>,
    /// Compiled pipelines to share (else the model compiles its own).
    pub(super) kernels: Option<Arc<super::kernels::Kernels>>,
}

impl Pending {
    /// Check that every tensor arrived and the GPU took it, then compile the kernels. `model`:
    /// the description, without its bytes.
    pub(super) async fn finish(mut self, mut model: Model) -> Result<GpuModel> {
        self.fill.check_complete()?;
        if let Some(bytes) = self.fill.rope_freqs.take() {
            model.set_rope_freqs(&bytes);
        }
        if let Some(e) = self.oom.take().expect("popped once").pop().await {
            return Err(gpu_err(format!("out of memory for the model's weights: {e}")));
        }
        self.ctx.check_lost()?;
        GpuModel::assemble(self, model).await
    }
}

/// What [`GpuStream`] is doing.
enum Phase {
    /// Collecting the first bytes until the header parses; tried again once `need` are here.
    Header { buf: Vec<u8>, need: usize },
    /// Writing tensors: the model's description, and its buffers being filled.
    Body { model: Box<Model>, pending: Box<Pending> },
    /// An error happened: the stream takes nothing more.
    Failed,
}

/// A model loaded onto the GPU from its GGUF file's bytes as they arrive (a download), without
/// holding the file: see the module's documentation. Only a whole model in one file (a split
/// model's parts are not streamed).
pub struct GpuStream {
    ctx: Arc<GpuContext>,
    opts: GpuOptions,
    file_len: usize,
    received: usize,
    phase: Phase,
}

impl GpuStream {
    /// A stream for a file of `file_len` bytes (the length must be known: it bounds the header
    /// and tells a complete file from a truncated one) onto the device of `ctx`.
    pub fn new(ctx: Arc<GpuContext>, opts: GpuOptions, file_len: usize) -> Result<GpuStream> {
        if file_len == 0 {
            return Err(Error::Gguf(
                "not a GGUF file: it is empty (0 bytes: truncated or never written)".into(),
            ));
        }
        let phase = Phase::Header { buf: Vec::new(), need: 0 };
        Ok(GpuStream { ctx, opts, file_len, received: 0, phase })
    }

    /// Bytes received so far.
    pub fn received(&self) -> usize {
        self.received
    }

    /// The model's description, once the header has arrived.
    pub fn model(&self) -> Option<&Model> {
        match &self.phase {
            Phase::Body { model, .. } => Some(model),
            _ => None,
        }
    }

    /// The next `bytes` of the file. Returns the header once, when it has arrived (for the
    /// tokenizer and the chat template: the stream keeps only the model's description). After
    /// an error the stream takes nothing more.
    pub fn push(&mut self, bytes: &[u8]) -> Result<Option<Gguf>> {
        let r = self.push_inner(bytes);
        if r.is_err() {
            self.phase = Phase::Failed;
        }
        r
    }

    fn push_inner(&mut self, bytes: &[u8]) -> Result<Option<Gguf>> {
        if self.received + bytes.len() > self.file_len {
            return Err(Error::Gguf(format!(
                "more than the {} bytes the file was announced to have arrived",
                self.file_len
            )));
        }
        self.received += bytes.len();
        match &mut self.phase {
            Phase::Failed => Err(Error::Input("this load already failed".into())),
            Phase::Body { pending, .. } => {
                pending.fill.feed(bytes)?;
                Ok(None)
            }
            Phase::Header { buf, need } => {
                buf.extend_from_slice(bytes);
                if buf.len() < *need && self.received < self.file_len {
                    return Ok(None);
                }
                match Gguf::parse_header(buf, self.file_len)? {
                    Header::NeedMore(n) => {
                        if n > MAX_HEADER_BYTES {
                            return Err(Error::Gguf(format!(
                                "the header is longer than {} MB (a vocabulary of millions of tokens?): refused",
                                MAX_HEADER_BYTES >> 20
                            )));
                        }
                        // Parsing again at each piece would take time quadratic in the
                        // header's length: wait for a quarter more at least.
                        *need = n.max(buf.len() + buf.len() / 4);
                        Ok(None)
                    }
                    Header::Complete(header) => {
                        let buf = std::mem::take(buf);
                        let (model, rope_freqs) = Model::describe_header(&header, self.file_len)?;
                        let mut pending = GpuModel::plan(
                            self.ctx.clone(),
                            &model,
                            self.opts,
                            rope_freqs.as_ref(),
                        )?;
                        // The header's bytes hold no tensor; what came after it does.
                        pending.fill.feed(&buf)?;
                        let (model, pending) = (Box::new(model), Box::new(pending));
                        self.phase = Phase::Body { model, pending };
                        Ok(Some(header))
                    }
                }
            }
        }
    }

    /// The model, once the whole file has arrived: an error if the file ended early (the
    /// header, or the tensor it stopped in) or the GPU could not take it.
    pub async fn finish(self) -> Result<GpuModel> {
        let short = |what: &str| {
            Error::Gguf(format!(
                "the file ended after {} of its {} bytes, {what}: it is truncated",
                self.received, self.file_len
            ))
        };
        match self.phase {
            Phase::Failed => Err(Error::Input("this load already failed".into())),
            Phase::Header { .. } => Err(short("before its header was complete")),
            Phase::Body { model, pending } => {
                pending.fill.check_complete()?;
                if self.received < self.file_len {
                    return Err(short("after its last tensor"));
                }
                debug_assert_eq!(pending.fill.position(), self.received);
                pending.finish(*model).await
            }
        }
    }
}

/// Most tokens one pass over the layers handles (longer prompts run in several, in one
/// submission): large, because each pass reads every weight once and the tiled products need
/// hundreds of workgroups (tokens / 64 of them per 64 rows) to fill a large GPU.
const MAX_BATCH: usize = 512;
/// Most rows of logits computed at once (a prefill that returns every token's logits computes
/// them in pieces of this many, so the logits buffer stays small for large vocabularies).
const MAX_LOGIT_ROWS: usize = 64;

/// The weights' GPU buffers, each tensor given one once (a tied output projection shares its
/// embedding's buffer), keyed by its place in the file; where each tensor's bytes go is recorded
/// in `fill`, which writes them as the file's bytes come (all at once, or streamed).
struct Uploads<'m> {
    ctx: &'m GpuContext,
    cache: HashMap<(usize, usize), Arc<GpuTensor>>,
    fill: &'m mut Filler,
}

impl Uploads<'_> {
    fn key(t: &Tensor) -> (usize, usize) {
        (t.offset, t.size_bytes)
    }

    fn one(&mut self, t: &Tensor) -> Result<Arc<GpuTensor>> {
        if let Some(g) = self.cache.get(&Uploads::key(t)) {
            return Ok(g.clone());
        }
        let g = GpuTensor::alloc(self.ctx, &t.name, t.ty, t.rows, t.cols, t.size_bytes)?;
        for p in &g.parts {
            let len = p.rows * g.row_bytes;
            let buf = self.fill.add_buffer(p.buffer.clone(), len);
            let start = t.offset + p.row0 * g.row_bytes;
            self.fill.place(&t.name, start, len, Dest::Buffer { buf, at: 0 });
        }
        let g = Arc::new(g);
        self.cache.insert(Uploads::key(t), g.clone());
        Ok(g)
    }

    /// Tensors whose rows one product covers (q|k|v, gate|up): each run of one type and row
    /// length packed into one buffer (the tensors become views of it). Returns the products as
    /// (tensor, first row): one when all share a type; more when, as in Q4_K_M files, they differ.
    fn packed(&mut self, ts: &[&Tensor]) -> Result<Vec<(Arc<GpuTensor>, usize)>> {
        let mut products = Vec::new();
        let mut row0 = 0;
        for run in ts.chunk_by(|a, b| a.ty == b.ty && a.cols == b.cols) {
            let pieces: Vec<_> =
                run.iter().map(|t| (t.name.as_str(), t.rows, t.size_bytes)).collect();
            let packed = (run.len() > 1)
                .then(|| GpuTensor::alloc_packed(self.ctx, run[0].ty, run[0].cols, &pieces))
                .flatten();
            match packed {
                Some((whole, views)) => {
                    let part = &whole.parts[0];
                    let buf =
                        self.fill.add_buffer(part.buffer.clone(), whole.rows * whole.row_bytes);
                    for (t, view) in run.iter().zip(views) {
                        let at = view.parts[0].byte0 as u64;
                        self.fill.place(&t.name, t.offset, t.size_bytes, Dest::Buffer { buf, at });
                        self.cache.insert(Uploads::key(t), Arc::new(view));
                    }
                    products.push((Arc::new(whole), row0));
                }
                None => {
                    for (i, t) in run.iter().enumerate() {
                        let at = row0 + run[..i].iter().map(|t| t.rows).sum::<usize>();
                        products.push((self.one(t)?, at));
                    }
                }
            }
            row0 += run.iter().map(|t| t.rows).sum::<usize>();
        }
        Ok(products)
    }
}

/// The small vectors of a model (norm weights and biases, projection biases) decoded to f32 in
/// one buffer, so a fused product binds one buffer for all of them: their offsets (in floats),
/// and which tensor fills each.
#[derive(Default)]
struct Vectors {
    len: usize,
    /// (tensor, offset in floats).
    placed: Vec<(Tensor, usize)>,
}

impl Vectors {
    fn add(&mut self, t: &Tensor) -> usize {
        let at = self.len;
        self.len += t.rows * t.cols;
        self.placed.push((t.clone(), at));
        at
    }

    /// `n` zeros (a missing bias among q, k and v); their offset.
    fn zeros(&mut self, n: usize) -> usize {
        let at = self.len;
        self.len += n;
        at
    }

    fn norm(&mut self, n: &NormWeights) -> NormAt {
        NormAt { weight: self.add(&n.weight), bias: n.bias.as_ref().map(|b| self.add(b)) }
    }
}

impl GpuModel {
    /// Open the GPU and upload `model` (native; blocks).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new(model: Model) -> Result<GpuModel> {
        crate::lm::block_on(async {
            GpuModel::with_context(GpuContext::new_async().await?, model).await
        })
    }

    /// Upload `model` to the device of `ctx` and compile its kernels, with the default options
    /// ([`GpuOptions::auto`]: the f16 KV cache where the device supports it).
    pub async fn with_context(ctx: Arc<GpuContext>, model: Model) -> Result<GpuModel> {
        let opts = GpuOptions::auto(&ctx);
        GpuModel::with_options(ctx, model, opts).await
    }

    /// Upload `model` to the device of `ctx` and compile its kernels. The model keeps only its
    /// description: its bytes are released once they are on the GPU (freed, unless another
    /// handle shares them).
    pub async fn with_options(
        ctx: Arc<GpuContext>,
        model: Model,
        opts: GpuOptions,
    ) -> Result<GpuModel> {
        // The same path as a streamed load (`GpuStream`), with the whole file as one piece.
        let mut pending = GpuModel::plan(ctx, &model, opts, None)?;
        pending.fill.feed(&model.storage)?;
        pending.finish(model.release_bytes()).await
    }

    /// Upload `model` beside `other`, on its device, with its options and its compiled kernels
    /// (those `model` needs beyond them are compiled): a second model that costs no recompiling
    /// of what they share, such as [`GpuModel::check_against_cpu`]'s.
    pub async fn with_shared_kernels(other: &GpuModel, model: Model) -> Result<GpuModel> {
        let mut pending = GpuModel::plan(other.ctx.clone(), &model, other.opts, None)?;
        pending.kernels = Some(other.kernels.clone());
        pending.fill.feed(&model.storage)?;
        pending.finish(model.release_bytes()).await
    }

    /// Make every buffer of the model described by `model` (none of its bytes are read), and
    /// record where each tensor's bytes go: the weights (q|k|v and gate|up of one type packed
    /// into one buffer each), the small vectors decoded to f32 into one buffer, and
    /// `rope_freqs` (Llama 3's RoPE factors: for `Pending::finish` to give the model) when the
    /// model does not have them yet. The file's bytes then go to `Pending::fill` in order.
    pub(super) fn plan(
        ctx: Arc<GpuContext>,
        model: &Model,
        opts: GpuOptions,
        rope_freqs: Option<&Tensor>,
    ) -> Result<Pending> {
        ctx.check_lost()?;
        if (opts.f16_kv || opts.f16_prefill) && !ctx.shader_f16 {
            return Err(gpu_err(format!(
                "{opts:?} needs shader-f16 (f16 in shaders), which this device lacks"
            )));
        }
        let c = &model.config;
        if c.head_dim > MAX_HEAD_DIM {
            return Err(gpu_err(format!(
                "head size {} exceeds the kernels' {MAX_HEAD_DIM}",
                c.head_dim
            )));
        }
        // Running out of memory while the buffers are made or written is reported by `finish`.
        let oom = ctx.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let mut fill = Filler::new(ctx.clone());
        // The plans: q|k|v and gate|up of one type packed into one buffer each (the tensors
        // become views of it), and the small vectors' offsets. Then every other tensor.
        let mut uploads = Uploads { ctx: &ctx, cache: HashMap::new(), fill: &mut fill };
        let mut vectors = Vectors::default();
        let mut plans = Vec::new();
        for lw in &model.weights.layers {
            let (qkv, qkv_bias) = match &lw.qkv {
                Qkv::Fused(l) => {
                    (vec![(uploads.one(&l.weight)?, 0)], l.bias.as_ref().map(|b| vectors.add(b)))
                }
                Qkv::Separate { q, k, v } => {
                    let pieces = uploads.packed(&[&q.weight, &k.weight, &v.weight])?;
                    // One bias vector for q|k|v: zeros where one of them has none.
                    let bias = [q, k, v].iter().any(|l| l.bias.is_some()).then(|| {
                        let at = vectors.len;
                        for l in [q, k, v] {
                            match &l.bias {
                                Some(t) => vectors.add(t),
                                None => vectors.zeros(l.weight.rows),
                            };
                        }
                        at
                    });
                    (pieces, bias)
                }
            };
            let gate_up = match &lw.ffn {
                Ffn::GatedSilu { gate, up, .. } => {
                    let pieces = uploads.packed(&[&gate.weight, &up.weight])?;
                    (pieces.len() == 1).then(|| pieces[0].0.clone())
                }
                Ffn::Gelu { .. } => None,
            };
            let (gate_bias, up_bias, down_bias) = match &lw.ffn {
                Ffn::GatedSilu { gate, up, down } => (
                    gate.bias.as_ref().map(|b| vectors.add(b)),
                    up.bias.as_ref().map(|b| vectors.add(b)),
                    down.bias.as_ref().map(|b| vectors.add(b)),
                ),
                Ffn::Gelu { up, down } => (
                    None,
                    up.bias.as_ref().map(|b| vectors.add(b)),
                    down.bias.as_ref().map(|b| vectors.add(b)),
                ),
            };
            plans.push(LayerPlan {
                qkv,
                gate_up,
                attn_norm: vectors.norm(&lw.attn_norm),
                ffn_norm: vectors.norm(&lw.ffn_norm),
                qkv_bias,
                attn_output_bias: lw.attn_output.bias.as_ref().map(|b| vectors.add(b)),
                up_bias,
                gate_bias,
                down_bias,
            });
        }
        let weights = model.weights.try_map(|t: &Tensor| uploads.one(t))?;
        let cache = uploads.cache;
        let output_norm = vectors.norm(&model.weights.output_norm);
        let vectors_buffer = super::kernels::storage(&ctx, "vectors", (vectors.len * 4) as u64);
        let buf = fill.add_buffer(vectors_buffer.clone(), vectors.len * 4);
        for (t, at) in &vectors.placed {
            let n = t.rows * t.cols;
            fill.place(&t.name, t.offset, t.size_bytes, Dest::Vector { buf, at: *at, n, ty: t.ty });
        }
        if let Some(t) = rope_freqs {
            fill.place(&t.name, t.offset, t.size_bytes, Dest::RopeFreqs);
        }
        fill.seal();
        Ok(Pending {
            ctx,
            opts,
            weights,
            plans,
            vectors: vectors_buffer,
            output_norm,
            tensors: cache.into_values().collect(),
            fill,
            oom: Some(oom),
            kernels: None,
        })
    }

    /// The rest of [`GpuModel::with_options`] once the weights are written: activations,
    /// kernels, and the model itself.
    pub(super) async fn assemble(p: Pending, model: Model) -> Result<GpuModel> {
        let Pending { ctx, opts, weights, plans, vectors, output_norm, tensors, kernels, .. } = p;
        let c = model.config.clone();
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());

        let limit = ctx.max_binding();
        let shape =
            AttentionShape { n_head: c.n_head, n_head_kv: c.n_head_kv, head_dim: c.head_dim };
        let widest = [c.n_embd, q_dim + 2 * kv_dim, 2 * c.n_ff]
            .into_iter()
            .chain([dispatch::attention_scratch_floats(1, shape)])
            .max()
            .unwrap_or(1);
        let batch = ((limit / (widest as u64 * 4)) as usize).clamp(1, MAX_BATCH);
        let logit_rows =
            ((limit / (c.n_vocab.max(1) as u64 * 4)) as usize).clamp(1, MAX_LOGIT_ROWS.min(batch));
        // Keys and values share one buffer per layer.
        let max_seq = c.n_ctx.min((limit / (kv_dim as u64 * 8)) as usize).saturating_sub(1).max(1);
        let scratch = Scratch {
            x: floats(&ctx, "x", batch * c.n_embd),
            h: floats(&ctx, "h", batch * c.n_embd),
            qkv: floats(&ctx, "qkv", batch * (q_dim + 2 * kv_dim)),
            q: floats(&ctx, "q", batch * q_dim),
            // Only decode batches (a few tokens) split attention into chunks.
            chunks: floats(
                &ctx,
                "attention chunks",
                dispatch::attention_scratch_floats(batch.min(MATVEC_TOKENS as usize), shape),
            ),
            attn: floats(&ctx, "attn", batch * q_dim),
            up: floats(&ctx, "up", batch * c.n_ff),
            gate_up: floats(&ctx, "gate|up", batch * 2 * c.n_ff),
            logits: floats(&ctx, "logits", logit_rows * c.n_vocab),
            zeros: floats(&ctx, "zeros", c.n_embd.max(4)),
            no_kv: floats(&ctx, "no kv", 4),
        };
        let kernels = kernels.unwrap_or_else(|| Arc::new(Kernels::new(ctx.clone())));
        let h = opts.f16_kv;
        let mut needed = vec![
            Kernel::Rope(false),
            Kernel::Rope(h),
            Kernel::Attention(h, shape.head_dim as u32),
            Kernel::AttentionMerge,
            Kernel::AttentionPrefill(h, shape.head_dim as u32),
            Kernel::Embedding(weights.token_embd.ty),
        ];
        needed.extend([Kernel::TopkPartial, Kernel::TopkMerge]);
        needed.push(match c.norm {
            Norm::Rms => Kernel::RmsNorm,
            Norm::Layer => Kernel::LayerNorm,
        });
        needed.push(match c.mlp {
            Mlp::GatedSilu => Kernel::SiluMul,
            Mlp::Gelu => Kernel::Gelu,
        });
        if let Some(p) = &weights.pos_embd {
            needed.push(Kernel::Embedding(p.ty));
        }
        for t in &tensors {
            needed.push(Kernel::Matvec(t.ty, h, 1));
            needed.push(Kernel::Matvec(t.ty, h, MATVEC_TOKENS));
            needed.extend(Tile::ALL.map(|tile| Kernel::MatmulTiled(t.ty, tile, opts.f16_prefill)));
        }
        needed.sort_by_key(|k| format!("{k:?}"));
        needed.dedup();
        kernels.prepare(&needed).await?;

        let mut buffers: Vec<&wgpu::Buffer> = Vec::new();
        for t in &tensors {
            for p in &t.parts {
                if !buffers.contains(&&p.buffer) {
                    buffers.push(&p.buffer);
                }
            }
        }
        let s = &scratch;
        buffers.extend([&s.x, &s.h, &s.qkv, &s.q, &s.chunks, &s.attn, &s.up, &s.gate_up]);
        buffers.extend([&s.logits, &s.zeros, &s.no_kv, &vectors]);
        let load_bytes = buffers.iter().map(|b| b.size()).sum::<u64>();
        Ok(GpuModel {
            chunk: dispatch::attention_chunk(max_seq),
            model,
            ctx,
            kernels,
            weights,
            plans,
            vectors,
            output_norm,
            max_seq,
            batch,
            logit_rows,
            scratch,
            opts,
            load_bytes,
            rt: Mutex::new(Runtime::default()),
        })
    }
}
