"""Incremental detokenisation and stop rules (tiny byte-level BPE tokenizer: multi-byte characters span
several tokens, which is exactly what must not leak U+FFFD)."""

from __future__ import annotations

import pytest
from transformers import PreTrainedTokenizerFast

from splitserve.engines.detok import IncrementalDetokenizer, StopChecker, StopUpdate

TEXTS = [
    "Café naïve façade — Straße œuvre",
    "東京は日本の首都です。北京是中国的首都。",
    "Emoji 🚀🔥👍🏽 family 👨‍👩‍👧 done 🎉",
    "mixed: a→b, ½ ≠ ¾, ∑ xᵢ²  spaces   and\ttabs\nnew line",
]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.feed(t) for t in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(tiny_tokenizer: PreTrainedTokenizerFast, text: str) -> None:
    ids = tiny_tokenizer.encode(text)
    detok = IncrementalDetokenizer(tiny_tokenizer)
    deltas = stream(detok, ids)
    assert "".join(deltas) + detok.flush() == tiny_tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert sum(1 for d in deltas if d == "") > 0 or text.isascii()  # multi-byte chars really were split


def test_multibyte_character_is_withheld_until_complete(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("🚀")
    assert len(ids) > 1  # the tokenizer splits the emoji's 4 bytes
    detok = IncrementalDetokenizer(tiny_tokenizer)
    assert stream(detok, ids) == [""] * (len(ids) - 1) + ["🚀"]


def test_prompt_context_is_not_emitted(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = tiny_tokenizer.encode("The quick brown")
    ids = tiny_tokenizer.encode(" fox jumps 🚀")
    detok = IncrementalDetokenizer(tiny_tokenizer, prompt)
    assert "".join(stream(detok, ids)) == " fox jumps 🚀"


def test_special_tokens_are_skipped(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("hi") + [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(stream(IncrementalDetokenizer(tiny_tokenizer), ids)) == "hi"
    raw = IncrementalDetokenizer(tiny_tokenizer, skip_special_tokens=False)
    assert "".join(stream(raw, ids)) == "hi<|im_end|>"


def test_flush_releases_an_incomplete_character(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    ids = tiny_tokenizer.encode("ok🚀")
    detok = IncrementalDetokenizer(tiny_tokenizer)
    text = "".join(stream(detok, ids[:-1]))
    assert text == "ok"
    assert "\ufffd" in detok.flush()  # at the end of the stream a broken character is shown, not lost


def run_stop(checker: StopChecker, pieces: list[str], eos: int | None = None) -> tuple[str, StopUpdate]:
    """Feed text pieces as successive tokens (token id 10 + index, or eos at the end)."""
    out = ""
    update = StopUpdate("", None)
    ids = [10 + i for i in range(len(pieces))] + ([eos] if eos is not None else [])
    for token, piece in zip(ids, [*pieces, ""], strict=False):
        update = checker.update(token, piece)
        out += update.text
        if update.finish_reason:
            break
    return out, update


def test_stop_string_across_token_boundaries() -> None:
    checker = StopChecker(["###", "END"])
    out, update = run_stop(checker, ["Hello wor", "ld #", "#", "# ignored"])
    assert (out, update.finish_reason, update.stop_string) == ("Hello world ", "stop", "###")


def test_partial_stop_string_is_held_back_then_released() -> None:
    checker = StopChecker(["STOP"])
    assert checker.update(1, "a ST").text == "a "  # "ST" may become STOP
    assert checker.update(2, "O").text == ""
    released = checker.update(3, "P? no: STOW")  # "STOP" completes inside this piece
    assert (released.text, released.finish_reason) == ("", "stop")
    checker = StopChecker(["STOP"])
    assert checker.update(1, "a ST").text == "a "
    assert checker.update(2, "OW").text == "STOW"  # resolved: not a stop string


def test_earliest_stop_string_wins() -> None:
    out, update = run_stop(StopChecker(["b", "abc"]), ["xab", "c"])
    assert (out, update.stop_string) == ("xa", "b")


def test_eos_finishes_with_held_text_released() -> None:
    out, update = run_stop(StopChecker(["STOP"], eos_ids=[2]), ["Hi S"], eos=2)
    assert (out, update.finish_reason) == ("Hi S", "stop")


def test_max_tokens_finishes_with_length() -> None:
    checker = StopChecker(["zzz"], max_tokens=3)
    out, update = run_stop(checker, ["a", "b", "cz", "d"])
    assert (out, update.finish_reason) == ("abcz", "length")
    assert checker.num_tokens == 3


def test_stop_on_the_last_allowed_token_is_stop_not_length() -> None:
    out, update = run_stop(StopChecker(["!"], max_tokens=2), ["a", "b!"])
    assert (out, update.finish_reason) == ("ab", "stop")


def test_no_updates_after_finish() -> None:
    checker = StopChecker(eos_ids=[0])
    checker.update(0, "")
    with pytest.raises(RuntimeError):
        checker.update(1, "x")
    assert checker.finish("abort") == StopUpdate("", "stop")


def test_outside_finish_releases_pending_text() -> None:
    checker = StopChecker(["STOP"])
    assert checker.update(1, "x S").text == "x "
    assert checker.finish("length") == StopUpdate("S", "length")


def test_detok_and_stop_together(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """A decode worker's loop: detokenise each token, then apply the stop rules to the delta."""
    ids = tiny_tokenizer.encode("Café 🚀 done. The end") + [tiny_tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tiny_tokenizer)
    checker = StopChecker(["done."], eos_ids=[tiny_tokenizer.eos_token_id])
    out = ""
    for token in ids:
        update = checker.update(token, detok.feed(token))
        out += update.text
        if update.finish_reason:
            break
    assert (out, checker.finish_reason) == ("Café 🚀 ", "stop")


def test_resumed_output_that_had_already_ended() -> None:
    """Output moved to another worker: the text the previous worker withheld (``pending``) or its last token
    may already have ended it; then nothing more is generated."""
    c = StopChecker(["END"], eos_ids=[2], max_tokens=10)
    c.pending = " END of it"
    assert c.resumed_end(last_token=7) == StopUpdate(" ", "stop", "END")
    c = StopChecker(["END"], eos_ids=[2], max_tokens=10)
    c.pending = "EN"  # only the start of a stop string: it goes on
    assert c.resumed_end(last_token=7) is None and c.finish_reason is None
    c = StopChecker([], eos_ids=[2], max_tokens=10)
    assert c.resumed_end(last_token=2) == StopUpdate("", "stop")
    c = StopChecker(["END"], eos_ids=[2], max_tokens=10, min_tokens=3)  # tokens still owed: it cannot have ended
    c.pending = "END"
    assert c.resumed_end(last_token=2) is None
