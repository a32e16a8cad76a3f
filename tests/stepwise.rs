//! Beam search, its replay and scoring run step by step (as the browser's WebGPU path runs
//! them), checked against independent numbers: the lesson tables' probabilities, and a
//! transformer's one-pass all-logits scoring of the same tokens.

mod common;

use nexttoken::cpu::CpuModel;
use nexttoken::generate::{
    beam_search, prompt_ids, replay, score, BeamOptions, GenerationSummary, Scoring, StopReason,
};
use nexttoken::model::Model;
use nexttoken::table::TableModel;
use nexttoken::timing::{memcpy_bandwidth, per_second};
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{LanguageModel, Vocab};

fn load(name: &str) -> TableModel {
    let path = format!("{}/www/models/{name}.json", env!("CARGO_MANIFEST_DIR"));
    TableModel::from_json(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// `<s> words </s>` as ids.
fn sentence(model: &TableModel, words: &str) -> Vec<u32> {
    let mut ids = vec![model.bos_token().unwrap()];
    ids.extend(model.encode(words).unwrap());
    ids.push(model.eos_tokens()[0]);
    ids
}

fn score_in_chunks<M: LanguageModel>(model: &M, ids: &[u32], chunk: usize) -> Vec<f64> {
    let mut scoring = Scoring::new(model, ids, chunk).unwrap();
    while let Some(tokens) = scoring.step_input() {
        let logits = model.forward(scoring.state_mut(), &tokens, true).unwrap();
        scoring.step_output(&logits).unwrap();
    }
    assert!(scoring.is_done());
    scoring.finish().token_logprobs
}

#[test]
fn scoring_in_chunks_gives_the_lessons_probability() {
    let toy = load("lesson-toy");
    let ids = sentence(&toy, "the cat sat");
    // P(<s> the cat sat </s>) = 1 x .6 x .7 x 1 (lesson 1).
    let want = [1.0f64, 0.6, 0.7, 1.0];
    for chunk in 1..=ids.len() {
        let got = score_in_chunks(&toy, &ids, chunk);
        assert_eq!(got.len(), want.len());
        for (g, w) in got.iter().zip(want) {
            assert!((g.exp() - w).abs() < 1e-6, "chunk {chunk}: {got:?}");
        }
    }
    assert!(Scoring::new(&toy, &ids[..1], 4).is_err(), "one id leaves nothing to score");
}

#[test]
fn the_best_beam_replays_with_the_tables_probabilities() {
    let model = load("lesson-beam");
    let bos = [model.bos_token().unwrap()];
    let opts = BeamOptions { beams: 2, max_tokens: 10, length_normalise: false };
    let best = beam_search(&model, &bos, opts).unwrap().remove(0);
    let r = replay(&model, &bos, &best);
    assert_eq!(r.text, "a bird");
    assert_eq!(r.stop_reason, StopReason::Eos);
    assert_eq!(r.events.iter().map(|e| e.text.as_str()).collect::<String>(), "a bird");
    // The end token is the last event.
    assert_eq!(r.events.len(), best.ids.len() + 1);
    assert!(model.eos_tokens().contains(&r.events.last().unwrap().id));
    assert_eq!(r.events.iter().map(|e| e.position).collect::<Vec<_>>(), vec![1, 2, 3]);
    // Each token's probability is the table's: the same as scoring the sentence.
    let scored = score(&model, &sentence(&model, "a bird")).unwrap();
    for (event, want) in r.events.iter().zip(&scored.token_logprobs) {
        assert!((event.logprob as f64 - want).abs() < 1e-6, "{event:?} vs {want}");
        assert!(event.top.windows(2).all(|w| w[0].1 >= w[1].1), "alternatives best first");
        assert!(event.top.iter().any(|&(id, p)| id == event.id && (p - event.prob).abs() < 1e-6));
    }
    let p: f64 = r.events.iter().map(|e| e.prob as f64).product();
    assert!((p - 0.36).abs() < 0.005, "P(a bird) = {p}");
    let summary = r.summary(10.0);
    assert_eq!((summary.generated_tokens, summary.decode_ms), (3, 10.0));
}

#[test]
fn beam_tokens_on_a_transformer_match_one_pass_scoring() {
    let model =
        CpuModel::new(Model::open(&common::repo().join("www/models/default.gguf")).unwrap());
    let tokenizer =
        HfTokenizer::from_file(&common::repo().join("www/models/default-tokenizer.json")).unwrap();
    let prompt = prompt_ids(model.bos_token(), &tokenizer, "In the beginning").unwrap();
    let opts = BeamOptions { beams: 3, max_tokens: 8, length_normalise: false };
    let beams = beam_search(&model, &prompt, opts).unwrap();
    assert!(!beams.is_empty() && beams.len() <= 3);
    for beam in &beams {
        // Incremental top-k forwards against one all-logits pass over prompt + beam.
        let mut ids = prompt.clone();
        ids.extend(beam.tokens.iter().map(|t| t.id));
        let scored = score(&model, &ids).unwrap();
        let generated = &scored.token_logprobs[prompt.len() - 1..];
        assert_eq!(generated.len(), beam.tokens.len());
        for (token, want) in beam.tokens.iter().zip(generated) {
            assert!((token.logprob - want).abs() < 1e-4, "{} vs {want}", token.logprob);
        }
        let sum: f64 = beam.tokens.iter().map(|t| t.logprob).sum();
        assert!((beam.logprob - sum).abs() < 1e-9);
        // Scoring in chunks of 3 agrees with the single pass.
        let chunked = score_in_chunks(&model, &ids, 3);
        for (c, s) in chunked.iter().zip(&scored.token_logprobs) {
            assert!((c - s).abs() < 1e-4, "{c} vs {s}");
        }
    }
}

#[test]
fn prompt_ids_start_with_bos_and_refuse_nothing_at_all() {
    let toy = load("lesson-toy");
    assert_eq!(prompt_ids(Some(7), &toy, "").unwrap(), vec![7]);
    let the = toy.encode("the").unwrap();
    assert_eq!(prompt_ids(None, &toy, "the").unwrap(), the);
    assert!(prompt_ids(None, &toy, "").unwrap_err().to_string().contains("empty"));
}

static TICKS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A clock that advances 2 ms every time it is read.
fn ticking_clock() -> f64 {
    TICKS.fetch_add(2, std::sync::atomic::Ordering::Relaxed) as f64
}

#[test]
fn rates_count_per_second() {
    assert_eq!(per_second(30, 1500.0), 20.0);
    assert_eq!(per_second(30, 0.0), 0.0, "no time measured is no rate, not infinity");
    // Every copy takes 2 ms on this clock: 1 MiB read + 1 MiB written per 2 ms.
    let bytes = 1 << 20;
    assert_eq!(memcpy_bandwidth(bytes, ticking_clock), 2.0 * bytes as f64 / 0.002);
    let s = GenerationSummary {
        prompt_tokens: 10,
        reused_tokens: 0,
        generated_tokens: 5,
        text: String::new(),
        stop_reason: StopReason::MaxTokens,
        prefill_ms: 500.0,
        decode_ms: 2000.0,
        ttft_ms: 600.0,
        speculation: None,
    };
    // Decode counts the tokens after the first.
    assert_eq!((s.prefill_tokens_per_second(), s.decode_tokens_per_second()), (20.0, 2.0));
    // Prefill counts only the prompt tokens it ran, not those reused from a conversation's cache.
    let s = GenerationSummary { reused_tokens: 6, ..s };
    assert_eq!(s.prefill_tokens_per_second(), 8.0);
}
