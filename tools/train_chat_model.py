#!/usr/bin/env python3
"""Make nexttoken's small chat model: the default model (www/models/default.gguf) fine-tuned on
conversations made offline from the same corpus, with a chat template, so chat mode, "what the
model reads", KV reuse across turns and the OpenAI-shaped API work with no network.

The conversations are a responsive reading of the King James Bible: the reader says a verse and
the model answers with the next one, or the reader gives the start of a verse and the model
finishes it. The template writes a turn as "Reader: ...\\n" and "Answer: ...</s>\\n" (an optional
system line first); the end token `</s>` ends a reply, as the GGUF's EOS.

Writes
  www/models/chat.gguf                      Q8_0 GGUF (llama.cpp's convert_hf_to_gguf.py), the template
                                            in tokenizer.chat_template; the tokenizer is the default's
  www/models/chat.md                        model card (numbers and samples filled in by this script)
  tests/fixtures/chat_model/reference.json  a conversation rendered by transformers' apply_chat_template,
                                            its ids, transformers' logits and greedy reply from the
                                            EXPORTED weights (tests/chat_model.rs checks the engine)

Exact command (repository root; the default model's tools and inputs, see www/models/README.md):

    cargo build --release
    python3 tools/train_chat_model.py --llama-cpp-dir /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp

The functions of tools/train_default_model.py (corpus, conversion, evaluation) are reused: that
script reads its own options when imported, so they are handed to it below.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--llama-cpp-dir", default="/tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp")
ap.add_argument("--corpus-dir", default="/tmp/kjv")
ap.add_argument("--workdir", default="/tmp/nexttoken_chat_model")
ap.add_argument("--steps", type=int, default=900)
ap.add_argument("--batch", type=int, default=8)
ap.add_argument("--lr", type=float, default=2e-3)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--max-minutes", type=float, default=15.0)
ap.add_argument("--cli", default="target/release/nexttoken")
ARGS = ap.parse_args()
sys.argv = [sys.argv[0], "--llama-cpp-dir", ARGS.llama_cpp_dir, "--corpus-dir", ARGS.corpus_dir,
            "--threads", str(ARGS.threads)]
sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_default_model as base  # noqa: E402  (the default model's script: corpus, export, evaluation)

np, torch, Tokenizer = base.np, base.torch, base.Tokenizer
REPO, OUT = base.REPO, base.OUT
FIX = REPO / "tests" / "fixtures" / "chat_model"
CTX, SEED = base.CTX, base.SEED

# Jinja as transformers renders it (and minijinja in the engine): a system line, then "Reader: "
# and "Answer: " turns; `</s>` (the EOS, a stop token) closes each reply.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n"
    "{% elif message['role'] == 'user' %}Reader: {{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}Answer: {{ message['content'] }}{{ eos_token }}\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}Answer:{% endif %}"
)
SYSTEMS = ["Answer each verse with the next.", "Finish the verse.", "Read with me."]


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The template by hand (checked against transformers' rendering below)."""
    out = []
    for m in messages:
        if m["role"] == "system":
            out.append(m["content"] + "\n")
        elif m["role"] == "user":
            out.append(f"Reader: {m['content']}\n")
        else:
            out.append(f"Answer: {m['content']}</s>\n")
    if add_generation_prompt:
        out.append("Answer:")
    return "".join(out)


def split_verse(v: str, rng: random.Random):
    """A verse cut after a comma, colon or semicolon in its middle third: (start, rest), or None."""
    cuts = [i + 1 for i, c in enumerate(v) if c in ",;:" and len(v) / 4 < i < 3 * len(v) / 4]
    if not cuts:
        return None
    at = rng.choice(cuts)
    return v[:at].strip(), v[at:].strip()


def conversations(chapters, rng: random.Random) -> list[list[dict]]:
    """Each chapter read in conversations of consecutive verses: the reader says a verse and the
    answer is the next one (two thirds), or the reader gives the start of a verse and the answer
    finishes it; a system line in one of three."""
    convs = []
    for _, verses in chapters:
        i = 0
        while i < len(verses) - 1:
            msgs = [{"role": "system", "content": rng.choice(SYSTEMS)}] if rng.random() < 1 / 3 else []
            finish = rng.random() < 1 / 3
            length = len(render(msgs))
            while i < len(verses) - 1:
                if finish:
                    parts = split_verse(verses[i], rng)
                    i += 1
                    if parts is None:
                        continue
                    turn = [{"role": "user", "content": parts[0]}, {"role": "assistant", "content": parts[1]}]
                else:
                    turn = [{"role": "user", "content": verses[i]}, {"role": "assistant", "content": verses[i + 1]}]
                    i += 2
                # ~4 characters a token: stop well inside the context
                if length + len(render(turn)) > 3 * CTX and len(msgs) > 1:
                    break
                msgs += turn
                length += len(render(turn))
            if any(m["role"] == "assistant" for m in msgs):
                convs.append(msgs)
    return convs


def encode(tok: Tokenizer, msgs: list[dict]) -> tuple[list[int], list[int]]:
    """The ids of the whole rendered conversation (BOS first, as the engine prompts it) and the
    training labels: the replies' tokens (their "</s>" included), -100 elsewhere."""
    text = render(msgs)
    enc = tok.encode(text)
    spans, at = [], 0
    for m in msgs:
        piece = render([m])
        if m["role"] == "assistant":
            start = at + len("Answer: ")
            spans.append((start, start + len(m["content"]) + len("</s>")))
        at += len(piece)
    labels = []
    for tid, (a, b) in zip(enc.ids, enc.offsets):
        inside = b > a and any(s <= a and b <= e for s, e in spans)
        labels.append(tid if inside else -100)
    return enc.ids, labels


def batches(data, rng: np.random.Generator, size: int):
    order = rng.permutation(len(data))
    for k in range(0, len(order) - size + 1, size):
        yield [data[j] for j in order[k:k + size]]


def tensors(batch):
    n = min(CTX + 1, max(len(ids) for ids, _ in batch))
    x = torch.full((len(batch), n), 2, dtype=torch.long)
    y = torch.full((len(batch), n), -100, dtype=torch.long)
    for r, (ids, labels) in enumerate(batch):
        ids, labels = ids[:n], labels[:n]
        x[r, :len(ids)] = torch.tensor(ids)
        y[r, :len(labels)] = torch.tensor(labels)
    return x[:, :-1], y[:, 1:]


@torch.no_grad()
def reply_loss(model, data, bs: int = 16) -> float:
    """Mean cross-entropy over the replies' tokens (what the fine-tuning trains)."""
    model.eval()
    tot, n = 0.0, 0
    for k in range(0, len(data), bs):
        x, y = tensors(data[k:k + bs])
        logits = model(input_ids=x, use_cache=False).logits
        tot += float(torch.nn.functional.cross_entropy(logits.reshape(-1, base.VOCAB), y.reshape(-1),
                                                       ignore_index=-100, reduction="sum"))
        n += int((y != -100).sum())
    model.train()
    return tot / n


def with_gguf_weights(model, path: Path):
    """`model` holding the weights the GGUF at `path` holds (Q8_0 dequantized); and their types."""
    _, sd, types = base.effective_state_dict(path, base.SHAPE["num_attention_heads"], base.SHAPE["num_key_value_heads"])
    sd.pop("lm_head.weight", None)  # tied to the embedding
    msd = model.state_dict()
    with torch.no_grad():
        for k, v in sd.items():
            msd[k].copy_(v)
    return model, types


def default_model():
    """The default model as transformers holds it, from the Q8_0 weights it ships."""
    return with_gguf_weights(base.LlamaForCausalLM(base.make_config("sdpa")).float(), OUT / "default.gguf")[0]


def fine_tune(model, train, held):
    torch.manual_seed(SEED)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=ARGS.lr, betas=(0.9, 0.95))
    warm = max(1, ARGS.steps // 20)

    def lr_at(s):
        if s < warm:
            return ARGS.lr * (s + 1) / warm
        return ARGS.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - warm) / max(1, ARGS.steps - warm))))

    rng = np.random.default_rng(SEED)
    log = {"steps_planned": ARGS.steps, "batch": ARGS.batch, "lr": ARGS.lr, "evals": [], "step_loss": [],
           "stopped_early": False}
    log["evals"].append({"step": 0, "heldout_reply_loss": reply_loss(model, held)})
    print(f"  held-out reply loss before: {log['evals'][0]['heldout_reply_loss']:.4f}", flush=True)
    t0, s = time.time(), 0
    model.train()
    while s < ARGS.steps:
        for batch in batches(train, rng, ARGS.batch):
            if s >= ARGS.steps:
                break
            x, y = tensors(batch)
            for g in opt.param_groups:
                g["lr"] = lr_at(s)
            logits = model(input_ids=x, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, base.VOCAB), y.reshape(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            log["step_loss"].append(float(loss.detach()))
            s += 1
            if s % 20 == 0:
                print(f"  step {s}/{ARGS.steps} loss {float(loss):.3f} {time.time() - t0:.0f}s", flush=True)
            if s % 100 == 0 and s != ARGS.steps:
                log["evals"].append({"step": s, "heldout_reply_loss": reply_loss(model, held)})
                print(f"  eval step {s}: held-out reply loss {log['evals'][-1]['heldout_reply_loss']:.4f}", flush=True)
            if time.time() - t0 > ARGS.max_minutes * 60:
                log["stopped_early"] = True
                break
        if log["stopped_early"]:
            break
    log["steps_done"] = s
    log["train_seconds"] = time.time() - t0
    log["evals"].append({"step": s, "heldout_reply_loss": reply_loss(model, held)})
    print(f"  held-out reply loss after {s} steps: {log['evals'][-1]['heldout_reply_loss']:.4f}", flush=True)
    return model, log


@torch.no_grad()
def greedy_reply(model, ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """Argmax tokens until the end token (or n), and each step's top-1/top-2 logit gap."""
    seq, out, margins = list(ids), [], []
    for _ in range(n):
        logits = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
        top2 = torch.topk(logits, 2)
        margins.append(float(top2.values[0] - top2.values[1]))
        t = int(top2.indices[0])
        out.append(t)
        if t == 2:
            break
        seq.append(t)
    return out, margins


FIXTURE_CONVERSATIONS = [
    [{"role": "user", "content": "In the beginning God created the heaven and the earth."}],
    [{"role": "system", "content": "Answer each verse with the next."},
     {"role": "user", "content": "The LORD is my shepherd; I shall not want."}],
    [{"role": "user", "content": "And God said, Let there be light:"}],
]


def cli_samples() -> list[dict]:
    """Replies from nexttoken's own CLI (the engine) to a conversation, greedy and sampled."""
    out = []
    conv = [{"role": "user", "content": "In the beginning God created the heaven and the earth."},
            {"role": "assistant", "content": "And the earth was without form, and void; and darkness was upon the face of the deep."},
            {"role": "user", "content": "And the Spirit of God moved upon the face of the waters."}]
    path = Path(ARGS.workdir) / "sample-conversation.json"
    path.write_text(json.dumps(conv))
    for temp in ("0", "0.8"):
        cmd = [ARGS.cli, "chat", "--model", "www/models/chat.gguf", "--messages", str(path), "--temperature", temp,
               "--seed", "42", "--max-tokens", "60"]
        r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        text = r.stdout.strip() if r.returncode == 0 else f"(failed: {r.stderr.strip()[-300:]})"
        out.append({"temperature": temp, "text": text})
        print(f"  [{temp}] {text!r}", flush=True)
    return out, conv


def main():
    work = Path(ARGS.workdir)
    work.mkdir(parents=True, exist_ok=True)
    FIX.mkdir(parents=True, exist_ok=True)
    random.seed(SEED)
    torch.manual_seed(SEED)
    tok = Tokenizer.from_file(str(OUT / "default-tokenizer.json"))

    print("== conversations")
    chapters = base.get_corpus()
    every = base.HELDOUT_EVERY
    train_ch = [c for i, c in enumerate(chapters) if i % every != every - 1]
    held_ch = [c for i, c in enumerate(chapters) if i % every == every - 1]
    rng = random.Random(SEED)
    train = [encode(tok, c) for c in conversations(train_ch, rng)]
    held = [encode(tok, c) for c in conversations(held_ch, rng)]
    too_long = sum(len(ids) > CTX + 1 for ids, _ in train + held)
    split = {"train_conversations": len(train), "heldout_conversations": len(held),
             "train_reply_tokens": sum(sum(t != -100 for t in y) for _, y in train),
             "heldout_reply_tokens": sum(sum(t != -100 for t in y) for _, y in held), "cut_to_context": too_long}
    print("  ", split)

    print("== fine-tune")
    model, log = fine_tune(default_model(), train, held)
    hf_dir = work / "hf"
    if hf_dir.exists():
        shutil.rmtree(hf_dir)
    model.config._attn_implementation = "eager"
    model.save_pretrained(hf_dir, safe_serialization=True)
    tok.save(str(hf_dir / "tokenizer.json"))
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**base.TOKENIZER_CONFIG, "chat_template": CHAT_TEMPLATE},
                                                             indent=2))

    print("== export Q8_0")
    gguf_path = OUT / "chat.gguf"
    base.convert(hf_dir, gguf_path, "q8_0")
    model = base.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    model, types = with_gguf_weights(model, gguf_path)
    q8_loss = reply_loss(model, held)
    before = log["evals"][0]["heldout_reply_loss"]
    print(f"  q8_0 held-out reply loss {q8_loss:.4f} (the default model: {before:.4f})")
    if not q8_loss < before:
        raise SystemExit("the fine-tuned model does not answer better than the default one")

    print("== fixture")
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    cases = []
    for conv in FIXTURE_CONVERSATIONS:
        rendered = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        assert rendered == render(conv, True), (rendered, render(conv, True))
        ids = tok.encode(rendered).ids
        reply, margins = greedy_reply(model, ids, 40)
        with torch.no_grad():
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1].float().numpy()
        cases.append({"messages": conv, "rendered": rendered, "prompt_ids": ids, "last_logits": base.r7list(logits),
                      "greedy_reply_ids": reply, "greedy_reply": tok.decode(reply, skip_special_tokens=True),
                      "min_top2_margin": base.r7(min(margins))})
        print(f"  {conv[-1]['content']!r} -> {cases[-1]['greedy_reply']!r} (min margin {min(margins):.4f})")
    ref = {"model": "chat", "generator": "tools/train_chat_model.py", "file": "www/models/chat.gguf",
           "chat_template": CHAT_TEMPLATE, "cases": cases, "tensor_types": types,
           "notes": ("rendered: transformers' apply_chat_template (add_generation_prompt) of messages; prompt_ids: "
                     "the tokenizer's ids of it (BOS first); last_logits: transformers (float32, eager) at the last "
                     "prompt position with the weights chat.gguf holds (Q8_0 dequantized by gguf-py); "
                     "greedy_reply_ids: argmax until the end token </s> (included) or 40 tokens.")}
    (FIX / "reference.json").write_text(json.dumps(ref, separators=(",", ":"), ensure_ascii=False) + "\n")

    print("== samples / card")
    samples, sample_conv = cli_samples()
    size = gguf_path.stat().st_size
    write_card(split, log, q8_loss, samples, sample_conv, size)
    (work / "log.json").write_text(json.dumps({"split": split, "log": log, "q8": q8_loss}))
    print("done:", size)


def write_card(split, log, q8_loss, samples, conv, size):
    ev = log["evals"]
    evals = ", ".join(f"step {e['step']}: {e['heldout_reply_loss']:.3f}" for e in ev)
    shown = "\n".join(f"{m['role']}: {m['content']}" for m in conv)
    sample_text = "\n\n".join(f"temperature {s['temperature']} (`--seed 42`):\n\n```text\n{s['text']}\n```" for s in samples)
    card = f"""# nexttoken chat model (`chat.gguf`)

The default model (`default.gguf`, see [README.md](README.md)) fine-tuned to take turns, so that chat
works in the page, the CLI and the OpenAI-shaped API with nothing downloaded. **What it is:** a responsive
reading of the King James Bible. Say a verse and it answers with (its idea of) the next one; give the start
of a verse and it finishes it. **What it is not:** an assistant. It has 1.97M parameters and has seen no
instructions, questions or facts: ask it anything and it answers in KJV phrasing, usually with little
sense. It is here to show what a chat template does (the page's "what the model reads"), how turns reuse
the KV cache, and how a reply ends at the end token.

| file | bytes |
| --- | --- |
| `chat.gguf` (GGUF v3, llama, Q8_0, with `tokenizer.chat_template`) | {size:,} |

The tokenizer is the default model's (`default-tokenizer.json`; the GGUF carries it too).

## Chat template

```jinja
{CHAT_TEMPLATE}
```

A turn is `Reader: ...` or `Answer: ...</s>` on its own line, after an optional system line; the
generation prompt is `Answer:`. `</s>` is the model's end token (`tokenizer.ggml.eos_token_id`), so a
reply stops there.

## Data

Made by `tools/train_chat_model.py` from the default model's corpus and split (Debian's `bible-kjv-text`;
every 20th chapter held out): each chapter read as conversations of consecutive verses, the reader saying
a verse and the answer the next one (two thirds of the conversations), or the reader giving a verse's
start (cut after a comma, colon or semicolon in its middle) and the answer finishing it; one in three
starts with a system line ({", ".join(repr(s) for s in SYSTEMS)}). Conversations are made to fit the
{CTX}-token context ({split['cut_to_context']} longer ones are cut at it). {split['train_conversations']:,} train / {split['heldout_conversations']:,} held-out
conversations, {split['train_reply_tokens']:,} / {split['heldout_reply_tokens']:,} reply tokens.

## Fine-tuning

From the default model's Q8_0 weights (dequantized), transformers' `LlamaForCausalLM`, float32 on the CPU:
loss on the replies' tokens only (their `</s>` included; the reader's turns and the template's words are
context), AdamW (lr {log['lr']}, warm-up then cosine to 10 %, weight decay 0.1, clipping 1.0), batch
{log['batch']} conversations, **{log['steps_done']} steps**, {log['train_seconds'] / 60:.1f} min on a shared
2-core machine{' (the wall-clock guard stopped it early)' if log['stopped_early'] else ''}.

Held-out reply loss (nats/token): {evals}; the exported Q8_0 weights: **{q8_loss:.4f}** (perplexity
{math.exp(q8_loss):.2f}), against **{ev[0]['heldout_reply_loss']:.4f}** (perplexity
{math.exp(ev[0]['heldout_reply_loss']):.2f}) for the default model reading the same conversations.

## Samples (nexttoken's own CLI)

`nexttoken chat --model www/models/chat.gguf --messages conversation.json --max-tokens 60` with

```text
{shown}
```

{sample_text}

## Test fixture

`tests/fixtures/chat_model/reference.json`: three conversations rendered by transformers'
`apply_chat_template` (which must equal the template by hand), their ids, transformers' logits at the
last prompt position and greedy replies, from the weights `chat.gguf` holds. `tests/chat_model.rs` checks
the engine's rendering, ids, logits and replies against it.

## Reproduce

The default model's tools (see [README.md](README.md), "Reproduce"), then

```sh
cargo build --release
python3 tools/train_chat_model.py --llama-cpp-dir /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp
cargo test --release --test chat_model
```

Versions: `{json.dumps(base.versions())}`.
"""
    (OUT / "chat.md").write_text(card)


if __name__ == "__main__":
    main()
