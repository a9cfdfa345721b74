"""Rendering of a state and its questions into token ids (DESIGN.md §4): prompt text, labels, trunk/branch split.

A question is one user turn of the model's own chat template (thinking off, generation prompt on) holding
the state (a string as is, anything else as `json.dumps(state, ensure_ascii=False)`), a blank line, then
`Question: <instructions>`, one line per option and a reply instruction. Each option's label is read as
one token, the first of the reply; a Choice scored by text (`scoring="text"`) lists its options as written and
reads each option's own tokens as the whole reply, up to the end of the turn. The trunk of a request is the template head + state + blank line; each
branch is the question text + template tail, so `trunk + branch` is exactly the tokenizer's ids of the
whole prompt. That holds because the split falls where the Qwen3.5 pre-tokenizer always splits (after a
newline, before a letter or digit, see `history`); `Renderer` refuses any other pre-tokenizer.

A state is tokenized on the lone request's critical path: `Renderer.encode_cut` first asks the single-
threaded `word_cache.WordEncoder` (a regex split and a piece -> ids cache, exact on the characters it
accepts), and only for other texts cuts the text into pieces the tokenizer encodes on its threads.
"""

from __future__ import annotations

import bisect
import itertools
import json
import os
import string
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
import numpy as np
from tokenizers import Tokenizer

from flide_sdk.errors import (
    CheckpointError,
    InvalidOptionError,
    InvalidQuestionError,
    StateTooLongError,
)
from flide_sdk.models.checkpoint import read_json
from flide_sdk.questions import Choice, Content, Noul, Question, Score
from flide_sdk.text import decision_prompt
from flide_sdk.text.cuts import BoundaryFinder
from flide_sdk.text.history import SEPARATOR, History, Trunk, prompt_text
from flide_sdk.text.pretokenizer import check_pretokenizer
from flide_sdk.text.word_cache import WordEncoder

LETTERS = tuple(string.ascii_uppercase)
# a text the word encoder declines is encoded in about one piece per CPU (the tokenizer's thread pool), in
# parallel, each piece 128 to 512 characters: a short text (a passage, a step's messages) still spreads over
# the threads, a long one is not cut into more pieces than the threads need (each piece costs host time of its own)
ENCODE_PIECES = os.cpu_count() or 1
ENCODE_PIECE_CHARS = (128, 512)
QUESTION_CACHE = 4096  # rendered questions (and branch texts) kept, least recently used dropped first
DIGITS = tuple(string.digits)
REPLY_CHOICE = "Answer with the letter of one option only."
REPLY_NOUL = "Answer with yes or no only."
REPLY_SCORE = "Answer with the number of one level only."
REPLY_LETTERED_SCORE = "Answer with the letter of one level only."  # scores past ten levels use letters
REPLY_TEXT = "Answer with one option exactly as written."
END_OF_TURN = "<|im_end|>"  # what closes a text-scored option's reply
MAX_REPLY_TOKENS = 1024  # tokens of a text-scored question's replies, summed over its options
_SENTINELS = ("\x00flide-content-a\x00", "\x00flide-content-b\x00")


@dataclass(frozen=True)
class RenderedQuestion:
    """One question's branch: its token ids (after the trunk), its label tokens and labels, its text; scored by
    text: no labels, and each option's reply (its tokens and the end of the turn) in `replies`."""

    ids: np.ndarray
    label_ids: np.ndarray
    labels: tuple[str, ...]
    text: str
    replies: tuple[np.ndarray, ...] = ()
    temperature: float = 1.0  # a decision model's, for this question's type: probabilities ~ p ** (1 / T)

    @property
    def options(self) -> int:
        return len(self.replies) or len(self.label_ids)


@dataclass(frozen=True)
class CacheSizes:
    """How full the renderer's caches are: rendered questions (by content) and branch ids (by text)."""

    questions: int
    branches: int


@dataclass(frozen=True)
class Rendered:
    """A request at token level: `state_ids` is the trunk; `trunk + questions[name].ids` is a whole prompt.
    A decision model's prompts may split a request into several trunks: `trunks` then names each question's."""

    state_ids: np.ndarray
    questions: dict[str, RenderedQuestion]
    trunks: dict[str, np.ndarray] = field(default_factory=dict)

    def prompt_ids(self, name: str) -> np.ndarray:
        """The standalone prompt of one question (up to its read token): its trunk + its branch."""
        return np.concatenate([self.trunks.get(name, self.state_ids), self.questions[name].ids])


def load_chat_template(path: Path) -> str:
    """The chat template of a checkpoint: chat_template.jinja, or `chat_template` in tokenizer_config.json."""
    return _chat_template(path)[0]


def _chat_template(path: Path) -> tuple[str, str]:
    """(the chat template of a checkpoint, where it was read from: the file, and the field if any)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), str(jinja_file)
        except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
            raise CheckpointError(f"{jinja_file}: unreadable ({error})") from error
    config_file = path / "tokenizer_config.json"
    template = None
    if config_file.is_file():
        config = read_json(config_file)
        if not isinstance(config, dict):
            raise CheckpointError(f"{config_file}: must hold a JSON object, got a {type(config).__name__}")
        template = config.get("chat_template")
    if isinstance(template, list):  # named templates
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if not isinstance(template, str):
        raise CheckpointError(f"{path}: no chat template (chat_template.jinja or tokenizer_config.json)")
    return template, f"{config_file} (chat_template)"


def split_user_turn(template_source: str) -> tuple[str, str]:
    """(head, tail) around the content of one user turn, thinking off, generation prompt on."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.globals["raise_exception"] = raise_exception

    def render(content: str) -> str:
        return template.render(
            messages=[{"role": "user", "content": content}], add_generation_prompt=True, enable_thinking=False
        )

    try:
        template = env.from_string(template_source)
        first, second = (render(s) for s in _SENTINELS)
    except Exception as error:  # the template is the checkpoint's code: whatever it raises, it does not render
        message = f"the chat template does not render a user turn ({type(error).__name__}: {error})"
        raise CheckpointError(message) from error
    if first.count(_SENTINELS[0]) != 1:
        raise CheckpointError("the chat template does not place the user content exactly once")
    head, tail = first.split(_SENTINELS[0])
    if second != head + _SENTINELS[1] + tail:
        raise CheckpointError("the chat template transforms the user content; cannot render states verbatim")
    return head, tail


def content_text(value: Content) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def scored_by_text(question: Question) -> bool:
    return isinstance(question, Choice) and question.scoring == "text"


def question_labels(question: Question) -> tuple[str, ...]:
    """Single-token labels of a question's options: yes/no, letters, or digits (letters past ten levels); none
    for a Choice scored by text."""
    count = len(question.option_names())
    if scored_by_text(question):
        return ()
    if isinstance(question, Noul):
        return ("yes", "no")
    alphabet = DIGITS if isinstance(question, Score) and count <= len(DIGITS) else LETTERS
    if count > len(alphabet):
        kind = type(question).__name__
        raise InvalidQuestionError(f"a {kind} has {count} options; at most {len(alphabet)} single-token labels exist")
    return alphabet[:count]


def question_text(question: Question) -> str:
    """The question block of a prompt: `Question: ...`, one line per option, the reply instruction."""
    lines = [] if question.instructions is None else [f"Question: {content_text(question.instructions)}"]
    if scored_by_text(question):
        for name, description in zip(question.option_names(), question.option_descriptions()):
            lines.append(f"- {name}" if description is None else f"- {name}: {content_text(description)}")
        lines.append(REPLY_TEXT)
        return "\n".join(lines)
    labels = question_labels(question)
    for label, name, description in zip(labels, question.option_names(), question.option_descriptions()):
        if isinstance(question, Choice):
            line = f"{label}: {name}" if description is None else f"{label}: {name} - {content_text(description)}"
        elif isinstance(question, Noul):
            line = label if description is None else f"{label}: {content_text(description)}"
        else:
            line = f"{label}: {content_text(description)}"
        lines.append(line)
    lines.append(_reply(question, labels))
    return "\n".join(lines)


def content_key(question: Question) -> tuple | None:
    """A hashable key that determines how `question` renders (type, instructions, options in order), when
    all its content is plain text; None when some of it is JSON data (rendered each time, never cached)."""
    instructions, criteria = question.instructions, question.criteria
    if instructions is not None and type(instructions) is not str:
        return None
    if criteria is None:
        options = None
    elif isinstance(question, Score):
        options = tuple(criteria)
        if not all(type(level) is str for level in options):
            return None
    else:
        options = tuple(criteria.items())
        if not all(type(name) is str and (value is None or type(value) is str) for name, value in options):
            return None
    return type(question), getattr(question, "scoring", "label"), instructions, options


def _trim(cache: OrderedDict) -> None:
    """Drop the least recently used entries past QUESTION_CACHE."""
    while len(cache) > QUESTION_CACHE:
        cache.popitem(last=False)


def _reply(question: Question, labels: tuple[str, ...]) -> str:
    if isinstance(question, Choice):
        return REPLY_CHOICE
    if isinstance(question, Noul):
        return REPLY_NOUL
    return REPLY_SCORE if labels[0] == DIGITS[0] else REPLY_LETTERED_SCORE


@dataclass(frozen=True)
class PromptFormat:
    """How a question is written after the state's blank line (up to the end of the user turn), and the labels
    its options are read by."""

    text: Callable[[Question], str]
    labels: Callable[[Question], tuple[str, ...]]


# Engine.load's `rendering`: flide_sdk's own prompt, or transformers' generic decision prompt (`decision_prompt`)
RENDERINGS = {"flide": PromptFormat(question_text, question_labels),
              "transformers": PromptFormat(decision_prompt.question_text, decision_prompt.labels)}


class Renderer:
    """Turns (state, questions) into token ids with the checkpoint's tokenizer and chat template, questions
    written in the format named by `rendering` (`RENDERINGS`)."""

    def __init__(self, tokenizer: Tokenizer, template_source: str, max_prompt_tokens: int,
                 rendering: str = "flide") -> None:
        if rendering not in RENDERINGS:
            raise InvalidOptionError(f"rendering must be one of {', '.join(map(repr, RENDERINGS))}, got {rendering!r}")
        self.rendering, self.format = rendering, RENDERINGS[rendering]
        check_pretokenizer(tokenizer)
        self.tokenizer = tokenizer
        self.head, self.tail = split_user_turn(template_source)
        self.max_prompt_tokens = max_prompt_tokens
        added = [token.content for token in tokenizer.get_added_tokens_decoder().values()]
        self.boundaries = BoundaryFinder(added, tokenizer)  # the tokenizer for token-level cuts of long tails
        self.words = WordEncoder(tokenizer)  # the fast path of `encode_cut` (`words.enabled`: whether it runs)
        # least recently used first: rendered questions by `content_key`, branch ids by branch text
        self._questions: OrderedDict[tuple, RenderedQuestion] = OrderedDict()
        self._branches: OrderedDict[str, np.ndarray] = OrderedDict()
        self._cache_lock = threading.Lock()
        self._label_ids: dict[str, int] = {}

    @classmethod
    def from_checkpoint(cls, path: str | Path, max_prompt_tokens: int, vocab_size: int | None = None,
                        rendering: str = "flide") -> Renderer:
        """The renderer of a checkpoint directory: its tokenizer.json and chat template. CheckpointError, naming
        the file, for a tokenizer that does not load or is not Qwen3.5's, one with token ids from `vocab_size`
        on (the model's embedding rows), or a chat template that does not render."""
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{path}: no tokenizer.json")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # tokenizers raises a bare Exception for a file it cannot read
            raise CheckpointError(f"{tokenizer_file}: not a readable tokenizer ({error})") from error
        try:
            check_pretokenizer(tokenizer)
        except CheckpointError as error:
            raise CheckpointError(f"{tokenizer_file}: {error}") from error
        if vocab_size is not None:
            largest = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
            if largest >= vocab_size:
                raise CheckpointError(f"{tokenizer_file}: token id {largest} is past the model's vocab_size "
                                      f"{vocab_size} (config.json); every id of the tokenizer needs an embedding row")
        template, source = _chat_template(path)
        try:
            return cls(tokenizer, template, max_prompt_tokens, rendering)
        except CheckpointError as error:  # the tokenizer passed its checks above: this is the template's
            raise CheckpointError(f"{source}: {error}") from error

    def encode(self, text: str) -> np.ndarray:
        """The tokenizer's own ids of `text` (int64, no special tokens, no fast path): the reference every other
        encoding here equals."""
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def encode_cut(self, text: str, cut: int) -> tuple[np.ndarray, int]:
        """Token ids of `text`, and how many of them encode `text[:cut]` (`cut`: 0, or a stable boundary of
        `text`). The text is cut there (same tokens: no regex piece, so no BPE merge, crosses a stable boundary)
        and both parts go to the word encoder. When it declines either (a character it does not vouch for),
        the text is cut there and, when long, at more stable boundaries, into pieces that the tokenizer encodes
        in parallel, without offsets."""
        if cut:
            first = self.words.encode(text[:cut])
            second = None if first is None else self.words.encode(text[cut:])
            if second is not None:
                return np.concatenate([first, second]), len(first)
        else:
            ids = self.words.encode(text)
            if ids is not None:
                return ids, 0
        shortest, longest = ENCODE_PIECE_CHARS
        every = min(longest, max(shortest, len(text) // ENCODE_PIECES))
        cuts = self.boundaries.cuts(text, every) if len(text) >= 2 * every else []
        if cut and cut not in cuts:
            bisect.insort(cuts, cut)
        bounds = [0, *cuts, len(text)]
        pieces = [text[a:b] for a, b in itertools.pairwise(bounds)]
        encodings = self.tokenizer.encode_batch_fast(pieces, add_special_tokens=False)
        ids = np.concatenate([np.asarray(e.ids, dtype=np.int64) for e in encodings])
        before = sum(len(e) for e, end in zip(encodings, bounds[1:]) if end <= cut)
        return ids, before

    def label_id(self, label: str) -> int:
        if label not in self._label_ids:
            ids = self.encode(label)
            if len(ids) != 1:
                raise InvalidQuestionError(f"label {label!r} is {len(ids)} tokens in this tokenizer, not one")
            self._label_ids[label] = int(ids[0])
        return self._label_ids[label]

    def new_history(self) -> History:
        """An empty, growing history (a session's state)."""
        return History(self.head, self.encode_cut, self.boundaries)

    def trunk(self, state: Any) -> Trunk:
        """The trunk of a one-off ask about `state`, with its stable boundary."""
        return History.of_state(self.head, prompt_text(state), self.encode_cut, self.boundaries).snapshot()

    def trunk_text(self, state: Any) -> str:
        return self.head + prompt_text(state) + SEPARATOR

    def prompt_text(self, state: Any, question: Question) -> str:
        """The whole standalone prompt of one question, as text."""
        return self.trunk_text(state) + self.format.text(question) + self.tail

    def render_questions(self, questions: Mapping[str, Question]) -> dict[str, RenderedQuestion]:
        """Each question's branch. A question of plain-text content is rendered once, then served from a cache
        by content (`content_key`); the branch texts of the rest are tokenized in one batch (a cache by text
        serves repeated ones). Cached arrays are read-only."""
        keys = {name: content_key(question) for name, question in questions.items()}
        rendered: dict[str, RenderedQuestion] = {}
        with self._cache_lock:
            for name, key in keys.items():
                hit = None if key is None else self._questions.get(key)
                if hit is not None:
                    self._questions.move_to_end(key)
                    rendered[name] = hit
        missing = [name for name in questions if name not in rendered]
        if not missing:
            return rendered
        parts = {}
        for name in missing:  # validation errors raise in question order
            text, labels = self.format.text(questions[name]), self.format.labels(questions[name])
            label_ids = np.array([self.label_id(label) for label in labels], dtype=np.int64)
            label_ids.flags.writeable = False  # shared through the cache
            replies = self.replies(name, questions[name]) if scored_by_text(questions[name]) else ()
            parts[name] = text, labels, label_ids, replies
        branch_ids = self._branch_ids([parts[name][0] + self.tail for name in missing])
        with self._cache_lock:
            for name, ids in zip(missing, branch_ids):
                text, labels, label_ids, replies = parts[name]
                rendered[name] = RenderedQuestion(ids, label_ids, labels, text, replies)
                if keys[name] is not None:
                    self._questions[keys[name]] = rendered[name]
            _trim(self._questions)
        return {name: rendered[name] for name in questions}

    def replies(self, name: str, question: Choice) -> tuple[np.ndarray, ...]:
        """Each option's reply (read-only): the tokenizer's ids of its name, then the end of the turn; at most
        MAX_REPLY_TOKENS over all options."""
        end = self.tokenizer.token_to_id(END_OF_TURN)
        if end is None:
            raise InvalidQuestionError(f"question {name!r}: scoring='text' needs the tokenizer's {END_OF_TURN} token")
        replies = []
        for option in question.option_names():
            reply = np.append(self.encode(option), end)
            reply.flags.writeable = False
            replies.append(reply)
        total = sum(len(reply) for reply in replies)
        if total > MAX_REPLY_TOKENS:
            raise InvalidQuestionError(f"question {name!r}: its options' replies are {total} tokens together; "
                                       f"scoring='text' reads at most {MAX_REPLY_TOKENS} per question")
        return tuple(replies)

    def _branch_ids(self, texts: list[str]) -> list[np.ndarray]:
        """Token ids of branch texts (read-only, shared): from the cache by text, the rest from the word encoder
        (a batch call of the tokenizer wakes its worker threads, too costly for a few short texts) or, for the
        texts it declines, in one batch."""
        with self._cache_lock:
            found = {text: self._branches[text] for text in texts if text in self._branches}
            for text in found:
                self._branches.move_to_end(text)
        new = list(dict.fromkeys(text for text in texts if text not in found))
        if new:
            for text in new:
                ids = self.words.encode(text)
                if ids is not None:
                    ids.flags.writeable = False
                    found[text] = ids
            declined = [text for text in new if text not in found]
            for text, encoding in zip(declined, self.tokenizer.encode_batch_fast(declined, add_special_tokens=False)):
                ids = np.asarray(encoding.ids, dtype=np.int64)
                ids.flags.writeable = False
                found[text] = ids
            with self._cache_lock:
                self._branches.update((text, found[text]) for text in new)
                _trim(self._branches)
        return [found[text] for text in texts]

    def cache_sizes(self) -> CacheSizes:
        """How many rendered questions and branch texts the caches hold now (each at most QUESTION_CACHE)."""
        with self._cache_lock:
            return CacheSizes(len(self._questions), len(self._branches))

    def check_length(self, trunk_tokens: int, questions: Mapping[str, RenderedQuestion]) -> None:
        """StateTooLongError when a question's whole prompt (its longest reply included) passes max_prompt_tokens."""
        longest = trunk_tokens + max(len(q.ids) + max((len(r) for r in q.replies), default=0)
                                     for q in questions.values())
        if longest > self.max_prompt_tokens:
            raise StateTooLongError(longest, self.max_prompt_tokens)

    def render(self, state: Any, questions: Mapping[str, Question]) -> Rendered:
        trunk = self.trunk(state)
        rendered = self.render_questions(questions)
        self.check_length(len(trunk), rendered)
        return Rendered(trunk.tokens(), rendered)
