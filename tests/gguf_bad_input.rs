//! Hostile and broken GGUF files, and bad requests to a loaded model: each must give an error
//! whose message names the problem, never a panic or a huge allocation.

mod common;

use common::*;
use nexttoken::cpu::CpuModel;
use nexttoken::gguf::{Gguf, Header, Value};
use nexttoken::model::Model;
use nexttoken::quant::GgmlType;
use nexttoken::LanguageModel;
use proptest::prelude::*;

/// Load `bytes` and expect an error whose message contains every one of `needles`.
#[track_caller]
fn expect_err(bytes: Vec<u8>, needles: &[&str]) {
    match Model::from_bytes(bytes) {
        Ok(_) => panic!("expected an error containing {needles:?}, but the model loaded"),
        Err(e) => {
            let msg = e.to_string();
            for n in needles {
                assert!(msg.contains(n), "error {msg:?} does not mention {n:?}");
            }
        }
    }
}

fn valid() -> Vec<u8> {
    synth_model("llama", GgmlType::Q8_0, 7)
}

#[test]
fn the_valid_files_load() {
    // The baseline every broken file below is derived from.
    for arch in ["llama", "qwen2", "gpt2"] {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0] {
            let m = Model::from_bytes(synth_model(arch, ty, 1))
                .unwrap_or_else(|e| panic!("{arch} {ty:?}: {e}"));
            assert_eq!(m.config.n_vocab, SYNTH_VOCAB);
            assert_eq!(m.config.n_ctx, SYNTH_CTX);
        }
    }
}

#[test]
fn wrong_magic() {
    let mut b = valid();
    b[..4].copy_from_slice(b"GGML");
    expect_err(b, &["not a GGUF file"]);
    expect_err(b"hello".to_vec(), &["not a GGUF file"]);
    expect_err(Vec::new(), &["not a GGUF file", "empty"]);
}

#[test]
fn unsupported_versions() {
    for v in [0u32, 1, 4, 99, u32::MAX] {
        let mut b = valid();
        put_u32(&mut b, 4, v);
        expect_err(b, &["version", &v.to_string()]);
    }
    // Version 2 has the same layout as 3 for everything we read.
    let mut b = valid();
    put_u32(&mut b, 4, 2);
    Model::from_bytes(b).expect("a v2 header is accepted");
}

/// Where the tensor data of `bytes` really ends (the writer pads after the last tensor).
fn data_end(bytes: &[u8]) -> usize {
    let g = Gguf::parse(bytes).unwrap();
    g.tensors.iter().map(|t| t.offset + t.size_bytes).max().unwrap()
}

#[test]
fn truncated_at_every_length() {
    let b = valid();
    let end = data_end(&b);
    let header_end = Gguf::parse(&b).unwrap().data_offset;
    for len in 0..b.len() {
        let r = Model::from_bytes(b[..len].to_vec());
        if len < end {
            let Err(e) = r else { panic!("prefix of {len} of {} bytes loaded", b.len()) };
            let msg = e.to_string();
            // A cut inside the header is a truncated read; a cut in the data, a tensor past the end.
            // (A count or string length that cannot fit in what is left says so instead.)
            let named = msg.contains("truncated")
                || (len < header_end && (msg.contains("impossible") || msg.contains("are left")));
            assert!(named, "len {len}: {msg}");
        } else {
            // Only the padding after the last tensor is missing: nothing is lost.
            r.unwrap_or_else(|e| panic!("len {len} (data ends at {end}): {e}"));
        }
    }
}

/// The streamed loader reads the header from the first bytes that arrive: at every length short
/// of the header's end it asks for more (never fewer bytes than it has), from there on it gives
/// the header `Gguf::parse` gives; a file whose tensors run past the length announced is refused
/// as soon as its header is read.
#[test]
fn the_header_from_its_first_bytes() {
    for (arch, ty) in [("llama", GgmlType::Q8_0), ("gpt2", GgmlType::F32)] {
        let b = synth_model(arch, ty, 3);
        let want = Gguf::parse(&b).unwrap();
        let mut first_complete = None;
        for len in 0..=want.data_offset {
            match Gguf::parse_header(&b[..len], b.len()).unwrap() {
                Header::NeedMore(n) => {
                    assert!(first_complete.is_none(), "{arch}: need more at {len} after complete");
                    assert!(n > len && n <= want.data_offset, "{arch}: at {len} needs {n}");
                }
                Header::Complete(g) => {
                    first_complete.get_or_insert(len);
                    assert_eq!(
                        (g.tensors, g.metadata),
                        (want.tensors.clone(), want.metadata.clone())
                    );
                }
            }
        }
        // The tensor infos end within the alignment's padding before the data.
        let end = first_complete.expect("complete at the data's start");
        assert!(end + 32 > want.data_offset, "{arch}: complete at {end}");
        let e = Gguf::parse_header(&b[..end], end + 100).unwrap_err().to_string();
        assert!(e.contains("past the end of the file") && e.contains("truncated"), "{e}");
        let e = Gguf::parse_header(&b, b.len() - 1).unwrap_err().to_string();
        assert!(e.contains("arrived of a file announced"), "{e}");
    }
    // A part of a split model is refused by name (the streamed loader takes whole files).
    let parts = nexttoken::gguf::split_gguf(&valid(), 2).unwrap();
    let e = Gguf::parse_header(&parts[0], parts[0].len()).unwrap_err().to_string();
    assert!(e.contains("part 1 of 2 of a split model"), "{e}");
}

#[test]
fn tensor_data_past_the_end() {
    let b = valid();
    let (_, off) = tensor_type_and_offset_pos(&b, "output_norm.weight");
    for bad in [1u64 << 40, u64::MAX - 31, (b.len() as u64).div_ceil(32) * 32] {
        let mut b = b.clone();
        put_u64(&mut b, off, bad);
        expect_err(b, &["output_norm.weight", "past the end"]);
    }
    // Misaligned offsets are refused by name too.
    let mut b = b.clone();
    put_u64(&mut b, off, 33);
    expect_err(b, &["output_norm.weight", "not aligned"]);
}

#[test]
fn absurd_counts() {
    for count in [u64::MAX, u64::MAX / 2, 1 << 40, 1 << 20] {
        let mut b = valid();
        put_u64(&mut b, 8, count);
        expect_err(b, &["tensor count", "impossible"]);
        let mut b = valid();
        put_u64(&mut b, 16, count);
        expect_err(b, &["metadata count", "impossible"]);
    }
}

#[test]
fn absurd_string_length() {
    // The first metadata key's length sits right after the 24-byte fixed header.
    for len in [u64::MAX, 1 << 40, 1_000_000] {
        let mut b = valid();
        put_u64(&mut b, 24, len);
        expect_err(b, &["metadata key", &format!("claims {len} bytes")]);
    }
    // A string value (the architecture name).
    let mut b = valid();
    let p = metadata_type_pos(&b, "general.architecture") + 4;
    put_u64(&mut b, p, u64::MAX - 1);
    expect_err(b, &["general.architecture", "claims"]);
    // A tensor name.
    let mut b = valid();
    let p = tensor_info_pos(&b, "token_embd.weight");
    put_u64(&mut b, p, u64::MAX);
    expect_err(b, &["tensor name", "claims"]);
}

#[test]
fn absurd_array_length() {
    // tokenizer.ggml.tokens: type 9 (array), element type (u32), length (u64), elements.
    let key = "tokenizer.ggml.tokens";
    for len in [u64::MAX, 1 << 40, 1 << 24] {
        let mut b = valid();
        let p = metadata_type_pos(&b, key);
        assert_eq!(u32::from_le_bytes(b[p..p + 4].try_into().unwrap()), 9);
        put_u64(&mut b, p + 8, len);
        expect_err(b, &[key, "array length", "impossible"]);
    }
}

#[test]
fn unknown_value_type() {
    for ty in [13u32, 255, u32::MAX] {
        let mut b = valid();
        let p = metadata_type_pos(&b, "general.name");
        put_u32(&mut b, p, ty);
        expect_err(b, &["general.name", &format!("unknown value type {ty}")]);
    }
    // Unknown array element type.
    let mut b = valid();
    let p = metadata_type_pos(&b, "tokenizer.ggml.tokens");
    put_u32(&mut b, p + 4, 77);
    expect_err(b, &["tokenizer.ggml.tokens", "unknown array element type 77"]);
    // A bool that is neither 0 nor 1.
    let mut parts = synth_parts("llama", GgmlType::Q8_0, 7);
    parts.set_meta("tokenizer.ggml.add_bos_token", Value::Bool(true));
    let mut b = parts.to_bytes();
    let p = metadata_type_pos(&b, "tokenizer.ggml.add_bos_token");
    b[p + 4] = 2;
    expect_err(b, &["add_bos_token", "invalid bool"]);
}

#[test]
fn unsupported_tensor_type() {
    for (id, name) in [(10u32, "Q2_K"), (11, "Q3_K"), (3, "Q4_1"), (28, "F64"), (39, "MXFP4")] {
        let mut b = valid();
        let (ty, _) = tensor_type_and_offset_pos(&b, "token_embd.weight");
        put_u32(&mut b, ty, id);
        expect_err(b, &["token_embd.weight", name, "unsupported type"]);
    }
    let mut b = valid();
    let (ty, _) = tensor_type_and_offset_pos(&b, "token_embd.weight");
    put_u32(&mut b, ty, 1000);
    expect_err(b, &["unsupported type", "unknown id 1000"]);
}

#[test]
fn bad_dimensions() {
    let b = valid();
    let p = tensor_info_pos(&b, "token_embd.weight") + 8 + "token_embd.weight".len();
    for n_dims in [0u32, 5, u32::MAX] {
        let mut b = b.clone();
        put_u32(&mut b, p, n_dims);
        expect_err(b, &["token_embd.weight", "dimensions"]);
    }
    for d in [0u64, 1 << 33, u64::MAX] {
        let mut b = b.clone();
        put_u64(&mut b, p + 4, d);
        expect_err(b, &["token_embd.weight", "absurd dimension"]);
    }
}

#[test]
fn unknown_architecture() {
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("general.architecture", Value::String("mamba".into()));
    expect_err(parts.to_bytes(), &["unsupported architecture", "mamba"]);

    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.remove_meta("general.architecture");
    expect_err(parts.to_bytes(), &["general.architecture"]);

    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("general.architecture", Value::U32(7));
    expect_err(parts.to_bytes(), &["general.architecture"]);
}

#[test]
fn missing_metadata() {
    for key in [
        "llama.embedding_length",
        "llama.block_count",
        "llama.context_length",
        "llama.attention.head_count",
    ] {
        let mut parts = synth_parts("llama", GgmlType::F32, 7);
        parts.remove_meta(key);
        expect_err(parts.to_bytes(), &["missing", key]);
        let mut parts = synth_parts("llama", GgmlType::F32, 7);
        parts.set_meta(key, Value::U32(0));
        expect_err(parts.to_bytes(), &[key, "out of range"]);
        let mut parts = synth_parts("llama", GgmlType::F32, 7);
        parts.set_meta(key, Value::String("64".into()));
        expect_err(parts.to_bytes(), &[key]);
    }
}

#[test]
fn missing_required_tensor() {
    for (arch, name) in [
        ("llama", "blk.1.ffn_down.weight"),
        ("llama", "token_embd.weight"),
        ("llama", "output_norm.weight"),
        ("llama", "blk.0.attn_norm.weight"),
        ("llama", "blk.0.ffn_gate.weight"),
        ("gpt2", "position_embd.weight"),
        ("gpt2", "blk.0.ffn_up.weight"),
    ] {
        let mut parts = synth_parts(arch, GgmlType::F32, 7);
        parts.remove_tensor(name);
        expect_err(parts.to_bytes(), &["missing tensor", name]);
    }
    // No attention projection at all.
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.remove_tensor("blk.0.attn_k.weight");
    expect_err(parts.to_bytes(), &["layer 0", "attn_qkv"]);
    // qwen2 without its q/k/v biases.
    let mut parts = synth_parts("qwen2", GgmlType::F32, 7);
    parts.remove_tensor("blk.1.attn_v.bias");
    expect_err(parts.to_bytes(), &["qwen2", "layer 1", "biases"]);
}

#[test]
fn wrong_tensor_shape() {
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    let t = parts.tensor_mut("blk.0.attn_k.weight");
    t.dims = vec![64, 16];
    t.data.truncate(64 * 16 * 4);
    expect_err(parts.to_bytes(), &["blk.0.attn_k.weight", "shape", "expected [64, 32]"]);

    // Same element count, transposed.
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.tensor_mut("blk.1.ffn_down.weight").dims = vec![64, 96];
    expect_err(parts.to_bytes(), &["blk.1.ffn_down.weight", "expected [96, 64]"]);

    // A norm that is not F32.
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    let t = parts.tensor_mut("output_norm.weight");
    t.ty = GgmlType::F16;
    t.data.truncate(64 * 2);
    expect_err(parts.to_bytes(), &["output_norm.weight", "F16", "F32"]);

    // gpt2's position table shorter than the context.
    let mut parts = synth_parts("gpt2", GgmlType::F32, 7);
    let t = parts.tensor_mut("position_embd.weight");
    t.dims = vec![64, 16];
    t.data.truncate(64 * 16 * 4);
    expect_err(parts.to_bytes(), &["position_embd.weight", "shape"]);
}

#[test]
fn heads_not_divisible() {
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("llama.attention.head_count_kv", Value::U32(3));
    expect_err(parts.to_bytes(), &["4 attention heads", "3 key/value heads"]);

    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("llama.attention.head_count_kv", Value::U32(8));
    expect_err(parts.to_bytes(), &["8 key/value heads"]);

    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("llama.attention.head_count", Value::U32(5));
    expect_err(parts.to_bytes(), &["not a multiple of 5 heads"]);
}

#[test]
fn q4_0_row_not_whole_blocks() {
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.push_tensor("extra.weight", GgmlType::Q4_0, &[48, 2], vec![0; 2 * 2 * 18]);
    expect_err(parts.to_bytes(), &["extra.weight", "Q4_0", "block size 32"]);
    // Whole blocks in total (96 = 3 blocks) but not per row (rows of 48).
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.push_tensor("extra.weight", GgmlType::Q4_0, &[48, 2], vec![0; 3 * 18]);
    expect_err(parts.to_bytes(), &["extra.weight", "not a multiple of the block size"]);
    // Q4_K with rows of 64 (super-blocks are 256).
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.push_tensor("extra.weight", GgmlType::Q4_K, &[64, 4], vec![0; 144]);
    expect_err(parts.to_bytes(), &["extra.weight", "Q4_K", "block size 256"]);
}

#[test]
fn duplicate_names() {
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    let norm = parts.tensor_mut("output_norm.weight").clone();
    parts.tensors.push(norm);
    expect_err(parts.to_bytes(), &["duplicate tensor name", "output_norm.weight"]);

    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.metadata.push(("llama.block_count".into(), Value::U32(2)));
    expect_err(parts.to_bytes(), &["duplicate metadata key", "llama.block_count"]);
}

#[test]
fn bad_alignment() {
    for a in [0u32, 3, 48, 1 << 30] {
        let mut parts = synth_parts("llama", GgmlType::F32, 7);
        parts.set_meta("general.alignment", Value::U32(a));
        expect_err(parts.to_bytes(), &["general.alignment", "power of two"]);
    }
}

// ------------------------------------------------------------------ requests to a loaded model

fn cpu(arch: &str) -> CpuModel {
    CpuModel::new(Model::from_bytes(synth_model(arch, GgmlType::Q8_0, 3)).unwrap())
}

#[test]
fn prompt_longer_than_context() {
    for arch in ["llama", "qwen2", "gpt2"] {
        let m = cpu(arch);
        assert_eq!(m.context_length(), SYNTH_CTX);
        let long: Vec<u32> = (0..SYNTH_CTX as u32 + 1).map(|i| i % 50).collect();
        let mut s = m.new_state();
        let e = m.forward(&mut s, &long, false).unwrap_err().to_string();
        assert!(e.contains("context"), "{arch}: {e}");
        assert_eq!(m.position(&s), 0, "a refused forward leaves the state alone");

        // Exactly the context fits; one more token does not, and the state is left unchanged.
        let mut s = m.new_state();
        m.forward(&mut s, &long[..SYNTH_CTX - 2], false).unwrap();
        let e = m.forward(&mut s, &[3, 4, 5], false).unwrap_err().to_string();
        assert!(e.contains("context"), "{arch}: {e}");
        assert_eq!(m.position(&s), SYNTH_CTX - 2);
        m.forward(&mut s, &[3, 4], false).unwrap();
        let e = m.forward(&mut s, &[3], false).unwrap_err().to_string();
        assert!(e.contains("context"), "{arch}: {e}");
        assert_eq!(m.position(&s), SYNTH_CTX);

        // A capped context is enforced the same way.
        let m = cpu(arch).with_max_seq(8);
        let mut s = m.new_state();
        let e = m.forward(&mut s, &long[..9], false).unwrap_err().to_string();
        assert!(e.contains("context of 8"), "{arch}: {e}");
    }
}

#[test]
fn token_outside_vocabulary() {
    for arch in ["llama", "qwen2", "gpt2"] {
        let m = cpu(arch);
        for bad in [SYNTH_VOCAB as u32, 1000, u32::MAX] {
            let mut s = m.new_state();
            let e = m.forward(&mut s, &[1, 2, bad], false).unwrap_err().to_string();
            assert!(e.contains("vocabulary") && e.contains(&bad.to_string()), "{arch}: {e}");
            assert_eq!(m.position(&s), 0);
        }
        let mut s = m.new_state();
        let e = m.forward(&mut s, &[], false).unwrap_err().to_string();
        assert!(e.contains("no tokens"), "{arch}: {e}");
        // The last id is fine.
        m.forward(&mut s, &[SYNTH_VOCAB as u32 - 1], false).unwrap();
    }
}

// ------------------------------------------------------------------ fuzzing: never a panic

/// One way to damage a file.
#[derive(Debug, Clone)]
enum Damage {
    /// Set the byte at (position as a fraction of the file or of the header) to a value.
    Flip {
        at: f64,
        in_header: bool,
        value: u8,
    },
    /// Overwrite 8 bytes with an interesting u64.
    Word {
        at: f64,
        value: u64,
    },
    Truncate {
        at: f64,
    },
    /// Copy `len` bytes from one place over another (or insert them there).
    Splice {
        from: f64,
        to: f64,
        len: usize,
        insert: bool,
    },
    /// Remove a range.
    Delete {
        at: f64,
        len: usize,
    },
}

fn damage() -> impl Strategy<Value = Damage> {
    let frac = 0.0..1.0f64;
    let words = prop_oneof![
        Just(0u64),
        Just(1),
        Just(u64::MAX),
        Just(u32::MAX as u64),
        Just(1 << 32),
        Just(1 << 63),
        any::<u64>(),
        0u64..64,
    ];
    prop_oneof![
        4 => (frac.clone(), any::<bool>(), any::<u8>()).prop_map(|(at, in_header, value)| Damage::Flip { at, in_header, value }),
        2 => (frac.clone(), words).prop_map(|(at, value)| Damage::Word { at, value }),
        1 => frac.clone().prop_map(|at| Damage::Truncate { at }),
        1 => (frac.clone(), frac.clone(), 1usize..64, any::<bool>()).prop_map(|(from, to, len, insert)| Damage::Splice { from, to, len, insert }),
        1 => (frac.clone(), 1usize..64).prop_map(|(at, len)| Damage::Delete { at, len }),
    ]
}

fn apply(b: &mut Vec<u8>, header_len: usize, d: &Damage) {
    let pos = |f: f64, n: usize| ((f * n as f64) as usize).min(n.saturating_sub(1));
    match *d {
        Damage::Flip { at, in_header, value } => {
            let n = if in_header { header_len.min(b.len()) } else { b.len() };
            if n > 0 {
                let p = pos(at, n);
                b[p] = value;
            }
        }
        Damage::Word { at, value } => {
            // Mostly in the header, where the counts, lengths and offsets are.
            let n = header_len.min(b.len());
            if n >= 8 {
                let p = pos(at, n - 7);
                b[p..p + 8].copy_from_slice(&value.to_le_bytes());
            }
        }
        Damage::Truncate { at } => b.truncate(pos(at, b.len() + 1)),
        Damage::Splice { from, to, len, insert } => {
            if b.is_empty() {
                return;
            }
            let f = pos(from, b.len());
            let chunk: Vec<u8> = b[f..(f + len).min(b.len())].to_vec();
            let t = pos(to, header_len.min(b.len()));
            if insert {
                b.splice(t..t, chunk);
            } else {
                let end = (t + chunk.len()).min(b.len());
                b[t..end].copy_from_slice(&chunk[..end - t]);
            }
        }
        Damage::Delete { at, len } => {
            if !b.is_empty() {
                let p = pos(at, header_len.min(b.len()));
                let end = (p + len).min(b.len());
                b.drain(p..end);
            }
        }
    }
}

fn base_files() -> Vec<(Vec<u8>, usize)> {
    let mut files: Vec<_> =
        [("llama", GgmlType::Q8_0), ("qwen2", GgmlType::F16), ("gpt2", GgmlType::Q8_0)]
            .iter()
            .map(|&(arch, ty)| {
                let b = synth_model(arch, ty, 11);
                let header = Gguf::parse(&b).unwrap().data_offset;
                (b, header)
            })
            .collect();
    // A model split by gguf-split, its 3 parts laid end to end: damage anywhere (every part has
    // a header).
    let split = nexttoken::gguf::split_gguf(&files[0].0, 3).unwrap().concat();
    let len = split.len();
    files.push((split, len));
    files
}

proptest! {
    // 300 cases run in about a second; NEXTTOKEN_FUZZ_CASES=100000 for a long soak.
    #![proptest_config(ProptestConfig {
        cases: std::env::var("NEXTTOKEN_FUZZ_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(300),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    /// The streamed loader's header parse (`Gguf::parse_header`) on any prefix of a damaged
    /// file: "need more" (more than the prefix), the whole-file parse's own error, or the
    /// whole-file parse's header. A prefix never gives another answer than the whole file.
    #[test]
    fn a_prefix_parses_as_the_whole_file(which in 0usize..3, damages in proptest::collection::vec(damage(), 0..3), cut in 0.0f64..1.0) {
        thread_local! { static BASES: Vec<(Vec<u8>, usize)> = base_files(); }
        let (mut b, header) = BASES.with(|bases| bases[which].clone());
        for d in &damages {
            apply(&mut b, header, d);
        }
        // Mostly inside the header.
        let k = ((cut * cut * (header + 64) as f64) as usize).min(b.len());
        let whole = Gguf::parse_header(&b, b.len());
        match (Gguf::parse_header(&b[..k], b.len()), &whole) {
            (Ok(Header::NeedMore(n)), _) => prop_assert!(n > k, "need {} after {}", n, k),
            (Ok(Header::Complete(g)), Ok(Header::Complete(w))) => {
                prop_assert_eq!(&g.tensors, &w.tensors);
                // As text, in key order: damage can make a float NaN, which equals nothing.
                let text = |m: &std::collections::HashMap<String, _>| {
                    m.iter().map(|(k, v)| (k.clone(), format!("{v:?}"))).collect::<std::collections::BTreeMap<_, _>>()
                };
                prop_assert_eq!(text(&g.metadata), text(&w.metadata));
            }
            (Err(e), Err(w)) if e.to_string().contains("not a GGUF") => prop_assert!(w.to_string().contains("not a GGUF")),
            (Err(e), Err(w)) => prop_assert_eq!(e.to_string(), w.to_string()),
            (got, _) => prop_assert!(false, "prefix of {}: {:?}, whole file: {:?}", k, got, whole),
        }
        // The whole file: the ordinary parse's answer (a file of one part).
        match (&whole, Gguf::parse(&b)) {
            (Ok(Header::Complete(w)), Ok(g)) => prop_assert_eq!(&w.tensors, &g.tensors),
            (Err(w), Err(g)) => prop_assert_eq!(w.to_string(), g.to_string()),
            (w, g) => prop_assert!(false, "parse_header: {:?}, parse: {:?}", w, g.map(|g| g.tensors.len())),
        }
    }

    #[test]
    fn damaged_files_never_panic(which in 0usize..4, damages in proptest::collection::vec(damage(), 1..4)) {
        thread_local! { static BASES: Vec<(Vec<u8>, usize)> = base_files(); }
        let (mut b, header) = BASES.with(|bases| bases[which].clone());
        for d in &damages {
            apply(&mut b, header, d);
        }
        if let Ok(model) = Model::from_bytes(b) {
            let m = CpuModel::new(model).with_max_seq(4);
            let mut s = m.new_state();
            let logits = m.forward(&mut s, &[0], false).expect("token 0 at position 0 is always valid");
            prop_assert_eq!(logits.len(), m.vocab_size());
        }
    }
}

#[test]
fn odd_metadata_values() {
    let edit = |arch: &str, key: &str, v: Value| {
        let mut parts = synth_parts(arch, GgmlType::F32, 7);
        parts.set_meta(&format!("{arch}.{key}"), v);
        parts.to_bytes()
    };
    // RoPE dimensions must be even and fit the head (16 here).
    expect_err(edit("llama", "rope.dimension_count", Value::U32(3)), &["rope dimension count 3"]);
    expect_err(edit("llama", "rope.dimension_count", Value::U32(18)), &["rope dimension count 18"]);
    expect_err(
        edit("llama", "rope.dimension_count", Value::U32(0)),
        &["rope.dimension_count", "out of range"],
    );
    expect_err(edit("llama", "rope.dimension_count", Value::I32(-2)), &["rope.dimension_count"]);
    // Partial RoPE is legal and runs.
    let m = CpuModel::new(
        Model::from_bytes(edit("llama", "rope.dimension_count", Value::U32(8))).unwrap(),
    );
    m.forward(&mut m.new_state(), &[1, 2, 3], false).unwrap();
    // A head size that disagrees with the weights.
    expect_err(edit("llama", "attention.key_length", Value::U32(8)), &["attn_q.weight", "shape"]);
    expect_err(
        edit("llama", "attention.key_length", Value::U64(u64::MAX)),
        &["attention.key_length", "out of range"],
    );
    // Huge but in-range values must fail on the weights, not allocate.
    expect_err(edit("llama", "attention.head_count", Value::U32(1 << 24)), &["head"]);
    expect_err(
        edit("llama", "feed_forward_length", Value::U32(1 << 24)),
        &["ffn_gate.weight", "shape"],
    );
    expect_err(edit("llama", "block_count", Value::U32(1 << 24)), &["block_count", "absurd"]);
    expect_err(edit("llama", "block_count", Value::U32(3)), &["missing tensor blk.2."]);
    expect_err(
        edit("gpt2", "context_length", Value::U32(1 << 24)),
        &["position_embd.weight", "shape"],
    );
    // A long advertised context (llama has no position table) loads; the cache grows on demand.
    let m = CpuModel::new(
        Model::from_bytes(edit("llama", "context_length", Value::U32(1 << 24))).unwrap(),
    );
    assert_eq!(m.context_length(), 1 << 24);
    m.forward(&mut m.new_state(), &[1, 2, 3], false).unwrap();
    // Nonsense float hyperparameters and special-token ids are refused by name: see
    // `metadata_that_contradicts_the_tensors_or_sense`. Sane ones of every width load and run.
    for v in [Value::F32(500000.0), Value::F64(1e6), Value::U32(10000)] {
        let m =
            CpuModel::new(Model::from_bytes(edit("llama", "rope.freq_base", v.clone())).unwrap());
        m.forward(&mut m.new_state(), &[1, 2, 3], false).unwrap();
    }
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("tokenizer.ggml.bos_token_id", Value::U32(49));
    parts.set_meta("tokenizer.ggml.eos_token_id", Value::I32(2));
    let m = CpuModel::new(Model::from_bytes(parts.to_bytes()).unwrap());
    assert_eq!(m.bos_token(), Some(49));
    assert_eq!(m.eos_tokens(), [2]);
}

/// Metadata that contradicts the tensors or makes no sense is refused, naming the key (as
/// llama.cpp refuses it), instead of running and printing nonsense.
#[test]
fn metadata_that_contradicts_the_tensors_or_sense() {
    // A block count below the layers the tensors hold (2 here): one layer would run.
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("llama.block_count", Value::U32(1));
    expect_err(parts.to_bytes(), &["llama.block_count = 1", "tensors of 2 layers"]);
    // Above them: a missing tensor, as before.
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("llama.block_count", Value::U32(3));
    expect_err(parts.to_bytes(), &["missing tensor", "blk.2."]);

    let eps = "llama.attention.layer_norm_rms_epsilon";
    for bad in [f32::INFINITY, f32::NAN, 0.0, -1e-5, 2.0] {
        let mut parts = synth_parts("llama", GgmlType::F32, 7);
        parts.set_meta(eps, Value::F32(bad));
        expect_err(parts.to_bytes(), &[eps, "finite and positive"]);
    }
    let mut parts = synth_parts("gpt2", GgmlType::F32, 7);
    parts.set_meta("gpt2.attention.layer_norm_epsilon", Value::String("tiny".into()));
    expect_err(parts.to_bytes(), &["gpt2.attention.layer_norm_epsilon", "not a number"]);
    for bad in [f32::INFINITY, 1e-45, 0.0, -10000.0] {
        let mut parts = synth_parts("llama", GgmlType::F32, 7);
        parts.set_meta("llama.rope.freq_base", Value::F32(bad));
        expect_err(parts.to_bytes(), &["llama.rope.freq_base", "at least 1"]);
    }
    // An f64 beyond f32's range is not finite once stored.
    let mut parts = synth_parts("llama", GgmlType::F32, 7);
    parts.set_meta("llama.rope.freq_base", Value::F64(1e300));
    expect_err(parts.to_bytes(), &["llama.rope.freq_base"]);

    // Special-token ids outside the vocabulary (50 tokens), negative or not numbers.
    for key in [
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
    ] {
        for (bad, needle) in [
            (Value::U32(512), "outside the vocabulary of 50"),
            (Value::U32(u32::MAX), "outside the vocabulary"),
            (Value::I32(-1), "not a token id"),
            (Value::String("1".into()), "not a token id"),
        ] {
            let mut parts = synth_parts("llama", GgmlType::F32, 7);
            parts.set_meta(key, bad);
            expect_err(parts.to_bytes(), &[key, needle]);
        }
    }
    // The valid file still loads.
    Model::from_bytes(synth_model("llama", GgmlType::F32, 7)).unwrap();
}
