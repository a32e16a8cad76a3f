//! Multi-turn KV reuse must not change the numbers: the logits of a conversation's next turn,
//! computed from the previous turn's state cut back to the shared prefix (`chat::reuse_prefix`)
//! plus a prefill of only the rest, equal those of running the whole conversation from an empty
//! state. On the CPU's exact path (tolerance 1e-4, as `tests/kv_cache.rs` for the cache itself),
//! on the GPU (1e-3 with the f32 KV cache, as `tests/gpu.rs` for GPU against CPU), and on the
//! table models. Also: `Generation::resume` streams the same tokens as a fresh generation, and
//! `fit_prompt` errors or drops the oldest turns when a conversation outgrows the context.

mod common;

use common::*;
use nexttoken::chat::{fit_prompt, reuse_prefix, Chat, ChatTemplate, Message, Overflow};
use nexttoken::cpu::CpuModel;
use nexttoken::generate::{GenerateOptions, Generation, TokenEvent};
use nexttoken::gpu::{GpuModel, GpuOptions};
use nexttoken::model::Model;
use nexttoken::quant::GgmlType;
use nexttoken::sampling::SamplerConfig;
use nexttoken::{Error, LanguageModel, Result, Vocab};

const CPU_TOL: f32 = 1e-4;
const GPU_TOL: f32 = 1e-3;

/// Turn 1's prompt, and turn 2's tokens after what turn 1 shares with it.
const TURN1: &[u32] = &[SYNTH_BOS, 7, 19, 33, 4, 11, 12];
const TURN2_NEW: &[u32] = &[21, 5, 8, 30, 17];

/// A toy vocabulary for the synthetic models: one token per byte, so a rendered conversation
/// has as many tokens as characters. Ids 3.. decode to the characters from ' ' on, and encode
/// back to themselves; ids 0-2 (unknown, BOS, EOS) decode to nothing.
struct Chars;

const FIRST_TEXT_ID: u32 = 3;

impl Vocab for Chars {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let span = SYNTH_VOCAB as u32 - FIRST_TEXT_ID;
        Ok(text.bytes().map(|b| FIRST_TEXT_ID + u32::from(b).saturating_sub(32) % span).collect())
    }
    fn decode(&self, ids: &[u32]) -> String {
        let text = ids.iter().filter(|&&id| id >= FIRST_TEXT_ID);
        text.map(|&id| char::from(b' ' + (id - FIRST_TEXT_ID) as u8)).collect()
    }
    fn token_text(&self, id: u32) -> String {
        self.decode(&[id])
    }
}

/// Turn 1 greedy for `n` tokens; returns the state and the ids it holds.
fn turn1<M: LanguageModel>(model: &M, n: usize) -> (M::State, Vec<u32>, Vec<u32>) {
    let opts = GenerateOptions {
        max_tokens: n,
        sampler: SamplerConfig::greedy(),
        stop_at_eos: false,
        ..GenerateOptions::default()
    };
    let mut g = Generation::new(model, &Chars, TURN1, opts).unwrap();
    while g.step().unwrap().is_some() {}
    let held = g.held_ids().to_vec();
    let generated = g.generated_ids().to_vec();
    // The last sampled token is never fed to the model.
    assert_eq!(held.len(), TURN1.len() + n - 1);
    assert_eq!(held[..TURN1.len()], *TURN1);
    (g.into_state(), held, generated)
}

/// Turn 2 prompts: the whole of turn 1 (prompt and every sampled token) then new tokens, and one
/// that departs from the cached ids two tokens before their end (as when a reply re-tokenises
/// differently once it is part of the text).
fn turn2_prompts(held: &[u32], generated: &[u32]) -> Vec<(Vec<u32>, usize)> {
    let mut all: Vec<u32> = TURN1.iter().chain(generated).copied().collect();
    all.extend(TURN2_NEW);
    let mut departs = held[..held.len() - 2].to_vec();
    departs.extend(TURN2_NEW);
    vec![(all, held.len()), (departs, held.len() - 2)]
}

/// Compare all logits of turn 2 computed with reuse against a full recompute (and, if given, a
/// reference model's full recompute), within `tol`.
fn check_reuse<M: LanguageModel, R: LanguageModel>(what: &str, model: &M, reference: &R, tol: f32) {
    let (state, held, generated) = turn1(model, 4);
    for (prompt, want_reuse) in turn2_prompts(&held, &generated) {
        let mut s = state.clone();
        let reused = reuse_prefix(model, &mut s, &held, &prompt).unwrap();
        assert_eq!(reused, want_reuse, "{what}");
        assert_eq!(model.position(&s), reused);
        let with_reuse = model.forward(&mut s, &prompt[reused..], true).unwrap();

        let mut fresh = model.new_state();
        let full = model.forward(&mut fresh, &prompt, true).unwrap();
        let mut ref_state = reference.new_state();
        let reference_full = reference.forward(&mut ref_state, &prompt, true).unwrap();
        let v = model.vocab_size();
        let tail = &full[reused * v..];
        let d_self = max_abs_diff(&with_reuse, tail);
        let d_ref = max_abs_diff(&with_reuse, &reference_full[reused * v..]);
        eprintln!("{what}: reused {reused} of {}: |reuse - full| {d_self:e}, |reuse - reference| {d_ref:e}", prompt.len());
        assert!(d_self <= tol, "{what}: reuse differs from a full recompute by {d_self}");
        assert!(d_ref <= tol, "{what}: reuse differs from the reference by {d_ref}");
        // The next token after the conversation continues from the same state either way.
        let next = nexttoken::sampling::argmax(&with_reuse[with_reuse.len() - v..]);
        let a = model.forward(&mut s, &[next], false).unwrap();
        let b = model.forward(&mut fresh, &[next], false).unwrap();
        assert!(max_abs_diff(&a, &b) <= tol, "{what}: decode after reuse");
    }
}

fn synth_cpu(arch: &str, ty: GgmlType) -> CpuModel {
    CpuModel::new(Model::from_bytes(synth_model(arch, ty, 3)).unwrap())
}

#[test]
fn reuse_equals_full_recompute_cpu_exact() {
    for arch in ["llama", "qwen2", "gpt2"] {
        for ty in [GgmlType::F32, GgmlType::Q8_0] {
            let m = synth_cpu(arch, ty);
            check_reuse(&format!("cpu {arch} {}", ty.name()), &m, &m, CPU_TOL);
        }
    }
}

/// The fast path (int8 activations, f16 KV cache for quantised weights, threads): reuse against
/// its own full recompute, on every instruction set this machine has.
#[test]
fn reuse_equals_full_recompute_cpu_fast() {
    use nexttoken::cpu::{kernels::Isa, Precision};
    for arch in ["llama", "gpt2"] {
        for isa in Isa::available() {
            let m = synth_cpu(arch, GgmlType::Q8_0)
                .with_precision(Precision::Fast)
                .with_isa(isa)
                .with_threads(2);
            check_reuse(&format!("cpu fast {arch} q8_0 {}", isa.name()), &m, &m, CPU_TOL);
        }
    }
}

#[test]
fn reuse_equals_full_recompute_gpu() {
    let Some(ctx) = gpu_context() else { return };
    for arch in ["llama", "qwen2", "gpt2"] {
        let bytes = synth_model(arch, GgmlType::Q8_0, 3);
        let cpu = CpuModel::new(Model::from_bytes(bytes.clone()).unwrap());
        let gpu = pollster::block_on(GpuModel::with_options(
            ctx.clone(),
            Model::from_bytes(bytes).unwrap(),
            GpuOptions::f32(),
        ))
        .unwrap();
        check_reuse(&format!("gpu {arch} q8_0"), &gpu, &cpu, GPU_TOL);
    }
}

#[test]
fn truncate_checks_its_length() {
    let m = synth_cpu("llama", GgmlType::F32);
    let mut s = m.new_state();
    m.forward(&mut s, TURN1, false).unwrap();
    let err = m.truncate(&mut s, TURN1.len() + 1).unwrap_err();
    assert!(matches!(err, Error::Input(_)), "{err}");
    assert_eq!(m.position(&s), TURN1.len());
    // The ids given must be the ones the state holds (by count).
    assert!(reuse_prefix(&m, &mut s, &TURN1[1..], TURN1).is_err());
    // A prompt equal to what is held still leaves its last token to run.
    assert_eq!(reuse_prefix(&m, &mut s, TURN1, TURN1).unwrap(), TURN1.len() - 1);
}

/// A resumed generation streams exactly what a fresh one does, and says what it reused.
#[test]
fn resumed_generation_streams_the_same_tokens() {
    let m = synth_cpu("qwen2", GgmlType::F32);
    let (state, held, generated) = turn1(&m, 4);
    let (prompt, want_reuse) = turn2_prompts(&held, &generated).remove(0);
    let opts = GenerateOptions {
        max_tokens: 6,
        sampler: SamplerConfig { temperature: 0.8, seed: 5, ..SamplerConfig::default() },
        stop_at_eos: false,
        ..GenerateOptions::default()
    };
    let run = |g: &mut Generation<CpuModel>| -> Vec<TokenEvent> {
        std::iter::from_fn(|| g.step().unwrap()).collect()
    };
    let mut s = state.clone();
    let reused = reuse_prefix(&m, &mut s, &held, &prompt).unwrap();
    assert_eq!(reused, want_reuse);
    let mut resumed = Generation::resume(&m, &Chars, s, &prompt, opts.clone()).unwrap();
    let mut fresh = Generation::new(&m, &Chars, &prompt, opts).unwrap();
    let (a, b) = (run(&mut resumed), run(&mut fresh));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!((x.id, x.position, &x.text), (y.id, y.position, &y.text));
        assert!((x.prob - y.prob).abs() <= CPU_TOL);
    }
    assert_eq!(resumed.reused_tokens(), reused);
    let summary = resumed.summary().unwrap();
    assert_eq!((summary.prompt_tokens, summary.reused_tokens), (prompt.len(), reused));
    assert_eq!(resumed.held_ids(), fresh.held_ids());

    // A state that already holds the whole prompt leaves nothing to prefill: an error.
    let mut full = m.new_state();
    m.forward(&mut full, &prompt, false).unwrap();
    let opts = GenerateOptions::default();
    assert!(Generation::resume(&m, &Chars, full, &prompt, opts).is_err());
}

/// The table models (which keep their sequence so they can be cut back) reuse exactly too.
#[test]
fn reuse_on_a_table_model() {
    let path = common::repo().join("www/models/lesson-toy.json");
    let m =
        nexttoken::table::TableModel::from_json(&std::fs::read_to_string(path).unwrap()).unwrap();
    let n = m.vocab_size() as u32;
    let a: Vec<u32> = (0..5).map(|i| i % n).collect();
    let mut b = a[..3].to_vec();
    b.extend([4 % n, 2 % n]);
    let mut s = m.new_state();
    m.forward(&mut s, &a, false).unwrap();
    let reused = reuse_prefix(&m, &mut s, &a, &b).unwrap();
    assert_eq!(reused, 3);
    let with_reuse = m.forward(&mut s, &b[3..], true).unwrap();
    let full = m.forward(&mut m.new_state(), &b, true).unwrap();
    assert_eq!(with_reuse, full[3 * m.vocab_size()..]);
}

const TEMPLATE: &str = "{% for m in messages %}<{{ m.role[0] }}>{{ m.content }}{% endfor %}\
                        {% if add_generation_prompt %}<a>{% endif %}";

/// `Chat` end to end on the CPU: turn 2 reuses the whole of turn 1 that its prompt repeats, and
/// its reply is the one a fresh generation over the whole conversation gives.
#[test]
fn chat_turns_reuse_the_cache() {
    let m = synth_cpu("llama", GgmlType::F32);
    let template = || ChatTemplate::new(TEMPLATE, "", "").unwrap();
    // Ids without text end the reply, so the reply's text encodes back to the ids it came from.
    let opts = GenerateOptions {
        max_tokens: 3,
        sampler: SamplerConfig::greedy(),
        stop_tokens: (0..FIRST_TEXT_ID).collect(),
        ..GenerateOptions::default()
    };
    let mut chat: Chat<nexttoken::cpu::KvCache> = Chat::new(template(), Some("sys"));
    chat.push(Message::user("hi"));
    let (mut g, stats) = chat.start_reply(&m, &Chars as &dyn Vocab, opts.clone()).unwrap();
    assert_eq!(stats.reused_tokens, 0);
    // BOS, then "<s>sys<u>hi<a>".
    assert_eq!(stats.prompt_tokens, 1 + "<s>sys<u>hi<a>".len());
    while g.step().unwrap().is_some() {}
    let reply = chat.finish_reply(g);
    assert_eq!(chat.messages.last().unwrap(), &Message::assistant(reply.clone()));

    chat.push(Message::user("more"));
    // The cache holds turn 1's prompt and the reply's tokens, but for the last sampled one
    // (never run through the model) when the reply stopped at max_tokens.
    let turn1_held = chat.cached_ids().len();
    let prompt1 = 1 + "<s>sys<u>hi<a>".len();
    assert!(turn1_held == prompt1 + reply.len() || turn1_held == prompt1 + reply.len() - 1);
    let (mut g, stats) = chat.start_reply(&m, &Chars as &dyn Vocab, opts.clone()).unwrap();
    // All of it is the start of turn 2's prompt: the reply's text encodes back to its ids.
    assert_eq!(stats.reused_tokens, turn1_held, "{stats}");
    assert_eq!(stats.prompt_tokens, prompt1 + reply.len() + "<u>more<a>".len());
    assert_eq!(
        stats.to_string(),
        format!("reused {turn1_held} of {} prompt tokens", stats.prompt_tokens)
    );
    let resumed: Vec<u32> = std::iter::from_fn(|| g.step().unwrap()).map(|e| e.id).collect();
    let prompt = g.prompt_ids().to_vec();
    let fresh = greedy(&m, &prompt, resumed.len());
    assert_eq!(resumed, fresh);

    // /clear keeps the system message.
    chat.clear();
    assert_eq!(chat.messages, vec![Message::system("sys")]);
}

#[test]
fn a_conversation_longer_than_the_context() {
    let template = ChatTemplate::new(TEMPLATE, "", "").unwrap();
    let long = |n: usize| "x".repeat(n);
    let mut messages = vec![
        Message::system("S"),
        Message::user(long(8)),
        Message::assistant(long(8)),
        Message::user(long(4)),
        Message::assistant(long(4)),
        Message::user("q"),
    ];
    let context = SYNTH_CTX;
    let mut kept = messages.clone();
    let err = fit_prompt(&template, &Chars, Some(1), &mut kept, context, Overflow::Error)
        .unwrap_err()
        .to_string();
    assert!(err.contains("context is 32 tokens"), "{err}");
    assert_eq!(kept, messages, "an error drops nothing");

    let (ids, dropped) = fit_prompt(
        &template,
        &Chars,
        Some(1),
        &mut messages,
        context,
        Overflow::DropOldest { reply_room: 4 },
    )
    .unwrap();
    // The first turn (user + assistant) goes; the second stays: 1 + "<s>S<u>xxxx<a>xxxx<u>q<a>".
    assert_eq!(dropped, 2);
    assert_eq!(messages[0], Message::system("S"));
    assert_eq!(messages[1], Message::user(long(4)));
    assert_eq!(ids.len(), 1 + "<s>S<u>xxxx<a>xxxx<u>q<a>".len());
    assert!(ids.len() + 4 <= context);

    // When even the system and last user message do not fit, it says so.
    let mut alone = vec![Message::system("S"), Message::user(long(40))];
    let err = fit_prompt(
        &template,
        &Chars,
        None,
        &mut alone,
        context,
        Overflow::DropOldest { reply_room: 1 },
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("last user message alone"), "{err}");
}
