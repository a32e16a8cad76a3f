//! Tool calling (`nexttoken::tools`): conversations with tools, calls and tool answers rendered
//! through the real Qwen2.5 template against what transformers renders
//! (`tests/fixtures/tools/rendered.json`, made by `tools/make_tool_fixtures.py`); calls read
//! back out of each family's format (the Hermes blocks transformers rendered, Llama 3's JSON as
//! Meta documents it); and forced calls on a random-weight model with Qwen2's vocabulary and
//! template, whose arguments validate against the tool's schema on every seed (checked by the
//! `jsonschema` crate).

mod common;

use nexttoken::chat::{ChatTemplate, Message};
use nexttoken::constraint::ConstraintSpec;
use nexttoken::cpu::{CpuModel, Precision};
use nexttoken::generate::{GenerateOptions, Generation, StopReason};
use nexttoken::gguf::Gguf;
use nexttoken::model::Model;
use nexttoken::quant::GgmlType;
use nexttoken::sampling::SamplerConfig;
use nexttoken::synthetic::{self, VocabMeta};
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::tools::{call_constraint, parse_reply, ForcedCall, ToolFormat};
use serde_json::{json, Value};

fn fixture() -> Value {
    let path = common::repo().join("tests/fixtures/tools/rendered.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn qwen_template(shared: &std::path::Path) -> ChatTemplate {
    let source =
        std::fs::read_to_string(shared.join("chat-templates/Qwen2.5-Instruct.jinja")).unwrap();
    ChatTemplate::new(source, "", "<|im_end|>").unwrap()
}

#[test]
fn tools_render_byte_identical_to_transformers() {
    let Some(shared) = common::shared() else { return };
    let f = fixture();
    let tools = f["_meta"]["tools"].as_array().unwrap().clone();
    let template = qwen_template(&shared).with_tools(tools).unwrap();
    assert_eq!(template.tool_format(), Some(ToolFormat::Hermes));
    let mut checked = 0;
    for (name, conversation) in f["_meta"]["conversations"].as_object().unwrap() {
        // OpenAI's shapes as clients send them: `content: null`, calls with their ids.
        let messages: Vec<Message> = serde_json::from_value(conversation.clone()).unwrap();
        let got = template.render(&messages, true).unwrap();
        assert_eq!(got, f[format!("Qwen2.5-Instruct/{name}")].as_str().unwrap(), "{name}");
        checked += 1;
    }
    assert_eq!(checked, 4);
    // OpenAI's arguments are a string of JSON: the template sees the object all the same.
    let mut messages: Vec<Message> =
        serde_json::from_value(f["_meta"]["conversations"]["answered"].clone()).unwrap();
    let as_string = json!({"type": "function", "id": "call_0", "function": {"name": "get_weather",
        "arguments": "{\"city\": \"Paris\", \"unit\": \"celsius\"}"}});
    messages[1].tool_calls = vec![serde_json::from_value(as_string).unwrap()];
    assert_eq!(
        template.render(&messages, true).unwrap(),
        f["Qwen2.5-Instruct/answered"].as_str().unwrap()
    );
}

#[test]
fn a_template_that_takes_no_tools_refuses_them() {
    let Some(shared) = common::shared() else { return };
    let source =
        std::fs::read_to_string(shared.join("chat-templates/TinyLlama-Chat.jinja")).unwrap();
    let template = ChatTemplate::new(source, "<s>", "</s>").unwrap();
    assert_eq!(template.tool_format(), None);
    let err = template.with_tools(vec![json!({"type": "function", "function": {"name": "f"}})]);
    assert!(err.unwrap_err().to_string().contains("takes no tools"));
    // A name that is not a function name is refused before anything renders.
    let err = qwen_template(&shared)
        .with_tools(vec![json!({"type": "function", "function": {"name": "rm -rf /"}})])
        .unwrap_err();
    assert!(err.to_string().contains("not 1 to 64 letters"), "{err}");
}

#[test]
fn calls_are_read_back_in_each_familys_format() {
    let f = fixture();
    // Hermes (Qwen2.5): the assistant turns transformers rendered from the calls.
    let answered = f["Qwen2.5-Instruct/answered"].as_str().unwrap();
    let reply = answered.split("<|im_start|>assistant\n").nth(1).unwrap();
    let reply = reply.split("<|im_end|>").next().unwrap();
    let parsed = parse_reply(ToolFormat::Hermes, reply);
    assert_eq!(parsed.content, "");
    assert_eq!(parsed.tool_calls.len(), 1);
    let call = &parsed.tool_calls[0];
    assert_eq!((call.id.as_str(), call.function.name.as_str()), ("call_0", "get_weather"));
    assert_eq!(call.function.arguments, json!({"city": "Paris", "unit": "celsius"}));
    let parallel = f["Qwen2.5-Instruct/parallel"].as_str().unwrap();
    let reply = parallel.split("<|im_start|>assistant\n").nth(1).unwrap();
    let reply = reply.split("<|im_end|>").next().unwrap();
    let parsed = parse_reply(ToolFormat::Hermes, reply);
    assert_eq!(parsed.content, "Let me look.");
    let names: Vec<_> = parsed.tool_calls.iter().map(|c| c.function.name.as_str()).collect();
    assert_eq!(names, ["get_weather", "get_time"]);
    assert_eq!(parsed.tool_calls[1].function.arguments, json!({"timezone": "Asia/Tokyo"}));
    // A block cut short by max tokens still counts when its JSON is whole; a broken one is text.
    let cut = parse_reply(ToolFormat::Hermes, "<tool_call>\n{\"name\": \"f\", \"arguments\": {}}");
    assert_eq!(cut.tool_calls.len(), 1);
    let broken = parse_reply(ToolFormat::Hermes, "Sure. <tool_call>{\"name\": \"f\", </tool_call>");
    assert!(broken.tool_calls.is_empty());
    assert_eq!(broken.content, "Sure. <tool_call>{\"name\": \"f\",");

    // Llama 3.x: a bare JSON object with "parameters" (Meta's model card), after <|python_tag|>
    // at times, several separated by ";".
    let one = parse_reply(
        ToolFormat::LlamaJson,
        "{\"name\": \"get_time\", \"parameters\": {\"timezone\": \"UTC\"}}",
    );
    assert_eq!(one.tool_calls[0].function.arguments, json!({"timezone": "UTC"}));
    let two = parse_reply(
        ToolFormat::LlamaJson,
        "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}",
    );
    let names: Vec<_> = two.tool_calls.iter().map(|c| c.function.name.as_str()).collect();
    assert_eq!((names, two.content.as_str()), (vec!["a", "b"], ""));
    let prose = parse_reply(ToolFormat::LlamaJson, "The weather is {fine}.");
    assert!(prose.tool_calls.is_empty() && prose.content == "The weather is {fine}.");
}

#[test]
fn a_forced_call_on_a_random_model_always_parses_and_validates() {
    let Some(shared) = common::shared() else { return };
    let f = fixture();
    // The fixture's tools with their strings bounded and no keys but theirs (OpenAI's strict
    // tools): a random model's strings rarely end on their own (it picks a closing quote about
    // once in a hundred tokens), and a key is a string too.
    let mut tools = f["_meta"]["tools"].as_array().unwrap().clone();
    for tool in &mut tools {
        tool["function"]["parameters"]["additionalProperties"] = json!(false);
        for property in
            tool["function"]["parameters"]["properties"].as_object_mut().unwrap().values_mut()
        {
            if property["type"] == "string" && property.get("enum").is_none() {
                property["maxLength"] = json!(12);
            }
        }
    }
    let vocab = std::fs::read(shared.join("tokenizer-tests/qwen2/ggml-vocab-qwen2.gguf")).unwrap();
    let meta = VocabMeta::from_gguf(&Gguf::parse(&vocab).unwrap()).unwrap();
    let spec = common::synth_spec("qwen2", GgmlType::Q8_0, 41).with_vocab(meta);
    let bytes = synthetic::write(&synthetic::Spec { n_ctx: 2048, ..spec }).unwrap();
    let tok = HfTokenizer::from_gguf_bytes(&bytes).unwrap();
    let model = CpuModel::new(Model::from_bytes(bytes).unwrap())
        .with_precision(Precision::Fast)
        .with_threads(1);
    let template = qwen_template(&shared).with_tools(tools.clone()).unwrap();
    let messages: Vec<Message> =
        serde_json::from_value(f["_meta"]["conversations"]["offer"].clone()).unwrap();
    let prompt = template.prompt_ids(&tok, None, &messages).unwrap();
    let schemas: Vec<(String, Value)> = tools
        .iter()
        .map(|t| {
            (
                t["function"]["name"].as_str().unwrap().to_string(),
                t["function"]["parameters"].clone(),
            )
        })
        .collect();
    let cases = [
        (ForcedCall::Named("get_weather".into()), false),
        (ForcedCall::Any, false),
        (ForcedCall::Any, true),
    ];
    for (case, (forced, parallel)) in cases.iter().enumerate() {
        let constraint = call_constraint(ToolFormat::Hermes, &tools, forced, *parallel).unwrap();
        assert!(matches!(constraint, ConstraintSpec::Grammar { .. }));
        for seed in 0..4 {
            let opts = GenerateOptions {
                max_tokens: 1500,
                sampler: SamplerConfig {
                    temperature: 1.0,
                    seed: 100 * case as u64 + seed,
                    ..Default::default()
                },
                constraint: Some(constraint.clone()),
                ..GenerateOptions::default()
            };
            let mut g =
                Generation::new(&model, &tok as &dyn nexttoken::Vocab, &prompt, opts).unwrap();
            while g.step().unwrap().is_some() {}
            let text = g.text().to_string();
            assert_eq!(
                g.stop_reason(),
                Some(StopReason::ConstraintComplete),
                "{forced:?} seed {seed}: {text:?}"
            );
            let parsed = parse_reply(ToolFormat::Hermes, &text);
            assert_eq!(parsed.content, "", "{forced:?} seed {seed}: {text:?}");
            assert!(!parsed.tool_calls.is_empty(), "{forced:?} seed {seed}: {text:?}");
            assert!(*parallel || parsed.tool_calls.len() == 1, "one call: {text:?}");
            for call in &parsed.tool_calls {
                let (_, schema) =
                    schemas.iter().find(|(n, _)| *n == call.function.name).expect("a tool's name");
                if let ForcedCall::Named(name) = forced {
                    assert_eq!(&call.function.name, name);
                }
                let validator = jsonschema::validator_for(schema).unwrap();
                if let Err(e) = validator.validate(&call.function.arguments) {
                    panic!("{forced:?} seed {seed}: {e} in {text:?}");
                }
            }
        }
    }
    // A name that is not among the tools cannot be forced.
    let err = call_constraint(ToolFormat::Hermes, &tools, &ForcedCall::Named("nope".into()), false);
    assert!(err.unwrap_err().to_string().contains("not among the tools"));
}
