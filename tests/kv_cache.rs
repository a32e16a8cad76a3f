//! The KV cache must not change the numbers: decoding token by token with the cache gives the same
//! logits as recomputing the whole prefix from scratch, prefill in one pass equals feeding the
//! prompt one token at a time, `all_logits` rows equal the per-step logits, and a cloned state is
//! independent of the original.

mod common;

use common::*;
use nexttoken::cpu::CpuModel;
use nexttoken::model::Model;
use nexttoken::quant::GgmlType;
use nexttoken::LanguageModel;

const TOL: f32 = 1e-4;
const STEPS: usize = 20;

fn synth_cpu(arch: &str, ty: GgmlType) -> CpuModel {
    CpuModel::new(Model::from_bytes(synth_model(arch, ty, 0)).unwrap())
}

fn synth_cases() -> Vec<(String, CpuModel, Vec<u32>)> {
    let mut out = Vec::new();
    for arch in ["llama", "qwen2", "gpt2"] {
        for ty in [GgmlType::F32, GgmlType::F16, GgmlType::Q8_0] {
            out.push((
                format!("{arch} {}", ty.name()),
                synth_cpu(arch, ty),
                vec![SYNTH_BOS, 7, 19, 33, 4],
            ));
        }
    }
    out
}

/// stories260K (a real llama model with grouped-query attention and tied embeddings), if present.
fn shared_cases() -> Vec<(String, CpuModel, Vec<u32>)> {
    let Some(shared) = common::shared() else { return Vec::new() };
    let dir = shared.join("models/stories260K");
    // BOS + "Once upon a time" (see ../shared/README.md).
    let prompt = vec![1, 403, 407, 261, 378];
    ["stories260K-f32.gguf", "stories260K-q8_0.gguf"]
        .iter()
        .filter(|f| dir.join(f).is_file())
        .map(|f| (f.to_string(), CpuModel::new(Model::open(&dir.join(f)).unwrap()), prompt.clone()))
        .collect()
}

fn all_cases() -> Vec<(String, CpuModel, Vec<u32>)> {
    let mut v = synth_cases();
    v.extend(shared_cases());
    v
}

/// Logits of the last token of `tokens`, computed from an empty state in one pass.
fn recompute(m: &CpuModel, tokens: &[u32]) -> Vec<f32> {
    let mut s = m.new_state();
    m.forward(&mut s, tokens, false).unwrap()
}

#[test]
fn cached_decode_matches_full_recompute() {
    for (name, m, prompt) in all_cases() {
        let mut state = m.new_state();
        let mut tokens = prompt.clone();
        let mut logits = m.forward(&mut state, &prompt, false).unwrap();
        assert_eq!(logits.len(), m.vocab_size(), "{name}");
        let mut worst = 0f32;
        let mut distinct = std::collections::HashSet::new();
        for step in 0..=STEPS {
            let fresh = recompute(&m, &tokens);
            let d = max_abs_diff(&logits, &fresh);
            assert!(
                d <= TOL,
                "{name}: step {step} ({} tokens): cached vs recomputed logits differ by {d}",
                tokens.len()
            );
            assert!(logits.iter().all(|v| v.is_finite()), "{name}: step {step}: non-finite logits");
            worst = worst.max(d);
            if step == STEPS {
                break;
            }
            let next = argmax(&logits) as u32;
            distinct.insert(next);
            tokens.push(next);
            logits = m.forward(&mut state, &[next], false).unwrap();
            assert_eq!(m.position(&state), tokens.len(), "{name}");
        }
        eprintln!(
            "{name}: {STEPS} cached steps, worst |diff| {worst:e}, {} distinct tokens",
            distinct.len()
        );
    }
}

#[test]
fn prefill_equals_token_by_token_and_all_logits_rows() {
    for (name, m, prompt) in all_cases() {
        // A longer prompt than the decode test: the prompt plus a few more ids.
        let mut prompt = prompt.clone();
        prompt.extend([3u32, 11, 5, 0, 9, 2]);
        let v = m.vocab_size();

        let mut one_pass = m.new_state();
        let all = m.forward(&mut one_pass, &prompt, true).unwrap();
        assert_eq!(all.len(), prompt.len() * v, "{name}: all_logits has one row per token");
        let mut last_pass = m.new_state();
        let last = m.forward(&mut last_pass, &prompt, false).unwrap();
        assert_eq!(m.position(&one_pass), prompt.len());
        assert_eq!(m.position(&last_pass), prompt.len());
        let d = max_abs_diff(&last, &all[(prompt.len() - 1) * v..]);
        assert!(d <= TOL, "{name}: last all_logits row vs last-only logits differ by {d}");

        let mut stepwise = m.new_state();
        for (i, &t) in prompt.iter().enumerate() {
            // With one token, all_logits or not gives the same single row; alternate them.
            let step = m.forward(&mut stepwise, &[t], i % 2 == 1).unwrap();
            let row = &all[i * v..(i + 1) * v];
            let d = max_abs_diff(&step, row);
            assert!(
                d <= TOL,
                "{name}: token {i}: step-by-step logits vs all_logits row differ by {d}"
            );
        }
        let d = max_abs_diff(
            &m.forward(&mut stepwise.clone(), &[4], false).unwrap(),
            &m.forward(&mut one_pass.clone(), &[4], false).unwrap(),
        );
        assert!(
            d <= TOL,
            "{name}: caches filled in one pass vs step by step continue differently ({d})"
        );

        // Mixed chunking: the prompt in uneven pieces, with all_logits, reproduces every row.
        let mut chunked = m.new_state();
        let mut rows = Vec::new();
        let mut i = 0;
        for len in [3usize, 1, 4, 2, 7] {
            if i >= prompt.len() {
                break;
            }
            let end = (i + len).min(prompt.len());
            rows.extend(m.forward(&mut chunked, &prompt[i..end], true).unwrap());
            i = end;
        }
        if i < prompt.len() {
            rows.extend(m.forward(&mut chunked, &prompt[i..], true).unwrap());
        }
        let d = max_abs_diff(&rows, &all);
        assert!(d <= TOL, "{name}: chunked prefill rows vs one-pass rows differ by {d}");
    }
}

#[test]
fn cloned_states_do_not_interfere() {
    for (name, m, prompt) in all_cases() {
        let mut original = m.new_state();
        m.forward(&mut original, &prompt, false).unwrap();
        let mut clone = original.clone();

        // Diverge: different tokens into each, interleaved.
        let (a, b) = ([5u32, 6, 7, 8], [9u32, 10, 11, 12]);
        let mut seq_a = prompt.clone();
        let mut seq_b = prompt.clone();
        for i in 0..a.len() {
            let la = m.forward(&mut original, &[a[i]], false).unwrap();
            seq_a.push(a[i]);
            let lb = m.forward(&mut clone, &[b[i]], false).unwrap();
            seq_b.push(b[i]);
            let da = max_abs_diff(&la, &recompute(&m, &seq_a));
            let db = max_abs_diff(&lb, &recompute(&m, &seq_b));
            assert!(da <= TOL, "{name}: original after {} diverging steps is off by {da}", i + 1);
            assert!(db <= TOL, "{name}: clone after {} diverging steps is off by {db}", i + 1);
            assert!(
                max_abs_diff(&la, &lb) > TOL,
                "{name}: different inputs gave the same logits (degenerate model?)"
            );
        }
        assert_eq!(m.position(&original), seq_a.len());
        assert_eq!(m.position(&clone), seq_b.len());

        // A clone taken now and dropped after use leaves the original untouched.
        {
            let mut scratch = original.clone();
            m.forward(&mut scratch, &[1, 2, 3], false).unwrap();
        }
        let la = m.forward(&mut original, &[13], false).unwrap();
        seq_a.push(13);
        let da = max_abs_diff(&la, &recompute(&m, &seq_a));
        assert!(da <= TOL, "{name}: original disturbed by a scratch clone ({da})");

        // A failed forward (out of vocabulary) leaves the state usable and unchanged.
        let before = m.position(&clone);
        assert!(m.forward(&mut clone, &[m.vocab_size() as u32], false).is_err());
        assert_eq!(m.position(&clone), before);
        let lb = m.forward(&mut clone, &[14], false).unwrap();
        seq_b.push(14);
        let db = max_abs_diff(&lb, &recompute(&m, &seq_b));
        assert!(db <= TOL, "{name}: clone after a refused forward is off by {db}");
    }
}
