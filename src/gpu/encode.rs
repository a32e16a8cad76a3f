//! Recording a forward pass: what one submission holds for a batch of tokens (the decode plan's
//! six dispatches per layer, the prefill plan's tiled products and flash attention, the logits or
//! the GPU's ranking of them), from the model description and the buffers `stream.rs` made.

use std::sync::Arc;

use super::dispatch::{
    self, AttentionShape, Columns, Epilogue, Fused, GpuTensor, Heads, KvBuffers, Lookup, Matvec,
    NormIn, NormOp, Out, QkvOut, RopeMode, RopeOut, Rows, TiledOpts, Tokens, TopkBuffers,
};
use super::kernels::{readback, Pass, Timestamps, Timing, MAX_TOP_K};

use super::model::{GpuModel, GpuState, GpuStats, NormAt, Output, Runtime};
use crate::model::{Ffn, Norm, NormWeights, RopeStyle};

impl GpuModel {
    /// Record the forward of `tokens` and submit it; returns the read-back buffer (its copy is
    /// submitted) and how many of its bytes hold the result.
    pub(super) fn submit(
        &self,
        state: &mut GpuState,
        tokens: &[u32],
        output: Output,
        mask: Option<&[u32]>,
        extra: usize,
        timing: Timing,
    ) -> (wgpu::Buffer, usize, Option<Timestamps>) {
        let c = &self.model.config;
        let ctx = &self.ctx;
        let (n, vocab, pos0) = (tokens.len(), c.n_vocab, state.pos);
        let mut guard = self.rt.lock().unwrap_or_else(|p| p.into_inner());
        let rt = &mut *guard;
        self.ensure_runtime(rt, pos0 + n + extra);
        let step = rt.step.clone().expect("made");
        let table = rt.table.clone().expect("made");
        let (cand, pick) = (rt.cand.clone().expect("made"), rt.pick.clone().expect("made"));
        let pick_all = rt.pick_all.clone().expect("made");
        let mask_buf = rt.mask.clone().expect("made");
        ctx.queue.write_buffer(&step, 0, &dispatch::step_words(pos0, tokens));
        if let Some(words) = mask {
            let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            ctx.queue.write_buffer(&mask_buf, 0, &bytes);
        }

        let row_bytes = (vocab * 4) as u64;
        let (out_len, is_logits) = match output {
            Output::Logits { all } => ((if all { n } else { 1 }) * vocab * 4, true),
            Output::TopK { k } => ((2 + 2 * k) * 4, false),
            Output::TopKAllowed { k, shown } => ((2 + 2 * k + 2 + 2 * shown) * 4, false),
            Output::Greedy => (4, false),
            Output::Chain { steps } => (4 * steps, false),
        };
        let slot = if is_logits { &mut rt.logits_rb } else { &mut rt.pick_rb };
        let rb = match slot.take() {
            Some(b) if b.size() >= out_len as u64 => b,
            _ => {
                let b = readback(ctx, out_len as u64);
                rt.bytes += b.size();
                b
            }
        };

        let mut pass = Pass::new(&self.kernels);
        if timing != Timing::Off {
            pass.time(timing);
        }
        let s = &self.scratch;
        let fused = Fused {
            vectors: &self.vectors,
            table: &table,
            step: &step,
            no_kv: &s.no_kv,
            f16_kv: self.opts.f16_kv,
            f16_tiles: self.opts.f16_prefill,
        };
        let picks = TopkBuffers { cand: &cand, out: &pick, step: &step, mask: &mask_buf };
        let picks_all = TopkBuffers { cand: &cand, out: &pick_all, step: &step, mask: &mask_buf };
        // The most positions any token of this forward sees (sizes attention's grid).
        let max_seen = pos0 + n + extra;
        let mut start = 0;
        while start < n {
            let len = self.batch.min(n - start);
            let tokens = Tokens { step: &step, start, n: len };
            self.encode_layers(&mut pass, state, &fused, tokens, max_seen);
            match output {
                Output::Logits { all: true } => {
                    for r0 in (0..len).step_by(self.logit_rows) {
                        let m = self.logit_rows.min(len - r0);
                        self.encode_logits(&mut pass, &fused, r0, m);
                        let at = (start + r0) as u64 * row_bytes;
                        pass.copy(&s.logits, 0, &rb, at, m as u64 * row_bytes);
                    }
                }
                _ if start + len == n => {
                    self.encode_logits(&mut pass, &fused, len - 1, 1);
                    match output {
                        Output::Logits { .. } => pass.copy(&s.logits, 0, &rb, 0, row_bytes),
                        Output::TopK { k } => {
                            dispatch::topk(&mut pass, &s.logits, 0, vocab, k, &picks, false);
                            pass.copy(&pick, 0, &rb, 0, out_len as u64);
                        }
                        Output::TopKAllowed { k, shown } => {
                            dispatch::topk_masked(&mut pass, &s.logits, 0, vocab, k, &picks);
                            let first = ((2 + 2 * k) * 4) as u64;
                            pass.copy(&pick, 0, &rb, 0, first);
                            dispatch::topk(
                                &mut pass, &s.logits, 0, vocab, shown, &picks_all, false,
                            );
                            pass.copy(&pick_all, 0, &rb, first, out_len as u64 - first);
                        }
                        Output::Greedy => {
                            dispatch::topk(&mut pass, &s.logits, 0, vocab, 1, &picks, false);
                            pass.copy(&pick, 8, &rb, 0, 4);
                        }
                        Output::Chain { steps } => {
                            dispatch::topk(&mut pass, &s.logits, 0, vocab, 1, &picks, true);
                            pass.copy(&pick, 8, &rb, 0, 4);
                            // Each further step reads its token and position from the step buffer
                            // the previous pick wrote.
                            for i in 1..steps {
                                let next = Tokens { step: &step, start: 0, n: 1 };
                                self.encode_layers(&mut pass, state, &fused, next, max_seen);
                                self.encode_logits(&mut pass, &fused, 0, 1);
                                dispatch::topk(&mut pass, &s.logits, 0, vocab, 1, &picks, true);
                                pass.copy(&pick, 8, &rb, 4 * i as u64, 4);
                            }
                        }
                    }
                }
                _ => {}
            }
            start += len;
        }
        let state_bufs = state.buffers();
        let mut groups = state.groups.lock().unwrap_or_else(|p| p.into_inner());
        let stats = pass.submit_with(&mut rt.binder, Some((&state_bufs, &mut groups)));
        rt.last = GpuStats {
            dispatches_last: stats.dispatches,
            submissions_last: stats.submissions,
            readback_bytes_last: out_len as u64,
            ..GpuStats::default()
        };
        (rb, out_len, stats.timestamps)
    }

    /// Make the buffers sized by `max_seq` if not yet made, and fill the RoPE table up to `rows`
    /// positions.
    fn ensure_runtime(&self, rt: &mut Runtime, rows: usize) {
        let ctx = &self.ctx;
        let rope = &self.model.rope;
        let half = rope.pairs();
        if rt.step.is_none() {
            let mk = |rt: &mut Runtime, label: &str, bytes: u64| {
                let b = super::kernels::storage(ctx, label, bytes);
                rt.bytes += b.size();
                b
            };
            rt.table = Some(mk(rt, "rope table", (self.max_seq * half.max(1) * 8) as u64));
            rt.step = Some(mk(rt, "step", ((dispatch::STEP_IDS + self.max_seq) * 4) as u64));
            rt.cand = Some(mk(
                rt,
                "top-k candidates",
                (dispatch::topk_scratch_words(self.model.config.n_vocab) * 4) as u64,
            ));
            rt.pick = Some(mk(rt, "top-k", ((2 + 2 * MAX_TOP_K) * 4) as u64));
            rt.pick_all = Some(mk(rt, "top-k of all", ((2 + 2 * MAX_TOP_K) * 4) as u64));
            let mask_words = dispatch::mask_words(self.model.config.n_vocab);
            rt.mask = Some(mk(rt, "allowed tokens", (mask_words * 4) as u64));
        }
        if rows > rt.table_rows && half > 0 {
            // In blocks of 256 positions, so decoding uploads a block every 256 tokens.
            let to = rows.next_multiple_of(256).min(self.max_seq);
            let mut cos_sin = vec![0f32; (to - rt.table_rows) * half * 2];
            rope.fill_cos_sin(rt.table_rows, &mut cos_sin);
            let bytes: Vec<u8> = cos_sin.iter().flat_map(|v| v.to_le_bytes()).collect();
            let table = rt.table.as_ref().expect("made");
            ctx.queue.write_buffer(table, (rt.table_rows * half * 8) as u64, &bytes);
            rt.table_rows = to;
        }
    }

    /// Logits of `n` tokens from row `row0` of the residual stream (`scratch.x`) into
    /// `scratch.logits`: the final norm fused into the product (the tiled one for many tokens;
    /// a LayerNorm there is a kernel of its own first).
    fn encode_logits<'a>(&'a self, pass: &mut Pass<'a>, fused: &Fused<'a>, row0: usize, n: usize) {
        let c = &self.model.config;
        let s = &self.scratch;
        let out = Out { buf: &s.logits, stride: c.n_vocab, col0: 0 };
        let rows = Rows { buf: &s.x, row0, n };
        if dispatch::fits_matvec(n) {
            let m = Matvec {
                norm: Some(self.norm_in(self.output_norm)),
                bias: None,
                epilogue: Epilogue::Store,
            };
            dispatch::matvec(pass, &self.weights.output, rows, out, m, fused);
        } else if c.norm == Norm::Rms {
            let rms_norm = Some((self.output_norm.weight, c.norm_eps));
            let opts = TiledOpts { rms_norm, ..TiledOpts::default() };
            dispatch::matmul_tiled_with(pass, &self.weights.output, None, rows, out, fused, opts);
        } else {
            self.norm(pass, &self.weights.output_norm, row0 + n);
            let rows = Rows { buf: &s.h, row0, n };
            dispatch::matmul(pass, &self.weights.output, None, rows, out, fused);
        }
    }

    fn norm_in(&self, at: NormAt) -> NormIn {
        let c = &self.model.config;
        NormIn { kind: c.norm, eps: c.norm_eps, weight: at.weight, bias: at.bias }
    }

    /// The norm kernel: the first `n` rows of `scratch.x` into `scratch.h`.
    fn norm<'a>(&'a self, pass: &mut Pass<'a>, w: &'a NormWeights<Arc<GpuTensor>>, n: usize) {
        let c = &self.model.config;
        let s = &self.scratch;
        // A LayerNorm without a bias adds zeros.
        let bias = Some(w.bias.as_ref().map_or(&s.zeros, |b| b.buffer()));
        let op = NormOp { kind: c.norm, eps: c.norm_eps, weight: w.weight.buffer(), bias };
        dispatch::norm(pass, op, &s.x, c.n_embd, n, &s.h);
    }

    /// Record the layers for `tokens`, leaving the final residual stream in `scratch.x`.
    ///
    /// Decode (a few tokens) runs each layer as six dispatches: norm + q|k|v + bias + RoPE + KV
    /// write; attention over chunks of the sequence and their merge; output projection + residual;
    /// norm + gate|up + SiLU·up (or up + GELU); down projection + residual. Prefill runs the
    /// norms, RoPE and activations as kernels of their own around tiled products (the residual
    /// adds in the products' epilogue) and attention in one pass (see ARCHITECTURE.md).
    fn encode_layers<'a>(
        &'a self,
        pass: &mut Pass<'a>,
        state: &'a GpuState,
        fused: &Fused<'a>,
        tokens: Tokens<'a>,
        max_seen: usize,
    ) {
        let len = tokens.n;
        let c = &self.model.config;
        let w = &self.weights;
        let s = &self.scratch;
        let (e, ff) = (c.n_embd, c.n_ff);
        let shape =
            AttentionShape { n_head: c.n_head, n_head_kv: c.n_head_kv, head_dim: c.head_dim };
        let (q_dim, kv_dim) = (c.q_dim(), c.kv_dim());
        let qkv_w = q_dim + 2 * kv_dim;
        let h16 = self.opts.f16_kv;
        let mode = match c.rope {
            RopeStyle::Interleaved => RopeMode::Interleaved,
            RopeStyle::HalfSplit => RopeMode::HalfSplit,
            RopeStyle::None => RopeMode::Copy,
        };
        let few = dispatch::fits_matvec(len);
        let rows = |buf| Rows { buf, row0: 0, n: len };
        let out = |buf, stride, col0| Out { buf, stride, col0 };
        let bias = |b: Option<usize>, row0: usize| b.map(|o| o + row0);
        // The input of the products after a norm: for a prefill batch of a model with RMSNorm,
        // the residual stream itself (the products fold the norm in); otherwise the norm kernel's
        // output.
        let fold_norm = !few && c.norm == Norm::Rms;
        let normed = |pass: &mut Pass<'a>, nw: &'a NormWeights<Arc<GpuTensor>>, at: NormAt| {
            if fold_norm {
                (&s.x, Some((at.weight, c.norm_eps)))
            } else {
                self.norm(pass, nw, len);
                (&s.h, None)
            }
        };
        let product = |pass: &mut Pass<'a>, t: &'a GpuTensor, b, x, rms_norm: Option<_>, y| {
            if rms_norm.is_some() {
                let opts = TiledOpts { rms_norm, ..TiledOpts::default() };
                dispatch::matmul_tiled_with(pass, t, b, rows(x), y, fused, opts);
            } else {
                dispatch::matmul(pass, t, b, rows(x), y, fused);
            }
        };
        // A product whose output is added to the residual stream (in the product's epilogue).
        let residual = |pass: &mut Pass<'a>, t: &'a GpuTensor, x, b: Option<usize>| {
            dispatch::matmul_add(pass, t, bias(b, 0), rows(x), out(&s.x, e, 0), fused);
        };

        dispatch::embedding(pass, &w.token_embd, tokens, Lookup::Ids, &s.x);
        if let Some(pe) = &w.pos_embd {
            dispatch::embedding(pass, pe, tokens, Lookup::Positions, &s.x);
        }
        for ((l, lw), plan) in w.layers.iter().enumerate().zip(&self.plans) {
            let kv = KvBuffers { kv: &state.kv[l], v_base: state.v_base(), f16: h16 };
            // Attention block.
            if few && plan.qkv.iter().all(|(t, _)| t.parts.len() == 1) {
                for (t, row0) in &plan.qkv {
                    let qkv = QkvOut {
                        row0: *row0,
                        q_dim,
                        kv_dim,
                        head_dim: c.head_dim,
                        rope_dims: c.rope_dims,
                        mode,
                        kv: kv.kv,
                        v_base: kv.v_base,
                        start: tokens.start,
                    };
                    let m = Matvec {
                        norm: Some(self.norm_in(plan.attn_norm)),
                        bias: bias(plan.qkv_bias, *row0),
                        epilogue: Epilogue::Qkv(qkv),
                    };
                    dispatch::matvec(pass, t, rows(&s.x), out(&s.q, q_dim, 0), m, fused);
                }
            } else {
                let (x, rms) = normed(pass, &lw.attn_norm, plan.attn_norm);
                for (t, row0) in &plan.qkv {
                    let o = out(&s.qkv, qkv_w, *row0);
                    product(pass, t, bias(plan.qkv_bias, *row0), x, rms, o);
                }
                let rope = |pass: &mut Pass<'a>, mode, col0, n_head, y| {
                    let x = Columns { buf: &s.qkv, stride: qkv_w, col0 };
                    let heads = Heads { n: n_head, dim: c.head_dim, rotated: c.rope_dims };
                    dispatch::rope(pass, mode, x, fused.table, tokens, heads, y);
                };
                let q_out = RopeOut { buf: &s.q, row0: 0, at_pos: false, f16: false };
                rope(pass, mode, 0, c.n_head, q_out);
                let k_out = RopeOut { buf: kv.kv, row0: 0, at_pos: true, f16: h16 };
                rope(pass, mode, q_dim, c.n_head_kv, k_out);
                let v_out = RopeOut { buf: kv.kv, row0: state.v_rows, at_pos: true, f16: h16 };
                rope(pass, RopeMode::Copy, q_dim + kv_dim, c.n_head_kv, v_out);
            }
            dispatch::attention(
                pass, &s.q, kv, tokens, shape, self.chunk, max_seen, &s.chunks, &s.attn,
            );
            residual(pass, &lw.attn_output.weight, &s.attn, plan.attn_output_bias);

            // Feed-forward block.
            let norm = Some(self.norm_in(plan.ffn_norm));
            match (&lw.ffn, &plan.gate_up) {
                (Ffn::GatedSilu { down, .. }, Some(gate_up))
                    if few && plan.gate_bias.is_none() && plan.up_bias.is_none() =>
                {
                    let m = Matvec { norm, bias: None, epilogue: Epilogue::Gated { up_row: ff } };
                    dispatch::matvec(pass, gate_up, rows(&s.x), out(&s.up, ff, 0), m, fused);
                    residual(pass, &down.weight, &s.up, plan.down_bias);
                }
                (Ffn::Gelu { up, down }, _) if few => {
                    let m = Matvec { norm, bias: bias(plan.up_bias, 0), epilogue: Epilogue::Gelu };
                    dispatch::matvec(pass, &up.weight, rows(&s.x), out(&s.up, ff, 0), m, fused);
                    residual(pass, &down.weight, &s.up, plan.down_bias);
                }
                (Ffn::GatedSilu { gate, up, down }, packed) => {
                    let (x, rms) = normed(pass, &lw.ffn_norm, plan.ffn_norm);
                    match packed {
                        Some(gu) if plan.gate_bias.is_none() && plan.up_bias.is_none() => {
                            product(pass, gu, None, x, rms, out(&s.gate_up, 2 * ff, 0));
                        }
                        _ => {
                            let (g, u) = (&gate.weight, &up.weight);
                            let o = out(&s.gate_up, 2 * ff, 0);
                            product(pass, g, bias(plan.gate_bias, 0), x, rms, o);
                            let o = out(&s.gate_up, 2 * ff, ff);
                            product(pass, u, bias(plan.up_bias, 0), x, rms, o);
                        }
                    }
                    dispatch::silu_mul(pass, &s.gate_up, &s.up, len, ff);
                    residual(pass, &down.weight, &s.up, plan.down_bias);
                }
                (Ffn::Gelu { up, down }, _) => {
                    let (x, rms) = normed(pass, &lw.ffn_norm, plan.ffn_norm);
                    let o = out(&s.up, ff, 0);
                    product(pass, &up.weight, bias(plan.up_bias, 0), x, rms, o);
                    dispatch::gelu(pass, &s.up, len * ff);
                    residual(pass, &down.weight, &s.up, plan.down_bias);
                }
            }
        }
    }
}
