//! `nexttoken synth`: a GGUF file with random weights of a real model's exact shapes, built from
//! its Hugging Face `config.json`, for benchmarks (ours and llama.cpp's on the same file) without
//! downloading the weights.
//!
//! This file reads the config; `nexttoken::synthetic` writes the model (how the weights and the
//! placeholder vocabulary are made is described there). The BOS/EOS ids are the config's.

use std::path::Path;

use serde_json::Value as Json;

use nexttoken::model::Arch;
use nexttoken::quant::GgmlType;
use nexttoken::synthetic::{self, Spec};
use nexttoken::{Error, Result};

/// The shapes and hyperparameters `synth` needs, from a Hugging Face config.
#[derive(Debug, Clone)]
pub struct SynthConfig {
    pub arch: Arch,
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
            Arch::Qwen2
        } else if model_type == "gpt2" || has("GPT2") {
            Arch::Gpt2
        } else if model_type == "llama" || has("Llama") || model_type == "mistral" {
            Arch::Llama
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
        let name = j["_name_or_path"].as_str().unwrap_or(arch.gguf_name()).to_string();
        let c = if arch == Arch::Gpt2 {
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

    /// The synthetic model of this config's shapes with weight matrices of type `ty`.
    pub fn spec(&self, ty: GgmlType, seed: u64) -> Spec {
        let special = |id: Option<u64>, default: u32| {
            id.filter(|&v| (v as usize) < self.n_vocab).map_or(default, |v| v as u32)
        };
        Spec {
            name: format!("synthetic {} ({})", self.name, ty.name()),
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            norm_eps: self.norm_eps as f32,
            rope_theta: self.rope_theta as f32,
            rope_dims: self.head_dim,
            tied: self.tied,
            weight_type: ty,
            bos: special(self.bos, 1),
            eos: special(self.eos, 2),
            seed,
            ..Spec::new(
                self.arch,
                self.n_vocab,
                self.n_embd,
                self.n_layer,
                self.n_head,
                self.n_ff,
                self.n_ctx,
            )
        }
    }
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
    let bytes = synthetic::write(&c.spec(ty, seed))?;
    std::fs::write(out, &bytes)
        .map_err(|source| Error::Io { path: out.display().to_string(), source })?;
    eprintln!(
        "wrote {} ({} {}, {} layers, n_embd {}, vocab {}, {:.1} MiB) in {:.1} s",
        out.display(),
        c.arch.gguf_name(),
        ty.name(),
        c.n_layer,
        c.n_embd,
        c.n_vocab,
        bytes.len() as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
