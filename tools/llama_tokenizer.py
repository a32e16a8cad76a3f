"""The sentencepiece-like BPE tokenizer.json both tools/make_fixtures.py (fixture models) and
tools/train_default_model.py (the shipped default model) train: the layout of the Llama-2 /
stories260K tokenizer.json, so the Rust tokenizer path is exercised as real llama models use it."""

from __future__ import annotations

import json
from typing import Iterable

from tokenizers import Tokenizer, models, pre_tokenizers, trainers


def make_llama_tokenizer(lines: Iterable[str], vocab_size: int, limit_alphabet: int | None = None) -> Tokenizer:
    """<unk>,<s>,</s> = 0,1,2; <0x00>..<0xFF> = 3..258; byte fallback; Metaspace (prepend_scheme
    first); BOS added by the post-processor. `limit_alphabet` caps the initial characters."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    extra = {} if limit_alphabet is None else {"limit_alphabet": limit_alphabet}
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False, **extra)
    tok.train_from_iterator(lines, trainer)
    j = json.loads(tok.to_str())
    old_vocab = j["model"]["vocab"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for t, _ in sorted(old_vocab.items(), key=lambda kv: kv[1]):
        if t not in vocab:
            vocab[t] = len(vocab)
    j["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True, unk_token="<unk>")
    j["added_tokens"] = [dict(id=i, content=c, single_word=False, lstrip=False, rstrip=False, normalized=False,
                              special=True) for i, c in enumerate(["<unk>", "<s>", "</s>"])]
    j["normalizer"] = None
    j["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    j["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<s>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
    j["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return Tokenizer.from_str(json.dumps(j, ensure_ascii=False))
