//! The lessons' numbers, reproduced from the shipped table models in `www/models/`. If one of
//! these fails, a lesson says something the code does not do.

use nexttoken::generate::{
    beam_search, generate, score, BeamOptions, GenerateOptions, Generation, Score, StopReason,
    TokenEvent,
};
use nexttoken::sampling::SamplerConfig;
use nexttoken::table::TableModel;
use nexttoken::{LanguageModel, Vocab};

fn load(name: &str) -> TableModel {
    let path = format!("{}/www/models/{name}.json", env!("CARGO_MANIFEST_DIR"));
    let json = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    TableModel::from_json(&json).unwrap_or_else(|e| panic!("{path}: {e}"))
}

/// `<s> words </s>` as ids.
fn sentence(model: &TableModel, words: &str) -> Vec<u32> {
    let mut ids = vec![model.bos_token().unwrap()];
    ids.extend(model.encode(words).unwrap());
    ids.push(model.eos_tokens()[0]);
    ids
}

fn round(x: f64, decimals: i32) -> f64 {
    let scale = 10f64.powi(decimals);
    (x * scale).round() / scale
}

fn greedy(max_tokens: usize) -> GenerateOptions {
    GenerateOptions { max_tokens, sampler: SamplerConfig::greedy(), ..GenerateOptions::default() }
}

/// Sampling at temperature 1 from the model's own distribution.
fn seeded(seed: u64) -> GenerateOptions {
    GenerateOptions {
        max_tokens: 10,
        sampler: SamplerConfig { seed, ..SamplerConfig::default() },
        ..GenerateOptions::default()
    }
}

/// Run a generation and collect its events.
fn run(
    model: &TableModel,
    prompt: &[u32],
    opts: GenerateOptions,
) -> (Vec<TokenEvent>, StopReason, String) {
    let mut events = Vec::new();
    let summary = generate(model, model, prompt, opts, |e| {
        events.push(e.clone());
        true
    })
    .unwrap();
    (events, summary.stop_reason, summary.text)
}

// --- The chain rule ------------------------------------------------------------------------

#[test]
fn the_cat_sat_has_probability_0_42() {
    let toy = load("lesson-toy");
    // P(<s> the cat sat </s>) = P(the|<s>) P(cat|the) P(sat|cat) P(</s>|sat) = 1 x .6 x .7 x 1.
    let with_end = score(&toy, &sentence(&toy, "the cat sat")).unwrap();
    assert!((with_end.probability() - 0.42).abs() < 1e-6, "{}", with_end.probability());
    assert_eq!(with_end.token_logprobs.len(), 4);
    // P(</s>|sat) = 1, so leaving the end token out gives the same number.
    let ids = sentence(&toy, "the cat sat");
    let without_end = score(&toy, &ids[..ids.len() - 1]).unwrap();
    assert!((without_end.probability() - 0.42).abs() < 1e-6);
}

#[test]
fn the_four_sentences_share_all_the_probability() {
    let toy = load("lesson-toy");
    let expected = [
        ("the cat sat", 0.42),
        ("the cat ran", 0.18),
        ("the dog sat", 0.08),
        ("the dog ran", 0.32),
    ];
    let mut total = 0.0;
    for (words, p) in expected {
        let got = score(&toy, &sentence(&toy, words)).unwrap().probability();
        assert!((got - p).abs() < 1e-6, "P({words}) = {got}, expected {p}");
        total += got;
    }
    assert_eq!(round(total, 2), 1.00);
}

#[test]
fn an_impossible_sentence_has_probability_zero() {
    let toy = load("lesson-toy");
    let s = score(&toy, &sentence(&toy, "the sat")).unwrap();
    assert_eq!(s.probability(), 0.0);
    assert_eq!(s.total_logprob, f64::NEG_INFINITY);
}

// --- Perplexity ----------------------------------------------------------------------------

#[test]
fn perplexity_of_a_confident_and_a_confused_model() {
    let confident = Score::from_probs(&[0.9, 0.6, 0.7, 0.8, 0.95]);
    assert_eq!(round(confident.perplexity, 2), 1.28);
    let confused = Score::from_probs(&[0.9, 0.05, 0.3, 0.1, 0.95]);
    assert_eq!(round(confused.perplexity, 2), 3.79);
    // Perplexity is exp of the average negative log-likelihood.
    assert!((confused.avg_nll - confused.perplexity.ln()).abs() < 1e-12);
}

#[test]
fn long_sequences_need_log_space() {
    let steps = [0.1f64; 400];
    let s = Score::from_probs(&steps);
    assert_eq!(round(s.total_logprob, 1), -921.0);
    assert_eq!(round(s.perplexity, 1), 10.0);

    // The naive product 0.1^400 = 1e-400 is below the smallest f32 (and even f64) > 0.
    let product_f32: f32 = steps.iter().map(|&p| p as f32).product();
    assert_eq!(product_f32, 0.0);
    let product_f64: f64 = steps.iter().product();
    assert_eq!(product_f64, 0.0);
}

#[test]
fn from_probs_and_from_logprobs_agree() {
    let a = Score::from_probs(&[0.5, 0.25]);
    let b = Score::from_logprobs(vec![0.5f64.ln(), 0.25f64.ln()]);
    assert_eq!(a, b);
    assert!((a.perplexity - 8f64.sqrt()).abs() < 1e-12);
}

// --- Greedy generation and beam search -----------------------------------------------------

#[test]
fn greedy_says_the_cat_sat_and_stops_at_the_end_token() {
    let toy = load("lesson-toy");
    let (events, reason, text) = run(&toy, &[toy.bos_token().unwrap()], greedy(10));
    assert_eq!(text, "the cat sat");
    assert_eq!(reason, StopReason::Eos);

    let pieces: Vec<&str> = events.iter().map(|e| e.text.as_str()).collect();
    assert_eq!(pieces, ["the", " cat", " sat", ""], "the end token adds no text");
    let probs: Vec<f32> = events.iter().map(|e| e.prob).collect();
    for (got, want) in probs.iter().zip([1.0, 0.6, 0.7, 1.0]) {
        assert!((got - want).abs() < 1e-6, "{probs:?}");
    }
    assert_eq!(events.iter().map(|e| e.position).collect::<Vec<_>>(), [1, 2, 3, 4]);
    // The alternatives the lesson shows at "the": cat 0.6, dog 0.4.
    let cat = toy.id("cat").unwrap();
    let dog = toy.id("dog").unwrap();
    assert_eq!(events[1].top[0].0, cat);
    assert_eq!(events[1].top[1].0, dog);
    assert!((events[1].top[1].1 - 0.4).abs() < 1e-6);
}

#[test]
fn greedy_misses_the_most_probable_sentence_and_beam_search_finds_it() {
    let model = load("lesson-beam");
    let bos = [model.bos_token().unwrap()];

    let (events, reason, text) = run(&model, &bos, greedy(10));
    assert_eq!((text.as_str(), reason), ("the cat", StopReason::Eos));
    let p_greedy: f64 = events.iter().map(|e| e.prob as f64).product();
    assert_eq!(round(p_greedy, 2), 0.33);

    let beams = beam_search(
        &model,
        &bos,
        BeamOptions { beams: 2, max_tokens: 10, length_normalise: false },
    )
    .unwrap();
    assert_eq!(model.decode(&beams[0].ids), "a bird");
    assert!(beams[0].finished);
    assert_eq!(round(beams[0].logprob.exp(), 2), 0.36);
    assert_eq!(model.decode(&beams[1].ids), "the cat");
    assert_eq!(round(beams[1].probability(), 2), 0.33);

    // One beam is greedy decoding.
    let one = beam_search(
        &model,
        &bos,
        BeamOptions { beams: 1, max_tokens: 10, length_normalise: false },
    )
    .unwrap();
    assert_eq!(one.len(), 1);
    let greedy_ids: Vec<u32> =
        events.iter().map(|e| e.id).filter(|id| !model.eos_tokens().contains(id)).collect();
    assert_eq!(one[0].ids, greedy_ids);
    assert!((one[0].logprob - p_greedy.ln()).abs() < 1e-6);
}

#[test]
fn beam_search_stops_at_max_tokens_with_unfinished_beams() {
    let model = load("lesson-beam");
    let beams =
        beam_search(&model, &[0], BeamOptions { beams: 2, max_tokens: 1, length_normalise: false })
            .unwrap();
    assert_eq!(beams.len(), 2);
    assert!(beams.iter().all(|b| !b.finished && b.ids.len() == 1));
    assert_eq!(model.decode(&beams[0].ids), "the");
    // Length normalisation divides log P by the length (end token counted).
    let normalised =
        beam_search(&model, &[0], BeamOptions { beams: 2, max_tokens: 10, length_normalise: true })
            .unwrap();
    assert!((normalised[0].score - normalised[0].logprob / 3.0).abs() < 1e-12);
}

// --- Sampling ------------------------------------------------------------------------------

#[test]
fn sampling_reproduces_the_tables_probabilities() {
    let toy = load("lesson-toy");
    let bos = [toy.bos_token().unwrap()];
    let runs = 2000;
    let mut counts = std::collections::HashMap::<String, usize>::new();
    for seed in 0..runs {
        let summary = generate(&toy, &toy, &bos, seeded(seed), |_| true).unwrap();
        assert_eq!(summary.stop_reason, StopReason::Eos);
        *counts.entry(summary.text).or_default() += 1;
    }
    // A binomial with n = 2000 has a standard deviation of at most 0.011: 0.04 is over 3.5 of them.
    for (words, p) in
        [("the cat sat", 0.42), ("the cat ran", 0.18), ("the dog sat", 0.08), ("the dog ran", 0.32)]
    {
        let freq = counts.get(words).copied().unwrap_or(0) as f64 / runs as f64;
        assert!((freq - p).abs() < 0.04, "{words}: sampled {freq}, table says {p} ({counts:?})");
    }
    assert_eq!(counts.len(), 4, "{counts:?}");
}

#[test]
fn the_same_seed_gives_the_same_sentences() {
    let toy = load("lesson-toy");
    let bos = [toy.bos_token().unwrap()];
    let sentences = |seed: u64| -> Vec<Vec<u32>> {
        (0..20u64)
            .map(|i| {
                let mut g = Generation::new(&toy, &toy, &bos, seeded(seed * 100 + i)).unwrap();
                while g.step().unwrap().is_some() {}
                g.generated_ids().to_vec()
            })
            .collect()
    };
    assert_eq!(sentences(7), sentences(7));
    assert_ne!(sentences(7), sentences(8));
}

// --- The generation loop -------------------------------------------------------------------

#[test]
fn stepping_reports_the_stop_with_the_last_token() {
    let toy = load("lesson-toy");
    let mut g = Generation::new(&toy, &toy, &[0], greedy(3)).unwrap();
    for expected in ["the", " cat", " sat"] {
        assert_eq!(g.stop_reason(), None);
        assert_eq!(g.step().unwrap().unwrap().text, expected);
    }
    assert_eq!(g.stop_reason(), Some(StopReason::MaxTokens));
    assert_eq!(g.step().unwrap(), None);
    assert_eq!(g.text(), "the cat sat");
    assert_eq!(g.generated_ids().len(), 3);
    let summary = g.summary().unwrap();
    assert_eq!((summary.prompt_tokens, summary.generated_tokens), (1, 3));
}

#[test]
fn text_continues_the_prompt() {
    let toy = load("lesson-toy");
    let prompt = toy.encode("<s> the dog").unwrap();
    let (events, _, text) = run(&toy, &prompt, greedy(10));
    assert_eq!(text, " ran", "the first generated word keeps its space");
    assert_eq!(events[0].position, 3);
}

#[test]
fn stop_strings_cut_the_text_and_the_stream() {
    let toy = load("lesson-toy");
    let (events, reason, text) =
        run(&toy, &[0], GenerateOptions { stop_strings: vec!["cat sat".into()], ..greedy(10) });
    assert_eq!(reason, StopReason::StopString);
    assert_eq!(text, "the ");
    // " cat" could have been the start of "cat sat", so it was held back, and never sent.
    let streamed: String = events.iter().map(|e| e.text.as_str()).collect();
    assert_eq!(streamed, "the ");
    assert_eq!(events.len(), 3);

    // Held-back text that turns out not to be a stop string is sent with the next token.
    let (events, reason, text) =
        run(&toy, &[0], GenerateOptions { stop_strings: vec!["cat ran".into()], ..greedy(10) });
    assert_eq!((text.as_str(), reason), ("the cat sat", StopReason::Eos));
    let pieces: Vec<&str> = events.iter().map(|e| e.text.as_str()).collect();
    assert_eq!(pieces, ["the", " ", "cat sat", ""]);
}

#[test]
fn a_full_context_stops_generation() {
    let json = std::fs::read_to_string(format!(
        "{}/www/models/lesson-toy.json",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let mut value: serde_json::Value = serde_json::from_str(&json).unwrap();
    value["context_length"] = 3.into();
    let small = TableModel::from_json(&value.to_string()).unwrap();
    let (_, reason, text) = run(&small, &[0], greedy(10));
    assert_eq!((text.as_str(), reason), ("the cat", StopReason::ContextFull));

    let err = Generation::new(&small, &small, &[0, 1, 2, 4], greedy(10)).err().unwrap();
    assert_eq!(err.to_string(), "prompt has 4 tokens but the model's context is 3");
    let err = Generation::new(&small, &small, &[], greedy(10)).err().unwrap();
    assert!(err.to_string().contains("empty"), "{err}");
}

#[test]
fn on_token_can_abort() {
    let toy = load("lesson-toy");
    let summary = generate(&toy, &toy, &[0], greedy(10), |e| e.text != " cat").unwrap();
    assert_eq!(summary.stop_reason, StopReason::Aborted);
    assert_eq!(summary.text, "the cat");
}

/// A vocabulary of single bytes, like a tokenizer's byte-fallback tokens: "€" is three of them.
struct Bytes(Vec<u8>);

impl Vocab for Bytes {
    fn encode(&self, _: &str) -> nexttoken::Result<Vec<u32>> {
        unimplemented!()
    }
    fn decode(&self, ids: &[u32]) -> String {
        let bytes: Vec<u8> =
            ids.iter().filter_map(|&id| self.0.get(id as usize).copied()).collect();
        String::from_utf8_lossy(&bytes).into_owned()
    }
    fn token_text(&self, id: u32) -> String {
        format!("<0x{:02X}>", self.0[id as usize])
    }
}

#[test]
fn multi_byte_characters_come_out_whole() {
    let chain = r#"{ "name": "euro", "vocab": ["<s>", "b0", "b1", "b2", "x", "</s>"], "bos": "<s>", "eos": "</s>",
        "next": { "<s>": {"b0": 1}, "b0": {"b1": 1}, "b1": {"b2": 1}, "b2": {"x": 1}, "x": {"</s>": 1} } }"#;
    let model = TableModel::from_json(chain).unwrap();
    let bytes = Bytes(vec![b'>', 0xE2, 0x82, 0xAC, b'!', b'.']); // "€" = E2 82 AC
    let mut g = Generation::new(&model, &bytes, &[0], greedy(10)).unwrap();
    let mut pieces = Vec::new();
    while let Some(event) = g.step().unwrap() {
        pieces.push(event.text);
    }
    assert_eq!(pieces, ["", "", "€", "!", ""]);
    assert_eq!(g.text(), "€!");

    // Cut off mid-character, the partial character is still flushed at the end.
    let mut g = Generation::new(&model, &bytes, &[0], greedy(2)).unwrap();
    let mut streamed = String::new();
    while let Some(event) = g.step().unwrap() {
        streamed.push_str(&event.text);
    }
    assert_eq!(streamed, "\u{FFFD}");
}

// --- The table format ----------------------------------------------------------------------

fn table_error(json: &str) -> String {
    TableModel::from_json(json).expect_err("should be rejected").to_string()
}

#[test]
fn bad_tables_are_rejected_with_a_reason() {
    let err = table_error(
        r#"{"name":"t","vocab":["<s>","a","</s>"],"bos":"<s>","eos":"</s>",
        "next":{"<s>":{"a":0.5,"</s>":0.4},"a":{"</s>":1}}}"#,
    );
    assert!(err.contains("sums to 0.9"), "{err}");

    let err = table_error(
        r#"{"name":"t","vocab":["<s>","a","</s>"],"bos":"<s>","eos":"</s>",
        "next":{"<s>":{"b":1},"a":{"</s>":1}}}"#,
    );
    assert!(err.contains("\"b\" is not in vocab"), "{err}");

    let err = table_error(
        r#"{"name":"t","vocab":["<s>","a","</s>"],"bos":"<s>","eos":"</s>",
        "next":{"<s>":{"a":1}}}"#,
    );
    assert!(err.contains("no row for \"a\""), "{err}");

    let err = table_error(
        r#"{"name":"t","vocab":["<s>","a","a","</s>"],"bos":"<s>","eos":"</s>","next":{}}"#,
    );
    assert!(err.contains("twice"), "{err}");

    let err =
        table_error(r#"{"name":"t","vocab":["<s>","</s>"],"bos":"<s>","eos":"</s>","nxt":{}}"#);
    assert!(err.contains("nxt"), "{err}");
}

#[test]
fn the_table_vocab_encodes_words_and_decodes_without_markers() {
    let toy = load("lesson-toy");
    let ids = toy.encode("<s> the  cat\nsat </s>").unwrap();
    assert_eq!(ids, [0, 1, 2, 4, 6]);
    assert_eq!(toy.decode(&ids), "the cat sat");
    assert_eq!(toy.token_text(6), "</s>");
    let err = toy.encode("the cow").err().unwrap().to_string();
    assert!(err.contains("\"cow\""), "{err}");
    assert!((toy.prob(1, 2) - 0.6).abs() < 1e-6);
}

// --- Branching -----------------------------------------------------------------------------

/// A branch: after "the", the reader picks "dog" (P = 0.4) instead of greedy's "cat". The forced
/// token comes out with the table's probability, the sampler draws nothing for it, and what
/// follows is greedy's continuation of "the dog" (P(ran | dog) = 0.8), exactly as a fresh
/// generation from "<s> the dog" gives.
#[test]
fn a_forced_token_branches_with_the_models_probability() {
    let model = load("lesson-toy");
    let the = sentence(&model, "the");
    let prefix = &the[..2]; // <s> the
    let dog = model.encode("dog").unwrap()[0];
    let opts = GenerateOptions { forced: vec![dog], ..greedy(8) };
    let (events, stop, text) = run(&model, prefix, opts);
    assert_eq!(events[0].id, dog);
    assert!((events[0].prob - 0.4).abs() < 1e-6, "{}", events[0].prob);
    assert_eq!(text.trim(), "dog ran");
    assert_eq!(stop, StopReason::Eos);

    let fresh_prompt: Vec<u32> = prefix.iter().copied().chain([dog]).collect();
    let (fresh, _, _) = run(&model, &fresh_prompt, greedy(8));
    let ids = |e: &[TokenEvent]| e.iter().map(|e| e.id).collect::<Vec<_>>();
    assert_eq!(ids(&events[1..]), ids(&fresh));
    // An id outside the vocabulary is an error, not a panic.
    let bad = GenerateOptions { forced: vec![999], ..greedy(8) };
    assert!(Generation::new(&model, &model, prefix, bad).is_err());
}

/// The perplexity lesson's table (`www/models/lesson-perplexity.json`) gives the seed's numbers
/// by the chain rule: each sentence is scored through its end token.
#[test]
fn the_perplexity_lesson_reproduces_the_seeds_numbers() {
    let table = load("lesson-perplexity");
    let confident = score(&table, &sentence(&table, "the sun is warm")).unwrap();
    assert_eq!(round(confident.perplexity, 2), 1.28);
    let confused = score(&table, &sentence(&table, "the moon ate seven")).unwrap();
    assert_eq!(round(confused.perplexity, 2), 3.79);
    // 400 digits after "digits": each P = 0.1.
    let mut ids = vec![table.bos_token().unwrap()];
    ids.extend(table.encode(&format!("digits {}", "7 ".repeat(400))).unwrap());
    let all = score(&table, &ids).unwrap();
    let digits = Score::from_logprobs(all.token_logprobs[1..].to_vec());
    assert_eq!(digits.token_logprobs.len(), 400);
    assert_eq!(round(digits.total_logprob, 1), -921.0);
    assert_eq!(round(digits.perplexity, 1), 10.0);
}

/// The beam search's tree on the lesson: every extension it considered, with its total log P,
/// pruned ones marked, the best beam's path ending at "a bird </s>" (0.36). By hand: step 0 keeps
/// "the" (0.6) and "a" (0.4); step 1 considers the cat 0.33, the dog 0.27, a bird 0.36, a fish
/// 0.04 and keeps "a bird" and "the cat".
#[test]
fn the_beam_tree_holds_every_extension_considered() {
    use nexttoken::generate::{BeamNode, BeamSearch};
    let model = load("lesson-beam");
    let bos = [model.bos_token().unwrap()];
    let opts = BeamOptions { beams: 2, max_tokens: 10, length_normalise: false };
    let mut search = BeamSearch::new(&model, &bos, opts).unwrap();
    while let Some(tokens) = search.step_input() {
        let logits = model.forward(search.state_mut(), &tokens, false).unwrap();
        let top = nexttoken::lm::TopK::from_logits(&logits, search.top_k());
        search.step_output(top).unwrap();
    }
    let tree: Vec<BeamNode> = search.tree().to_vec();
    let beams = search.finish();
    let word = |n: &BeamNode| model.token_text(n.id);
    let path = |mut at: usize| {
        let mut words = vec![];
        loop {
            words.push(word(&tree[at]));
            match tree[at].parent {
                Some(p) => at = p,
                None => break,
            }
        }
        words.reverse();
        words.join(" ")
    };
    assert_eq!(path(beams[0].node.unwrap()), "a bird </s>");
    let step1: Vec<(String, f64, bool)> = tree
        .iter()
        .enumerate()
        .filter(|(_, n)| n.step == 1)
        .map(|(i, n)| (path(i), round(n.logprob.exp(), 2), n.kept))
        .collect();
    let want = [
        ("a bird".to_string(), 0.36, true),
        ("the cat".to_string(), 0.33, true),
        ("the dog".to_string(), 0.27, false),
        ("a fish".to_string(), 0.04, false),
    ];
    assert_eq!(step1, want);
    // Every node's log P is its parent's plus its own token's.
    for n in &tree {
        let parent = n.parent.map_or(0.0, |p| tree[p].logprob);
        assert!(n.logprob <= parent + 1e-12);
    }
}
