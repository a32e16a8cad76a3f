//! The `nexttoken` binary end to end: streaming text, JSON per token, scoring, info, and clear
//! errors for bad input. Expected values come from the transformers fixtures and the lesson's
//! hand-computed tables, not from earlier runs of the CLI.

mod common;

use std::process::{Command, Output};

use serde_json::Value;

fn nexttoken(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nexttoken")).args(args).output().expect("run nexttoken")
}

fn stdout(o: &Output) -> String {
    assert!(o.status.success(), "failed: {}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn fixture(dir: &str) -> (String, Value) {
    let d = common::fixtures().join(dir);
    let reference =
        serde_json::from_str(&std::fs::read_to_string(d.join("reference.json")).unwrap()).unwrap();
    (d.display().to_string(), reference)
}

fn ids(v: &Value) -> Vec<u64> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap()).collect()
}

#[test]
fn greedy_json_matches_transformers() {
    let (dir, reference) = fixture("qwen2");
    let model = format!("{dir}/qwen2-f32.gguf");
    let prompt = reference["prompt"].as_str().unwrap();
    let want = ids(&reference["variants"]["f32"]["greedy_ids"]);
    let n = want.len().to_string();
    let out = stdout(&nexttoken(&[
        "generate",
        "--model",
        &model,
        "--prompt",
        prompt,
        "--temperature",
        "0",
        "--max-tokens",
        &n,
        "--json",
    ]));
    let lines: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let (summary, tokens) = lines.split_last().unwrap();
    // EOS may come early for a random model; compare the prefix that was generated.
    let got: Vec<u64> = tokens.iter().map(|t| t["id"].as_u64().unwrap()).collect();
    assert!(!got.is_empty());
    assert_eq!(got, want[..got.len()]);
    for t in tokens {
        let top = t["top"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        // Greedy picks the most likely token, so it heads the top-5 list with the same probability.
        assert_eq!(top[0]["id"], t["id"]);
        let p = t["prob"].as_f64().unwrap();
        assert!((t["logprob"].as_f64().unwrap() - p.ln()).abs() < 1e-5);
    }
    for key in
        ["prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "ttft_ms", "text"]
    {
        assert!(summary.get(key).is_some(), "summary lacks {key}: {summary}");
    }
    assert_eq!(summary["generated_tokens"].as_u64().unwrap() as usize, got.len());
    // A recording (<next-token replay>): the tokens' texts make the summary's text, and the
    // summary says what made it.
    let texts: String = tokens.iter().map(|t| t["text"].as_str().unwrap()).collect();
    assert_eq!(summary["text"].as_str().unwrap(), texts);
    assert_eq!(summary["prompt"].as_str().unwrap(), prompt);
    assert_eq!(summary["model"], "qwen2-f32.gguf");
    assert_eq!(summary["options"]["temperature"], 0.0);
    assert_eq!(summary["options"]["max_tokens"].as_u64().unwrap() as usize, want.len());
    assert!(tokens.iter().all(|t| t["token"].is_string()), "each token's spelling");
}

#[test]
fn text_output_starts_with_the_prompt() {
    let (dir, reference) = fixture("llama");
    let prompt = reference["prompt"].as_str().unwrap();
    let out = stdout(&nexttoken(&[
        "generate",
        "--model",
        &format!("{dir}/llama-q4_k.gguf"),
        "--prompt",
        prompt,
        "--max-tokens",
        "8",
        "--seed",
        "7",
    ]));
    assert!(out.starts_with(prompt), "{out:?}");
    assert!(out.len() > prompt.len());
}

#[test]
fn seeded_sampling_is_reproducible_and_seed_dependent() {
    let (dir, reference) = fixture("gpt2");
    let model = format!("{dir}/gpt2-f32.gguf");
    let prompt = reference["prompt"].as_str().unwrap();
    let run = |seed: &str| {
        stdout(&nexttoken(&[
            "generate",
            "--model",
            &model,
            "--prompt",
            prompt,
            "--max-tokens",
            "24",
            "--temperature",
            "1.5",
            "--seed",
            seed,
        ]))
    };
    assert_eq!(run("1"), run("1"));
    let distinct: std::collections::HashSet<String> =
        ["1", "2", "3", "4"].iter().map(|s| run(s)).collect();
    assert!(distinct.len() > 1, "four seeds gave the same text");
}

#[test]
fn score_reports_chain_rule() {
    let lesson = common::repo().join("www/models/lesson-toy.json").display().to_string();
    let out = stdout(&nexttoken(&["score", "--model", &lesson, "--text", "the cat sat", "--json"]));
    let v: Value = serde_json::from_str(&out).unwrap();
    // P(the|<s>) P(cat|the) P(sat|cat) = 1 * 0.6 * 0.7
    assert!((v["logprob"].as_f64().unwrap() - 0.42f64.ln()).abs() < 1e-6, "{v}");
    let ppl = (-0.42f64.ln() / 3.0).exp();
    assert!((v["perplexity"].as_f64().unwrap() - ppl).abs() < 1e-6);
    assert_eq!(v["tokens"].as_array().unwrap().len(), 3);
    // What a recording's score view shows: the scored text, its model, and each token's piece
    // of the text (together, the text).
    assert_eq!(v["text"], "the cat sat");
    assert_eq!(v["model"], "lesson-toy.json");
    let pieces: String =
        v["tokens"].as_array().unwrap().iter().map(|t| t["piece"].as_str().unwrap()).collect();
    assert_eq!(pieces, "the cat sat");
    let text = stdout(&nexttoken(&["score", "--model", &lesson, "--text", "the cat sat"]));
    assert!(text.contains("perplexity") && text.contains("logprob"), "{text}");
}

#[test]
fn lesson_models_from_the_cli() {
    let repo = common::repo();
    let toy = repo.join("www/models/lesson-toy.json").display().to_string();
    let beam = repo.join("www/models/lesson-beam.json").display().to_string();
    assert_eq!(
        stdout(&nexttoken(&["generate", "--model", &toy, "--temperature", "0"])).trim(),
        "the cat sat"
    );
    assert_eq!(
        stdout(&nexttoken(&["generate", "--model", &beam, "--temperature", "0"])).trim(),
        "the cat"
    );
    assert_eq!(
        stdout(&nexttoken(&["generate", "--model", &beam, "--beams", "2"])).trim(),
        "a bird"
    );
}

#[test]
fn info_describes_the_model() {
    let (dir, _) = fixture("llama");
    let out = stdout(&nexttoken(&["info", "--model", &format!("{dir}/llama-q4_k.gguf")]));
    for want in ["architecture   llama", "layers         2", "Q4_K", "Q6_K", "parameters"] {
        assert!(out.contains(want), "missing {want:?} in:\n{out}");
    }
}

fn fails_with(args: &[&str], message: &str) {
    let o = nexttoken(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success(), "{args:?} succeeded");
    assert!(err.contains(message), "{args:?}: stderr {err:?} lacks {message:?}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn bad_input_gives_clear_errors() {
    let tmp = std::env::temp_dir().join(format!("nexttoken-cli-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let (dir, _) = fixture("llama");
    let model = format!("{dir}/llama-q8_0.gguf");

    // A model with no tokenizer.json beside it and no tokenizer metadata of its own.
    let mut parts = common::synth_parts("llama", nexttoken::quant::GgmlType::F32, 1);
    parts.metadata.retain(|(k, _)| !k.starts_with("tokenizer."));
    let lonely = tmp.join("lonely.gguf");
    std::fs::write(&lonely, parts.to_bytes()).unwrap();
    fails_with(
        &["generate", "--model", lonely.to_str().unwrap(), "--prompt", "hi", "--backend", "cpu"],
        "no tokenizer",
    );
    fails_with(
        &["generate", "--model", lonely.to_str().unwrap(), "--prompt", "hi", "--backend", "cpu"],
        "no tokenizer.ggml.model",
    );

    // A truncated file.
    let bytes = std::fs::read(&model).unwrap();
    let truncated = tmp.join("truncated.gguf");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(&["info", "--model", truncated.to_str().unwrap()], "truncated");

    // Not a GGUF at all.
    let text = tmp.join("text.gguf");
    std::fs::write(&text, "hello, I am not a model").unwrap();
    fails_with(&["info", "--model", text.to_str().unwrap()], "not a GGUF file");

    fails_with(&["info", "--model", tmp.join("missing.gguf").to_str().unwrap()], "missing.gguf");

    // A prompt longer than the context (128 tokens for this fixture).
    let long = "Flat is better than nested. ".repeat(60);
    fails_with(&["generate", "--model", &model, "--prompt", &long], "context");
    std::fs::remove_dir_all(&tmp).ok();
}

/// With no tokenizer.json beside it, a GGUF model's own tokenizer metadata is used: the fixture
/// alone gives transformers' greedy ids (so its prompt was tokenized as by the tokenizer.json).
/// A synthetic model made with `synth --vocab-from` (a real Qwen2 vocabulary) runs the same way.
#[test]
fn gguf_without_tokenizer_json_uses_its_own_tokenizer() {
    let tmp = std::env::temp_dir().join(format!("nexttoken-cli-gguf-tok-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let (dir, reference) = fixture("qwen2");
    let model = tmp.join("qwen2-f32.gguf");
    std::fs::copy(format!("{dir}/qwen2-f32.gguf"), &model).unwrap();
    let want = ids(&reference["variants"]["f32"]["greedy_ids"]);
    let n = want.len().to_string();
    let model = model.to_str().unwrap();
    let prompt = reference["prompt"].as_str().unwrap();
    let args = [
        "generate",
        "--model",
        model,
        "--prompt",
        prompt,
        "--backend",
        "cpu",
        "--temperature",
        "0",
    ];
    let out = stdout(&nexttoken(&[&args[..], &["--max-tokens", &n, "--json"]].concat()));
    let lines: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let (summary, tokens) = lines.split_last().unwrap();
    let got: Vec<u64> = tokens.iter().map(|t| t["id"].as_u64().unwrap()).collect();
    assert!(!got.is_empty());
    assert_eq!(got, want[..got.len()]);
    assert_eq!(
        summary["prompt_tokens"].as_u64().unwrap() as usize,
        reference["prompt_ids"].as_array().map_or(0, |a| a.len()),
        "{summary}"
    );
    // An explicit --tokenizer still wins (a missing one is an error naming it).
    fails_with(&[&args[..], &["--tokenizer", "/nonexistent/tok.json"]].concat(), "tok.json");

    if let Some(shared) = common::shared() {
        let config = tmp.join("config.json");
        let c = r#"{"model_type": "qwen2", "vocab_size": 1000, "hidden_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 96, "max_position_embeddings": 64, "tie_word_embeddings": true}"#;
        std::fs::write(&config, c).unwrap();
        let vocab = shared.join("tokenizer-tests/qwen2/ggml-vocab-qwen2.gguf");
        let synth = tmp.join("synth.gguf");
        let o = nexttoken(&[
            "synth",
            "--config",
            config.to_str().unwrap(),
            "--vocab-from",
            vocab.to_str().unwrap(),
            "--out",
            synth.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let info = stdout(&nexttoken(&["info", "--model", synth.to_str().unwrap()]));
        assert!(info.contains("vocab          151936"), "{info}");
        let out = stdout(&nexttoken(&[
            "generate",
            "--model",
            synth.to_str().unwrap(),
            "--prompt",
            "Hello world",
            "--max-tokens",
            "4",
            "--backend",
            "cpu",
            "--json",
        ]));
        let summary: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
        // "Hello" " world": Qwen2's real ids, no BOS.
        assert_eq!(summary["prompt_tokens"], 2, "{summary}");
    }
    std::fs::remove_dir_all(&tmp).ok();
}

// ---------------------------------------------------------------------------------------------
// chat: a synthetic Qwen2-shaped model (random weights, tiny dims, Qwen2.5's real vocabulary size)
// whose GGUF carries Qwen2.5-Instruct's chat template, with Qwen2.5's tokenizer.json. The
// references: transformers' rendering of the conversation (../shared/chat-templates) tokenised
// by the library, and a greedy decode by the CPU's exact path.
// ---------------------------------------------------------------------------------------------

use common::EditParts;
use nexttoken::gguf::Value as Meta;
use nexttoken::Vocab;
use std::io::Write as _;
use std::path::PathBuf;

/// <|endoftext|> and <|im_end|> in Qwen2.5's vocabulary.
const QWEN_ENDOFTEXT: u32 = 151643;
const QWEN_IM_END: u32 = 151645;

struct ChatFixture {
    dir: PathBuf,
    model: PathBuf,
    tokenizer: PathBuf,
    shared: PathBuf,
    bytes: Vec<u8>,
}

impl Drop for ChatFixture {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.dir).ok();
    }
}

/// The model file (with the template when `template`), in a fresh temporary folder.
fn chat_fixture(name: &str, template: bool) -> Option<ChatFixture> {
    chat_fixture_with_context(name, template, 256)
}

/// [`chat_fixture`] with a context of `n_ctx` positions.
fn chat_fixture_with_context(name: &str, template: bool, n_ctx: usize) -> Option<ChatFixture> {
    let shared = common::shared()?;
    let tokenizer = shared.join("tokenizer-tests/qwen2/tokenizer.json");
    let n_vocab = nexttoken::tokenizer::HfTokenizer::from_file(&tokenizer).unwrap().vocab_size();
    let spec = nexttoken::synthetic::Spec {
        n_vocab,
        n_ctx,
        bos: QWEN_ENDOFTEXT,
        eos: QWEN_IM_END,
        ..common::synth_spec("qwen2", nexttoken::quant::GgmlType::Q8_0, 11)
    };
    let mut parts = nexttoken::synthetic::parts(&spec).unwrap();
    if template {
        let source =
            std::fs::read_to_string(shared.join("chat-templates/Qwen2.5-Instruct.jinja")).unwrap();
        parts.set_meta("tokenizer.chat_template", Meta::String(source));
    }
    let bytes = parts.into_bytes();
    let dir = std::env::temp_dir().join(format!("nexttoken-chat-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("chat.gguf");
    std::fs::write(&model, &bytes).unwrap();
    Some(ChatFixture { dir, model, tokenizer, shared, bytes })
}

fn chat_args<'a>(f: &'a ChatFixture, extra: &[&'a str]) -> Vec<String> {
    let mut args = vec![
        "chat",
        "--model",
        f.model.to_str().unwrap(),
        "--tokenizer",
        f.tokenizer.to_str().unwrap(),
        "--backend",
        "cpu",
        "--exact",
        "--temperature",
        "0",
    ];
    args.extend(extra);
    args.into_iter().map(String::from).collect()
}

/// Greedy ids after `prompt` on the CPU's exact path, up to `n` or the first end token.
fn greedy_reply(bytes: &[u8], prompt: &[u32], n: usize) -> Vec<u32> {
    let model =
        nexttoken::cpu::CpuModel::new(nexttoken::model::Model::from_bytes(bytes.to_vec()).unwrap());
    let mut ids = common::greedy(&model, prompt, n);
    if let Some(end) = ids.iter().position(|id| *id == QWEN_IM_END) {
        ids.truncate(end + 1);
    }
    ids
}

#[test]
fn chat_messages_replies_to_the_conversation_transformers_renders() {
    let Some(f) = chat_fixture("messages", true) else { return };
    let examples: Value = serde_json::from_str(
        &std::fs::read_to_string(f.shared.join("chat-templates/rendered_examples.json")).unwrap(),
    )
    .unwrap();
    let conversation = &examples["_meta"]["conversations"]["with_system"];
    let rendered = examples["Qwen2.5-0.5B-Instruct/with_system"].as_str().unwrap();
    let messages = f.dir.join("conversation.json");
    std::fs::write(&messages, conversation.to_string()).unwrap();

    let args =
        chat_args(&f, &["--messages", messages.to_str().unwrap(), "--max-tokens", "6", "--json"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = nexttoken(&args);
    let out: Value = serde_json::from_str(stdout(&o).trim()).unwrap();

    let tokenizer = nexttoken::tokenizer::HfTokenizer::from_file(&f.tokenizer).unwrap();
    // Qwen2 prompts start without BOS; the template's special tokens are single ids.
    let prompt = tokenizer.encode(rendered).unwrap();
    assert_eq!(prompt.iter().filter(|&&id| id == QWEN_IM_END).count(), 4);
    let want = greedy_reply(&f.bytes, &prompt, 6);
    assert_eq!(ids(&out["ids"]), want.iter().map(|&i| i as u64).collect::<Vec<_>>());
    assert_eq!(out["prompt_tokens"].as_u64().unwrap() as usize, prompt.len());
    assert_eq!(out["reused_tokens"], 0);
    assert_eq!(out["role"], "assistant");
    let text_ids: Vec<u32> = want.iter().copied().filter(|&id| id != QWEN_IM_END).collect();
    assert_eq!(out["content"].as_str().unwrap(), tokenizer.decode(&text_ids));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(&format!("reused 0 of {} prompt tokens", prompt.len())), "{err}");
}

/// `chat --tools`: the conversation with its tools and the calls and answers so far renders as
/// transformers renders it (tests/fixtures/tools/rendered.json); a forced call (a tool's name,
/// or "required") comes back as OpenAI's `tool_calls`, its arguments a string of JSON that
/// matches the tool's schema; "none" offers no tools.
#[test]
fn chat_tools_renders_as_transformers_and_forces_valid_calls() {
    let Some(f) = chat_fixture_with_context("tools", true, 1024) else { return };
    let fixture: Value = serde_json::from_str(
        &std::fs::read_to_string(common::repo().join("tests/fixtures/tools/rendered.json"))
            .unwrap(),
    )
    .unwrap();
    // Strings bounded and no other keys: a random model's strings rarely end on their own.
    let mut tools = fixture["_meta"]["tools"].clone();
    for tool in tools.as_array_mut().unwrap() {
        let parameters = &mut tool["function"]["parameters"];
        parameters["additionalProperties"] = Value::Bool(false);
        for p in parameters["properties"].as_object_mut().unwrap().values_mut() {
            if p.get("enum").is_none() {
                p["maxLength"] = 10.into();
            }
        }
    }
    let tools_file = f.dir.join("tools.json");
    std::fs::write(&tools_file, tools.to_string()).unwrap();
    let tokenizer = nexttoken::tokenizer::HfTokenizer::from_file(&f.tokenizer).unwrap();
    let run = |conversation: &str, extra: &[&str]| {
        let messages = f.dir.join(format!("{conversation}.json"));
        std::fs::write(&messages, fixture["_meta"]["conversations"][conversation].to_string())
            .unwrap();
        let mut more = vec!["--messages", messages.to_str().unwrap(), "--json", "--max-tokens"];
        more.extend(["300", "--tools", tools_file.to_str().unwrap()]);
        more.extend(extra);
        let args = chat_args(&f, &more);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let o = nexttoken(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_str::<Value>(stdout(&o).trim()).unwrap()
    };

    // The prompt of a conversation that called a tool and got its answer: transformers' text.
    // (The fixture's tools are the unbounded ones: render their prompt with those.)
    let plain_tools = f.dir.join("plain-tools.json");
    std::fs::write(&plain_tools, fixture["_meta"]["tools"].to_string()).unwrap();
    for conversation in ["answered", "parallel"] {
        let messages = f.dir.join(format!("{conversation}.json"));
        std::fs::write(&messages, fixture["_meta"]["conversations"][conversation].to_string())
            .unwrap();
        let args = chat_args(
            &f,
            &["--messages", messages.to_str().unwrap(), "--json", "--max-tokens", "1"],
        );
        let mut args: Vec<&str> = args.iter().map(String::as_str).collect();
        args.extend(["--tools", plain_tools.to_str().unwrap()]);
        let out: Value = serde_json::from_str(stdout(&nexttoken(&args)).trim()).unwrap();
        let rendered = fixture[format!("Qwen2.5-Instruct/{conversation}")].as_str().unwrap();
        let want = tokenizer.encode(rendered).unwrap().len();
        assert_eq!(out["prompt_tokens"].as_u64().unwrap() as usize, want, "{conversation}");
    }

    for choice in ["get_weather", "required"] {
        let out = run("offer", &["--tool-choice", choice, "--no-parallel-tool-calls"]);
        assert_eq!(out["stop_reason"], "ConstraintComplete", "{choice}: {out}");
        assert_eq!(out["content"], Value::Null, "{choice}: {out}");
        let calls = out["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{choice}: {out}");
        let function = &calls[0]["function"];
        let name = function["name"].as_str().unwrap();
        if choice != "required" {
            assert_eq!(name, choice);
        }
        let tool =
            tools.as_array().unwrap().iter().find(|t| t["function"]["name"] == name).unwrap();
        let schema = &tool["function"]["parameters"];
        let args: Value = serde_json::from_str(function["arguments"].as_str().unwrap()).unwrap();
        let validator = jsonschema::validator_for(schema).unwrap();
        assert!(validator.is_valid(&args), "{choice}: {args} against {schema}");
        assert_eq!(calls[0]["type"], "function");
        assert_eq!(calls[0]["id"], "call_0");
    }
    // "none": no tools in the prompt, no calls.
    let with = run("offer", &[]);
    let without = run("offer", &["--tool-choice", "none"]);
    assert!(without.get("tool_calls").is_none(), "{without}");
    assert!(
        without["prompt_tokens"].as_u64() < with["prompt_tokens"].as_u64(),
        "the tools are in the prompt only when offered"
    );
}

#[test]
fn chat_interactive_reuses_the_cache_between_turns() {
    let Some(f) = chat_fixture("interactive", true) else { return };
    let args = chat_args(&f, &["--system", "You are a helpful assistant.", "--max-tokens", "4"]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_nexttoken"))
        .args(&args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child.stdin.take().unwrap().write_all(b"Hello!\nTell me a story.\n/clear\nHello!\n").unwrap();
    let o = child.wait_with_output().unwrap();
    let out = stdout(&o);
    let err = String::from_utf8_lossy(&o.stderr);

    // Turn 1's prompt as transformers renders it: the with_system conversation up to the first
    // opening of the assistant's turn.
    let examples: Value = serde_json::from_str(
        &std::fs::read_to_string(f.shared.join("chat-templates/rendered_examples.json")).unwrap(),
    )
    .unwrap();
    let rendered = examples["Qwen2.5-0.5B-Instruct/with_system"].as_str().unwrap();
    let opening = "<|im_start|>assistant\n";
    let turn1 = &rendered[..rendered.find(opening).unwrap() + opening.len()];
    let tokenizer = nexttoken::tokenizer::HfTokenizer::from_file(&f.tokenizer).unwrap();
    let t1 = tokenizer.encode(turn1).unwrap();

    let stats: Vec<(usize, usize)> = err
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix("reused ")?;
            let (n, rest) = rest.split_once(" of ")?;
            let m = rest.split_once(' ')?.0;
            Some((n.parse().unwrap(), m.parse().unwrap()))
        })
        .collect();
    assert_eq!(stats.len(), 3, "{err}");
    assert_eq!(stats[0], (0, t1.len()), "{err}");
    // Turn 2 repeats turn 1's prompt (and the reply): all of it comes from the cache.
    assert!(stats[1].0 >= t1.len() && stats[1].0 < stats[1].1, "{err}");
    // After /clear the prompt is turn 1's again, all in the cache but its last token.
    assert_eq!(stats[2], (t1.len() - 1, t1.len()), "{err}");
    assert!(err.contains("(conversation cleared)"), "{err}");
    // Greedy from the same prompt: turn 3 replies what turn 1 did, and that is the reference's.
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 3, "{out}");
    assert_eq!(lines[0], lines[2]);
    let want = greedy_reply(&f.bytes, &t1, 4);
    let text_ids: Vec<u32> = want.into_iter().filter(|&id| id != QWEN_IM_END).collect();
    assert_eq!(lines[0], tokenizer.decode(&text_ids));
}

#[test]
fn chat_errors_are_clear() {
    let Some(f) = chat_fixture("errors", false) else { return };
    let messages = f.dir.join("conversation.json");
    std::fs::write(&messages, r#"[{"role": "user", "content": "Hello!"}]"#).unwrap();
    let args = chat_args(&f, &["--messages", messages.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(&args, "the model has no chat template");

    // A conversation that is not a list of messages.
    let Some(f) = chat_fixture("errors2", true) else { return };
    let bad = f.dir.join("bad.json");
    std::fs::write(&bad, r#"{"role": "user"}"#).unwrap();
    let args = chat_args(&f, &["--messages", bad.to_str().unwrap()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(&args, "not a conversation");

    // Longer than the context (256 tokens here), then the same with --drop-oldest.
    let long = "many words here ".repeat(60);
    let conversation = serde_json::json!([
        {"role": "user", "content": long},
        {"role": "assistant", "content": long},
        {"role": "user", "content": "Hello!"},
    ]);
    let path = f.dir.join("long.json");
    std::fs::write(&path, conversation.to_string()).unwrap();
    let args = chat_args(&f, &["--messages", path.to_str().unwrap(), "--max-tokens", "2"]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fails_with(&args, "the model's context is 256 tokens");
    let args = chat_args(
        &f,
        &["--messages", path.to_str().unwrap(), "--max-tokens", "2", "--drop-oldest"],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = nexttoken(&args);
    stdout(&o);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("(2 oldest messages dropped to fit the context)"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// No input that panics, hangs or lies.
// ---------------------------------------------------------------------------------------------

/// Run nexttoken, killing it after `secs` (a FIFO or /dev/zero must not block or read forever).
fn nexttoken_within(args: &[&str], secs: u64) -> Output {
    use std::process::Stdio;
    let mut child = Command::new(env!("CARGO_BIN_EXE_nexttoken"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run nexttoken");
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed().as_secs() >= secs {
            child.kill().unwrap();
            panic!("{args:?} still running after {secs} s");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn tmp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("nexttoken-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A synthetic llama (vocabulary of 50, tokenizer in its metadata) whose final norm's first
/// weight is `value`, written to `dir`.
fn synth_file(dir: &std::path::Path, name: &str, value: f32) -> String {
    let mut parts = common::synth_parts("llama", nexttoken::quant::GgmlType::F32, 5);
    let norm = nexttoken::tensor_names::OUTPUT_NORM;
    let t = parts.tensors.iter_mut().find(|t| t.name == norm).unwrap();
    t.data[..4].copy_from_slice(&value.to_le_bytes());
    let path = dir.join(name);
    std::fs::write(&path, parts.to_bytes()).unwrap();
    path.display().to_string()
}

#[test]
fn nan_logits_are_an_error_on_every_path() {
    let dir = tmp_dir("nan");
    let model = synth_file(&dir, "nan.gguf", f32::NAN);
    let base = ["--model", &model, "--backend", "cpu", "--max-tokens", "3"];
    let with = |cmd: &'static str, extra: &[&'static str]| -> Vec<String> {
        [&[cmd][..], &base[..], extra].concat().into_iter().map(String::from).collect()
    };
    for extra in [&[][..], &["--json"], &["--beams", "3"], &["--beams", "3", "--json"]] {
        let o = nexttoken(&strs(&with("generate", extra)));
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{extra:?}: {err}");
        assert!(err.contains("NaN or infinite"), "{extra:?}: {err}");
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(!out.contains("beams"), "{extra:?}: printed {out}");
    }
    fails_with(
        &["score", "--model", &model, "--backend", "cpu", "--text", "abc"],
        "NaN or infinite",
    );
    // The same model without the NaN runs.
    let fine = synth_file(&dir, "fine.gguf", 1.0);
    stdout(&nexttoken(&["generate", "--model", &fine, "--backend", "cpu", "--max-tokens", "3"]));
}

/// generate echoes the prompt before the first token; an error after it starts a new line.
#[test]
fn an_error_after_the_echoed_prompt_starts_a_new_line() {
    let dir = tmp_dir("newline");
    let model = synth_file(&dir, "nan.gguf", f32::NAN);
    let o = nexttoken(&["generate", "--model", &model, "--backend", "cpu", "--prompt", "abc"]);
    assert!(!o.status.success());
    assert_eq!(String::from_utf8_lossy(&o.stdout), "abc\n");
}

#[test]
fn option_ranges_are_checked() {
    let gen = |extra: &[&'static str]| {
        [&["generate", "--max-tokens", "2", "--backend", "cpu"][..], extra].concat()
    };
    fails_with(&gen(&["--beams", "0"]), "beams = 0");
    fails_with(&gen(&["--beams", "65"]), "1 to 64");
    fails_with(&gen(&["--threads", "5000"]), "--threads 5000: at most 1024");
    fails_with(&gen(&["--context", "0"]), "--context 0: the context must hold at least one token");
    // More than the machine's cores: every core, with a note.
    let o = nexttoken(&gen(&["--threads", "1000"]));
    assert!(o.status.success());
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let note = format!("--threads 1000: this machine has {cores} cores; using {cores}");
    assert!(String::from_utf8_lossy(&o.stderr).contains(&note), "{o:?}");
    // Each error names the option as it is typed, whichever way a negative number is written,
    // and comes before any output (the prompt is not echoed first).
    for (args, message) in [
        (&["--temperature=-1"][..], "--temperature = -1 is out of range"),
        (&["--temperature", "-1"], "--temperature = -1 is out of range"),
        (&["--temperature", "NaN"], "--temperature = NaN"),
        (&["--top-p", "1.5"], "--top-p = 1.5"),
        (&["--min-p=-0.5"], "--min-p = -0.5"),
        (&["--min-p", "-0.5"], "--min-p = -0.5"),
        (&["--repeat-penalty", "0"], "--repeat-penalty = 0"),
        (&["--top-k", "-3"], "'--top-k <TOP_K>'"),
        (&["--max-tokens", "-1"], "'--max-tokens <MAX_TOKENS>'"),
    ] {
        let args = gen(&[&["--prompt", "In the"][..], args].concat());
        fails_with(&args, message);
        assert!(nexttoken(&args).stdout.is_empty(), "{args:?} printed before its error");
    }
    // Temperatures that overflowed 1/T are greedy: the same ids as temperature 0.
    let greedy = stdout(&nexttoken(&gen(&["--temperature", "0", "--json"])));
    let tiny = stdout(&nexttoken(&gen(&["--temperature", "1e-40", "--json", "--seed", "3"])));
    let ids = |out: &str| -> Vec<Value> {
        out.lines().map(|l| serde_json::from_str::<Value>(l).unwrap()["id"].clone()).collect()
    };
    assert_eq!(ids(&tiny), ids(&greedy));
}

#[test]
fn model_and_tokenizer_paths_that_are_not_files() {
    let dir = tmp_dir("paths");
    let missing = dir.join("missing.gguf");
    let gen = |model: &str| -> Vec<String> {
        ["generate", "--model", model, "--prompt", "x", "--backend", "cpu"]
            .map(String::from)
            .to_vec()
    };
    let run = |args: &[&str]| {
        let o = nexttoken_within(args, 30);
        assert!(!o.status.success(), "{args:?} succeeded");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let err = run(&strs(&gen(missing.to_str().unwrap())));
    assert!(err.contains("missing.gguf: the model file does not exist"), "{err}");
    let err = run(&strs(&gen(dir.to_str().unwrap())));
    assert!(err.contains("is a directory"), "{err}");
    let err = run(&strs(&gen("/dev/null")));
    assert!(err.contains("/dev/null: is not a regular file"), "{err}");
    let fifo = dir.join("fifo.gguf");
    let made = Command::new("mkfifo").arg(&fifo).status().is_ok_and(|s| s.success());
    if made {
        let err = run(&strs(&gen(fifo.to_str().unwrap())));
        assert!(err.contains("is not a regular file"), "{err}");
        let err = run(&["info", "--model", fifo.to_str().unwrap()]);
        assert!(err.contains("is not a regular file"), "{err}");
    }
    let err = run(&[
        "generate",
        "--tokenizer",
        "/dev/zero",
        "--prompt",
        "x",
        "--backend",
        "cpu",
        "--model",
        &synth_file(&dir, "m.gguf", 1.0),
    ]);
    assert!(err.contains("/dev/zero: is not a regular file"), "{err}");
    // A regular file too large to be a tokenizer (sparse: no disk used).
    let big = dir.join("big.json");
    std::fs::File::create(&big).unwrap().set_len(65 << 20).unwrap();
    let model = synth_file(&dir, "m.gguf", 1.0);
    let err = run(&["generate", "--tokenizer", big.to_str().unwrap(), "--model", &model]);
    assert!(err.contains("too large") && err.contains("64 MiB"), "{err}");
}

#[test]
fn tokenizer_files_that_panicked_inside_tokenizers() {
    let dir = tmp_dir("tok");
    let model = synth_file(&dir, "m.gguf", 1.0);
    let text = std::fs::read_to_string(common::fixtures().join("gpt2/tokenizer.json")).unwrap();
    let cut = text.find("\"decoder\"").unwrap() + 20;
    let bad: [(&str, String); 2] = [
        ("truncated.json", text[..cut].to_string()),
        ("nested.json", {
            let mut t: Value = serde_json::from_str(&text).unwrap();
            for _ in 0..70 {
                t["decoder"] =
                    serde_json::json!({"type": "Sequence", "decoders": [t["decoder"].clone()]});
            }
            t.to_string()
        }),
    ];
    for (name, json) in bad {
        let path = dir.join(name);
        std::fs::write(&path, json).unwrap();
        let o = nexttoken(&["generate", "--model", &model, "--tokenizer", path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{name}: {err}");
        assert!(err.contains("cannot read tokenizer.json") && !err.contains("panicked"), "{err}");
    }
}

/// A tokenizer with more tokens than the model has logits belongs to another model.
#[test]
fn a_tokenizer_larger_than_the_model_is_refused_at_load() {
    let dir = tmp_dir("fit");
    let model = synth_file(&dir, "m.gguf", 1.0);
    let tok = common::fixtures().join("gpt2/tokenizer.json");
    fails_with(
        &["generate", "--model", &model, "--tokenizer", tok.to_str().unwrap(), "--prompt", "hi"],
        "but the model only 50",
    );
}

/// www/models/default.gguf alone (no --tokenizer): its tokenizer is default-tokenizer.json
/// beside it; a copy with nothing beside it uses the GGUF's own. Both tokenize the reference
/// prompt as transformers did.
#[test]
fn the_default_model_file_finds_its_tokenizer() {
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(common::fixtures().join("default_model/reference.json")).unwrap(),
    )
    .unwrap();
    let want = ids(&reference["prompt_ids"]);
    let www = common::repo().join("www/models/default.gguf");
    let alone = tmp_dir("default").join("default.gguf");
    std::fs::copy(&www, &alone).unwrap();
    for model in [&www, &alone] {
        let text = reference["prompt"].as_str().unwrap();
        let args = ["score", "--model", model.to_str().unwrap(), "--text", text, "--json"];
        let out: Value = serde_json::from_str(&stdout(&nexttoken(&args))).unwrap();
        let got: Vec<u64> =
            out["tokens"].as_array().unwrap().iter().map(|t| t["id"].as_u64().unwrap()).collect();
        assert_eq!(got, want[1..], "{}", model.display());
    }
}

#[test]
fn info_prints_plain_values() {
    let out = stdout(&nexttoken(&["info"]));
    assert!(out.contains("bos / eos      1 (add bos: true) / 2"), "{out}");
    assert!(!out.contains("Some("), "{out}");
}

#[test]
fn not_a_gguf_says_what_the_file_starts_with() {
    let dir = tmp_dir("magic");
    let cases = [
        ("text.gguf", "The quick brown fox", "\"The \" (54 68 65 20)"),
        ("json.gguf", "{\"model\": {}}", "looks like JSON"),
        ("page.gguf", "<!DOCTYPE html><html>404</html>", "HTML page"),
        ("empty.gguf", "", "it is empty"),
    ];
    for (name, content, needle) in cases {
        let path = dir.join(name);
        std::fs::write(&path, content).unwrap();
        fails_with(&["info", "--model", path.to_str().unwrap()], needle);
    }
}

/// Without a desktop session (XDG_RUNTIME_DIR unset) the GPU probe prints nothing but the
/// backend line: Mesa's device-select layer used to make libwayland complain twice.
#[test]
fn the_gpu_probe_is_quiet_without_a_session() {
    let o = Command::new(env!("CARGO_BIN_EXE_nexttoken"))
        .args(["generate", "--prompt", "In the", "--max-tokens", "1"])
        .env_remove("XDG_RUNTIME_DIR")
        .env_remove("NODEVICE_SELECT")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(!err.contains("XDG_RUNTIME_DIR"), "{err}");
}

// ---------------------------------------------------------------------------------------------
// Structured output: --json-schema, --json-object, --regex, --grammar on the embedded default
// model (trained, with its real SentencePiece tokenizer); outputs checked by the jsonschema and
// regex crates, not by the constraint engine that produced them.
// ---------------------------------------------------------------------------------------------

struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("nexttoken-cli-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
    fn file(&self, name: &str, text: &str) -> String {
        let path = self.0.join(name);
        std::fs::write(&path, text).unwrap();
        path.display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        std::fs::remove_dir_all(&self.0).ok();
    }
}

const PROMPT: &str = "And God said";

/// `generate --json` on the default model with `extra`: the token lines and the summary.
fn generate_json(extra: &[&str]) -> (Vec<Value>, Value) {
    let args = ["generate", "--backend", "cpu", "--prompt", PROMPT, "--json"];
    let out = stdout(&nexttoken(&[&args[..], extra].concat()));
    let mut lines: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let summary = lines.pop().unwrap();
    (lines, summary)
}

#[test]
fn json_schema_output_validates() {
    let tmp = TempDir::new("schema");
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 2}
        },
        "required": ["name", "age"],
        "additionalProperties": false
    });
    let file = tmp.file("schema.json", &schema.to_string());
    let validator = jsonschema::validator_for(&schema).unwrap();
    for sampling in
        [&["--temperature", "0"][..], &["--seed", "4"], &["--top-k", "5", "--seed", "9"]]
    {
        let (tokens, summary) = generate_json(&[&["--json-schema", &file], sampling].concat());
        let text = summary["text"].as_str().unwrap();
        let value: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text:?}"));
        assert!(validator.is_valid(&value), "{text:?}");
        let stop = summary["stop_reason"].as_str().unwrap();
        assert!(stop == "ConstraintComplete" || stop == "Eos", "{stop}");
        // Each token line says what the constraint removed from the model's top tokens.
        assert!(tokens.iter().all(|t| t["removed"].is_array()));
        assert!(tokens.iter().any(|t| !t["removed"].as_array().unwrap().is_empty()));
    }
    // Beam search under the schema: the best beam, as text.
    let out = stdout(&nexttoken(&[
        "generate",
        "--backend",
        "cpu",
        "--prompt",
        PROMPT,
        "--json-schema",
        &file,
        "--beams",
        "3",
    ]));
    let value: Value = serde_json::from_str(out.trim_end().strip_prefix(PROMPT).unwrap()).unwrap();
    assert!(validator.is_valid(&value), "{out:?}");
}

#[test]
fn regex_grammar_and_json_object_outputs_match() {
    let tmp = TempDir::new("regex");
    for (pattern, sampling) in [
        (r"[0-9]{3}-[0-9]{4}", &["--temperature", "0"][..]),
        (r"(Yea|Nay), [a-z]{2,10}\.", &["--seed", "2"][..]),
        (r"[A-Z][a-z]+( [a-z]+){2,5}\.", &["--seed", "3", "--min-p", "0.05"][..]),
    ] {
        let (_, summary) = generate_json(&[&["--regex", pattern], sampling].concat());
        let text = summary["text"].as_str().unwrap();
        let re = regex::Regex::new(&format!("^(?:{pattern})$")).unwrap();
        assert!(re.is_match(text), "{pattern}: {text:?}");
    }
    let grammar = tmp.file(
        "list.lark",
        "start: \"[\" item (\", \" item)? (\", \" item)? \"]\"\nitem: /[0-9]{1,3}/ | /[a-z]{1,8}/\n",
    );
    let (_, summary) = generate_json(&["--grammar", &grammar, "--seed", "1"]);
    let text = summary["text"].as_str().unwrap();
    let re = regex::Regex::new(r"^\[([0-9]{1,3}|[a-z]{1,8})(, ([0-9]{1,3}|[a-z]{1,8})){0,2}\]$");
    assert!(re.unwrap().is_match(text), "{text:?}");
    let (_, summary) = generate_json(&["--json-object", "--temperature", "0"]);
    let text = summary["text"].as_str().unwrap();
    assert!(serde_json::from_str::<Value>(text).unwrap().is_object(), "{text:?}");
}

#[test]
fn structured_output_errors_name_the_problem() {
    let tmp = TempDir::new("constraint-errors");
    fn with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["generate", "--backend", "cpu", "--prompt", PROMPT];
        args.extend_from_slice(extra);
        args
    }
    let not_json = tmp.file("bad.json", "{\"type\": \"object\",\n \"properties\": }");
    fails_with(&with(&["--json-schema", &not_json]), "not JSON: expected value at line 2");
    let bad_type = tmp.file("type.json", r#"{"type": "strng"}"#);
    fails_with(&with(&["--json-schema", &bad_type]), "invalid JSON schema");
    fails_with(&with(&["--json-schema", &bad_type]), "strng");
    fails_with(&with(&["--json-schema", "/nonexistent/schema.json"]), "schema.json");
    fails_with(&with(&["--regex", "[0-9"]), "unclosed character class");
    let bad_grammar = tmp.file("bad.lark", "start: item\n");
    fails_with(&with(&["--grammar", &bad_grammar]), "invalid grammar");
    fails_with(&with(&["--grammar", &bad_grammar]), "item");
    // One constraint at a time; none with stop strings.
    fails_with(&with(&["--regex", "a", "--json-object"]), "cannot be used with");
    fails_with(&with(&["--json-object", "--stop", "}"]), "stop strings cannot be combined");
    // Out of tokens before the output is complete: the text so far, then an error (exit 1).
    let o = nexttoken(&with(&["--json-object", "--max-tokens", "2"]));
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("Incomplete") && err.contains("does not match the constraint"), "{err}");
    assert!(String::from_utf8_lossy(&o.stdout).starts_with(&format!("{PROMPT}{{")));
    let o = nexttoken(&with(&["--json-object", "--max-tokens", "2", "--json"]));
    assert!(!o.status.success());
    let out = String::from_utf8_lossy(&o.stdout);
    let summary: Value = serde_json::from_str(out.lines().last().unwrap()).unwrap();
    assert_eq!(summary["stop_reason"], "Incomplete");
}

/// `chat` takes the same constraint flags: the reply is constrained, and the template's end of
/// turn (`<|im_end|>`) ends it only once the output is complete.
#[test]
fn chat_reply_follows_a_constraint() {
    let Some(f) = chat_fixture("constrained", true) else { return };
    let messages = f.dir.join("conversation.json");
    std::fs::write(&messages, r#"[{"role": "user", "content": "Is it raining?"}]"#).unwrap();
    let m = messages.to_str().unwrap();
    for pattern in ["(yes|no)", r"(Yes|No), [a-z]{1,12}\."] {
        let args = chat_args(&f, &["--messages", m, "--regex", pattern, "--json"]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out: Value = serde_json::from_str(stdout(&nexttoken(&args)).trim()).unwrap();
        let content = out["content"].as_str().unwrap();
        let re = regex::Regex::new(&format!("^(?:{pattern})$")).unwrap();
        assert!(re.is_match(content), "{pattern}: {content:?}");
        let ids = ids(&out["ids"]);
        match out["stop_reason"].as_str().unwrap() {
            "Eos" => assert_eq!(ids.last(), Some(&(QWEN_IM_END as u64))),
            "ConstraintComplete" => assert!(!ids.contains(&(QWEN_IM_END as u64))),
            other => panic!("{other}"),
        }
    }
}

/// The fast CPU path holds one copy of the weights at every moment: its private copy (in huge
/// pages where the kernel offers them) is made a piece at a time, each piece of the file's
/// mapping given back once copied. Peak RSS of a load and a step of SmolLM2-135M's shape
/// (144 MB, Q8_0): at most 1.2x the file (it was 2.1x).
#[test]
fn the_fast_path_holds_the_weights_once() {
    let Some(shared) = common::shared() else { return };
    let dir = tmp_dir("rss");
    let model = dir.join("smol.gguf");
    let config = shared.join("configs/SmolLM2-135M-Instruct.config.json");
    let o = nexttoken(&[
        "synth",
        "--config",
        config.to_str().unwrap(),
        "--type",
        "q8_0",
        "--out",
        model.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{o:?}");
    let file = std::fs::metadata(&model).unwrap().len() as f64;
    let args = ["--prefill", "1", "--contexts", "1", "--steps", "1", "--threads", "1", "--json"];
    let bench = |extra: &[&str]| -> f64 {
        let o = nexttoken(
            &[&["bench", "--model", model.to_str().unwrap(), "--backend", "cpu"][..], &args, extra]
                .concat(),
        );
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        v["peak_rss_bytes"].as_f64().unwrap() / file
    };
    let (fast, exact) = (bench(&[]), bench(&["--exact"]));
    eprintln!("peak RSS / file: fast {fast:.2}, exact {exact:.2}");
    assert!(fast <= 1.2, "the fast path peaked at {fast:.2} times the file");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Without `--seed` each run draws a fresh seed and prints it with the stats; that seed, or any
/// fixed one, reproduces the text. Text mode says why generation stopped (here: the context
/// filled before `--max-tokens`).
#[test]
fn seeds_are_fresh_unless_given_and_text_mode_says_why_it_stopped() {
    let run = |extra: &[&str]| {
        let args = [
            &["generate", "--backend", "cpu", "--prompt", "And the", "--max-tokens", "24"][..],
            extra,
        ]
        .concat();
        let o = nexttoken(&args);
        let err = String::from_utf8_lossy(&o.stderr).into_owned();
        let seed = err
            .split("; seed ")
            .nth(1)
            .map(|s| s.split(|c: char| !c.is_ascii_digit()).next().unwrap().to_string());
        (stdout(&o), seed, err)
    };
    let (a, seed_a, _) = run(&["--temperature", "1"]);
    let (b, seed_b, _) = run(&["--temperature", "1"]);
    let (seed_a, seed_b) = (seed_a.expect("no seed printed"), seed_b.expect("no seed printed"));
    assert!(
        seed_a != seed_b && a != b,
        "two runs without --seed: {a:?} {b:?} (seeds {seed_a}, {seed_b})"
    );
    let (again, seed_again, _) = run(&["--temperature", "1", "--seed", &seed_a]);
    assert_eq!((again, seed_again), (a, Some(seed_a)), "the printed seed reproduces the run");
    let (c, _, _) = run(&["--seed", "7"]);
    let (d, _, _) = run(&["--seed", "7"]);
    assert_eq!(c, d, "--seed 7 twice (the default temperature)");
    // Greedy draws nothing: no seed to print.
    let (_, seed, _) = run(&["--temperature", "0"]);
    assert_eq!(seed, None);
    // The context (16 tokens) fills before --max-tokens 24: said in text mode, not only in --json.
    let (_, _, err) = run(&["--temperature", "0", "--context", "16"]);
    assert!(err.contains("stopped: the context is full"), "{err}");
    let (_, _, err) = run(&["--temperature", "0"]);
    assert!(err.contains("stopped: max_tokens were generated"), "{err}");
}

/// `bench` runs the embedded model when no `--model` is given; `--passes` times verification
/// passes of those sizes and of one token, the reference.
#[test]
fn bench_defaults_to_the_embedded_model() {
    let args = ["bench", "--contexts", "16", "--prefill", "16", "--steps", "2", "--passes", "3"];
    let o = nexttoken(&[&args[..], &["--json"]].concat());
    let report: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(report["model"], "embedded default (www/models/default.gguf)");
    assert_eq!(report["results"][0]["backend"], "cpu", "{report}");
    let passes = report["results"][0]["pass_ms"].as_object().expect("pass_ms");
    let sizes: Vec<&str> = passes.keys().map(|k| k.as_str()).collect();
    assert_eq!(sizes, ["1", "3"], "{report}");
    assert!(passes.values().all(|ms| ms.as_f64().is_some_and(|ms| ms > 0.0)), "{report}");
    // The embedded model's size, as `info` reports it from the file.
    let info = stdout(&nexttoken(&["info"]));
    let params = report["parameters"].as_u64().unwrap();
    assert!(params > 0 && info.contains(&params.to_string()), "{params} not in:\n{info}");
}

/// The recording the lesson page plays (`www/models/default-recording.jsonl`, made by
/// `generate --json` on the default model) is what the default model generates now: a lesson
/// must not show a recording of a model it no longer ships.
#[test]
fn the_shipped_recording_is_the_default_models_generation() {
    let path = common::repo().join("www/models/default-recording.jsonl");
    let recorded: Vec<Value> = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let (summary, tokens) = recorded.split_last().unwrap();
    let model = common::repo().join("www/models/default.gguf").display().to_string();
    let prompt = summary["prompt"].as_str().unwrap();
    assert_eq!(summary["options"]["temperature"], 0.0, "a greedy recording");
    let n = tokens.len().to_string();
    let args = ["generate", "--model", &model, "--prompt", prompt, "--temperature", "0"];
    let more = ["--max-tokens", &n, "--backend", "cpu", "--exact", "--json"];
    let out = stdout(&nexttoken(&[&args[..], &more[..]].concat()));
    let now: Vec<Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(now.len(), recorded.len());
    for (i, (a, b)) in tokens.iter().zip(&now).enumerate() {
        assert_eq!(a["id"], b["id"], "token {i}");
        assert_eq!(a["text"], b["text"], "token {i}");
        let (pa, pb) = (a["prob"].as_f64().unwrap(), b["prob"].as_f64().unwrap());
        assert!((pa - pb).abs() < 1e-5, "token {i}: P {pa} recorded, {pb} now");
    }
    assert_eq!(summary["text"], now.last().unwrap()["text"]);
}
