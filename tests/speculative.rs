//! Speculative decoding keeps the model's output: greedy runs equal plain greedy token for
//! token whatever the drafter guesses; sampling with a drafter that guesses without a
//! distribution (prompt lookup, a replay) equals the plain run with the same seed; a draft
//! model sampling its guesses leaves the distribution of the output as the model's (chi-square
//! against the exact distribution); the rejection rule itself against an exact enumeration; and
//! after a rejection the KV cache is what plain decoding leaves.

mod common;

use common::{synth_spec, SYNTH_BOS};
use nexttoken::constraint::ConstraintSpec;
use nexttoken::cpu::{CpuModel, Precision};
use nexttoken::generate::speculative::{accept_probability, residual, DraftLength, Outcome};
use nexttoken::generate::{
    prompt_ids, DraftSource, GenerateOptions, Generation, SpeculativeOptions, TokenEvent,
};
use nexttoken::lm::IdsOnly;
use nexttoken::model::Model;
use nexttoken::quant::GgmlType;
use nexttoken::sampling::{softmax, SamplerConfig};
use nexttoken::table::TableModel;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::{LanguageModel, Vocab};

/// A synthetic model with room for long generations (context 256).
fn synth(arch: &str, ty: GgmlType, seed: u64, precision: Precision) -> CpuModel {
    let spec = nexttoken::synthetic::Spec { n_ctx: 256, ..synth_spec(arch, ty, seed) };
    let model = Model::from_bytes(nexttoken::synthetic::write(&spec).unwrap()).unwrap();
    CpuModel::new(model).with_precision(precision)
}

/// Every model the greedy checks run on: synthetic llama, qwen2 and gpt2, and stories260K when
/// ../shared has it, each on the exact and the fast CPU paths.
fn models() -> Vec<(String, CpuModel, Vec<u32>)> {
    let mut out = Vec::new();
    for precision in [Precision::Exact, Precision::Fast] {
        for arch in ["llama", "qwen2", "gpt2"] {
            let name = format!("synthetic {arch} Q8_0 {precision:?}");
            out.push((name, synth(arch, GgmlType::Q8_0, 3, precision), vec![SYNTH_BOS, 7, 19, 33]));
        }
        if let Some(shared) = common::shared() {
            for file in ["stories260K-f32.gguf", "stories260K-q8_0.gguf"] {
                let path = shared.join("models/stories260K").join(file);
                let model = CpuModel::new(Model::open(&path).unwrap()).with_precision(precision);
                // "Once upon a time" in stories260K's vocabulary, after BOS.
                out.push((format!("{file} {precision:?}"), model, vec![1, 403, 407, 261, 378]));
            }
        }
    }
    out
}

fn run<M: LanguageModel>(
    model: &M,
    vocab: &dyn Vocab,
    prompt: &[u32],
    opts: GenerateOptions,
) -> (Vec<TokenEvent>, nexttoken::generate::GenerationSummary) {
    // A stopped clock: the draft length then follows acceptance alone (a pass that costs more
    // than its tokens backs off, which would make the counts below depend on this host's speed).
    let state = model.new_state();
    let mut g: Generation<M> =
        Generation::resume_with_clock(model, vocab, state, prompt, opts, || 0.0).unwrap();
    let mut events = Vec::new();
    while let Some(event) = g.step().unwrap() {
        events.push(event);
    }
    (events, g.summary().unwrap())
}

fn ids(events: &[TokenEvent]) -> Vec<u32> {
    events.iter().map(|e| e.id).collect()
}

fn plain(max_tokens: usize, sampler: SamplerConfig) -> GenerateOptions {
    GenerateOptions { max_tokens, sampler, stop_at_eos: false, ..GenerateOptions::default() }
}

fn with(opts: &GenerateOptions, source: DraftSource, max_draft: usize) -> GenerateOptions {
    GenerateOptions { speculative: Some(SpeculativeOptions { source, max_draft }), ..opts.clone() }
}

/// A drafter that guesses pseudo-random tokens.
fn random_tokens(n: usize, n_vocab: usize, seed: u64) -> Vec<u32> {
    let mut rng = common::SplitMix64(seed);
    (0..n).map(|_| rng.below(n_vocab as u64) as u32).collect()
}

#[test]
fn greedy_speculation_is_plain_greedy_token_for_token() {
    const N: usize = 40;
    for (name, model, prompt) in models() {
        let opts = plain(N, SamplerConfig::greedy());
        let (want, _) = run(&model, &IdsOnly, &prompt, opts.clone());
        let want = ids(&want);
        assert_eq!(want, common::greedy(&model, &prompt, N), "{name}: plain greedy");
        let n_vocab = model.vocab_size();
        let drafters = [
            ("always right", DraftSource::Replay { tokens: want.clone(), wrong_every: 0 }),
            ("always wrong", DraftSource::Replay { tokens: want.clone(), wrong_every: 1 }),
            ("every other wrong", DraftSource::Replay { tokens: want.clone(), wrong_every: 2 }),
            (
                "random",
                DraftSource::Replay { tokens: random_tokens(N, n_vocab, 9), wrong_every: 0 },
            ),
            ("prompt lookup", DraftSource::lookup()),
        ];
        for (drafter, source) in drafters {
            for k in [1, 4, 7] {
                let (got, summary) = run(&model, &IdsOnly, &prompt, with(&opts, source.clone(), k));
                assert_eq!(ids(&got), want, "{name}, {drafter}, k = {k}");
                let stats = summary.speculation.unwrap();
                match drafter {
                    "always right" => {
                        assert_eq!(stats.accepted, stats.drafted, "{name}: {stats:?}");
                        assert!(
                            stats.tokens_per_pass(summary.generated_tokens) > 1.0 + 0.6 * k as f64,
                            "{name}, k = {k}: {stats:?}"
                        );
                    }
                    "always wrong" => {
                        // A replay guesses for free, so its guesses are checked between passes,
                        // and none being right, no pass is tried.
                        assert_eq!(stats.passes, 0, "{name}, k = {k}: {stats:?}");
                    }
                    _ => {}
                }
                // The events say which guesses were kept, and the kept ones are the tokens.
                for e in &got {
                    if let Some(s) = &e.speculated {
                        let expect = match s.drafted.get(s.row) {
                            None => Outcome::Bonus,
                            Some(&d) if d == e.id => Outcome::Accepted,
                            Some(_) => Outcome::Rejected,
                        };
                        assert_eq!(s.outcome, expect, "{name}, {drafter}: {s:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn speculative_tokens_carry_their_own_rows_candidates_and_probabilities() {
    // The events of a verification pass describe the row each token was sampled from (its
    // probability, alternatives and candidates for the sampler view), as plain steps do.
    for (name, model, prompt) in models() {
        let opts = GenerateOptions { keep_candidates: 8, ..plain(30, SamplerConfig::greedy()) };
        let (want, _) = run(&model, &IdsOnly, &prompt, opts.clone());
        let source = DraftSource::Replay { tokens: ids(&want), wrong_every: 3 };
        let (got, _) = run(&model, &IdsOnly, &prompt, with(&opts, source, 4));
        assert!(got.iter().any(|e| e.speculated.is_some()), "{name}: nothing speculated");
        for (a, b) in got.iter().zip(&want) {
            let same = |x: f32, y: f32| (x - y).abs() <= 1e-4 * (1.0 + y.abs());
            assert!(same(a.logprob, b.logprob), "{name} at {}: {a:?} vs {b:?}", b.position);
            let ids = |e: &TokenEvent| e.candidates.iter().map(|c| c.0).collect::<Vec<_>>();
            assert_eq!(ids(a), ids(b), "{name} at {}: candidates", b.position);
            assert!(a.candidates.iter().zip(&b.candidates).all(|(x, y)| same(x.1, y.1)));
            assert_eq!(
                a.top.iter().map(|t| t.0).collect::<Vec<_>>(),
                b.top.iter().map(|t| t.0).collect::<Vec<_>>()
            );
        }
    }
}

#[test]
fn sampling_with_guesses_made_without_a_distribution_is_the_plain_run() {
    // Prompt lookup and replays guess without a distribution: each row is sampled exactly as a
    // plain step samples it, so with one seed the tokens are the plain run's, whatever the
    // filters, the penalty and the guesses.
    let model = synth("llama", GgmlType::Q8_0, 5, Precision::Fast);
    let prompt = [SYNTH_BOS, 7, 19, 33, 7, 19];
    let samplers = [
        SamplerConfig { temperature: 1.0, ..SamplerConfig::default() },
        SamplerConfig { temperature: 0.7, top_k: 10, ..SamplerConfig::default() },
        SamplerConfig { temperature: 1.2, top_p: 0.8, min_p: 0.02, ..SamplerConfig::default() },
        SamplerConfig { temperature: 0.9, repeat_penalty: 1.3, ..SamplerConfig::default() },
    ];
    let mut passes = [0; 3];
    for (i, sampler) in samplers.into_iter().enumerate() {
        for seed in 0..6 {
            let opts = plain(60, SamplerConfig { seed, ..sampler.clone() });
            let (want, _) = run(&model, &IdsOnly, &prompt, opts.clone());
            let want = ids(&want);
            for (j, source) in [
                DraftSource::lookup(),
                DraftSource::Lookup { min_ngram: 1, max_ngram: 1 },
                DraftSource::Replay { tokens: want.clone(), wrong_every: 3 },
            ]
            .into_iter()
            .enumerate()
            {
                let (got, summary) = run(&model, &IdsOnly, &prompt, with(&opts, source.clone(), 5));
                assert_eq!(ids(&got), want, "sampler {i}, seed {seed}, {source:?}");
                passes[j] += summary.speculation.unwrap().passes;
            }
        }
    }
    // Passes, not only plain steps, made those tokens: lookup's passes come only after a guess
    // checked between passes was right, which on this random model is rarer.
    assert!(passes.iter().all(|&p| p > 0), "passes: {passes:?}");
}

#[test]
fn constrained_generation_with_speculation_is_the_plain_run() {
    // The shipped default model with its tokenizer: a JSON object, greedy and sampled.
    let repo = common::repo();
    let model = CpuModel::new(Model::open(&repo.join("www/models/default.gguf")).unwrap());
    let vocab = HfTokenizer::from_file(&repo.join("www/models/default-tokenizer.json")).unwrap();
    let prompt = prompt_ids(model.bos_token(), &vocab, "The record reads").unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"name": {"type": "string"}, "verse": {"type": "string"}},
        "required": ["name", "verse"]
    });
    let spec = ConstraintSpec::JsonSchema { schema };
    for sampler in [
        SamplerConfig::greedy(),
        SamplerConfig { temperature: 0.8, seed: 4, ..SamplerConfig::default() },
    ] {
        let opts = GenerateOptions {
            max_tokens: 48,
            sampler,
            constraint: Some(spec.clone()),
            ..GenerateOptions::default()
        };
        let (want, plain_summary) = run(&model, &vocab, &prompt, opts.clone());
        let (got, summary) = run(&model, &vocab, &prompt, with(&opts, DraftSource::lookup(), 4));
        assert_eq!(ids(&got), ids(&want));
        assert_eq!(summary.text, plain_summary.text);
        assert_eq!(summary.stop_reason, plain_summary.stop_reason);
    }
}

#[test]
fn after_a_rejection_the_cache_is_what_plain_decoding_leaves() {
    for (name, model, prompt) in models() {
        let opts = plain(24, SamplerConfig::greedy());
        let mut g = Generation::new(&model, &IdsOnly, &prompt, opts.clone()).unwrap();
        while g.step().unwrap().is_some() {}
        let want = g.generated_ids().to_vec();
        let (plain_held, mut plain_state) = (g.held_ids().to_vec(), g.into_state());
        for wrong_every in [1, 2, 3] {
            let source = DraftSource::Replay { tokens: want.clone(), wrong_every };
            let mut g = Generation::new(&model, &IdsOnly, &prompt, with(&opts, source, 4)).unwrap();
            // Stop in the middle of a pass too: after a kept guess whose next row is waiting.
            let mut stopped_mid_pass = false;
            while let Some(e) = g.step().unwrap() {
                let kept = e.speculated.as_ref().is_some_and(|s| s.outcome == Outcome::Accepted);
                if wrong_every == 3 && kept && g.generated_ids().len() >= 12 {
                    g.abort();
                    stopped_mid_pass = true;
                }
            }
            let held = g.held_ids().to_vec();
            let mut state = g.into_state();
            assert_eq!(model.position(&state), held.len(), "{name}");
            if !stopped_mid_pass {
                assert_eq!(held, plain_held, "{name}, wrong every {wrong_every}");
            }
            // The next step's logits from the speculative run's cache equal plain decoding's at
            // the same tokens (the plain one cut back to the same length).
            let mut plain_cut = plain_state.clone();
            model.truncate(&mut plain_cut, held.len()).unwrap();
            let next = want[held.len() - prompt.len()];
            let a = model.forward(&mut state, &[next], false).unwrap();
            let b = model.forward(&mut plain_cut, &[next], false).unwrap();
            let diff = common::max_abs_diff(&a, &b);
            assert!(diff < 2e-3, "{name}, wrong every {wrong_every}: logits differ by {diff}");
        }
        // The plain state still works (it was cloned, not moved).
        model.forward(&mut plain_state, &[want[0]], false).unwrap();
    }
}

/// ln Γ by Lanczos (g = 7), for the chi-square distribution's tail.
fn ln_gamma(x: f64) -> f64 {
    const C: [f64; 9] = [
        0.999_999_999_999_809_9,
        676.520_368_121_885_1,
        -1_259.139_216_722_402_8,
        771.323_428_777_653_1,
        -176.615_029_162_140_6,
        12.507_343_278_686_905,
        -0.138_571_095_265_720_12,
        9.984_369_578_019_572e-6,
        1.505_632_735_149_311_6e-7,
    ];
    let x = x - 1.0;
    let t = x + 7.5;
    let sum: f64 = C[0] + (1..9).map(|i| C[i] / (x + i as f64)).sum::<f64>();
    0.5 * (2.0 * std::f64::consts::PI).ln() + (x + 0.5) * t.ln() - t + sum.ln()
}

/// P(X >= x) for a chi-square variable with `df` degrees of freedom (regularised upper incomplete
/// gamma by its series).
fn chi_square_tail(x: f64, df: usize) -> f64 {
    let (a, x) = (df as f64 / 2.0, x / 2.0);
    let (mut term, mut sum) = (1.0 / a, 1.0 / a);
    for n in 1..10_000 {
        term *= x / (a + n as f64);
        sum += term;
        if term < sum * 1e-15 {
            break;
        }
    }
    1.0 - (a * x.ln() - x - ln_gamma(a) + sum.ln()).exp()
}

/// The chi-square statistic's tail probability of `counts` (of `n` draws) against the exact
/// probabilities `want`, cells with fewer than 5 expected draws pooled.
fn goodness_of_fit(counts: &[usize], want: &[f64], n: usize) -> f64 {
    let (mut stat, mut cells) = (0.0, 0);
    let (mut pooled_count, mut pooled_want) = (0.0, 0.0);
    for (&c, &p) in counts.iter().zip(want) {
        let expected = p * n as f64;
        if expected < 5.0 {
            pooled_count += c as f64;
            pooled_want += expected;
        } else {
            stat += (c as f64 - expected).powi(2) / expected;
            cells += 1;
        }
    }
    if pooled_want > 0.0 {
        stat += (pooled_count - pooled_want).powi(2) / pooled_want.max(1e-9);
        cells += 1;
    }
    chi_square_tail(stat, cells - 1)
}

#[test]
fn a_sampling_draft_model_leaves_the_distribution_the_models() {
    // The target, and a deliberately bad draft model (other random weights, same vocabulary).
    let target = synth("llama", GgmlType::F32, 11, Precision::Exact);
    let draft = synth("llama", GgmlType::F32, 12, Precision::Exact);
    let prompt = [SYNTH_BOS, 7, 19];
    // Forced: the 1st token (the prompt's pass) and the 2nd (the first decode step, a plain one
    // that times a step), so the first verification pass makes the 3rd and 4th tokens.
    let forced = [23, 31];
    let sampler = SamplerConfig { temperature: 1.5, ..SamplerConfig::default() };
    let n_vocab = target.vocab_size();
    let dist = |logits: &[f32]| -> Vec<f64> {
        let scaled: Vec<f32> = logits.iter().map(|l| l / sampler.temperature).collect();
        softmax(&scaled).into_iter().map(f64::from).collect()
    };

    // Exact: P(t3) and P(t4) = sum over t3 of P(t3) P(t4 | t3).
    let mut state = target.new_state();
    let mut context = prompt.to_vec();
    context.extend(forced);
    let p2 = dist(&target.forward(&mut state, &context, false).unwrap());
    let mut p3 = vec![0.0; n_vocab];
    for (t2, &w) in p2.iter().enumerate() {
        let mut s = state.clone();
        let row = dist(&target.forward(&mut s, &[t2 as u32], false).unwrap());
        p3.iter_mut().zip(row).for_each(|(acc, r)| *acc += w * r);
    }

    let runs = 3000;
    let (mut c2, mut c3) = (vec![0; n_vocab], vec![0; n_vocab]);
    let (mut drafted, mut accepted) = (0, 0);
    for seed in 0..runs {
        let opts = GenerateOptions {
            forced: forced.to_vec(),
            speculative: Some(SpeculativeOptions::draft_model()),
            ..plain(4, SamplerConfig { seed, ..sampler.clone() })
        };
        let mut g = Generation::new(&target, &IdsOnly, &prompt, opts).unwrap();
        g = g.with_draft_model(&draft).unwrap();
        let mut events = Vec::new();
        while let Some(e) = g.step().unwrap() {
            events.push(e);
        }
        c2[events[2].id as usize] += 1;
        c3[events[3].id as usize] += 1;
        let stats = g.speculation_stats().unwrap();
        (drafted, accepted) = (drafted + stats.drafted, accepted + stats.accepted);
    }
    // Guesses were made and judged: some kept, some not (else the rule was not exercised).
    assert!(accepted > 0 && accepted < drafted, "{accepted} of {drafted} kept");
    let (fit2, fit3) =
        (goodness_of_fit(&c2, &p2, runs as usize), goodness_of_fit(&c3, &p3, runs as usize));
    assert!(fit2 > 1e-4 && fit3 > 1e-4, "chi-square tail: 3rd token {fit2}, 4th token {fit3}");

    // The test can fail: the draft model's own distribution is far from the target's.
    let mut s = draft.new_state();
    let q2 = dist(&draft.forward(&mut s, &context, false).unwrap());
    let draws: Vec<usize> = {
        // 3000 draws from q2 through the same counting.
        let mut rng = nexttoken::sampling::Rng::new(1);
        let mut counts = vec![0; n_vocab];
        for _ in 0..runs {
            let r = rng.next_f32() as f64;
            let mut acc = 0.0;
            let id = q2.iter().position(|&p| {
                acc += p;
                r < acc
            });
            counts[id.unwrap_or(n_vocab - 1)] += 1;
        }
        counts
    };
    assert!(goodness_of_fit(&draws, &p2, runs as usize) < 1e-6, "the draft model is too good");
}

#[test]
fn the_rejection_rule_gives_the_targets_distribution_exactly() {
    // Exact enumeration on the lesson's bigram table: for a target p (the table's next-word
    // distribution after one word) and a drafter q (after another word, or uniform), the
    // output's probability of x is sum over guesses d of q(d) [a(d) 1{x = d} + (1 - a(d)) r(x)]
    // with a(d) = min(1, p(d)/q(d)) and r the residual: it must be p(x).
    let path = common::repo().join("www/models/lesson-toy.json");
    let table = TableModel::from_json(&std::fs::read_to_string(path).unwrap()).unwrap();
    let n = table.vocab_size();
    let next = |word: u32| -> Vec<(u32, f32)> {
        let mut state = table.new_state();
        let logits = table.forward(&mut state, &[table.bos_token().unwrap(), word], false).unwrap();
        softmax(&logits).into_iter().enumerate().map(|(i, p)| (i as u32, p)).collect()
    };
    let uniform: Vec<(u32, f32)> = (0..n as u32).map(|i| (i, 1.0 / n as f32)).collect();
    let mut checked = 0;
    for a in 0..n as u32 {
        for q in [next((a + 1) % n as u32), uniform.clone(), next(a)] {
            let p = next(a);
            let r = residual(&p, &q);
            let mut out = vec![0.0f64; n];
            for &(d, qd) in &q {
                let accept = accept_probability(p[d as usize].1 as f64, qd as f64);
                out[d as usize] += qd as f64 * accept;
                for &(x, rx) in &r {
                    out[x as usize] += qd as f64 * (1.0 - accept) * rx as f64;
                }
            }
            for (x, &(_, px)) in p.iter().enumerate() {
                assert!((out[x] - px as f64).abs() < 1e-6, "after word {a}: {out:?} vs {p:?}");
            }
            checked += 1;
        }
    }
    assert!(checked >= 3 * 4, "the table has words");
    // The residual never gives a token the target cannot make, and is a distribution.
    let p = [(0, 0.5f32), (1, 0.5), (2, 0.0)];
    let q = [(0, 0.9f32), (2, 0.1)];
    assert_eq!(residual(&p, &q), vec![(1, 1.0)]);
    assert_eq!(accept_probability(0.0, 0.3), 0.0);
    assert_eq!(accept_probability(0.5, 0.25), 1.0);
}

#[test]
fn bad_speculative_options_are_refused() {
    let model = synth("llama", GgmlType::Q8_0, 3, Precision::Fast);
    let prompt = [SYNTH_BOS, 7];
    let opts = plain(8, SamplerConfig::greedy());
    for (source, k) in [
        (DraftSource::lookup(), 0),
        (DraftSource::lookup(), 10_000),
        (DraftSource::Lookup { min_ngram: 3, max_ngram: 2 }, 4),
        (DraftSource::Lookup { min_ngram: 0, max_ngram: 2 }, 4),
    ] {
        let err = Generation::new(&model, &IdsOnly, &prompt, with(&opts, source.clone(), k));
        assert!(err.is_err(), "{source:?}, k = {k}");
    }
    // A draft model's generation without one says so at its first guess.
    let mut g = Generation::new(&model, &IdsOnly, &prompt, with(&opts, DraftSource::DraftModel, 4))
        .unwrap();
    let err = loop {
        match g.step() {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the generation ended without guessing"),
            Err(e) => break e.to_string(),
        }
    };
    assert!(err.contains("draft model"), "{err}");
    // One with another vocabulary is refused.
    let other = {
        let spec =
            nexttoken::synthetic::Spec { n_vocab: 60, ..synth_spec("llama", GgmlType::Q8_0, 3) };
        CpuModel::new(Model::from_bytes(nexttoken::synthetic::write(&spec).unwrap()).unwrap())
    };
    let g = Generation::new(&model, &IdsOnly, &prompt, with(&opts, DraftSource::DraftModel, 4))
        .unwrap();
    let err = g.with_draft_model(&other).err().unwrap().to_string();
    assert!(err.contains("vocabulary"), "{err}");
}

#[test]
fn a_greedy_draft_model_gives_plain_greedy_and_is_mostly_right_when_it_is_the_model() {
    // The model as its own draft model: every guess is right (up to the batched pass's
    // rounding), and the output is plain greedy.
    for precision in [Precision::Exact, Precision::Fast] {
        let model = synth("qwen2", GgmlType::Q8_0, 7, precision);
        let prompt = [SYNTH_BOS, 7, 19, 33];
        let opts = plain(40, SamplerConfig::greedy());
        let (want, _) = run(&model, &IdsOnly, &prompt, opts.clone());
        let spec = with(&opts, DraftSource::DraftModel, 4);
        let mut g = Generation::new(&model, &IdsOnly, &prompt, spec)
            .unwrap()
            .with_draft_model(&model)
            .unwrap();
        let mut got = Vec::new();
        while let Some(e) = g.step().unwrap() {
            got.push(e.id);
        }
        assert_eq!(got, ids(&want), "{precision:?}");
        let stats = g.speculation_stats().unwrap();
        assert!(stats.acceptance_rate() > 0.9, "{precision:?}: {stats:?}");
    }
}

/// How many steps `length` leaves plain before it guesses again, and how many it guesses then.
fn plain_steps_then_guesses(length: &mut DraftLength) -> (usize, usize) {
    for plain in 0..100 {
        match length.for_this_step() {
            0 => {}
            k => return (plain, k),
        }
    }
    panic!("no guess in 100 steps: {length:?}");
}

#[test]
fn the_draft_length_follows_acceptance_and_cost() {
    // A pass of k guesses in 10 ms (a plain step) plus 2 ms a guess.
    let pass_ms = |k: usize| 10.0 + 2.0 * k as f64;
    let mut length = DraftLength::new(4);
    assert_eq!(length.for_this_step(), 0, "the first decode step is plain (a step's time)");
    length.time_plain_step(10.0);
    // The first pass of each length is not timed: in wasm the engine compiles a tile's code
    // during it (here it costs 3 times the later ones; timed, one guess would have looked dearer
    // than a step, and the counts would have backed off).
    assert_eq!(length.for_this_step(), 1, "the first pass tries one guess");
    length.record(1, 1, 3.0 * pass_ms(1));
    assert_eq!(length.for_this_step(), 1, "the second pass times one guess");
    length.record(1, 1, pass_ms(1));
    assert_eq!(
        length.for_this_step(),
        4,
        "the counts (with a prior of 4 in 5 kept) ask for the most"
    );
    length.record(4, 4, 3.0 * pass_ms(4));
    assert_eq!(length.for_this_step(), 4, "the first pass of four, as dear, changes nothing");
    // Every guess kept: stays at 4.
    for _ in 0..3 {
        length.record(4, 4, pass_ms(4));
        assert_eq!(length.for_this_step(), 4);
    }
    // First guesses kept, second ones not: one guess a pass (2 tokens for 1.2 steps beats
    // 2 tokens for 1.4 or 1.8), though half the guesses of a k = 2 pass are kept.
    for _ in 0..6 {
        let k = length.for_this_step();
        length.record(k, 1.min(k), pass_ms(k));
    }
    let ks: Vec<usize> = (0..4).map(|_| length.for_this_step()).collect();
    assert_eq!(ks, [1, 1, 1, 1], "shares kept: {:?}", length.kept_shares());
    // Right again: back to 4 within a few passes (old counts fade, untried positions return to
    // the prior).
    let mut k = length.for_this_step();
    for _ in 0..12 {
        length.record(k, k, pass_ms(k));
        k = length.for_this_step();
    }
    assert_eq!(k, 4);
    // Nothing kept from now on: no guessing for 1, 2, 4, 8 steps, each followed by one guess.
    length.record(4, 0, pass_ms(4));
    for wait in [1, 2, 4, 8] {
        assert_eq!(plain_steps_then_guesses(&mut length), (wait, 1));
        length.record(1, 0, pass_ms(1));
    }
    // A probe that is kept ends the back-off: the counts choose again.
    assert_eq!(plain_steps_then_guesses(&mut length), (16, 1));
    length.record(1, 1, pass_ms(1));
    assert_eq!(plain_steps_then_guesses(&mut length).0, 0);
    // Dear guesses (wasm: 0.6 of a step each), all kept: still the most, from the first passes.
    let mut wasm = DraftLength::new(4);
    wasm.for_this_step();
    wasm.time_plain_step(10.0);
    let ks: Vec<usize> = (0..6)
        .map(|_| {
            let k = wasm.for_this_step();
            wasm.record(k, k, 10.0 + 6.0 * k as f64);
            k
        })
        .collect();
    assert_eq!((ks[0], &ks[2..]), (1, &[4; 4][..]), "{ks:?}");
    // wasm as measured (Node 24, SmolLM2-135M Q8_0 shape): a step 9.5 ms, a pass of one guess
    // 19 (each guess about a step), of four 41 (0.82 of a step each), the first pass of each
    // length 1.45 times that. All kept: four guesses a pass, soon and for good.
    let wasm_pass_ms = |k: usize| [9.5, 19.0, 27.5, 34.5, 41.0][k];
    let mut measured = DraftLength::new(4);
    measured.for_this_step();
    measured.time_plain_step(9.5);
    let mut ran = [false; 5];
    let ks: Vec<usize> = (0..12)
        .map(|_| {
            let k = measured.for_this_step();
            if k > 0 {
                let cold = if std::mem::replace(&mut ran[k], true) { 1.0 } else { 1.45 };
                measured.record(k, k, cold * wasm_pass_ms(k));
            }
            k
        })
        .collect();
    assert_eq!(ks[4..], [4; 8], "{ks:?}");
    // Kept but dear (a compute-bound step: a pass of 2 guesses for the time of 5 steps): no k
    // pays, whatever is kept.
    let mut dear = DraftLength::new(4);
    dear.for_this_step();
    dear.time_plain_step(10.0);
    for _ in 0..3 {
        let k = dear.for_this_step().max(1);
        dear.record(k, k, 10.0 * (k + 2) as f64 + 20.0);
    }
    assert_eq!(dear.best(), None, "per pass: {:?}", dear);
    assert_eq!(dear.for_this_step(), 0);
}

/// The guesses `length` makes over `steps` steps of a drafter that is always right: 0 for a
/// plain step (its guess checked and right), k for a pass (all kept).
fn always_right(length: &mut DraftLength, steps: usize) -> Vec<usize> {
    (0..steps)
        .map(|_| {
            let k = length.for_this_step();
            match k {
                0 => length.shadow(true),
                k => length.record(k, k, 10.0 + 2.0 * k as f64),
            }
            k
        })
        .collect()
}

/// `steps` steps of a drafter whose guesses checked between passes are all wrong: none passes.
fn no_pass_while_wrong(length: &mut DraftLength, steps: usize) {
    for _ in 0..steps {
        assert_eq!(length.for_this_step(), 0, "{length:?}");
        length.shadow(false);
    }
}

#[test]
fn guesses_checked_between_passes_keep_a_wrong_drafter_from_passing() {
    let mut length = DraftLength::new(4).shadowing();
    assert_eq!(length.for_this_step(), 0);
    length.time_plain_step(10.0);
    // Wrong guesses between passes: no pass, not even the first, however long.
    no_pass_while_wrong(&mut length, 200);
    // One right guess: the first pass at the next step; then passes of more as the counts
    // recover from 200 wrong guesses (old counts fade: each step keeps 0.9 of them).
    length.shadow(true);
    let ks = always_right(&mut length, 16);
    assert_eq!(ks[0], 1, "{ks:?}");
    assert!(ks.iter().filter(|&&k| k == 0).count() <= 4, "{ks:?}");
    assert_eq!(ks[12..], [4; 4], "{ks:?}");
    // A pass that keeps nothing, then wrong guesses: no pass in the back-off nor after it.
    length.record(4, 0, 18.0);
    no_pass_while_wrong(&mut length, 100);
    // Right again: one guess at once, and the same recovery.
    length.shadow(true);
    let ks = always_right(&mut length, 16);
    assert_eq!(ks[0], 1, "{ks:?}");
    assert_eq!(ks[12..], [4; 4], "{ks:?}");
    // Within a back-off that the counts call worth ending (a pass kept nothing, but the guesses
    // keep being right): two right guesses in a row between passes end it at once; one does not.
    length.record(4, 0, 18.0);
    length.record(1, 0, 12.0);
    length.record(1, 0, 12.0);
    assert_eq!(length.for_this_step(), 0, "backing off 4 steps");
    length.shadow(true);
    assert_eq!(length.for_this_step(), 0, "{length:?}");
    length.shadow(true);
    assert_eq!(length.for_this_step(), 1, "{length:?}");
}
