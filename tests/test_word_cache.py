"""The word encoder (the fast path of `Tokens.encode_cut`): the tokenizer's exact ids on whitelisted texts,
for fuzz, every whitelisted character in context and the real data; None for anything else; a bounded cache."""

from __future__ import annotations

import glob
import itertools
import json
import random
import threading
import unicodedata
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, pre_tokenizers

from flide_sdk.prompt.chat import ChatFormat, load_chat_template
from flide_sdk.text import pretokenizer, word_cache
from flide_sdk.text.tokens import Tokens
from flide_sdk.text.word_cache import WHITELIST, WordEncoder, character_classes

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
QWEN35_TOKENIZER = DATA / "tokenizer" / "qwen3.5"
W = [chr(point) for low, high in WHITELIST for point in range(low, high + 1)]
TRICKY = [
    "'", "'s", "'S", "'t", "'T", "'re", "'RE", "'rE", "'Re", "'ve", "'VE", "'vE", "'m", "'M", "'ll", "'LL", "'lL",
    "'d", "'D", "'x", "''", " '", " ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\r", " \n", "  \n\n ", "\t\n",
    "1", "12", "2024", "¹", "²", "½", "¾", "—", "–", "‘", "’", "“", "”", "…", "•", "‰", "µ", "ª", "º", "×", "÷",
    "é", "É", "ñ", "ß", "ÿ", "Œ", "ĳ", "ǅ", "ǀ", "ƻ", "ɏ", "€", "™", "¿", "¡", "©", "¨", "´", "the", "The", " the",
    "don", "x", "Ab", "A", "z", "-", "_", ".", ",", "!!", "?", '"', "(", ")", "[", "]", "{", "}", "\\", "/", "#", "@",
    "<", ">", "|", "<|", "|>",
]


def added_contents(tokenizer: Tokenizer) -> list[str]:
    return [token.content for token in tokenizer.get_added_tokens_decoder().values()]


def hf_ids(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def fuzz_texts(tokenizer: Tokenizer, count: int, seed: int) -> list[str]:
    """Random texts of W: mostly the tricky pieces, some added tokens glued on, some any character of W."""
    rng = random.Random(seed)
    added = added_contents(tokenizer)
    texts = []
    for _ in range(count):
        parts = []
        for _ in range(rng.randint(1, 24)):
            roll = rng.random()
            parts.append(rng.choice(TRICKY) if roll < 0.7 else rng.choice(added) if roll < 0.78 else rng.choice(W))
        texts.append("".join(parts))
    return texts


def in_contexts(char: str) -> list[str]:
    return [f"x{char}y", f" {char}{char}1", f"{char}'s", f"\n {char} z\n\n", f"'{char}", f"'{char}{char}x",
            f"{char}  \n{char}", f"a{char}", f"1{char}2", f"<|im_end|>{char}<think>", f"{char}\r\n "]


def tiny_with_extra_tokens(path: Path, **options) -> Tokenizer:
    """The tiny tokenizer plus added tokens that overlap (leftmost-longest decides) or are plain words."""
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(content, normalized=False, **options)
                          for content in ("[[", "[[ref]]", "ref]]", "quux", "ab", "bcd", " zz")])
    return tokenizer


def tokenizers(tiny_path: Path):
    yield "tiny", Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    yield "tiny+added", tiny_with_extra_tokens(tiny_path)
    if QWEN35_TOKENIZER.is_dir():
        yield "qwen3.5", real_tokenizer()


_REAL: list[Tokenizer] = []


def real_tokenizer() -> Tokenizer:
    if not _REAL:
        _REAL.append(Tokenizer.from_file(str(QWEN35_TOKENIZER / "tokenizer.json")))
    return _REAL[0]


def test_whitelist_classes_are_what_the_pattern_expects():
    letters, digits, spaces = character_classes()
    assert digits == "0-9\\u00b2-\\u00b3\\u00b9\\u00bc-\\u00be"
    assert spaces == "\\u0009-\\u000a\\u000d\\u0020"
    assert "\\u017f" not in letters and "\\u017e-" not in letters  # the long s is not whitelisted
    for excluded in "\x0b\x0c\x85\xa0\xad\u017f\u2028\u2029\u202f\u205f\u2060\u2000\u200b":
        assert excluded not in W


@pytest.fixture(params=["default", "all_cut", "all_cut_one_by_one", "all_by_lines"])
def split_whole(request, monkeypatch):
    """Texts up to SPLIT_WHOLE characters are split whole: the others send every text through its lines, or the
    chunks when most lines are new, new chunks cached from one split of the text when many are new, or
    (`one_by_one`) each split on its own; `all_by_lines` sends every text of three lines or more line by line."""
    if request.param != "default":
        monkeypatch.setattr(word_cache, "SPLIT_WHOLE", 0)
    if request.param == "all_cut_one_by_one":
        monkeypatch.setattr(word_cache, "NEW_CHUNKS_SPLIT_WHOLE", 0)
    if request.param == "all_by_lines":
        monkeypatch.setattr(word_cache, "NEW_LINES_CHUNKED_WHOLE", 0)
    return request.param


def test_fast_ids_equal_the_tokenizers(tiny_path, split_whole):
    for name, tokenizer in tokenizers(tiny_path):
        encoder = WordEncoder(tokenizer)
        assert encoder.enabled, name
        texts = fuzz_texts(tokenizer, 3000 if name == "qwen3.5" else 1500, seed=len(name))
        for text, expected in zip(texts, hf_ids(tokenizer, texts)):
            ids = encoder.encode(text)
            assert ids is not None and ids.dtype == np.int64 and ids.tolist() == expected, (name, text)
            encoder.fill_chunks()
        check_split(encoder, tokenizer, texts)


def test_every_whitelisted_character_in_context(tiny_path, split_whole):
    texts = [text for char in W for text in in_contexts(char)]
    for name, tokenizer in tokenizers(tiny_path):
        encoder = WordEncoder(tokenizer)
        for text, expected in zip(texts, hf_ids(tokenizer, texts)):
            ids = encoder.encode(text)
            assert ids is not None and ids.tolist() == expected, (name, text)
            encoder.fill_chunks()
        check_split(encoder, tokenizer, texts)


def chunk_texts(segment: str) -> list[str]:
    """The texts of a segment's chunks: its part before the first cut, then each cut's space and what follows."""
    first, *chunks = word_cache.cut_at_spaces(segment)
    return [first.replace(word_cache.NUL, " ")] + [" " + chunk.replace(word_cache.NUL, " ") for chunk in chunks]


def line_texts(segment: str) -> list[str]:
    """The texts of a segment's lines: each with its newline, the last as it is."""
    *lines, last = word_cache.LINE_CUT.split(segment)
    return [line + "\n" for line in lines] + [last]


def check_split(encoder: WordEncoder, tokenizer: Tokenizer, texts: list[str]) -> None:
    """The split itself is the tokenizer's, not just the ids (a piece split differently may still give the
    same ids by chance); the chunks, and the lines, cover each segment between added tokens, and split one by
    one they give the tokenizer's pieces of the whole segment (no piece crosses a cut)."""
    for text in texts:
        segments = encoder.segments(text)
        assert "".join(segments) == text
        for segment in segments[::2]:
            hf = [segment[a:b] for _, (a, b) in tokenizer.pre_tokenizer.pre_tokenize_str(segment)]
            assert encoder.pieces(segment) == hf, segment
            for parts in (chunk_texts(segment), line_texts(segment)):
                assert "".join(parts) == segment
                assert [piece for part in parts for piece in encoder.pieces(part)] == hf, segment


def test_added_tokens_leftmost_longest_and_glued(tiny_path):
    tokenizer = tiny_with_extra_tokens(tiny_path)
    encoder = WordEncoder(tokenizer)
    texts = ["[[ref]]", "x[[ref]", "[[ref]]]]", "abcd", "abcbcd", "aquuxb", "quuxquux", "a zz'szz", "<think>[[ab",
             "'quux's", "[[[[ref]]]]", "<|im_start|>user\nabc<|im_end|>\n"]
    for text, expected in zip(texts, hf_ids(tokenizer, texts)):
        assert encoder.encode(text).tolist() == expected, text
    ref = tokenizer.token_to_id("[[ref]]")
    assert encoder.encode("[[ref]]").tolist() == [ref]


@pytest.mark.parametrize("option", ["lstrip", "rstrip", "single_word", "normalized"])
def test_texts_with_unsupported_added_tokens_fall_back(tiny_path, option):
    tokenizer = Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    options = {"normalized": False, option: True}
    tokenizer.add_tokens([AddedToken("quux", **options)])
    encoder = WordEncoder(tokenizer)
    assert encoder.encode("a quux b") is None
    assert encoder.encode("<|im_start|>a") is None  # any added token: one pass cannot mimic the others
    assert encoder.encode("a qu ux b").tolist() == tokenizer.encode("a qu ux b", add_special_tokens=False).ids


@pytest.mark.skipif(not (DATA / "reading").is_dir(), reason="the data copy lives in ../shared/data")
@pytest.mark.skipif(not QWEN35_TOKENIZER.is_dir(), reason="the real Qwen3.5 tokenizer lives in ../shared/data")
def test_real_data():
    tokenizer = real_tokenizer()
    encoder = WordEncoder(tokenizer)
    quality = [json.loads(line)["input"] for line in (DATA / "reading/quality/quality.jsonl").open() if line.strip()]
    race = [json.loads(Path(p).read_text())["article"]
            for p in sorted(glob.glob(str(DATA / "reading/race/dev/middle/*.txt")))[:40]]
    trajectories = []
    for path in sorted(glob.glob(str(DATA / "trajectories/mini-swe-agent/*/*/*.json")))[:8]:
        messages = json.loads(Path(path).read_text())["messages"]
        body = ", ".join(json.dumps({"role": m["role"], "content": m.get("content") or ""}, ensure_ascii=False)
                         for m in messages)
        trajectories.append("<|im_start|>user\n[" + body[:30_000])
    head = "<|im_start|>user\n"
    for name, texts, least in (("quality", quality, 1.0), ("race", race, 1.0), ("trajectories", trajectories, 0)):
        texts = [head + text + "\n\n" for text in texts]
        took = 0
        for text, expected in zip(texts, hf_ids(tokenizer, texts)):
            ids = encoder.encode(text)
            if ids is not None:
                assert ids.tolist() == expected, name
                took += 1
            else:
                assert not encoder.whitelisted(text), name  # declined only for a character outside W
        assert texts and took >= least * len(texts), (name, took, len(texts))


def test_characters_outside_the_whitelist_are_declined(tiny_path):
    encoder = WordEncoder(Tokenizer.from_file(str(tiny_path / "tokenizer.json")))
    assert encoder.encode("plain text, 'quoted' — fine") is not None
    for char in "\x00\x0b\x0c\x1f\x7f\x85\xa0\xad\u017f\u0250Ω東🙂\u0301\u200b\u2028\u202f\u205f\u2190\u2713\ufeff":
        for text in (char, f"word{char}", f"a b c {char} d e f" * 3):
            assert encoder.encode(text) is None, repr(text)
    assert encoder.encode("e\u0301") is None and encoder.encode("\u00e9") is not None


def test_every_text_of_the_whitelist_is_nfc():
    """The encoder checks no text for NFC: every character of W is an NFC-stable starter (no mark, no canonical
    change) and no two of them compose, so NFC leaves any text of W as it is (the tokenizer's normalizer too)."""
    chars = [chr(point) for low, high in word_cache.WHITELIST for point in range(low, high + 1)]
    assert all(unicodedata.combining(c) == 0 and unicodedata.normalize("NFC", c) == c for c in chars)
    assert all(unicodedata.is_normalized("NFC", a + b) for a in chars for b in chars)


def test_characters_outside_the_whitelist_are_declined_past_cached_lines(tiny_path):
    """A long text whose lines are cached is checked against W only where no cache serves it: a character
    outside W in a new line, in its last line or in its first one still declines the whole text (a line holding
    one is never cached), and the text without it is encoded exactly."""
    tokenizer = Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    encoder = WordEncoder(tokenizer)
    rng = random.Random(5)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    lines = [" ".join(rng.sample(words, 6)) for _ in range(120)]
    text = "\n".join(lines) + "\n"
    assert len(text) > word_cache.SPLIT_WHOLE and encoder.encode(text) is not None
    encoder.fill_chunks()
    assert len(encoder.lines) >= len(lines) - 1
    for char in "\x00\x0b\x85\xa0\u2028\u0301\ufeff":
        for bad in (text.replace(lines[40], f"{lines[40][:5]}{char}{lines[40][5:]}"),  # a new line
                    text + f"last words{char} here",  # its last line
                    f"{char}first line\n" + text,  # its first line
                    text[:200] + char + text[200:]):  # inside a cached line
            assert encoder.encode(bad) is None, repr(char)
    good = text.replace(lines[40], lines[40] + " extra") + "last words here"
    assert encoder.encode(good).tolist() == tokenizer.encode(good, add_special_tokens=False).ids


def test_unsupported_tokenizers_disable_it(tiny_path):
    spec = json.loads(Tokenizer.from_file(str(tiny_path / "tokenizer.json")).to_str())

    def variant(change) -> Tokenizer:
        edited = json.loads(json.dumps(spec))
        change(edited)
        return Tokenizer.from_str(json.dumps(edited))

    def split(s):
        return s["pre_tokenizer"]["pretokenizers"][0]

    assert WordEncoder(variant(lambda s: None)).enabled
    assert WordEncoder(variant(lambda s: s.update(normalizer=None))).enabled
    for change in (
        lambda s: split(s).update(behavior="MergedWithPrevious"),
        lambda s: split(s).update(invert=True),
        lambda s: split(s).update(pattern={"Regex": r"\s+|\S+"}),
        lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        lambda s: s.update(normalizer={"type": "NFKC"}),
        lambda s: s["model"].update(dropout=0.1),
        lambda s: s.update(truncation={"direction": "Right", "max_length": 8, "strategy": "LongestFirst",
                                       "stride": 0}),
    ):
        encoder = WordEncoder(variant(change))
        assert not encoder.enabled and encoder.encode("plain text") is None


def test_a_piece_that_does_not_split_into_itself_is_not_cached(tiny_path):
    encoder = WordEncoder(Tokenizer.from_file(str(tiny_path / "tokenizer.json")))
    assert not encoder.add_pieces(["ab cd"]) and "ab cd" not in encoder.cache
    assert encoder.add_pieces([" ab", " ab", " cd"]) and encoder.cache[" ab"] == np.asarray(
        encoder.tokenizer.encode(" ab", add_special_tokens=False).ids, np.int64).tobytes()


def test_cache_is_bounded_and_exact_after_clearing(tiny_path, monkeypatch):
    monkeypatch.setattr(word_cache, "MAX_CACHED_PIECES", 60)
    monkeypatch.setattr(word_cache, "MAX_CACHED_CHUNKS", 60)
    monkeypatch.setattr(word_cache, "SPLIT_WHOLE", 0)  # short texts: through the chunk cache too
    tokenizer = Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    encoder = WordEncoder(tokenizer)
    rng = random.Random(3)
    texts = ["<|im_start|>" + " ".join("".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 6)))
                                        for _ in range(rng.randint(1, 12))) for _ in range(300)]
    expected = hf_ids(tokenizer, texts)
    sizes = []
    for text, ids in zip(texts, expected):
        assert encoder.encode(text).tolist() == ids
        encoder.fill_chunks()
        sizes.append((len(encoder.cache), len(encoder.chunks)))
    for cache in (0, 1):  # both bounded, both cleared
        assert max(size[cache] for size in sizes) <= 60
        assert any(after[cache] < before[cache] for before, after in itertools.pairwise(sizes))
    # a clear keeps the chunks of the text that made it, and the pieces of the chunks being added
    for text in texts:
        before = len(encoder.chunks)
        encoder.encode(text)
        encoder.fill_chunks()
        if len(encoder.chunks) < before:
            assert set(word_cache.cut_at_spaces(text)[1:]) <= encoder.chunks.keys()
            break
    else:
        raise AssertionError("no text cleared the chunk cache")
    added = len(WordEncoder(tokenizer).cache)  # a cleared cache keeps the added tokens
    pieces = [" " + "".join(letters) for letters in itertools.product("hgf", repeat=3)][: 60 - added]
    assert encoder.add_pieces(pieces[:10])
    encoder.cache.update({f" z{i}": b"" for i in range(60)})
    assert encoder.add_pieces(pieces) and set(pieces) <= encoder.cache.keys() and " z0" not in encoder.cache
    assert all(encoder.cache[piece] == np.asarray(tokenizer.encode(piece, add_special_tokens=False).ids,
                                                  np.int64).tobytes() for piece in pieces)

    # several threads at once, clearing as they go: every result still exact, the cache still bounded
    failures = []

    def work(offset: int) -> None:
        for i in range(150):
            k = (offset * 37 + i) % len(texts)
            if encoder.encode(texts[k]).tolist() != expected[k]:
                failures.append(k)
            encoder.fill_chunks()

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not failures
    # the bounds, up to the pieces and chunks of texts whose inserts interleave
    assert len(encoder.cache) <= 60 + 4 * 14 and len(encoder.chunks) <= 60 + 4 * 14


def renderers(tiny_path: Path):
    yield ChatFormat.from_checkpoint(tiny_path, 1 << 20)
    if QWEN35_TOKENIZER.is_dir():
        yield ChatFormat(Tokens(real_tokenizer(), 1 << 20), load_chat_template(QWEN35_TOKENIZER))


def test_encode_cut_with_and_without_the_fast_path(tiny_path):
    rng = random.Random(11)
    for renderer in renderers(tiny_path):
        fuzz = fuzz_texts(renderer.tokens.tokenizer, 40, seed=5)
        foreign = [text[: len(text) // 2] + rng.choice("東Ω🙂\xa0") + text[len(text) // 2 :] for text in fuzz[:20]]
        long = [renderer.head + " ".join(fuzz) * 3 + "\n\n"]
        for text in fuzz + foreign + long:
            assert (renderer.tokens.words.encode(text) is None) == (text in foreign)
            for cut in [0, *renderer.tokens.boundaries.cuts(text, 23)[:6]]:
                fast_ids, fast_before = renderer.tokens.encode_cut(text, cut)
                renderer.tokens.words.enabled = False
                try:
                    ids, before = renderer.tokens.encode_cut(text, cut)
                finally:
                    renderer.tokens.words.enabled = True
                assert fast_ids.tolist() == ids.tolist() and fast_before == before, (text, cut)
                assert ids.tolist() == renderer.tokens.tokenizer.encode(text, add_special_tokens=False).ids


class BatchRecorder:
    """A tokenizer that records the texts of each of its batch calls (the calls that wake its threads)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.batches = tokenizer, []

    def __getattr__(self, name: str):
        return getattr(self.tokenizer, name)

    def encode_batch_fast(self, texts, **options):
        self.batches.append(list(texts))
        return self.tokenizer.encode_batch_fast(texts, **options)


def test_branch_ids_take_the_fast_path(tiny_path):
    """Branch texts (question + template tail, added tokens included) take the word encoder too; only texts it
    declines go to the tokenizer's batch; either way the ids are the tokenizer's."""
    import flide_sdk as fl

    for renderer in renderers(tiny_path):
        tokenizer = renderer.tokens.tokenizer
        fuzz = fuzz_texts(tokenizer, 12, seed=9)
        questions = {f"q{i}": fl.Noul(f"{text.strip() or 'x'} (case {i})") for i, text in enumerate(fuzz)}
        questions["foreign"] = fl.Choice("Which 東 one?", {"Ω": None, "b": "🙂"})
        renderer.tokens.tokenizer = recording = BatchRecorder(tokenizer)
        rendered = renderer.render_questions(questions)
        assert recording.batches == [[rendered["foreign"].text + renderer.tail]]
        for question in rendered.values():
            text = question.text + renderer.tail
            assert question.ids.tolist() == tokenizer.encode(text, add_special_tokens=False).ids


def test_new_pieces_take_the_bpe_model_alone(tiny_path):
    """A new piece's ids come from the BPE model on its byte-level characters (the alphabet checked against the
    tokenizer's), equal to the tokenizer's for pieces of every whitelisted character."""
    encoder = WordEncoder(Tokenizer.from_file(str(tiny_path / "tokenizer.json")))
    assert len(set(pretokenizer.byte_level_chars())) == 256
    assert set(pretokenizer.byte_level_chars()) == set(pre_tokenizers.ByteLevel.alphabet())
    calls = []
    model_tokenize = encoder.tokenizer.model.tokenize

    class Model:
        def tokenize(self, chars):
            calls.append(chars)
            return model_tokenize(chars)

    tokenizer = encoder.tokenizer
    encoder.tokenizer = recording = BatchRecorder(tokenizer)
    recording.model = Model()
    points = [point for low, high in word_cache.WHITELIST for point in range(low, high + 1)]
    seen: set[str] = set()
    for start in range(0, len(points), 24):  # a few dozen new pieces a text: the one-by-one path
        text = "a" + " ".join("x" + chr(point) * 2 + "y" for point in points[start : start + 24])
        assert encoder.encode(text).tolist() == tokenizer.encode(text, add_special_tokens=False).ids
        seen.update(encoder.pieces(text))
    assert len(calls) == len(seen) > 500 and not recording.batches


def test_a_few_new_pieces_are_encoded_without_a_batch_call(tiny_path):
    """A text bringing up to FEW_MISSING new pieces encodes them one by one on the calling thread (a batch call
    would wake the tokenizer's threads); more go in one batch; the ids are the tokenizer's either way."""
    renderer = ChatFormat.from_checkpoint(tiny_path, 1 << 20)
    encoder, tokenizer = renderer.tokens.words, renderer.tokens.tokenizer
    encoder.tokenizer = recording = BatchRecorder(tokenizer)
    words = ["".join(letters) for letters in itertools.product("qxzj", repeat=4)]  # distinct pieces " qxzj"...
    count = word_cache.FEW_MISSING
    many = " " + " ".join(words[: 3 * count])
    few = many + " " + " ".join(words[3 * count : 4 * count])
    for text, sizes in ((many, [3 * count]), (few, [])):
        recording.batches.clear()
        assert encoder.encode(text).tolist() == tokenizer.encode(text, add_special_tokens=False).ids
        assert [len(batch) for batch in recording.batches] == sizes


def test_short_segments_are_looked_up_whole(tiny_path):
    """A chat template's short segments between added tokens come from the short-segment cache once seen; the
    ids stay the tokenizer's; segments up to SPLIT_WHOLE characters are split whole, longer ones cut into
    chunks."""
    tokenizer = Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    encoder = WordEncoder(tokenizer)
    tail = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    long = "a question that is longer than a short segment can be, about " * 40
    for question in ("Is it so?", long, "Is it so?"):
        text = question + tail
        assert encoder.encode(text).tolist() == encoder.tokenizer.encode(text, add_special_tokens=False).ids
    assert set(encoder.short) == {"Is it so?", "\n", "assistant\n", "\n\n"}
    # once seen, a short segment is served whole from the short cache: ids marked there show in the result
    marks = {segment: np.int64(-1 - at).tobytes() for at, segment in enumerate(encoder.short)}
    encoder.short.update(marks)
    for question in ("Is it so?", long):
        text = question + tail
        expected = [token for segment in encoder.segments(text) for token in (
            np.frombuffer(marks[segment], np.int64).tolist() if segment in marks
            else tokenizer.encode(segment, add_special_tokens=False).ids)]
        assert encoder.encode(text).tolist() == expected
    assert set(encoder.short) == {"Is it so?", "\n", "assistant\n", "\n\n"}
    encoder.fill_chunks()
    assert len(long) > word_cache.SPLIT_WHOLE and set(word_cache.cut_at_spaces(long)[1:]) == set(encoder.chunks)


def test_new_chunks_are_cached_later_from_one_split(tiny_path, monkeypatch):
    """A long text most of whose chunks are new is split whole, and its chunks are cached by `fill_chunks` from
    that split (only the last UNFILLED_TEXTS texts wait); one with a few new chunks splits those alone, at once.
    Every cached chunk holds the tokenizer's ids of " " + it. (Here a text with any new line goes through the
    chunks whole.)"""
    monkeypatch.setattr(word_cache, "NEW_LINES_CHUNKED_WHOLE", 10**9)
    tokenizer = Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    encoder = WordEncoder(tokenizer)
    rng = random.Random(5)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7))) for _ in range(700)]
    text = "Start:  " + " ".join(w + rng.choice(["", ",", ".\n", "\n\n", "  x", "'s"]) for w in words) + " \t end "
    assert len(text) > word_cache.SPLIT_WHOLE
    assert encoder.encode(text).tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    assert len(encoder.unfilled) == 1 and not encoder.chunks  # split whole, its chunks waiting
    encoder.fill_chunks()
    assert set(word_cache.cut_at_spaces(text)[1:]) == set(encoder.chunks)
    for chunk, ids in encoder.chunks.items():
        real = " " + chunk.replace(word_cache.NUL, " ")
        assert np.frombuffer(ids, np.int64).tolist() == tokenizer.encode(real, add_special_tokens=False).ids, chunk
    again = text.replace("Start:", "Then:") + " one more"
    assert encoder.encode(again).tolist() == tokenizer.encode(again, add_special_tokens=False).ids
    # not split whole: its few new chunks were split alone and are cached at once
    assert not encoder.unfilled and set(word_cache.cut_at_spaces(again)[1:]) <= encoder.chunks.keys()
    for chunk in set(word_cache.cut_at_spaces(again)[1:]) - set(word_cache.cut_at_spaces(text)[1:]):
        real = " " + chunk.replace(word_cache.NUL, " ")
        assert np.frombuffer(encoder.chunks[chunk], np.int64).tolist() == tokenizer.encode(
            real, add_special_tokens=False).ids, chunk
    # texts split whole beyond the last UNFILLED_TEXTS are dropped, not kept for ever
    monkeypatch.setattr(word_cache, "UNFILLED_TEXTS", 2)
    encoder = WordEncoder(tokenizer)
    for i in range(5):
        encoder.encode(f"Text {i}: " + " ".join(rng.sample(words, 600)))
    assert len(encoder.unfilled) == 2


def test_lines_seen_before_come_from_the_line_cache(tiny_path):
    """A long text of many lines, first seen, goes through the chunks (its lines all new) and is split whole;
    `fill_chunks` caches its lines with their newlines. A text sharing most of those lines (another header, a
    line cut short, an extra tail) takes them from the line cache and encodes only the others, which it caches.
    Lines start after a newline followed by spaces or tabs and a character that is not white space."""
    tokenizer = Tokenizer.from_file(str(tiny_path / "tokenizer.json"))
    encoder = WordEncoder(tokenizer)
    rng = random.Random(11)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(1, 7))) for _ in range(300)]
    breaks = ["\n", "\n ", "\n\n", "\n\t", ".\n  ", " \n", "\n \n"]
    body = "".join(" ".join(rng.sample(words, 6)) + rng.choice(breaks) for _ in range(120))
    text = "Header one.\n" + body
    assert len(text) > word_cache.SPLIT_WHOLE
    assert encoder.encode(text).tolist() == tokenizer.encode(text, add_special_tokens=False).ids
    assert not encoder.lines
    encoder.fill_chunks()
    *lines, _ = word_cache.LINE_CUT.split(text)
    assert set(encoder.lines) == set(lines) and len(lines) > 60
    for line, ids in encoder.lines.items():
        assert np.frombuffer(ids, np.int64).tolist() == tokenizer.encode(line + "\n", add_special_tokens=False).ids
    # the lines seen before come from the line cache (ids marked there show in the result); only the new lines
    # and the last are encoded, the new lines cached
    cached = dict(encoder.lines)
    marks = {line: np.int64(-1 - at).tobytes() for at, line in enumerate(cached)}
    encoder.lines.update(marks)
    again = "Another header\n" + body[7:] + " tail words"
    *again_lines, again_last = word_cache.LINE_CUT.split(again)
    new_lines = [line for line in again_lines if line not in lines]
    expected = [token for line in again_lines for token in (
        np.frombuffer(marks[line], np.int64).tolist() if line in marks
        else tokenizer.encode(line + "\n", add_special_tokens=False).ids)]
    expected += tokenizer.encode(again_last, add_special_tokens=False).ids
    assert encoder.encode(again).tolist() == expected and 2 <= len(new_lines) <= 3
    assert set(new_lines) <= set(encoder.lines)
    encoder.lines.update(cached)
    assert encoder.encode(again).tolist() == tokenizer.encode(again, add_special_tokens=False).ids


def test_fill_chunks_leaves_a_misaligned_text_uncached(tiny_path, caplog):
    """Caching chunks is only a shortcut: a waiting text whose pieces do not fall at its chunks' ends (impossible
    for the regex split; forced here) is logged and skipped, and the texts after it are still cached."""
    encoder = WordEncoder(Tokenizer.from_file(str(tiny_path / "tokenizer.json")))
    encoder.unfilled.append(word_cache.SplitText("ab cd", ["ab cd"], [np.int64(7).tobytes()]))
    encoder.unfilled.append(word_cache.SplitText("ab cd", ["ab", " cd"],
                                                 [np.int64(1).tobytes(), np.int64(2).tobytes()]))
    encoder.fill_chunks()
    assert encoder.chunks == {"cd": np.int64(2).tobytes()} and not encoder.unfilled
    assert "crosses a clean space" in caplog.text
