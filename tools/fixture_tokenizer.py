"""Train the fixture's byte-level BPE tokenizer with the real model's layout.

Same pipeline as the real Spark tokenizer (docs/MODEL.md §12): no
normalizer, the DeepSeek-V3-style split sequence plus individual digits,
ByteLevel pre-tokenizer/decoder/post-processor without BOS insertion. The
special ids 0..13 match the real model; the role/tool markers keep their
real strings but sit at the top of the small vocabulary (the real ids
130972..130984 do not exist in a 4096-entry vocab).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LOW_SPECIALS = [  # (text, special) at ids 0..13, as in the real vocab
    ("<｜start▁of▁sentence｜>", True), ("<｜end▁of▁sentence｜>", True), ("<｜▁pad▁｜>", True),
    ("<think>", False), ("</think>", False), ("<unk>", False),
    ("<｜start▁of▁text｜>", True), ("<｜end▁of▁text｜>", True),
    ("<User>", False), ("<System>", False), ("<Bot>", False),
    ("<｜fim▁begin｜>", False), ("<｜fim▁hole｜>", False), ("<｜fim▁end｜>", False),
]
ROLE_MARKERS = ["<|System|>", "<|User|>", "<|Tool|>", "<|Developer|>", "<|Bot|>",
                "<tool_call>", "<tool_response>", "</tool_response>", "<arg_key>", "</arg_key>",
                "<arg_value>", "</arg_value>", "</tool_call>"]

MAIN_PATTERN = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def build(texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split(Regex("[一-龥぀-ゟ゠-ヿ]+"), behavior="isolated"),
        pre_tokenizers.Split(Regex(MAIN_PATTERN), behavior="isolated"),
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(t, special=s, normalized=False) for t, s in LOW_SPECIALS]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ROLE_MARKERS),
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ROLE_MARKERS])
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    for i, (t, _) in enumerate(LOW_SPECIALS):
        assert tok.token_to_id(t) == i, t
    return tok


def write(tok: Tokenizer, out: Path, chat_template: str) -> None:
    tok.save(str(out / "tokenizer.json"))
    added = {}
    for tid, tok_obj in sorted(tok.get_added_tokens_decoder().items()):
        added[str(tid)] = {"content": tok_obj.content, "lstrip": False, "normalized": False,
                           "rstrip": False, "single_word": False, "special": tok_obj.special}
    cfg = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": LOW_SPECIALS[0][0],
        "eos_token": LOW_SPECIALS[1][0],
        "pad_token": LOW_SPECIALS[2][0],
        "unk_token": "<unk>",
        "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
