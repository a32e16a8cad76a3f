//! `nexttoken synth`: a GGUF file with random weights of a real model's exact shapes, built from
//! its Hugging Face `config.json`, for benchmarks (ours and llama.cpp's on the same file) without
//! downloading the weights.
//!
//! This file reads the config; `nexttoken::synthetic` writes the model (how the weights and the
//! placeholder vocabulary are made is described there). The BOS/EOS ids are the config's, or with
//! `--vocab-from` those of the GGUF whose tokenizer is copied.

use std::path::Path;

use serde_json::Value as Json;

use nexttoken::gguf::{split_file_name, split_gguf, Gguf};
use nexttoken::model::Arch;
use nexttoken::quant::GgmlType;
use nexttoken::synthetic::{self, Spec, VocabMeta};
use nexttoken::{Error, Result};

fn bad(msg: String) -> Error {
    Error::Model(msg)
}

/// The synthetic model of a Hugging Face config's shapes, with weight matrices of type `ty`.
pub fn spec_from_hf_json(text: &str, ty: GgmlType, seed: u64) -> Result<Spec> {
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
        return Err(bad(format!(
            "unsupported model_type {model_type:?} / architectures {archs:?} (llama, qwen2, gpt2)"
        )));
    };
    let u = |k: &str| j[k].as_u64().map(|v| v as usize);
    let need = |k: &str| u(k).ok_or_else(|| bad(format!("config lacks integer {k:?}")));
    let f = |k: &str, default: f64| j[k].as_f64().unwrap_or(default) as f32;
    let first_id = |k: &str| match &j[k] {
        Json::Number(n) => n.as_u64(),
        Json::Array(a) => a.first().and_then(|v| v.as_u64()),
        _ => None,
    };
    let name = j["_name_or_path"].as_str().unwrap_or(arch.gguf_name());
    // (vocabulary, embedding, layers, heads, key/value heads, head size, feed-forward, context)
    let (n_vocab, e, n_layer) = match arch {
        Arch::Gpt2 => (need("vocab_size")?, need("n_embd")?, need("n_layer")?),
        _ => (need("vocab_size")?, need("hidden_size")?, need("num_hidden_layers")?),
    };
    let spec = match arch {
        Arch::Gpt2 => {
            let heads = need("n_head")?;
            Spec {
                norm_eps: f("layer_norm_epsilon", 1e-5),
                tied: true,
                ..Spec::new(
                    arch,
                    n_vocab,
                    e,
                    n_layer,
                    heads,
                    u("n_inner").unwrap_or(4 * e),
                    u("n_positions").or(u("n_ctx")).unwrap_or(1024),
                )
            }
        }
        _ => {
            let heads = need("num_attention_heads")?;
            let head_dim = u("head_dim").unwrap_or(e / heads.max(1));
            Spec {
                n_head_kv: u("num_key_value_heads").unwrap_or(heads),
                head_dim,
                rope_dims: head_dim,
                norm_eps: f("rms_norm_eps", 1e-6),
                rope_theta: f("rope_theta", 10000.0),
                tied: j["tie_word_embeddings"].as_bool().unwrap_or(false),
                ..Spec::new(
                    arch,
                    n_vocab,
                    e,
                    n_layer,
                    heads,
                    need("intermediate_size")?,
                    u("max_position_embeddings").unwrap_or(4096),
                )
            }
        }
    };
    if spec.n_head == 0 || spec.n_head_kv == 0 || spec.n_head % spec.n_head_kv != 0 || n_vocab < 300
    {
        return Err(bad(format!("config has unusable head counts or vocabulary: {spec:?}")));
    }
    let special = |id: Option<u64>, default: u32| {
        id.filter(|&v| (v as usize) < n_vocab).map_or(default, |v| v as u32)
    };
    Ok(Spec {
        name: format!("synthetic {name} ({})", ty.name()),
        weight_type: ty,
        bos: special(first_id("bos_token_id"), 1),
        eos: special(first_id("eos_token_id"), 2),
        seed,
        ..spec
    })
}

/// The tokenizer metadata of the GGUF file at `path` (mapped, not read: it may be a whole model).
fn vocab_from(path: &Path) -> Result<VocabMeta> {
    let io = |source| Error::Io { path: path.display().to_string(), source };
    let file = std::fs::File::open(path).map_err(io)?;
    // SAFETY: read-only map, read once while the header is parsed.
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
    let gguf = Gguf::parse(&map)?;
    VocabMeta::from_gguf(&gguf)
        .map_err(|e| Error::Input(format!("--vocab-from {}: {e}", path.display())))
}

/// The `synth` command: read the config, write the file (or its `split` parts), say what was
/// written.
pub fn run(
    config: &Path,
    ty: &str,
    out: &Path,
    seed: u64,
    vocab: Option<&Path>,
    chat_template: Option<String>,
    split: usize,
) -> Result<()> {
    let ty = match ty.to_ascii_lowercase().as_str() {
        "f32" => GgmlType::F32,
        "f16" => GgmlType::F16,
        "q8_0" => GgmlType::Q8_0,
        "q4_0" => GgmlType::Q4_0,
        "q5_0" => GgmlType::Q5_0,
        "q5_1" => GgmlType::Q5_1,
        other => {
            return Err(Error::Input(format!(
                "--type {other}: expected q8_0, q4_0, q5_0, q5_1, f16 or f32"
            )))
        }
    };
    let text = std::fs::read_to_string(config)
        .map_err(|source| Error::Io { path: config.display().to_string(), source })?;
    let mut c = spec_from_hf_json(&text, ty, seed)?;
    if let Some(path) = vocab {
        let config_vocab = c.n_vocab;
        c = c.with_vocab(vocab_from(path)?);
        if c.n_vocab != config_vocab {
            eprintln!(
                "vocabulary: {} tokens from {} (the config says {config_vocab})",
                c.n_vocab,
                path.display()
            );
        }
    }
    c.chat_template = chat_template;
    let t0 = std::time::Instant::now();
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| Error::Io { path: path.clone(), source }
    };
    let (files, size) = if split > 1 {
        // Split: made in memory, then cut into parts.
        let bytes = synthetic::write(&c)?;
        let name = out.file_name().and_then(|n| n.to_str()).unwrap_or("model");
        let prefix = name.strip_suffix(".gguf").unwrap_or(name);
        let parts = split_gguf(&bytes, split)?;
        let mut files = Vec::new();
        for (k, part) in (1..=split).zip(parts) {
            let path = out.with_file_name(split_file_name(prefix, k, split));
            std::fs::write(&path, part).map_err(io(&path))?;
            files.push(path);
        }
        (files, bytes.len() as u64)
    } else {
        // Streamed (a piece of a tensor in memory at a time) to OUT.partial, renamed once
        // whole: a refused shape or a full disk leaves no file that looks like a model.
        let partial = out.with_extension("gguf.partial");
        let written = (|| {
            let file = std::fs::File::create(&partial).map_err(io(&partial))?;
            let mut w = std::io::BufWriter::new(file);
            let size = synthetic::write_to(&c, &mut w)?;
            std::io::Write::flush(&mut w).map_err(io(&partial))?;
            std::fs::rename(&partial, out).map_err(io(out))?;
            Ok(size)
        })();
        if written.is_err() {
            let _ = std::fs::remove_file(&partial);
        }
        (vec![out.to_path_buf()], written?)
    };
    eprintln!(
        "wrote {} ({} {}, {} layers, n_embd {}, vocab {}, {:.1} MiB) in {:.1} s",
        files.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "),
        c.arch.gguf_name(),
        ty.name(),
        c.n_layer,
        c.n_embd,
        c.n_vocab,
        size as f64 / (1 << 20) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}
