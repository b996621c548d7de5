"""Incremental detokenisation with the model's real tokenizer."""

from __future__ import annotations

import pytest

from engine.serving.detokenizer import IncrementalDetokenizer

TEXTS = [
    "héllo wörld, café crème brûlée",
    "日本語のテキストと中文字符 mixed with English",
    "emoji 🎉👨‍👩‍👧 and math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ≈ ∞",
    "plain ascii,  double  spaces\nand\ttabs",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_rebuild_multibyte_text_exactly(tokenizer, text) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompt = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    deltas = [detok.push(t) for t in ids] + [detok.finish()]
    assert "".join(deltas) == text == detok.text
    assert not any("\ufffd" in d for d in deltas)  # no half characters, ever


def test_multibyte_characters_split_across_tokens_are_held(tokenizer) -> None:
    ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits this character
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.push(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1]) == "🎉"


def test_stop_string_is_held_back_then_cut(tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. Then more text follows.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["Then", "never"])
    deltas = [detok.push(t) for t in ids]
    assert detok.stopped and detok.stop_string == "Then"
    assert "".join(deltas) == detok.text == "The answer is 42. "
    assert detok.finish() == ""


def test_stop_strings_count_only_where_they_end_after_min_tokens(tokenizer) -> None:
    """vLLM's min_tokens: a stop string inside the first tokens' text is text; one that
    ends after them stops, also when it began before."""
    ids = tokenizer.encode("a, b, c, d, e", add_special_tokens=False)
    pieces = [tokenizer.decode(ids[: k + 1]) for k in range(len(ids))]
    first_comma = next(k for k, text in enumerate(pieces) if "," in text)
    detok = IncrementalDetokenizer(tokenizer, stop=[","], min_tokens=first_comma + 1)
    deltas = [detok.push(t) for t in ids]
    assert detok.stopped and "".join(deltas) == detok.text
    assert detok.text.count(",") == 1 and detok.text == "a, b"
    straddling = tokenizer.encode("xx END yy", add_special_tokens=False)
    ends = next(k for k in range(len(straddling))
                if "END" in tokenizer.decode(straddling[: k + 1]))
    detok = IncrementalDetokenizer(tokenizer, stop=[" END"], min_tokens=ends)
    for t in straddling:
        detok.push(t)
    assert detok.stopped and detok.text == "xx"


def test_a_stop_string_kept_in_the_text_when_asked(tokenizer) -> None:
    ids = tokenizer.encode("The answer is 42. Then more text follows.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["Then", "never"], include_stop=True)
    deltas = [detok.push(t) for t in ids] + [detok.finish()]
    assert detok.stopped and "".join(deltas) == detok.text == "The answer is 42. Then"


def test_text_that_only_looks_like_a_stop_prefix_is_released(tokenizer) -> None:
    ids = tokenizer.encode("The cat sat.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, stop=["The dog"])
    deltas = [detok.push(t) for t in ids] + [detok.finish()]
    assert "".join(deltas) == "The cat sat." and not detok.stopped


def test_special_tokens_are_not_in_the_text(tokenizer) -> None:
    ids = tokenizer.encode("Hi<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.push(t) for t in ids) + detok.finish() == "Hi"


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer: a word's leading space is part of its token and is
    dropped when that token starts a decoded sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁how": 4, "▁are": 5, "▁you": 6}
    backend = Tokenizer(models.WordPiece(vocab, unk_token="<unk>", continuing_subword_prefix=""))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")


def test_tokens_that_need_their_neighbours_keep_their_spaces() -> None:
    tokenizer = _metaspace_tokenizer()
    ids = tokenizer.encode("Hello world! how are you", add_special_tokens=False)
    one_by_one = "".join(tokenizer.decode([t]) for t in ids)
    assert one_by_one == "Helloworld!howareyou"  # what naive per-token decoding gives
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids] + [detok.finish()]
    assert "".join(deltas) == "Hello world! how are you"
    # After a prompt, the first generated word keeps its space too.
    prompt = tokenizer.encode("Hello", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    assert [detok.push(t) for t in ids[1:3]] == [" world", "!"]
