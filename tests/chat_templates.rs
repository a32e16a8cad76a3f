//! Chat templates rendered by `chat::ChatTemplate` against what transformers renders: the three
//! real templates in ../shared/chat-templates and `rendered_examples.json` (transformers 5.24's
//! `apply_chat_template(add_generation_prompt=True)` on the conversations in its `_meta`) must
//! come out byte for byte. Plus the template of a GGUF (llama.cpp's Qwen2 vocabulary file), its
//! stop tokens, and the errors: no template, a syntax error, `raise_exception`, a failing render.

mod common;

use nexttoken::chat::{strftime, ChatTemplate, Message, Overflow};
use nexttoken::gguf::{Gguf, GgufWriter, Value};
use nexttoken::Error;

/// Template file and the special-token strings the model's tokenizer_config gives it.
fn template_for(example: &str) -> (&'static str, &'static str, &'static str) {
    if example.starts_with("Qwen2.5") {
        // Qwen2.5's tokenizer has no BOS token; its EOS is <|im_end|>.
        ("Qwen2.5-Instruct.jinja", "", "<|im_end|>")
    } else if example.starts_with("TinyLlama") {
        ("TinyLlama-Chat.jinja", "<s>", "</s>")
    } else if example.starts_with("SmolLM2") {
        ("SmolLM2-Instruct.jinja", "<|im_start|>", "<|im_end|>")
    } else {
        panic!("no template for {example}")
    }
}

#[test]
fn renders_byte_identical_to_transformers() {
    let Some(shared) = common::shared() else { return };
    let dir = shared.join("chat-templates");
    let examples: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("rendered_examples.json")).unwrap())
            .unwrap();
    let conversations = &examples["_meta"]["conversations"];
    let mut checked = 0;
    for (name, want) in examples.as_object().unwrap() {
        if name == "_meta" {
            continue;
        }
        let (file, bos, eos) = template_for(name);
        let conversation = name.rsplit('/').next().unwrap();
        let messages: Vec<Message> =
            serde_json::from_value(conversations[conversation].clone()).unwrap();
        let source = std::fs::read_to_string(dir.join(file)).unwrap();
        let template = ChatTemplate::new(source, bos, eos).unwrap();
        let got = template.render(&messages, true).unwrap();
        assert_eq!(got, want.as_str().unwrap(), "{name}");
        checked += 1;
    }
    assert_eq!(checked, 6);
}

#[test]
fn without_generation_prompt_the_assistant_turn_is_not_opened() {
    let Some(shared) = common::shared() else { return };
    let source =
        std::fs::read_to_string(shared.join("chat-templates/SmolLM2-Instruct.jinja")).unwrap();
    let template = ChatTemplate::new(source, "<|im_start|>", "<|im_end|>").unwrap();
    let messages = [Message::system("S"), Message::user("Hi")];
    let with = template.render(&messages, true).unwrap();
    let without = template.render(&messages, false).unwrap();
    assert_eq!(without, "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    assert_eq!(with, format!("{without}<|im_start|>assistant\n"));
}

/// llama.cpp's vocabulary GGUF of Qwen2 carries the model's template and token list.
#[test]
fn template_and_stop_tokens_from_a_gguf() {
    let Some(shared) = common::shared() else { return };
    let bytes = std::fs::read(shared.join("tokenizer-tests/qwen2/ggml-vocab-qwen2.gguf")).unwrap();
    let gguf = Gguf::parse(&bytes).unwrap();
    let template = ChatTemplate::from_gguf(&gguf).unwrap();
    let tokens = match gguf.get("tokenizer.ggml.tokens") {
        Some(Value::Array(list)) => list,
        _ => panic!("no token list"),
    };
    let id_of = |text: &str| tokens.iter().position(|t| t.as_str() == Some(text)).unwrap() as u32;
    let eos = gguf.get("tokenizer.ggml.eos_token_id").unwrap().as_u64().unwrap() as u32;
    assert_eq!(template.eos_token(), tokens[eos as usize].as_str().unwrap());
    // The EOS id, and <|im_end|> (which the template writes) even where EOS is another token.
    assert!(template.stop_tokens().contains(&eos));
    assert!(template.stop_tokens().contains(&id_of("<|im_end|>")));
    assert!(!template.stop_tokens().contains(&id_of("<|im_start|>")));
    let text = template.render(&[Message::user("Hello!")], true).unwrap();
    assert!(text.contains("<|im_start|>user\nHello!<|im_end|>\n"), "{text}");
    assert!(text.ends_with("<|im_start|>assistant\n"), "{text}");
}

fn gguf_with(meta: &[(&str, Value)]) -> Gguf {
    let mut w = GgufWriter::new();
    for (k, v) in meta {
        w.metadata(k, v.clone());
    }
    Gguf::parse(&w.to_bytes()).unwrap()
}

#[test]
fn gguf_special_tokens_and_markers() {
    let tokens = ["<unk>", "<s>", "</s>", "<|end|>", "<|user|>", "hi"];
    let list = Value::Array(tokens.iter().map(|t| Value::String(t.to_string())).collect());
    let source = "{% for m in messages %}<|user|>{{ m.content }}<|end|>{% endfor %}{{ eos_token }}";
    let gguf = gguf_with(&[
        ("tokenizer.chat_template", Value::String(source.into())),
        ("tokenizer.ggml.tokens", list),
        ("tokenizer.ggml.bos_token_id", Value::U32(1)),
        ("tokenizer.ggml.eos_token_id", Value::U32(2)),
    ]);
    let t = ChatTemplate::from_gguf(&gguf).unwrap();
    assert_eq!((t.bos_token(), t.eos_token()), ("<s>", "</s>"));
    assert_eq!(t.stop_tokens(), &[2, 3]);
    assert_eq!(t.render(&[Message::user("x")], false).unwrap(), "<|user|>x<|end|></s>");
}

#[test]
fn a_model_without_a_template_is_a_clear_error() {
    let gguf = gguf_with(&[("general.architecture", Value::String("llama".into()))]);
    let err = ChatTemplate::from_gguf(&gguf).unwrap_err();
    assert!(matches!(err, Error::Template(_)));
    let msg = err.to_string();
    assert!(msg.contains("no chat template") && msg.contains("tokenizer.chat_template"), "{msg}");
    // One that is there but not text says so.
    for (value, kind) in [
        (Value::U32(5), "a number"),
        (Value::Array(vec![Value::String("{{ x }}".into())]), "a list of 1 items"),
    ] {
        let gguf = gguf_with(&[("tokenizer.chat_template", value)]);
        let msg = ChatTemplate::from_gguf(&gguf).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("tokenizer.chat_template is {kind}, not a template")),
            "{msg}"
        );
    }
}

#[test]
fn a_syntax_error_names_the_line() {
    let err = ChatTemplate::new("line one\n{% for m in messages %}\n{{ m.content ", "", "")
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("chat template: syntax error"), "{err}");
    assert!(err.contains("(line 3)"), "{err}");
}

#[test]
fn raise_exception_and_render_errors_carry_the_message_and_line() {
    let source = "{% if messages[0].role != 'user' %}\n\n{{ raise_exception('Conversation must start with user') }}{% endif %}ok";
    let t = ChatTemplate::new(source, "", "").unwrap();
    assert_eq!(t.render(&[Message::user("a")], true).unwrap(), "ok");
    let err = t.render(&[Message::assistant("a")], true).unwrap_err().to_string();
    assert!(err.contains("Conversation must start with user"), "{err}");
    assert!(err.contains("(line 3)"), "{err}");

    // Undefined attributes are lenient (as in Jinja2), but calling an undefined is an error.
    let t = ChatTemplate::new("{{ messages[0].nothing }}|\n{{ nothing() }}", "", "").unwrap();
    let err = t.render(&[Message::user("a")], true).unwrap_err().to_string();
    assert!(err.contains("(line 2)"), "{err}");
}

#[test]
fn python_string_methods_and_tojson() {
    let source = "{{ messages[0].content.strip() }}|{{ messages[0].content.startswith('  he') }}|\
                  {{ messages[0] | tojson }}|{{ ['é', 1, none, true] | tojson }}|{{ '<a&b>' | tojson }}";
    let t = ChatTemplate::new(source, "", "").unwrap();
    let got = t.render(&[Message::user("  hello ")], false).unwrap();
    // Jinja2 prints a boolean as Python does ("True"); tojson is Python's json.dumps(x,
    // ensure_ascii=False): default separators, keys in order, no HTML escaping.
    assert_eq!(
        got,
        r#"hello|True|{"role": "user", "content": "  hello "}|["é", 1, null, true]|"<a&b>""#
    );
}

#[test]
fn strftime_matches_known_dates() {
    // 2024-07-23 14:05:09 UTC, a Tuesday (Llama 3.1's template writes "%d %b %Y").
    let t = 1_721_743_509;
    assert_eq!(strftime("%d %b %Y", t).unwrap(), "23 Jul 2024");
    assert_eq!(
        strftime("%A %B %-d, %H:%M:%S %p %j %y", t).unwrap(),
        "Tuesday July 23, 14:05:09 PM 205 24"
    );
    // 2000-02-29 (leap day), 1970-01-01.
    assert_eq!(strftime("%Y-%m-%d %a", 951_782_400).unwrap(), "2000-02-29 Tue");
    assert_eq!(strftime("%Y-%m-%d %a %%", 0).unwrap(), "1970-01-01 Thu %");
    assert!(strftime("%Q", 0).is_err());
    let t = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
    let year: i32 = t.render(&[], false).unwrap().parse().unwrap();
    assert!(year >= 2024);
}

/// A chat template is a program from the file: whatever it does, rendering ends with the text
/// or a one-line error within its budget (minijinja's fuel: steps and the data they make). The
/// cases of issue 35 (nested loops of 10^10 steps, a string doubled 40 times, a list doubled
/// and written as JSON, doubling macro calls, `loop.cycle` 10^8 times), then generated programs:
/// loops, recursion, doubling strings, growing lists and JSON.
#[test]
fn hostile_templates_end_in_their_budget() {
    let user = [Message::new("user", "hi")];
    let render = |source: &str| ChatTemplate::new(source, "<s>", "</s>")?.render(&user, true);
    for (source, why) in [
        ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "budget"),
        (
            "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
            "budget",
        ),
        ("{% macro f(n) %}{{ f(n + 1) }}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", ""),
        // A list doubled 30 times is a lazy view of 2^30 items; written out, it is paid for.
        // (Past 32 levels minijinja 3.1 copies such a list whole without charging its budget:
        // the one way left to exhaust memory, noted in ARCHITECTURE.md.)
        (
            "{% set ns = namespace(l=[1]) %}{% for i in range(30) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|tojson }}",
            "budget",
        ),
        (
            "{% for i in range(10000) %}{% for j in range(10000) %}{{ loop.cycle('a', 'b') }}{% endfor %}{% endfor %}",
            "budget",
        ),
    ] {
        let e = render(source).expect_err(source).to_string();
        assert!(e.starts_with("chat template: ") && !e.contains('\n') && e.contains(why), "{source}: {e}");
    }
    // Data is paid for: 10 MB of it renders, 100 MB does not.
    assert_eq!(render("{{ ('a' * 10000000)|length }}").unwrap(), "10000000");
    assert!(render("{{ ('a' * 100000000)|length }}").unwrap_err().to_string().contains("budget"));
    // A rendering longer than the context could hold is refused without being tokenised
    // (tokenising 10 MB took 8 s and 800 MB).
    let tok = nexttoken::tokenizer::HfTokenizer::from_file(
        &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("www/models/default-tokenizer.json"),
    )
    .unwrap();
    let big = ChatTemplate::new("{{ 'word ' * 2000000 }}", "<s>", "</s>").unwrap();
    let t0 = std::time::Instant::now();
    let e = nexttoken::chat::fit_prompt(&big, &tok, None, &mut user.to_vec(), 512, Overflow::Error)
        .unwrap_err()
        .to_string();
    assert!(e.contains("renders to 10000000 bytes") && e.contains("context is 512 tokens"), "{e}");
    eprintln!("refused in {:?}", t0.elapsed());

    // Generated programs.
    let mut seed = 0x5eed_u64;
    let mut next = |n: u64| {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 33) % n
    };
    let pieces = [
        "{% for i in range(N) %}B{% endfor %}",
        "{% set ns.s = ns.s ~ ns.s %}",
        "{% set ns.l = ns.l + [1, 2] %}",
        "{{ ns.l|tojson }}",
        "{{ f(N) }}",
        "{{ 'ab' * N }}",
        "{% if N > 3 %}B{% else %}B{% endif %}",
        "{{ messages|tojson }}",
        "{% for m in messages %}{{ m.content * N }}{% endfor %}",
    ];
    for case in 0..100 {
        let mut body = String::from("B");
        for _ in 0..1 + next(4) {
            let piece = pieces[next(pieces.len() as u64) as usize];
            let n = [1, 7, 100, 10_000, 1_000_000][next(5) as usize].to_string();
            body = body.replacen('B', &piece.replace('N', &n), 1);
            if !body.contains('B') {
                body.push('B');
            }
        }
        let source = format!(
            "{{% set ns = namespace(s='xy', l=[1, 2]) %}}{{% macro f(n) %}}{{% if n > 0 %}}{{{{ f(n - 1) }}}}{{{{ f(n - 1) }}}}{{% endif %}}{{% endmacro %}}{}",
            body.replace('B', "x")
        );
        match render(&source) {
            Ok(text) => assert!(text.len() <= 130 << 20, "case {case}: {} bytes", text.len()),
            Err(e) => {
                let e = e.to_string();
                assert!(
                    e.starts_with("chat template: ") && !e.contains('\n'),
                    "case {case}: {source}: {e}"
                );
            }
        }
    }
}
