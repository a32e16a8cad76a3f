//! `nexttoken info`: what a model file holds (architecture, shapes, tensor types and bytes).

use std::path::Path;

use nexttoken::gguf::Gguf;
use nexttoken::model::Model;
use nexttoken::table::TableModel;
use nexttoken::{LanguageModel, Result};

use super::load::{default_model, read_text};

pub(crate) fn run_info(path: Option<&Path>) -> Result<()> {
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
