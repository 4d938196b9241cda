"""IncrementalDetokenizer against real fast tokenizers trained here (byte-level BPE like GPT-2 /
Llama-3 / SmolLM2, and a sentencepiece-style BPE with byte fallback like Llama-2)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from asyncengine.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, this is a small corpus for a tiny tokenizer.",
    "naïve café, déjà vu, Ünïcödé façade, smörgåsbord.",
    "日本語のテキストです。中文文本也在这里。",
    "emoji 🙂🚀🎉 party time 👩‍💻",
    "The quick brown fox jumps over the lazy dog. STOP here, or end.",
] * 10

TEXTS = [
    "Hello world",
    "日本語のテキスト 中文 and 한국어 mixed",
    "emoji 🙂🚀🎉 and 👩‍💻 and 🐍 too",
    "naïve café déjà vu — Ünïcödé “quotes”",
    "",
    " leading space, trailing space ",
    "repeat " * 40,
]

REPLACEMENT = "\ufffd"


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call was given."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.decode_lengths: list[int] = []

    def decode(self, ids: list[int], **kwargs: object) -> str:
        self.decode_lengths.append(len(ids))
        return self.inner.decode(ids, **kwargs)


@pytest.fixture(scope="module")
def byte_level() -> PreTrainedTokenizerFast:
    """GPT-2 style byte-level BPE; its small vocab splits CJK and emoji into byte tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>"],
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )


@pytest.fixture(scope="module")
def sentencepiece_style() -> PreTrainedTokenizerFast:
    """Llama-2 style: "▁" word marks, leading-space strip at the start, byte fallback."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(CORPUS, trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["decoder"] = {
        "type": "Sequence",
        "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"},
            {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0},
        ],
    }
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def encode(tok: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def encode_pieces(tok: PreTrainedTokenizerFast, pieces: list[str]) -> list[int]:
    """Ids whose token boundaries fall at least at every piece boundary (byte-level BPE)."""
    return [i for piece in pieces for i in encode(tok, piece)]


def stream(detok: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    deltas = [detok.append(ids[i : i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return deltas


def test_byte_level_really_splits_characters(byte_level: PreTrainedTokenizerFast) -> None:
    """Guard for the tests below: some tokens alone decode to a partial character."""
    ids = encode(byte_level, "日本語 🙂 한국어")
    assert any(REPLACEMENT in byte_level.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Prompt: 日本", "emoji 🙂"])
def test_byte_level_deltas_concatenate_to_decode(
    byte_level: PreTrainedTokenizerFast, text: str, prompt: str
) -> None:
    ids = encode(byte_level, text)
    detok = IncrementalDetokenizer(byte_level, encode(byte_level, prompt))
    deltas = stream(detok, ids)
    assert "".join(deltas) == byte_level.decode(ids) == text
    assert detok.output_text == text
    assert not any(REPLACEMENT in d for d in deltas)
    assert detok.stop_reason is None and not detok.finished_by_stop


@pytest.mark.parametrize("step", [2, 3, 7])
def test_several_tokens_per_append(byte_level: PreTrainedTokenizerFast, step: int) -> None:
    text = "日本語のテキスト 🙂🚀🎉 café déjà vu"
    ids = encode(byte_level, text)
    deltas = stream(IncrementalDetokenizer(byte_level, []), ids, step)
    assert "".join(deltas) == text
    assert not any(REPLACEMENT in d for d in deltas)


def test_multibyte_character_released_once_complete(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    ids = encode(byte_level, "🐍")  # not in the corpus: split into byte tokens
    assert len(ids) >= 2
    detok = IncrementalDetokenizer(byte_level, [])
    assert [detok.append([i]) for i in ids] == [""] * (len(ids) - 1) + ["🐍"]
    assert detok.flush() == ""


def test_flush_drops_a_dangling_partial_character(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    ids = encode(byte_level, "ok 🐍")
    detok = IncrementalDetokenizer(byte_level, [])
    released = "".join(detok.append([i]) for i in ids[:-1])  # the last byte never comes
    released += detok.flush()
    assert released == "ok "
    assert detok.output_text == "ok "


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_style_matches_decode_with_prompt_context(
    sentencepiece_style: PreTrainedTokenizerFast, text: str
) -> None:
    tok = sentencepiece_style
    prompt = encode(tok, "Hello world")
    ids = encode(tok, text)
    full = tok.decode(prompt + ids)
    expected = full[len(tok.decode(prompt)) :]
    deltas = stream(IncrementalDetokenizer(tok, [tok.bos_token_id, *prompt]), ids)
    assert "".join(deltas) == expected
    assert not any(REPLACEMENT in d for d in deltas)


def test_sentencepiece_style_keeps_word_spaces_and_byte_fallback(
    sentencepiece_style: PreTrainedTokenizerFast,
) -> None:
    tok = sentencepiece_style
    ids = encode(tok, "Hello 한국어 🐍 ok")
    assert "<0xED>" in tok.convert_ids_to_tokens(ids)  # byte fallback is exercised
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id, *encode(tok, "Say:")])
    deltas = stream(detok, ids)
    assert "".join(deltas) == " Hello 한국어 🐍 ok"
    assert not any(REPLACEMENT in d for d in deltas)


def test_decode_window_stays_small_for_long_outputs(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    counting = CountingTokenizer(byte_level)
    ids = encode(byte_level, "日本語 🙂 café and more words. " * 200)
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(counting, encode(byte_level, "prompt"))
    for i in ids:
        detok.append([i])
    assert detok.output_text == byte_level.decode(ids)
    assert max(counting.decode_lengths) <= 16
    assert len(counting.decode_lengths) <= 2 * len(ids)


def test_skip_special_tokens(byte_level: PreTrainedTokenizerFast) -> None:
    start = byte_level.convert_tokens_to_ids("<|im_start|>")
    ids = [start, *encode(byte_level, "hi 🙂"), byte_level.eos_token_id]
    skipped = IncrementalDetokenizer(byte_level, [], skip_special_tokens=True)
    assert "".join(stream(skipped, ids)) == "hi 🙂"
    kept = IncrementalDetokenizer(byte_level, [], skip_special_tokens=False)
    assert "".join(stream(kept, ids)) == "<|im_start|>hi 🙂<|endoftext|>"


# --- stop strings ---------------------------------------------------------------------------


def test_stop_string_split_across_three_tokens(byte_level: PreTrainedTokenizerFast) -> None:
    ids = encode_pieces(byte_level, ["Some text S", "T", "O", "P and after"])
    detok = IncrementalDetokenizer(byte_level, [], stop=["STOP"])
    deltas = [detok.append([i]) for i in ids]
    assert detok.finished_by_stop and detok.stop_reason == "STOP"
    assert "".join(deltas) == detok.output_text == "Some text "
    # Nothing is released once stopped, not even by flush or further tokens.
    assert detok.append(encode(byte_level, "more")) == ""
    assert detok.flush() == ""
    assert detok.output_text == "Some text "


def test_stop_string_text_is_held_back_until_it_cannot_match(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    detok = IncrementalDetokenizer(byte_level, [], stop=["STOP"])
    assert detok.append(encode(byte_level, "go S")) == "go "
    assert detok.append(encode(byte_level, "T")) == ""
    assert detok.append(encode(byte_level, "O")) == ""
    # "STOX" can no longer become "STOP": everything held is released.
    assert detok.append(encode(byte_level, "X")) == "STOX"
    assert not detok.finished_by_stop
    assert detok.append(encode(byte_level, " ST")) == " "
    assert detok.flush() == "ST"  # finished for another reason: the held tail is released
    assert detok.output_text == "go STOX ST"


def test_include_stop_str_in_output(byte_level: PreTrainedTokenizerFast) -> None:
    ids = encode_pieces(byte_level, ["answer: 4", "2", "</a", "ns>", " junk"])
    detok = IncrementalDetokenizer(byte_level, [], stop=["</ans>"], include_stop_str_in_output=True)
    deltas = stream(detok, ids)
    assert "".join(deltas) == detok.output_text == "answer: 42</ans>"
    assert detok.stop_reason == "</ans>"


def test_earliest_stop_string_wins(byte_level: PreTrainedTokenizerFast) -> None:
    ids = encode(byte_level, "one two three four")
    detok = IncrementalDetokenizer(byte_level, [], stop=["four", "two", "three"])
    deltas = stream(detok, ids, step=len(ids))  # all matches are visible in the same step
    assert detok.stop_reason == "two"
    assert "".join(deltas) == "one "


def test_stop_at_the_very_start(byte_level: PreTrainedTokenizerFast) -> None:
    detok = IncrementalDetokenizer(byte_level, encode(byte_level, "Q?"), stop=["\n"])
    ids = encode(byte_level, "\nanything")
    assert "".join(stream(detok, ids)) == ""
    assert detok.finished_by_stop and detok.stop_reason == "\n" and detok.output_text == ""


def test_stop_string_with_multibyte_characters(byte_level: PreTrainedTokenizerFast) -> None:
    text = "日本語 と 🙂🐍 終わり 余分"
    ids = encode(byte_level, text)
    detok = IncrementalDetokenizer(byte_level, [], stop=["🐍 終"])
    deltas = stream(detok, ids)
    assert detok.stop_reason == "🐍 終"
    assert "".join(deltas) == "日本語 と 🙂"
    assert not any(REPLACEMENT in d for d in deltas)


def test_no_stop_string_means_same_text_as_without_stops(
    byte_level: PreTrainedTokenizerFast,
) -> None:
    for text in TEXTS:
        ids = encode(byte_level, text)
        detok = IncrementalDetokenizer(byte_level, [], stop=["NEVER", "🙃🙃"])
        assert "".join(stream(detok, ids)) == text
        assert not detok.finished_by_stop


def test_stop_string_in_sentencepiece_style(sentencepiece_style: PreTrainedTokenizerFast) -> None:
    tok = sentencepiece_style
    ids = encode(tok, "The quick brown fox jumps over the lazy dog")
    detok = IncrementalDetokenizer(tok, [tok.bos_token_id], stop=[" over"])
    assert "".join(stream(detok, ids)) == "The quick brown fox jumps"
    assert detok.stop_reason == " over"
