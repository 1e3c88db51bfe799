from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from loraplex.engine.errors import InvalidRequestError
from loraplex.engine.tokenizer import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS,
                                       IncrementalDetokenizer, StopChecker, Tokenizer, check_stop_limits)

TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.\n  Indented line.",
    "emoji": "Party 🎉🎉 time 👩‍👩‍👧‍👦 family, thumbs 👍🏽 and flags 🇯🇵🇫🇷!",
    "cjk": "日本語のテキストと中文文本，还有한국어 텍스트。",
    "accented": "Crème brûlée, naïve façade, Ångström, żółć, Ελληνικά.",
}


@pytest.fixture(scope="module")
def tok(smollm2_dir: Path) -> Tokenizer:
    return Tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def chat_prompt(tok: Tokenizer) -> list[int]:
    return tok.apply_chat_template([{"role": "user", "content": "Say something."}])


def test_basic_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == (2,)  # <|im_end|>
    assert tok.bos_token_id == 1
    assert {0, 1, 2} <= tok.special_ids
    ids = tok.encode("Hello world")
    assert ids == [19556, 905]
    assert tok.decode(ids) == "Hello world"


def test_encode_rejects_non_strings(tok: Tokenizer) -> None:
    with pytest.raises(InvalidRequestError):
        tok.encode(["Hello"])  # type: ignore[arg-type]


def test_chat_template_matches_transformers(tok: Tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ids = tok.apply_chat_template(messages)
    reference = tok.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert ids == list(reference["input_ids"])
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    without = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(without) < len(ids)


def test_text_parts_are_joined(tok: Tokenizer) -> None:
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = tok.apply_chat_template([{"role": "user", "content": parts}])
    as_string = tok.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_string


@pytest.mark.parametrize(
    "messages, message",
    [
        ([], "non-empty"),
        ("hello", "non-empty"),
        (["hello"], r"messages\[0\]"),
        ([{"role": "robot", "content": "x"}], "role"),
        ([{"role": "user"}], "content"),
        ([{"role": "user", "content": 3}], "content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], r"content\[0\]"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], r"content\[0\]"),
    ],
)
def test_malformed_messages(tok: Tokenizer, messages: object, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def _copy_model_files(src: Path, dst: Path, skip: tuple[str, ...] = ()) -> Path:
    for file in src.iterdir():
        if file.suffix != ".safetensors" and file.name not in skip:
            shutil.copy2(file, dst / file.name)
    return dst


def test_model_without_chat_template(smollm2_dir: Path, tmp_path: Path) -> None:
    tok = Tokenizer(_copy_model_files(smollm2_dir, tmp_path, skip=("chat_template.jinja",)))
    assert not tok.has_chat_template
    with pytest.raises(InvalidRequestError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_eos_ids_merge_generation_config(smollm2_dir: Path, tmp_path: Path) -> None:
    folder = _copy_model_files(smollm2_dir, tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert Tokenizer(folder).eos_token_ids == (2, 0)


def _stream(tok: Tokenizer, prompt: list[int], output: list[int], chunk: int = 1) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.step(output[i : i + chunk]) for i in range(0, len(output), chunk)]
    return deltas + [detok.flush()]


@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_full_decode(tok: Tokenizer, chat_prompt: list[int], name: str, chunk: int) -> None:
    output = tok.encode(TEXTS[name], add_special_tokens=False)
    deltas = _stream(tok, chat_prompt, output, chunk)
    assert "".join(deltas) == tok.decode(output) == TEXTS[name]
    assert not any("\ufffd" in d for d in deltas)
    if name in ("emoji", "cjk") and chunk == 1:
        # Those texts have characters split across tokens: something must be held back.
        assert "" in deltas[:-1]


def test_special_tokens_are_skipped(tok: Tokenizer, chat_prompt: list[int]) -> None:
    output = tok.encode("Hi 🎉", add_special_tokens=False) + [2] + tok.encode(" after", add_special_tokens=False)
    assert "".join(_stream(tok, chat_prompt, output)) == tok.decode(output) == "Hi 🎉 after"
    detok = IncrementalDetokenizer(tok, chat_prompt, skip_special_tokens=False)
    text = "".join(detok.step([t]) for t in output) + detok.flush()
    assert text == tok.decode(output, skip_special_tokens=False) == "Hi 🎉<|im_end|> after"


@pytest.mark.parametrize("seed", range(5))
def test_random_tokens_match_full_decode(tok: Tokenizer, chat_prompt: list[int], seed: int) -> None:
    # Random ids produce invalid byte sequences too; the stream must still add up,
    # with the invalid bytes showing as U+FFFD exactly where the full decode has them.
    rng = random.Random(seed)
    output = [rng.randrange(tok.vocab_size) for _ in range(300)]
    assert "".join(_stream(tok, chat_prompt, output)) == tok.decode(output)


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode("Hi 🎉 ok", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    prompt, output = ids[:cut], ids[cut:]
    assert "".join(_stream(tok, prompt, output)) == tok.decode(output)


def test_window_stays_bounded(tok: Tokenizer, chat_prompt: list[int]) -> None:
    output = tok.encode(" ".join(TEXTS.values()) * 20, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, chat_prompt)
    longest = 0
    for token in output:
        detok.step([token])
        longest = max(longest, len(detok._tokens))
    assert len(output) > 1000 and longest <= 10


# ---------------------------------------------------------------------------------------
# Stop strings


def test_stop_split_across_deltas() -> None:
    checker = StopChecker(["END"])
    assert checker.feed("abc E") == ("abc ", False)
    assert checker.feed("N") == ("", False)
    assert checker.feed("D and more") == ("", True)
    assert checker.matched == "END"
    assert checker.feed("later") == ("", True)
    assert checker.flush() == ""


def test_false_alarm_is_released() -> None:
    checker = StopChecker(["END"])
    assert checker.feed("EN") == ("", False)
    assert checker.feed("x") == ("ENx", False)
    assert checker.feed("E") == ("", False)
    assert checker.flush() == "E"


def test_earliest_stop_wins() -> None:
    checker = StopChecker(["world", "lo"])
    assert checker.feed("hello world") == ("hel", True)
    assert checker.matched == "lo"


def test_no_stops_passes_through() -> None:
    checker = StopChecker(["", ""])
    assert checker.feed("anything END") == ("anything END", False)
    assert checker.flush() == ""


def test_unicode_stop_string() -> None:
    checker = StopChecker(["。\n"])
    assert checker.feed("日本。") == ("日本", False)
    assert checker.feed("\n次") == ("", True)


def _first_stop_to_end(text: str, stops: list[str]) -> tuple[str, bool]:
    """The reference: the output ends before the first stop string to be completed."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            return text[: end - len(max(ending, key=len))], True
    return text, False


@pytest.mark.parametrize("seed", range(40))
def test_stop_checker_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = "ab\n<|>"
    stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
    expected, hits = _first_stop_to_end(text, stops)
    checker = StopChecker(stops)
    emitted, stopped, pos = [], False, 0
    while pos < len(text) and not stopped:
        step = rng.randint(1, 5)
        out, stopped = checker.feed(text[pos : pos + step])
        emitted.append(out)
        pos += step
    emitted.append(checker.flush())
    assert "".join(emitted) == expected
    assert stopped == bool(hits)


def test_first_stop_to_end_wins_over_an_earlier_start() -> None:
    checker = StopChecker(["abc", "b"])
    assert checker.feed("xab") == ("xa", True)
    assert checker.matched == "b"


def test_overlapping_prefixes_are_held_and_released() -> None:
    checker = StopChecker(["aab"])
    out = [checker.feed(c)[0] for c in "aaaa"]
    assert "".join(out) == "aa"  # the last two could still start "aab"
    assert checker.feed("b") == ("", True)
    assert checker.matched == "aab"


def test_long_output_against_a_long_stop_string() -> None:
    # A near-match that never completes: held-back text stays below the stop's length.
    stop = "a" * (MAX_STOP_STRING_CHARS - 1) + "b"
    checker = StopChecker([stop])
    emitted = sum(len(checker.feed("a" * 1000)[0]) for _ in range(200))
    assert emitted == 200_000 - (MAX_STOP_STRING_CHARS - 1)
    assert checker.feed("b") == ("", True)


def test_stop_limits() -> None:
    check_stop_limits(["x"] * MAX_STOP_STRINGS, list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(InvalidRequestError, match="at most 16 stop strings"):
        StopChecker([str(i) for i in range(MAX_STOP_STRINGS + 1)])
    with pytest.raises(InvalidRequestError, match="characters"):
        StopChecker(["x" * (MAX_STOP_STRING_CHARS + 1)])
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        check_stop_limits([], list(range(MAX_STOP_TOKEN_IDS + 1)))


def test_max_token_chars_bounds_what_any_token_decodes_to(tok: Tokenizer) -> None:
    longest = tok.max_token_chars
    assert 1 < longest < 1000
    for token_id in range(0, tok.vocab_size, 7):
        assert len(tok.decode([token_id], skip_special_tokens=False)) <= longest
