//! `nexttoken synth`: a GGUF file with random weights of a real model's exact shapes, built from
//! its Hugging Face `config.json`, for benchmarks (ours and llama.cpp's on the same file) without
//! downloading the weights.
//!
//! Weights are normal-ish (a sum of four uniforms, scaled to std 0.02), norms are 1, biases small;
//! the model runs without NaN and its numbers mean nothing. Matrices are written in the requested
//! type (quantised by `quant::quantize`, ggml's reference quantisers); a matrix whose rows are not
//! whole blocks of 32 is written F16 (F32 when F32 was asked for). Norms and biases are F32.
//! The vocabulary is placeholder text (`<t123>`) in llama.cpp's "llama" (SentencePiece) format
//! with the 256 byte tokens, so llama.cpp loads the file; the BOS/EOS ids are the config's.

use std::path::Path;

use rayon::prelude::*;
use serde_json::Value as Json;

use nexttoken::gguf::{GgufWriter, Value};
use nexttoken::quant::{quantize, GgmlType};
use nexttoken::{Error, Result};

/// The shapes and hyperparameters `synth` needs, from a Hugging Face config.
#[derive(Debug, Clone)]
pub struct SynthConfig {
    pub arch: &'static str,
    pub name: String,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_ctx: usize,
    pub norm_eps: f64,
    pub rope_theta: f64,
    pub tied: bool,
    pub bos: Option<u64>,
    pub eos: Option<u64>,
}

fn bad(msg: String) -> Error {
    Error::Model(msg)
}

impl SynthConfig {
    pub fn from_hf_json(text: &str) -> Result<SynthConfig> {
        let j: Json =
            serde_json::from_str(text).map_err(|e| bad(format!("config is not JSON: {e}")))?;
        let model_type = j["model_type"].as_str().unwrap_or("");
        let archs: Vec<&str> = j["architectures"]
            .as_array()
            .map_or(vec![], |a| a.iter().filter_map(|v| v.as_str()).collect());
        let has = |s: &str| archs.iter().any(|a| a.starts_with(s));
        let arch = if model_type == "qwen2" || has("Qwen2") {
            "qwen2"
        } else if model_type == "gpt2" || has("GPT2") {
            "gpt2"
        } else if model_type == "llama" || has("Llama") || model_type == "mistral" {
            "llama"
        } else {
            return Err(bad(format!("unsupported model_type {model_type:?} / architectures {archs:?} (llama, qwen2, gpt2)")));
        };
        let u = |k: &str| j[k].as_u64().map(|v| v as usize);
        let need = |k: &str| u(k).ok_or_else(|| bad(format!("config lacks integer {k:?}")));
        let first_id = |k: &str| match &j[k] {
            Json::Number(n) => n.as_u64(),
            Json::Array(a) => a.first().and_then(|v| v.as_u64()),
            _ => None,
        };
        let name = j["_name_or_path"].as_str().unwrap_or(arch).to_string();
        let c = if arch == "gpt2" {
            let e = need("n_embd")?;
            SynthConfig {
                arch,
                name,
                n_vocab: need("vocab_size")?,
                n_embd: e,
                n_layer: need("n_layer")?,
                n_head: need("n_head")?,
                n_head_kv: need("n_head")?,
                head_dim: e / need("n_head")?,
                n_ff: u("n_inner").unwrap_or(4 * e),
                n_ctx: u("n_positions").or(u("n_ctx")).unwrap_or(1024),
                norm_eps: j["layer_norm_epsilon"].as_f64().unwrap_or(1e-5),
                rope_theta: 10000.0,
                tied: true,
                bos: first_id("bos_token_id"),
                eos: first_id("eos_token_id"),
            }
        } else {
            let e = need("hidden_size")?;
            let heads = need("num_attention_heads")?;
            SynthConfig {
                arch,
                name,
                n_vocab: need("vocab_size")?,
                n_embd: e,
                n_layer: need("num_hidden_layers")?,
                n_head: heads,
                n_head_kv: u("num_key_value_heads").unwrap_or(heads),
                head_dim: u("head_dim").unwrap_or(e / heads),
                n_ff: need("intermediate_size")?,
                n_ctx: u("max_position_embeddings").unwrap_or(4096),
                norm_eps: j["rms_norm_eps"].as_f64().unwrap_or(1e-6),
                rope_theta: j["rope_theta"].as_f64().unwrap_or(10000.0),
                tied: j["tie_word_embeddings"].as_bool().unwrap_or(false),
                bos: first_id("bos_token_id"),
                eos: first_id("eos_token_id"),
            }
        };
        if c.n_head == 0 || c.n_head_kv == 0 || c.n_head % c.n_head_kv != 0 || c.n_vocab < 300 {
            return Err(bad(format!("config has unusable head counts or vocabulary: {c:?}")));
        }
        Ok(c)
    }
}

/// splitmix64, seeded per tensor row so the output does not depend on the thread count.
fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` values with mean 0 and standard deviation `std`: each is the sum of four 16-bit uniforms
/// of one 64-bit draw (Irwin-Hall, close enough to normal for random weights).
fn normalish(seed: u64, n: usize, std: f32, out: &mut [f32]) {
    let mut s = seed;
    // Sum of 4 U(0,1) has mean 2 and standard deviation sqrt(4/12).
    let scale = std / (4.0f32 / 12.0).sqrt() / 65536.0;
    for o in out.iter_mut().take(n) {
        let r = splitmix(&mut s);
        let sum = (r & 0xffff) + ((r >> 16) & 0xffff) + ((r >> 32) & 0xffff) + (r >> 48);
        *o = (sum as f32 - 2.0 * 65536.0) * scale;
    }
}

/// Random matrix of `rows` x `cols`, encoded as `ty` (or the fallback when rows are not blocks).
fn matrix(seed: u64, cols: usize, rows: usize, ty: GgmlType) -> (GgmlType, Vec<u8>) {
    let ty = if cols % ty.block_size() == 0 {
        ty
    } else if ty == GgmlType::F32 {
        GgmlType::F32
    } else {
        GgmlType::F16
    };
    let row_bytes = ty.row_bytes(cols);
    let mut data = vec![0u8; rows * row_bytes];
    data.par_chunks_mut(row_bytes * 64).enumerate().for_each(|(chunk, out)| {
        let mut vals = vec![0f32; cols];
        for (i, o) in out.chunks_exact_mut(row_bytes).enumerate() {
            let r = chunk * 64 + i;
            normalish(seed ^ (r as u64).wrapping_mul(0xD1B5_4A32_D192_ED03), cols, 0.02, &mut vals);
            o.copy_from_slice(
                &quantize(ty, &vals).expect("synth writes only F32, F16, Q8_0, Q4_0"),
            );
        }
    });
    (ty, data)
}

fn f32_bytes(v: impl Iterator<Item = f32>) -> Vec<u8> {
    v.flat_map(f32::to_le_bytes).collect()
}

/// llama.cpp's `general.file_type` (LLAMA_FTYPE_*) for a model mostly of `ty`.
fn file_type(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q8_0 => 7,
        GgmlType::BF16 => 32,
        GgmlType::Q4_K => 15,
        GgmlType::Q6_K => 18,
    }
}

/// Build the whole GGUF file in memory.
pub fn synth_gguf(c: &SynthConfig, ty: GgmlType, seed: u64) -> Result<Vec<u8>> {
    if !matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::Q8_0 | GgmlType::Q4_0) {
        return Err(Error::Input(format!(
            "synth writes f32, f16, q8_0 or q4_0, not {}",
            ty.name()
        )));
    }
    let a = c.arch;
    let key = |k: &str| format!("{a}.{k}");
    let mut w = GgufWriter::new();
    w.metadata("general.architecture", Value::String(a.into()));
    w.metadata("general.name", Value::String(format!("synthetic {} ({})", c.name, ty.name())));
    w.metadata("general.file_type", Value::U32(file_type(ty)));
    w.metadata(&key("context_length"), Value::U32(c.n_ctx as u32));
    w.metadata(&key("embedding_length"), Value::U32(c.n_embd as u32));
    w.metadata(&key("block_count"), Value::U32(c.n_layer as u32));
    w.metadata(&key("feed_forward_length"), Value::U32(c.n_ff as u32));
    w.metadata(&key("attention.head_count"), Value::U32(c.n_head as u32));
    w.metadata(&key("attention.head_count_kv"), Value::U32(c.n_head_kv as u32));
    w.metadata(&key("vocab_size"), Value::U32(c.n_vocab as u32));
    if a == "gpt2" {
        w.metadata(&key("attention.layer_norm_epsilon"), Value::F32(c.norm_eps as f32));
    } else {
        w.metadata(&key("attention.layer_norm_rms_epsilon"), Value::F32(c.norm_eps as f32));
        w.metadata(&key("rope.freq_base"), Value::F32(c.rope_theta as f32));
        w.metadata(&key("rope.dimension_count"), Value::U32(c.head_dim as u32));
        if c.head_dim * c.n_head != c.n_embd {
            w.metadata(&key("attention.key_length"), Value::U32(c.head_dim as u32));
            w.metadata(&key("attention.value_length"), Value::U32(c.head_dim as u32));
        }
    }

    // Vocabulary: <unk> at 0, BOS/EOS as control tokens, the 256 byte tokens, placeholders.
    let bos = c.bos.filter(|&b| (b as usize) < c.n_vocab).unwrap_or(1) as usize;
    let eos = c.eos.filter(|&e| (e as usize) < c.n_vocab).unwrap_or(2) as usize;
    let mut tokens: Vec<String> = (0..c.n_vocab).map(|i| format!("<t{i}>")).collect();
    let mut types = vec![1i32; c.n_vocab]; // NORMAL
    tokens[0] = "<unk>".into();
    types[0] = 2; // UNKNOWN
    tokens[bos] = "<s>".into();
    types[bos] = 3; // CONTROL
    if eos != bos {
        tokens[eos] = "</s>".into();
    }
    types[eos] = 3;
    let mut byte = 0usize;
    for id in 1..c.n_vocab {
        if byte == 256 {
            break;
        }
        if id != bos && id != eos {
            tokens[id] = format!("<0x{byte:02X}>");
            types[id] = 6; // BYTE
            byte += 1;
        }
    }
    w.metadata("tokenizer.ggml.model", Value::String("llama".into()));
    w.metadata(
        "tokenizer.ggml.tokens",
        Value::Array(tokens.into_iter().map(Value::String).collect()),
    );
    w.metadata(
        "tokenizer.ggml.scores",
        Value::Array((0..c.n_vocab).map(|i| Value::F32(-(i as f32))).collect()),
    );
    w.metadata(
        "tokenizer.ggml.token_type",
        Value::Array(types.into_iter().map(Value::I32).collect()),
    );
    w.metadata("tokenizer.ggml.unknown_token_id", Value::U32(0));
    w.metadata("tokenizer.ggml.bos_token_id", Value::U32(bos as u32));
    w.metadata("tokenizer.ggml.eos_token_id", Value::U32(eos as u32));
    w.metadata("tokenizer.ggml.add_bos_token", Value::Bool(a == "llama"));
    w.metadata("tokenizer.ggml.add_eos_token", Value::Bool(false));

    let (e, ff, v) = (c.n_embd, c.n_ff, c.n_vocab);
    let (q, kv) = (c.n_head * c.head_dim, c.n_head_kv * c.head_dim);
    let mut tensor_seed = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED;
    let mut next_seed = || {
        tensor_seed = tensor_seed.wrapping_add(0x632B_E59B_D9B4_E019);
        tensor_seed
    };
    let mat = |w: &mut GgufWriter, name: &str, cols: usize, rows: usize, s: u64| {
        let (t, data) = matrix(s, cols, rows, ty);
        w.tensor(name, t, &[cols, rows], data);
    };
    let vector = |w: &mut GgufWriter, name: &str, n: usize, value: Option<f32>, s: u64| {
        let data = match value {
            Some(x) => f32_bytes(std::iter::repeat_n(x, n)),
            None => {
                let mut vals = vec![0f32; n];
                normalish(s, n, 0.02, &mut vals);
                f32_bytes(vals.into_iter())
            }
        };
        w.tensor(name, GgmlType::F32, &[n], data);
    };

    mat(&mut w, "token_embd.weight", e, v, next_seed());
    if a == "gpt2" {
        mat(&mut w, "position_embd.weight", e, c.n_ctx, next_seed());
    }
    for i in 0..c.n_layer {
        let n = |s: &str| format!("blk.{i}.{s}");
        vector(&mut w, &n("attn_norm.weight"), e, Some(1.0), 0);
        if a == "gpt2" {
            vector(&mut w, &n("attn_norm.bias"), e, None, next_seed());
            mat(&mut w, &n("attn_qkv.weight"), e, q + 2 * kv, next_seed());
            vector(&mut w, &n("attn_qkv.bias"), q + 2 * kv, None, next_seed());
        } else {
            mat(&mut w, &n("attn_q.weight"), e, q, next_seed());
            mat(&mut w, &n("attn_k.weight"), e, kv, next_seed());
            mat(&mut w, &n("attn_v.weight"), e, kv, next_seed());
            if a == "qwen2" {
                vector(&mut w, &n("attn_q.bias"), q, None, next_seed());
                vector(&mut w, &n("attn_k.bias"), kv, None, next_seed());
                vector(&mut w, &n("attn_v.bias"), kv, None, next_seed());
            }
        }
        mat(&mut w, &n("attn_output.weight"), q, e, next_seed());
        vector(&mut w, &n("ffn_norm.weight"), e, Some(1.0), 0);
        if a == "gpt2" {
            vector(&mut w, &n("attn_output.bias"), e, None, next_seed());
            vector(&mut w, &n("ffn_norm.bias"), e, None, next_seed());
            mat(&mut w, &n("ffn_up.weight"), e, ff, next_seed());
            vector(&mut w, &n("ffn_up.bias"), ff, None, next_seed());
            mat(&mut w, &n("ffn_down.weight"), ff, e, next_seed());
            vector(&mut w, &n("ffn_down.bias"), e, None, next_seed());
        } else {
            mat(&mut w, &n("ffn_gate.weight"), e, ff, next_seed());
            mat(&mut w, &n("ffn_up.weight"), e, ff, next_seed());
            mat(&mut w, &n("ffn_down.weight"), ff, e, next_seed());
        }
    }
    vector(&mut w, "output_norm.weight", e, Some(1.0), 0);
    if a == "gpt2" {
        vector(&mut w, "output_norm.bias", e, None, next_seed());
    }
    if !c.tied {
        mat(&mut w, "output.weight", e, v, next_seed());
    }
    Ok(w.to_bytes())
}

/// The `synth` command: read the config, write the file, say what was written.
pub fn run(config: &Path, ty: &str, out: &Path, seed: u64) -> Result<()> {
    let ty = match ty.to_ascii_lowercase().as_str() {
        "f32" => GgmlType::F32,
        "f16" => GgmlType::F16,
        "q8_0" => GgmlType::Q8_0,
        "q4_0" => GgmlType::Q4_0,
        other => {
            return Err(Error::Input(format!("--type {other}: expected q8_0, q4_0, f16 or f32")))
        }
    };
    let text = std::fs::read_to_string(config)
        .map_err(|source| Error::Io { path: config.display().to_string(), source })?;
    let c = SynthConfig::from_hf_json(&text)?;
    let t0 = std::time::Instant::now();
    let bytes = synth_gguf(&c, ty, seed)?;
    std::fs::write(out, &bytes)
        .map_err(|source| Error::Io { path: out.display().to_string(), source })?;
    eprintln!(
        "wrote {} ({} {}, {} layers, n_embd {}, vocab {}, {:.1} MiB) in {:.1} s",
        out.display(),
        c.arch,
        ty.name(),
        c.n_layer,
        c.n_embd,
        c.n_vocab,
        bytes.len() as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
