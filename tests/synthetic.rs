//! The synthetic-model writer against the loader: every architecture, with odd shapes (head size
//! not n_embd / n_head, partial RoPE, one key/value head), per-tensor types, the whole-blocks
//! fallback, K-quants, tied and untied outputs and `rope_freqs`, loads through `Model::from_bytes`
//! with exactly the described shapes and types, and runs to finite logits on the exact CPU path.
//! (The numbers' correctness is checked elsewhere, against transformers fixtures.)

mod common;

use nexttoken::cpu::CpuModel;
use nexttoken::generate::{self, prompt_ids, GenerateOptions};
use nexttoken::gguf::Gguf;
use nexttoken::model::{Arch, Ffn, Model, Qkv, RopeStyle};
use nexttoken::quant::{dequantize_row, GgmlType};
use nexttoken::synthetic::VocabMeta;
use nexttoken::synthetic::{self, Spec};
use nexttoken::tensor_names::{self as names, block};
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::LanguageModel;
use nexttoken::Vocab;

fn specs() -> Vec<Spec> {
    let llama = Spec {
        n_head_kv: 1,
        head_dim: 24,
        rope_dims: 16,
        rope_freqs: Some(vec![1.0, 1.5, 2.0, 4.0, 8.0, 8.0, 16.0, 32.0]),
        rope_theta: 50000.0,
        norm_eps: 1e-6,
        weight_type: GgmlType::Q8_0,
        type_overrides: vec![
            (block(0, names::FFN_DOWN), GgmlType::F16),
            (block(1, names::ATTN_V), GgmlType::Q4_0),
            // Rows of 80 are not whole super-blocks: written F16 instead.
            (names::OUTPUT.into(), GgmlType::Q6_K),
        ],
        bos: 3,
        eos: 4,
        seed: 5,
        ..Spec::new(Arch::Llama, 40, 80, 2, 5, 96, 64)
    };
    let qwen2 = Spec {
        n_head_kv: 2,
        tied: true,
        weight_type: GgmlType::Q4_K,
        type_overrides: vec![(block(0, names::ATTN_Q), GgmlType::Q6_K)],
        seed: 6,
        ..Spec::new(Arch::Qwen2, 30, 256, 2, 4, 512, 48)
    };
    let gpt2 = Spec {
        weight_type: GgmlType::BF16,
        type_overrides: vec![(block(1, names::ATTN_QKV), GgmlType::Q4_0)],
        seed: 7,
        ..Spec::new(Arch::Gpt2, 50, 64, 3, 2, 128, 20)
    };
    vec![llama, qwen2, gpt2]
}

/// The type the writer promises for matrix `name` of `spec` (the override, or the whole-blocks
/// fallback F16 when the rows are not whole blocks).
fn expected_type(spec: &Spec, name: &str, cols: usize) -> GgmlType {
    let ty = spec.type_overrides.iter().find(|(n, _)| n == name).map_or(spec.weight_type, |o| o.1);
    if cols.is_multiple_of(ty.block_size()) {
        ty
    } else {
        GgmlType::F16
    }
}

#[test]
fn written_models_load_with_the_described_shapes() {
    for spec in specs() {
        let what = spec.arch.gguf_name();
        let m = Model::from_bytes(synthetic::write(&spec).unwrap())
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let c = &m.config;
        assert_eq!(c.arch, spec.arch);
        assert_eq!(
            (c.n_vocab, c.n_embd, c.n_layer, c.n_head, c.n_head_kv, c.head_dim, c.n_ff, c.n_ctx),
            (
                spec.n_vocab,
                spec.n_embd,
                spec.n_layer,
                spec.n_head,
                spec.n_head_kv,
                spec.head_dim,
                spec.n_ff,
                spec.n_ctx
            ),
            "{what}"
        );
        assert_eq!(c.norm_eps, spec.norm_eps, "{what}");
        assert_eq!((c.bos_token, c.eos_tokens.clone()), (Some(spec.bos), vec![spec.eos]));
        if spec.arch == Arch::Gpt2 {
            assert_eq!(c.rope, RopeStyle::None);
        } else {
            assert_eq!((c.rope_theta, c.rope_dims), (spec.rope_theta, spec.rope_dims), "{what}");
        }

        // Every tensor in the file, by its role, in the type asked for.
        let w = &m.weights;
        let (e, q, kv) = (spec.n_embd, spec.q_dim(), spec.kv_dim());
        for t in &m.tensors {
            let vector = t.rows == 1 && !t.name.ends_with("token_embd.weight");
            let want = if vector { GgmlType::F32 } else { expected_type(&spec, &t.name, t.cols) };
            assert_eq!(t.ty, want, "{what}: {}", t.name);
        }
        assert_eq!(w.output.name, if spec.tied { names::TOKEN_EMBD } else { names::OUTPUT });
        assert_eq!(w.pos_embd.is_some(), spec.arch == Arch::Gpt2, "{what}");
        assert_eq!(w.output_norm.bias.is_some(), spec.arch == Arch::Gpt2, "{what}");
        let rope_freqs = m.tensors.iter().find(|t| t.name == names::ROPE_FREQS);
        assert_eq!(rope_freqs.is_some(), spec.rope_freqs.is_some(), "{what}");
        if let (Some(t), Some(want)) = (rope_freqs, &spec.rope_freqs) {
            let got: Vec<f32> =
                m.bytes(t).chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
            assert_eq!(&got, want);
        }
        assert_eq!(w.layers.len(), spec.n_layer);
        for (i, l) in w.layers.iter().enumerate() {
            match (spec.arch, &l.qkv, &l.ffn) {
                (Arch::Gpt2, Qkv::Fused(qkv), Ffn::Gelu { up, .. }) => {
                    let t = &qkv.weight;
                    assert_eq!(
                        (t.name.clone(), t.cols, t.rows),
                        (block(i, names::ATTN_QKV), e, q + 2 * kv)
                    );
                    assert!(qkv.bias.is_some() && up.bias.is_some());
                }
                (arch, Qkv::Separate { q: wq, k: wk, .. }, Ffn::GatedSilu { .. })
                    if arch != Arch::Gpt2 =>
                {
                    assert_eq!((wk.weight.cols, wk.weight.rows), (e, kv));
                    assert_eq!(wq.weight.rows, q);
                    assert_eq!(wq.bias.is_some(), arch == Arch::Qwen2, "{what} layer {i}");
                }
                _ => panic!("{what} layer {i}: wrong q/k/v or feed-forward layout"),
            }
            let wo = &l.attn_output.weight;
            assert_eq!((wo.cols, wo.rows), (q, e));
        }

        let model = CpuModel::new(m);
        let prompt: Vec<u32> = (0..7).map(|i| (i * 11 % spec.n_vocab) as u32).collect();
        let logits = model.forward(&mut model.new_state(), &prompt, true).unwrap();
        assert_eq!(logits.len(), prompt.len() * spec.n_vocab);
        assert!(logits.iter().all(|v| v.is_finite()), "{what}: non-finite logits");
        assert!(logits.iter().any(|&v| v != logits[0]), "{what}: constant logits");
    }
}

#[test]
fn same_spec_same_bytes_and_the_seed_matters() {
    let spec = &specs()[0];
    let a = synthetic::write(spec).unwrap();
    assert_eq!(a, synthetic::write(spec).unwrap());
    assert_ne!(a, synthetic::write(&Spec { seed: 99, ..spec.clone() }).unwrap());
}

#[test]
fn weights_have_the_documented_scale() {
    // Matrices: mean 0, standard deviation 1/sqrt(row length), whatever the type.
    for ty in [GgmlType::F32].into_iter().chain(GgmlType::QUANTISED) {
        let spec = Spec { weight_type: ty, ..Spec::new(Arch::Llama, 300, 256, 1, 4, 512, 16) };
        let m = Model::from_bytes(synthetic::write(&spec).unwrap()).unwrap();
        let t = m.tensors.iter().find(|t| t.name == block(0, names::FFN_UP)).unwrap();
        let mut vals = vec![0f32; t.cols * t.rows];
        for (r, out) in vals.chunks_mut(t.cols).enumerate() {
            dequantize_row(t.ty, &m.bytes(t)[r * t.row_bytes()..(r + 1) * t.row_bytes()], out);
        }
        let n = vals.len() as f64;
        let mean = vals.iter().map(|&v| v as f64).sum::<f64>() / n;
        let std = (vals.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n).sqrt();
        let want = 1.0 / (t.cols as f64).sqrt();
        assert!(mean.abs() < 0.1 * want, "{}: mean {mean}", ty.name());
        assert!((std / want - 1.0).abs() < 0.25, "{}: std {std}, want {want}", ty.name());
    }
}

#[test]
fn bad_specs_are_refused() {
    let ok = Spec::new(Arch::Llama, 40, 64, 1, 4, 96, 16);
    for (bad, needle) in [
        (Spec { n_head_kv: 3, ..ok.clone() }, "key/value heads"),
        (Spec { n_layer: 0, ..ok.clone() }, "positive"),
        (Spec { rope_dims: 18, ..ok.clone() }, "rope_dims"),
        (Spec { rope_freqs: Some(vec![1.0; 3]), ..ok.clone() }, "rope_freqs"),
        (Spec { eos: 40, ..ok.clone() }, "outside the vocabulary"),
    ] {
        let e = synthetic::write(&bad).unwrap_err().to_string();
        assert!(e.contains(needle), "{e:?} lacks {needle:?}");
    }
}

/// A synthetic model of a real shape carrying a real tokenizer copied from llama.cpp's Qwen2
/// vocabulary file: the one GGUF file is enough to tokenize, generate and decode (no
/// tokenizer.json), and the model and its tokenizer agree on BOS and the end tokens.
#[test]
fn real_tokenizer_from_a_vocab_gguf() {
    let Some(shared) = common::shared() else { return };
    let dir = shared.join("tokenizer-tests/qwen2");
    let vocab_file = std::fs::read(dir.join("ggml-vocab-qwen2.gguf")).unwrap();
    let vocab = VocabMeta::from_gguf(&Gguf::parse(&vocab_file).unwrap()).unwrap();
    let spec = Spec {
        n_head_kv: 2,
        tied: true,
        weight_type: GgmlType::Q8_0,
        seed: 9,
        ..Spec::new(Arch::Qwen2, 1, 64, 2, 4, 96, 64)
    }
    .with_vocab(vocab);
    assert_eq!((spec.n_vocab, spec.bos, spec.eos), (151936, 151643, 151643));
    let e = synthetic::write(&Spec { n_vocab: 1000, ..spec.clone() }).unwrap_err().to_string();
    assert!(e.contains("the vocabulary has 151936 tokens"), "{e}");
    let bytes = synthetic::write(&spec).unwrap();

    let tok = HfTokenizer::from_gguf_bytes(&bytes).unwrap();
    let model = CpuModel::new(Model::from_bytes(bytes).unwrap());
    let c = &model.model.config;
    assert_eq!(c.n_vocab, 151936);
    assert_eq!(c.prompt_start(), tok.special().prompt_start());
    assert_eq!(c.eos_tokens, tok.special().end_tokens());
    assert_eq!(c.bos_token, Some(151643));

    let text = "Hello world, this is Qwen2's tokenizer.";
    let ids = prompt_ids(model.bos_token(), &tok, text).unwrap();
    // Qwen2 adds no BOS; the ids are those of the real tokenizer.json.
    let json = HfTokenizer::from_file(&dir.join("tokenizer.json")).unwrap();
    assert_eq!(ids, json.encode(text).unwrap());
    assert_eq!(tok.decode(&ids), text);

    let opts = GenerateOptions { max_tokens: 6, stop_at_eos: false, ..GenerateOptions::default() };
    let mut events = Vec::new();
    let summary = generate::generate(&model, &tok, &ids, opts, |e| {
        events.push(e.id);
        true
    })
    .unwrap();
    assert_eq!(summary.generated_tokens, 6);
    assert!(events.iter().all(|&id| (id as usize) < c.n_vocab));
    assert_eq!(summary.text, tok.decode(&events));
}

/// The streamed writer (`write_to`, what `nexttoken synth` uses: a piece of a tensor in memory
/// at a time) writes the same bytes as the file assembled whole (`parts`), for every spec; a
/// shape whose tensor or file is too large is refused before a byte is written, naming it.
#[test]
fn streamed_files_are_the_assembled_ones_and_huge_shapes_are_refused() {
    for spec in specs() {
        let mut streamed = Vec::new();
        let n = synthetic::write_to(&spec, &mut streamed).unwrap();
        assert_eq!(n as usize, streamed.len());
        assert!(streamed == synthetic::parts(&spec).unwrap().into_bytes(), "{}", spec.name);
    }
    let huge = Spec::new(Arch::Llama, 49152, 1 << 20, 1, 16, 1536, 64);
    let mut out = Vec::new();
    let e = synthetic::write_to(&huge, &mut out).unwrap_err().to_string();
    assert!(e.contains("token_embd.weight") && e.contains("more than the 16 GB"), "{e}");
    assert!(out.is_empty(), "{} bytes written before the refusal", out.len());
}
