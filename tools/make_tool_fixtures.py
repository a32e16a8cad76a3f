#!/usr/bin/env python3
"""Tool-calling fixtures: conversations with tools, tool calls and tool answers rendered by
transformers' own chat-template renderer (`render_jinja_template`, what
`apply_chat_template(tools=...)` calls) through the real tool-aware templates in
../shared/chat-templates/ (read there, never copied).

    python3 -m venv /tmp/tfenv && /tmp/tfenv/bin/pip install transformers jinja2
    /tmp/tfenv/bin/python tools/make_tool_fixtures.py    # writes tests/fixtures/tools/rendered.json

tests/chat_templates.rs renders the same conversations with nexttoken's renderer and compares.
"""
import json
import pathlib

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

REPO = pathlib.Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared" / "chat-templates"
OUT = REPO / "tests" / "fixtures" / "tools" / "rendered.json"

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string"}},
                "required": ["timezone"],
            },
        },
    },
]

CALL_PARIS = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}
CALL_TOKYO = {"type": "function", "function": {"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}}

CONVERSATIONS = {
    "offer": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
    ],
    "offer_no_system": [{"role": "user", "content": "What time is it in Tokyo?"}],
    "answered": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [dict(CALL_PARIS, id="call_0")]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "{\"temperature\": 18}"},
    ],
    "parallel": [
        {"role": "user", "content": "Weather in Paris and time in Tokyo?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [dict(CALL_PARIS, id="call_0"), dict(CALL_TOKYO, id="call_1")]},
        {"role": "tool", "tool_call_id": "call_0", "name": "get_weather", "content": "18 degrees"},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_time", "content": "21:04"},
        {"role": "assistant", "content": "18 degrees in Paris; 21:04 in Tokyo."},
        {"role": "user", "content": "Thanks!"},
    ],
}

TEMPLATES = {"Qwen2.5-Instruct": ("Qwen2.5-Instruct.jinja", "", "<|im_end|>")}


def main():
    out = {
        "_meta": {
            "renderer": f"transformers {transformers.__version__} render_jinja_template(tools=..., add_generation_prompt=True)",
            "templates": {k: f"../shared/chat-templates/{v[0]}" for k, v in TEMPLATES.items()},
            "tools": TOOLS,
            "conversations": CONVERSATIONS,
        }
    }
    for name, (file, bos, eos) in TEMPLATES.items():
        source = (SHARED / file).read_text()
        for key, messages in CONVERSATIONS.items():
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=TOOLS,
                chat_template=source,
                add_generation_prompt=True,
                bos_token=bos,
                eos_token=eos,
            )
            out[f"{name}/{key}"] = rendered[0]
    OUT.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
