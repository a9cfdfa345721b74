"""flide_sdk's own prompt (DESIGN.md §4): each question one user turn of the model's chat template.

The turn holds the state (a string as is, anything else as its JSON), a blank line, `Question: <instructions>`,
one line per option and a reply instruction. Each option's label is read as one token, the first of the reply; a
Choice scored by text (`scoring="text"`) lists its options as written and reads each option's own tokens as the
whole reply, up to the end of the turn (the added token that closes the user turn). The trunk of a request is
the template head + state + blank line; each branch is the question text + template tail, so `trunk + branch` is
exactly the tokenizer's ids of the whole prompt: the split falls where the tokenizer always splits (checked for
every character a question text starts with). A template that trims the user content (Gemma 4's) gets the
content trimmed: the state without its leading white space, and no blank line after an empty state. Sessions
grow the trunk incrementally (`text.history.History`).
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flide_sdk.errors import CheckpointError, InvalidAssetError, InvalidQuestionError
from flide_sdk.images import DecodedImage
from flide_sdk.models.checkpoint import read_json
from flide_sdk.prompt.base import LETTERS, RenderedQuestion, TrunkQuestions, check_lengths, environment
from flide_sdk.prompt.images import ImagePrompt, RequestImages
from flide_sdk.questions import Choice, Noul, Question, Score, State
from flide_sdk.text.history import SEPARATOR, History, TokenBuffer, Trunk, chain_hashes, prompt_text
from flide_sdk.text.tokens import Tokens, trim

DIGITS = tuple("0123456789")
REPLY_CHOICE = "Answer with the letter of one option only."
REPLY_NOUL = "Answer with yes or no only."
REPLY_SCORE = "Answer with the number of one level only."
REPLY_LETTERED_SCORE = "Answer with the letter of one level only."  # scores past ten levels use letters
REPLY_TEXT = "Answer with one option exactly as written."
MAX_REPLY_TOKENS = 1024  # tokens of a text-scored question's replies, summed over its options
QUESTION_CACHE = 4096  # rendered questions kept, least recently used dropped first
_SENTINELS = ("\x00flide-content-a\x00", " \n\x00flide-content-b\x00\n ")  # the second: whitespace kept
# the first character of every question text (`question_text`): its instructions, or its first option line
QUESTION_STARTS = "Q-y" + "".join(LETTERS) + "".join(DIGITS)


@dataclass(frozen=True)
class Turn:
    """A chat template's user turn: the text before its content and after it, and whether it trims the content
    (strips its white space at both ends, as Jinja's `trim`)."""

    head: str
    tail: str
    trims: bool = False


def load_chat_template(path: Path) -> str:
    """The chat template of a checkpoint: chat_template.jinja, or `chat_template` in tokenizer_config.json."""
    return chat_template(path)[0]


def chat_template(path: Path) -> tuple[str, str]:
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


def special_tokens_of(path: Path) -> dict[str, str]:
    """The named special tokens of tokenizer_config.json (`bos_token`, ...), which chat templates may print."""
    file = path / "tokenizer_config.json"
    if not file.is_file():
        return {}
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    out = {}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        value = raw.get(key) if isinstance(raw, dict) else None
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def split_user_turn(template_source: str, special_tokens: Mapping[str, str] | None = None) -> Turn:
    """The user turn of a chat template, thinking off, generation prompt on (the content placed as it is, or
    trimmed); `special_tokens` (`bos_token`, ...) as transformers passes them to the template."""

    def render(content: str) -> str:
        return template.render(
            messages=[{"role": "user", "content": content}], add_generation_prompt=True, enable_thinking=False,
            **(special_tokens or {}),
        )

    try:
        template = environment().from_string(template_source)
        return split_turn(render, trimmed=True)
    except CheckpointError:
        raise
    except Exception as error:  # the template is the checkpoint's code: whatever it raises, it does not render
        message = f"the chat template does not render a user turn ({type(error).__name__}: {error})"
        raise CheckpointError(message) from error


def split_turn(render: Callable[[str], str], trimmed: bool = False) -> Turn:
    """The user turn `render` writes around a content; CheckpointError when it does not place the content once
    and as it is (two contents checked), or, where `trimmed` is allowed, stripped of its white space."""
    first, second = (render(s) for s in _SENTINELS)
    if first.count(_SENTINELS[0]) != 1:
        raise CheckpointError("the chat template does not place the user content exactly once")
    head, tail = first.split(_SENTINELS[0])
    if second == head + _SENTINELS[1] + tail:
        return Turn(head, tail)
    if trimmed and second == head + _SENTINELS[1].strip() + tail:
        return Turn(head, tail, trims=True)
    raise CheckpointError("the chat template transforms the user content; cannot render states verbatim")


def end_of_turn(tail: str, tokens: Tokens) -> int | None:
    """The id of the added token that closes the user turn (the tail's first text, Qwen's `<|im_end|>`, Gemma's
    `<turn|>`): what closes a reply; None when the tail does not start with one."""
    decoder = tokens.tokenizer.get_added_tokens_decoder()
    found = [t.content for t in decoder.values() if t.content and tail.startswith(t.content)]
    return tokens.tokenizer.token_to_id(max(found, key=len)) if found else None


def check_branch_start(turn: Turn, tokens: Tokens) -> None:
    """CheckpointError when the tokenizer may join the trunk's last character (the blank line's, or the head's
    under a trimming template) to a question text's first: trunk and branch are then not encoded apart."""
    for end in (SEPARATOR, turn.head) if turn.trims else (SEPARATOR,):
        for start in QUESTION_STARTS:
            text = end + start
            if not tokens.boundaries.splits(end[-1], start) or tokens.boundaries.inside_added(text, len(end)):
                raise CheckpointError(f"the tokenizer may merge {end[-1]!r} with {start!r} across the end of the "
                                      "state; cannot encode a question apart from its state")


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
    lines = [] if question.instructions is None else [f"Question: {prompt_text(question.instructions)}"]
    if scored_by_text(question):
        for name, description in zip(question.option_names(), question.option_descriptions()):
            lines.append(f"- {name}" if description is None else f"- {name}: {prompt_text(description)}")
        lines.append(REPLY_TEXT)
        return "\n".join(lines)
    labels = question_labels(question)
    for label, name, description in zip(labels, question.option_names(), question.option_descriptions()):
        if isinstance(question, Choice):
            line = f"{label}: {name}" if description is None else f"{label}: {name} - {prompt_text(description)}"
        elif isinstance(question, Noul):
            line = label if description is None else f"{label}: {prompt_text(description)}"
        else:
            line = f"{label}: {prompt_text(description)}"
        lines.append(line)
    lines.append(_reply(question, labels))
    return "\n".join(lines)


def _reply(question: Question, labels: tuple[str, ...]) -> str:
    if isinstance(question, Choice):
        return REPLY_CHOICE
    if isinstance(question, Noul):
        return REPLY_NOUL
    return REPLY_SCORE if labels[0] == DIGITS[0] else REPLY_LETTERED_SCORE


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


class ChatFormat:
    """flide_sdk's own prompt in a checkpoint's chat template; questions rendered once, then cached by content."""

    name = "flide"
    decision = None
    spec = None

    def __init__(self, tokens: Tokens, template_source: str, special_tokens: Mapping[str, str] | None = None,
                 images: ImagePrompt | None = None) -> None:
        self.tokens = tokens
        self.images = images  # the checkpoint's image tokens (None: it reads no images)
        turn = split_user_turn(template_source, special_tokens)
        check_branch_start(turn, tokens)
        self.head, self.tail, self.trims = turn.head, turn.tail, turn.trims
        self.end_of_turn = end_of_turn(self.tail, tokens)
        self._questions: OrderedDict[tuple, RenderedQuestion] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()

    @classmethod
    def from_checkpoint(cls, path: str | Path, max_prompt_tokens: int) -> ChatFormat:
        """flide_sdk's prompt in the tokenizer and chat template of a checkpoint directory."""
        return cls(Tokens.from_checkpoint(path, max_prompt_tokens), load_chat_template(Path(path)),
                   special_tokens_of(Path(path)))

    def new_state(self) -> History:
        history = self.tokens.history(self.head, self.trims)
        if self.images is not None:
            history.image_builder = self.images.trunk_images
        return history

    def trunk(self, state: Any) -> Trunk:
        """The trunk of a one-off ask about `state`, with its stable boundary."""
        return self.tokens.trunk(self.head, prompt_text(state), self.trims)

    def prompt_text(self, state: Any, question: Question) -> str:
        """The whole standalone prompt of one question, as text (as the chat template renders the turn)."""
        content = prompt_text(state) + SEPARATOR + question_text(question)
        return self.head + (content.strip() if self.trims else content) + self.tail

    def parts(self, state: State | Trunk, questions: Mapping[str, Question],
              assets: Mapping[str, DecodedImage] | None = None) -> list[TrunkQuestions]:
        rendered = self.render_questions(questions)
        if assets:
            if isinstance(state, Trunk):
                raise InvalidAssetError(next(iter(assets)), "a session's images are appended with its messages")
            trunk = self.image_trunk(prompt_text(state), self.request_images(assets))
        else:
            trunk = state if isinstance(state, Trunk) else self.trunk(state)
        parts = [TrunkQuestions(trunk, rendered)]
        check_lengths(self.tokens, parts)
        return parts

    def request_images(self, assets: Mapping[str, DecodedImage]) -> RequestImages:
        if self.images is None:
            raise InvalidAssetError(next(iter(assets)), "this model reads no images (no vision tower and "
                                                        "preprocessor_config.json)")
        return self.images.request(assets)

    def image_trunk(self, body: str, images: RequestImages) -> Trunk:
        """The trunk of a one-off state whose text names images: its text pieces encoded apart with the images'
        tokens between them, stable up to the last image's end (added tokens: the tokenizer splits there), the
        text after it as `trunk` cuts a state's."""
        images.check(body)
        if self.trims:
            body = body.lstrip()
        pieces = images.split(self.head + body)
        last = max((index for index, piece in enumerate(pieces) if isinstance(piece, int)), default=-1)
        if last < 0:
            return self.trunk(body)
        before = "".join(images.names[p] if isinstance(p, int) else p for p in pieces[: last + 1])
        after = "".join(pieces[last + 1 :])
        rest = self.tokens.trunk("", after)  # `after` then the blank line
        buffer = TokenBuffer(max(256, len(self.head) + len(body)))
        buffer.extend(images.encode(before, lambda text: self.tokens.encode_cut(text, 0)[0]))
        buffer.extend(rest.stable)
        stable = buffer.view()
        trunk_images = images.trunk_images(stable, images.order(before))
        buffer.images = [] if trunk_images is None else trunk_images.marks(len(stable))
        return Trunk(stable, rest.tail, chain_hashes(stable, marks=buffer.images), buffer,
                     len(stable) + len(rest.tail), trunk_images)

    def render_questions(self, questions: Mapping[str, Question]) -> dict[str, RenderedQuestion]:
        """Each question's branch. A question of plain-text content is rendered once, then served from a cache
        by content (`content_key`); the branch texts of the rest are encoded together. Cached arrays are
        read-only."""
        keys = {name: content_key(question) for name, question in questions.items()}
        rendered: dict[str, RenderedQuestion] = {}
        with self._lock:
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
            question = questions[name]
            labels = question_labels(question)
            label_ids = np.array([self.tokens.label_id(label) for label in labels], dtype=np.int64)
            label_ids.flags.writeable = False  # shared through the cache
            replies = self.replies(name, question) if scored_by_text(question) else ()
            parts[name] = question_text(question), labels, label_ids, replies
        branch_ids = self.tokens.encode_texts(parts[name][0] + self.tail for name in missing)
        with self._lock:
            for name, ids in zip(missing, branch_ids):
                text, labels, label_ids, replies = parts[name]
                rendered[name] = RenderedQuestion(ids, label_ids, labels, text, replies)
                if keys[name] is not None:
                    self._questions[keys[name]] = rendered[name]
            trim(self._questions, QUESTION_CACHE)
        return {name: rendered[name] for name in questions}

    def cached_questions(self) -> int:
        with self._lock:
            return len(self._questions)

    def replies(self, name: str, question: Choice) -> tuple[np.ndarray, ...]:
        """Each option's reply (read-only): the tokenizer's ids of its name, then the end of the turn; at most
        MAX_REPLY_TOKENS over all options."""
        end = self.end_of_turn
        if end is None:
            raise InvalidQuestionError(f"question {name!r}: scoring='text' needs a chat template whose user turn "
                                       "ends with an added token (what closes a reply)")
        replies = []
        for option in question.option_names():
            reply = np.append(self.tokens.encode(option), end)
            reply.flags.writeable = False
            replies.append(reply)
        total = sum(len(reply) for reply in replies)
        if total > MAX_REPLY_TOKENS:
            raise InvalidQuestionError(f"question {name!r}: its options' replies are {total} tokens together; "
                                       f"scoring='text' reads at most {MAX_REPLY_TOKENS} per question")
        return tuple(replies)

