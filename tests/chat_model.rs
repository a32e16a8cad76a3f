//! The shipped chat model (`www/models/chat.gguf`, the default model fine-tuned on turns by
//! `tools/train_chat_model.py`) against Hugging Face transformers: its chat template renders a
//! conversation as transformers' `apply_chat_template` does, the prompt ids, the logits after the
//! prompt, the greedy reply (ending at the end token), and the CLI's reply to the same
//! conversation.
//!
//! The reference (`tests/fixtures/chat_model/reference.json`) was computed by transformers on the
//! weights the GGUF holds (Q8_0 dequantised by gguf-py).

mod common;

use std::process::Command;

use nexttoken::chat::{ChatTemplate, Message};
use nexttoken::cpu::CpuModel;
use nexttoken::gguf::Gguf;
use nexttoken::model::Model;
use nexttoken::tokenizer::HfTokenizer;
use nexttoken::LanguageModel;
use serde_json::Value;

/// Max abs logit error vs transformers (f32 activations throughout), as for the default model.
const LOGIT_TOLERANCE: f32 = 1e-4;

fn reference() -> Value {
    let path = common::fixtures().join("chat_model/reference.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn model_path() -> std::path::PathBuf {
    common::repo().join("www/models/chat.gguf")
}

fn cases() -> Vec<Value> {
    let cases = reference()["cases"].as_array().unwrap().clone();
    assert!(cases.len() >= 3, "the fixture has {} conversations", cases.len());
    cases
}

fn messages(case: &Value) -> Vec<Message> {
    serde_json::from_value(case["messages"].clone()).unwrap()
}

/// The template in the GGUF, with the GGUF's own tokenizer (what the CLI and the page use when no
/// tokenizer.json lies beside the file): the same text and ids as transformers.
#[test]
fn the_chat_template_and_ids_match_transformers() {
    let bytes = std::fs::read(model_path()).unwrap();
    let header = Gguf::parse(&bytes).unwrap();
    let own = HfTokenizer::from_gguf(&header).unwrap();
    let json =
        HfTokenizer::from_file(&common::repo().join("www/models/default-tokenizer.json")).unwrap();
    let template = ChatTemplate::from_gguf_with_vocab(&header, Some(&own)).unwrap();
    assert_eq!(template.stop_tokens(), &[2], "the end token ends a reply");
    for case in cases() {
        let messages = messages(&case);
        let rendered = template.render(&messages, true).unwrap();
        assert_eq!(rendered, case["rendered"].as_str().unwrap(), "rendering");
        let want = common::ids(&case["prompt_ids"]);
        for vocab in [&own, &json] {
            assert_eq!(template.prompt_ids(vocab, Some(1), &messages).unwrap(), want, "prompt ids");
        }
    }
}

#[test]
fn the_chat_models_logits_and_greedy_replies_match_transformers() {
    let model = CpuModel::new(Model::open(&model_path()).unwrap());
    let vocab = model.vocab_size();
    for case in cases() {
        let prompt = common::ids(&case["prompt_ids"]);
        let want: Vec<f32> = case["last_logits"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(want.len(), vocab);
        let mut state = model.new_state();
        let got = model.forward(&mut state, &prompt, false).unwrap();
        let worst = got.iter().zip(&want).map(|(g, w)| (g - w).abs()).fold(0f32, f32::max);
        assert!(worst <= LOGIT_TOLERANCE, "max abs logit error {worst} > {LOGIT_TOLERANCE}");
        let reply = common::ids(&case["greedy_reply_ids"]);
        if case["min_top2_margin"].as_f64().unwrap() > 1e-3 {
            assert_eq!(common::greedy(&model, &prompt, reply.len()), reply, "greedy reply");
        }
    }
}

/// `nexttoken chat` on the shipped file alone (its own tokenizer and template) replies as
/// transformers' greedy decoding does, and stops at the end token.
#[test]
fn the_cli_chats_with_the_shipped_chat_model() {
    let tmp = std::env::temp_dir().join(format!("nexttoken-chat-model-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for (k, case) in cases().iter().enumerate() {
        if case["min_top2_margin"].as_f64().unwrap() <= 1e-3 {
            continue;
        }
        let conversation = tmp.join(format!("conversation-{k}.json"));
        std::fs::write(&conversation, case["messages"].to_string()).unwrap();
        let mut want = common::ids(&case["greedy_reply_ids"]);
        let ended = want.last() == Some(&2);
        let max_tokens = if ended { 64 } else { want.len() };
        let out = Command::new(env!("CARGO_BIN_EXE_nexttoken"))
            .args(["chat", "--model", model_path().to_str().unwrap(), "--messages"])
            .arg(&conversation)
            .args(["--temperature", "0", "--backend", "cpu", "--exact", "--json"])
            .args(["--max-tokens", &max_tokens.to_string()])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let reply: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let mut got = common::ids(&reply["ids"]);
        // The end token may or may not be listed among the reply's ids: compare the words.
        for ids in [&mut got, &mut want] {
            if ids.last() == Some(&2) {
                ids.pop();
            }
        }
        assert_eq!(got, want, "reply ids: {stdout}");
        let text = case["greedy_reply"].as_str().unwrap();
        assert_eq!(reply["content"].as_str().unwrap().trim(), text.trim(), "{stdout}");
        assert_eq!(reply["stop_reason"], if ended { "Eos" } else { "MaxTokens" }, "{reply}");
    }
    let _ = std::fs::remove_dir_all(&tmp);
}
