//! Tool calling: the tools a conversation offers reach the model through its own chat template
//! (the templates of Qwen2.5, Hermes-style models and Llama 3.x take a `tools` variable, as
//! transformers' `apply_chat_template(tools=...)` passes it), and the calls the model writes are
//! read back out of its reply in the format that template taught it ([`ToolFormat`]). A call
//! that must happen (OpenAI's `tool_choice: "required"` or a named function) is generated under
//! a grammar ([`call_constraint`]): the call's frame in the model's format, with each tool's
//! arguments held to its JSON schema, so they always parse and validate.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::Value;

use crate::constraint::ConstraintSpec;
use crate::error::{Error, Result};

/// One call the model asks for, in OpenAI's shape (`{id, type: "function", function: {name,
/// arguments}}`), except that `arguments` is the JSON object itself: what chat templates expect
/// in an assistant message's `tool_calls` (OpenAI's string of JSON is accepted and parsed).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

fn function_kind() -> String {
    "function".into()
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    #[serde(default = "empty_object", deserialize_with = "json_or_string")]
    pub arguments: Value,
}

fn empty_object() -> Value {
    Value::Object(Default::default())
}

/// Arguments as an object, or as OpenAI sends them: a string of JSON (kept as the string when
/// it is not JSON: a template then shows what the client sent).
fn json_or_string<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Value, D::Error> {
    Ok(match Value::deserialize(d)? {
        Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
        other => other,
    })
}

/// How a model writes its calls, as its chat template describes them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call
    /// (Qwen2.5, Hermes 2/3 and the models trained on their format).
    Hermes,
    /// A bare JSON object `{"name": ..., "parameters": {...}}`, after `<|python_tag|>` at times,
    /// several separated by `;` (Llama 3.1 to 3.3).
    LlamaJson,
}

impl ToolFormat {
    /// The format a chat template's source teaches, or `None` when the template takes no tools
    /// (it never mentions `tools`).
    pub fn detect(template_source: &str) -> Option<ToolFormat> {
        if !template_source.contains("tools") {
            return None;
        }
        if template_source.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template_source.contains("<|start_header_id|>") {
            Some(ToolFormat::LlamaJson)
        } else {
            // A tool-aware template of another family: the Hermes blocks are the most common
            // convention, and what a forced call writes.
            Some(ToolFormat::Hermes)
        }
    }

    /// The text of one call, as the model writes it.
    fn call_text(self, name: &str, arguments: &str) -> String {
        let name = Value::String(name.into());
        match self {
            ToolFormat::Hermes => {
                format!(
                    "<tool_call>\n{{\"name\": {name}, \"arguments\": {arguments}}}\n</tool_call>"
                )
            }
            ToolFormat::LlamaJson => format!("{{\"name\": {name}, \"parameters\": {arguments}}}"),
        }
    }

    /// Between two calls of one reply.
    fn separator(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "\n",
            ToolFormat::LlamaJson => "; ",
        }
    }
}

/// A reply read for calls: the text around them, and the calls (ids `call_0`, `call_1`, ...).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct ParsedReply {
    pub content: String,
    pub tool_calls: Vec<ToolCall>,
}

/// The calls in `text`, a reply written in `format`. What is not a well-formed call (a block
/// whose JSON does not parse, an object without a name) stays in `content`: a model that fails
/// to call a tool has said something, and the caller sees it.
pub fn parse_reply(format: ToolFormat, text: &str) -> ParsedReply {
    let mut calls = Vec::new();
    let content = match format {
        ToolFormat::Hermes => {
            let mut content = String::new();
            let mut rest = text;
            while let Some(start) = rest.find("<tool_call>") {
                let body_start = start + "<tool_call>".len();
                let (body, next) = match rest[body_start..].find("</tool_call>") {
                    Some(end) => (
                        &rest[body_start..body_start + end],
                        &rest[body_start + end + "</tool_call>".len()..],
                    ),
                    // Cut short (max tokens): the block runs to the end.
                    None => (&rest[body_start..], ""),
                };
                match call_from_json(body.trim()) {
                    Some(call) => {
                        content.push_str(&rest[..start]);
                        calls.push(call);
                    }
                    None => content.push_str(&rest[..body_start + body.len()]),
                }
                rest = next;
            }
            content.push_str(rest);
            content
        }
        ToolFormat::LlamaJson => {
            let body = text.trim();
            let body = body.strip_prefix("<|python_tag|>").unwrap_or(body).trim();
            let parsed: Option<Vec<ToolCall>> =
                body.split(';').map(|p| call_from_json(p.trim())).collect();
            match parsed {
                Some(found) if body.starts_with('{') => {
                    calls = found;
                    String::new()
                }
                _ => text.to_string(),
            }
        }
    };
    for (i, call) in calls.iter_mut().enumerate() {
        call.id = format!("call_{i}");
    }
    ParsedReply { content: content.trim().to_string(), tool_calls: calls }
}

/// `{"name": ..., "arguments" | "parameters": {...}}` as a call.
fn call_from_json(text: &str) -> Option<ToolCall> {
    let Value::Object(mut object) = serde_json::from_str::<Value>(text).ok()? else {
        return None;
    };
    let name = object.get("name")?.as_str()?.to_string();
    let arguments = object
        .remove("arguments")
        .or_else(|| object.remove("parameters"))
        .map(|a| match a {
            Value::String(s) => serde_json::from_str(&s).unwrap_or(Value::String(s)),
            other => other,
        })
        .unwrap_or_else(empty_object);
    Some(ToolCall {
        id: String::new(),
        kind: function_kind(),
        function: FunctionCall { name, arguments },
    })
}

/// Which call a reply must make: any of the tools (`"required"`), or the named one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ForcedCall {
    Any,
    Named(String),
}

/// Most tools one request may offer, and the longest tool name (OpenAI's limits).
pub const MAX_TOOLS: usize = 128;
/// Most calls a forced reply with parallel calls makes (a grammar must end somewhere: a model
/// that never stops calling would otherwise run to its max tokens).
pub const MAX_PARALLEL_CALLS: usize = 8;
const MAX_NAME: usize = 64;

/// A tool's name and its arguments' JSON schema, from OpenAI's `{type: "function", function:
/// {name, description, parameters}}` (a bare `{name, parameters}` is taken too).
pub fn tool_signature(tool: &Value) -> Result<(String, Value)> {
    let function = tool.get("function").unwrap_or(tool);
    let name = function.get("name").and_then(Value::as_str).ok_or_else(|| {
        Error::Constraint(
            "tools: each tool is {type: \"function\", function: {name, parameters}}".into(),
        )
    })?;
    if name.is_empty()
        || name.len() > MAX_NAME
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        return Err(Error::Constraint(format!(
            "tools: the name {name:?} is not 1 to {MAX_NAME} letters, digits, '_' or '-'"
        )));
    }
    let schema = function
        .get("parameters")
        .cloned()
        .unwrap_or_else(|| serde_json::json!({"type": "object"}));
    Ok((name.to_string(), schema))
}

/// A constraint under which the reply is exactly a call (with `parallel`, one to
/// [`MAX_PARALLEL_CALLS`]) of the
/// tools in `tools` that `forced` allows, in `format`, each call's arguments valid against its
/// tool's schema (with structured output's whitespace rules).
pub fn call_constraint(
    format: ToolFormat,
    tools: &[Value],
    forced: &ForcedCall,
    parallel: bool,
) -> Result<ConstraintSpec> {
    if tools.len() > MAX_TOOLS {
        return Err(Error::Constraint(format!(
            "tools: {} tools; at most {MAX_TOOLS}",
            tools.len()
        )));
    }
    let mut rules = Vec::new();
    let mut alternatives = Vec::new();
    for tool in tools {
        let (name, mut schema) = tool_signature(tool)?;
        if let ForcedCall::Named(wanted) = forced {
            if *wanted != name {
                continue;
            }
        }
        crate::constraint::with_json_defaults(&mut schema);
        let i = alternatives.len();
        // The call's text around its arguments, as Lark string literals (JSON strings are).
        let frame = format.call_text(&name, "\u{0}");
        let (before, after) = frame.split_once('\u{0}').expect("the frame has its marker");
        let lit = |s: &str| Value::String(s.into()).to_string();
        rules.push(format!("call_{i}: {} args_{i} {}", lit(before), lit(after)));
        rules.push(format!("args_{i}: %json {schema}"));
        alternatives.push(format!("call_{i}"));
    }
    if alternatives.is_empty() {
        return Err(Error::Constraint(match forced {
            ForcedCall::Named(name) => {
                format!("tool_choice names {name:?}, which is not among the tools")
            }
            ForcedCall::Any => "tool_choice \"required\" with no tools".into(),
        }));
    }
    // Parallel calls: up to MAX_PARALLEL_CALLS, nested as `call (sep call (sep call)?)?`.
    let mut start = "call".to_string();
    if parallel {
        let sep = Value::String(format.separator().into()).to_string();
        let mut rest = String::new();
        for _ in 1..MAX_PARALLEL_CALLS {
            rest = format!("({sep} call{rest})?");
        }
        start.push_str(&rest);
    }
    let start = format!("start: {start}");
    let lark = format!("{start}\ncall: {}\n{}\n", alternatives.join(" | "), rules.join("\n"));
    Ok(ConstraintSpec::Grammar { lark })
}

/// A chat's tools made ready, as every front end needs them: the template offering `tools`, the
/// format the model's calls come in, and, when `forced`, the constraint to generate the call
/// under (with `parallel`, one to [`MAX_PARALLEL_CALLS`] calls).
pub fn offer(
    template: crate::chat::ChatTemplate,
    tools: Vec<Value>,
    forced: Option<&ForcedCall>,
    parallel: bool,
) -> Result<(crate::chat::ChatTemplate, ToolFormat, Option<ConstraintSpec>)> {
    let template = template.with_tools(tools)?;
    let format = template.tool_format().expect("with_tools checked the template");
    let tools = template.tools().expect("with_tools set them");
    let constraint = forced.map(|f| call_constraint(format, tools, f, parallel)).transpose()?;
    Ok((template, format, constraint))
}
