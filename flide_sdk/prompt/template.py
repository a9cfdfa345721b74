"""Prompts written by a template, as transformers' `pipeline("decision")` writes them: a decision model's own
(`decision.json` / `decision_template.jinja`, JEV, vLLM deciders) and the generic prompt (`rendering="transformers"`).

The template renders the whole prompt of one question (it reads `question`) or of all of them (`questions`), in
the chat-template sandbox; `<|mark|>` marks where an answer is read (the token before it), `<|split|>` only breaks
the encoding, and both are dropped from the ids. Each question's prompt, cut after its read token, is what it is
asked alone; questions are grouped by the prefix their prompts share, each group one trunk with a branch per
question. A trunk's save point is found in the rendered text, not by matching the state's text: the state is
rendered once more with a private-use sentinel after its last text that appends leave as it is (the end of a
text, of the last message's content), and the save point is the last stable boundary before that sentinel, so
a growing state resumes however the template prints it (message lists item by item, the type before the state).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.meta
import numpy as np
from tokenizers import AddedToken, Tokenizer

from flide_sdk.errors import (
    CheckpointError,
    InvalidAssetError,
    InvalidQuestionError,
    InvalidStateError,
    StateTooLongError,
)
from flide_sdk.images import DecodedImage
from flide_sdk.models.decision import DecisionSpec
from flide_sdk.plan.images import TrunkImages
from flide_sdk.prompt.base import LETTERS, RenderedQuestion, TrunkQuestions, check_lengths, environment, render_bounded
from flide_sdk.prompt.chat import QUESTION_CACHE, Turn, content_key, split_turn
from flide_sdk.prompt.images import ImagePrompt, RequestImages
from flide_sdk.prompt.templates import builtin_template, generic_prompt
from flide_sdk.questions import Choice, Noul, Question, Score, State
from flide_sdk.text.history import StateLog, TokenBuffer, Trunk, chain_hashes, prompt_text
from flide_sdk.text.marked_encoding import END, START, MarkedEncoder, template_literals
from flide_sdk.text.tokens import TEXT_CACHE, Tokens, trim

MARK, SPLIT = "<|mark|>", "<|split|>"
SAVE = "\U000f0002"  # private use, after transformers' control-token markers: never in a rendered request
_SENTINEL_SPLIT = re.compile(f"({re.escape(MARK)}|{re.escape(SPLIT)})")
DEFAULT_LABELS = {"noul": ("Yes", "No"), "choice": LETTERS, "score": LETTERS}
TYPE_OF = {Noul: "noul", Choice: "choice", Score: "score"}
AFTER_STATE = 256  # characters searched past the state's end for a stable boundary to cut its rest at


@dataclass(frozen=True)
class TemplateQuestion:
    """A question as the template sees it (`as_dict`), and where its answer is read from: the token ids of
    its labels, or a head's rows, in the SDK's option order (`option_ids`)."""

    name: str
    kind: str
    instructions: Any
    options: list[str]
    labels: list[str]
    descriptions: list[Any]
    order: list[int]  # template option index of each of the SDK's options
    shown: dict[str, Any] | None = None  # `as_dict` as the template sees it (`TemplateFormat.question`)
    read_labels: tuple[str, ...] = ()  # the labels in the SDK's option order

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.kind, "instructions": self.instructions, "options": self.options,
                "labels": self.labels, "descriptions": self.descriptions}



@dataclass(frozen=True)
class Prompt:
    """One rendered prompt: the questions it asks, its ids (sentinels dropped) before its save point (`head`,
    one array for the prompts of an ask sharing it; empty: no save point) and after it (`tail`), each question's
    read position in the whole, and its text."""

    names: list[str]
    head: np.ndarray
    tail: np.ndarray
    reads: np.ndarray
    text: str


@dataclass(frozen=True)
class Encoded:
    """Token ids with the sentinels dropped, and how many come before each `<|mark|>`."""

    ids: np.ndarray
    marks: np.ndarray


@dataclass(frozen=True)
class Cut:
    """A save point (a stable boundary; 0: none) found in a render whose text began with `before`, up to the
    SAVE mark after the state: it serves every prompt that begins so too."""

    before: str
    save: int


NO_CUT = Cut("", 0)
NO_HEAD = Encoded(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class PromptGroup:
    """Questions sharing one trunk: its ids (`trunk`, saved at `boundary`) and each question's branch ids."""

    trunk: np.ndarray
    boundary: int
    branches: dict[str, np.ndarray]

    def as_trunk(self, images: TrunkImages | None = None) -> Trunk:
        buffer = TokenBuffer(max(256, len(self.trunk)))
        buffer.extend(self.trunk[: self.boundary])
        stable = buffer.view()
        tail = self.trunk[self.boundary:].copy()
        tail.flags.writeable = False
        marks = [] if images is None else images.marks(self.boundary)
        buffer.images = marks
        return Trunk(stable, tail, chain_hashes(stable, marks=marks), buffer, len(self.trunk), images)


def with_save_mark(state: Any) -> Any | None:
    """`state` with SAVE after its last text that later appends leave as it is: the end of a text, or of the
    last message's (or list item's) text content; None for other states."""
    if isinstance(state, str):
        return state + SAVE if state else None
    if not isinstance(state, list) or not state:
        return None
    last = state[-1]
    if isinstance(last, str):
        return [*state[:-1], last + SAVE]
    if isinstance(last, dict) and isinstance(last.get("content"), str):
        return [*state[:-1], {**last, "content": last["content"] + SAVE}]
    if isinstance(last, dict) and last.get("type") == "text" and isinstance(last.get("text"), str):
        return [*state[:-1], {**last, "text": last["text"] + SAVE}]
    return None


class TemplateFormat:
    """Renders (state, questions) with a decision spec into groups of trunk + branches and each question's
    read ids and temperature. `name`: "transformers" for the generic prompt of a plain model, else "decision".
    `images`: the checkpoint's image tokens (None: it reads no images); the generic prompt places a request's
    images where its text names them, as the pipeline's processor does."""

    def __init__(self, spec: DecisionSpec, tokens: Tokens, chat_template: str, special_tokens: Mapping[str, str],
                 name: str, images: ImagePrompt | None = None) -> None:
        self.spec, self.tokens, self.name, self.images = spec, tokens, name, images
        self.decision = None if name == "transformers" else spec.source
        # its own copy of the tokenizer: the sentinels are added to it
        self.tokenizer = Tokenizer.from_str(tokens.tokenizer.to_str())
        self.tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in (MARK, SPLIT)])
        self.sentinels = tuple(self.tokenizer.token_to_id(token) for token in (MARK, SPLIT))
        env = environment()
        source = spec.template or (spec.builtin_prefix + builtin_template(spec.builtin) if spec.builtin else chat_template)
        try:
            self.template = env.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateError as error:
            raise CheckpointError(f"{spec.source}: not a valid template ({error})") from error
        self.generic = spec.template is None and spec.builtin is None
        self.reads_all = not self.generic and "questions" in variables
        self.variables = variables
        self.encoder = MarkedEncoder(self.tokenizer, template_literals(env, source))
        self.special_tokens = dict(special_tokens)
        self._after: OrderedDict[str, np.ndarray] = OrderedDict()  # ids of what follows a state, by text
        self._read_ids: dict[tuple, np.ndarray] = {}
        self._views: OrderedDict[tuple, TemplateQuestion] = OrderedDict()  # by name and content (`content_key`)
        self._turn = self._split_turn()
        self._lock = threading.Lock()

    def new_state(self) -> StateLog:
        return StateLog()

    # ----------------------------------------------------------------------------------------- questions
    def view(self, name: str, question: Question) -> TemplateQuestion:
        """`question`'s template view, cached by name and content when all its content is plain text."""
        key = content_key(question)
        if key is None:
            return self.question(name, question)
        key = (name, key)
        with self._lock:
            found = self._views.get(key)
            if found is not None:
                self._views.move_to_end(key)
                return found
        found = self.question(name, question)
        with self._lock:
            self._views[key] = found
            trim(self._views, QUESTION_CACHE)
        return found

    def question(self, name: str, question: Question) -> TemplateQuestion:
        """The template's view of one question; InvalidQuestionError for what this model cannot read."""
        kind = TYPE_OF[type(question)]
        if isinstance(question, Choice) and question.scoring == "text":
            raise InvalidQuestionError(f"question {name!r}: scoring='text' is not served with {self.spec.source} "
                                       "(it reads labels or a head)")
        if kind == "noul":
            criteria = question.criteria or {}
            options = list(self.spec.noul_options)
            descriptions = [criteria.get(option) for option in options]
            order = [options.index("true"), options.index("false")]
        else:
            names, descriptions = question.option_names(), question.option_descriptions()
            options, order = list(names), list(range(len(names)))
        labels = self.spec.labels.get(kind) or DEFAULT_LABELS[kind]
        if len(labels) < len(options):
            raise InvalidQuestionError(f"question {name!r}: this model reads at most {len(labels)} options for a "
                                       f"{kind} question, got {len(options)}")
        view = TemplateQuestion(name, kind, question.instructions, options, list(labels[: len(options)]),
                                list(descriptions), order)
        # what the template sees: control tokens marked (sanitized), else sentinels dropped
        shown = self.encoder.mark(view.as_dict()) if self.spec.sanitize else strip_sentinels(view.as_dict())
        return dataclasses.replace(view, shown=shown, read_labels=tuple(view.labels[i] for i in view.order))

    def read_ids(self, question: TemplateQuestion) -> np.ndarray:
        """Where each of the SDK's options is read: a head's rows from the type's offset, or label token ids
        (cached: they depend on the question's type and option order alone)."""
        key = (question.kind, tuple(question.order))
        found = self._read_ids.get(key)
        if found is None:
            found = self._read_ids[key] = self._new_read_ids(question)
        return found

    def _new_read_ids(self, question: TemplateQuestion) -> np.ndarray:
        head = self.spec.head
        if head is not None:
            start = head.offsets.get(question.kind)
            if start is None or start + len(question.options) > head.rows:
                raise InvalidQuestionError(f"question {question.name!r}: this model's head has no rows for "
                                           f"{len(question.options)} {question.kind} options")
            ids = [start + index for index in question.order]
        else:
            ids = [self.tokens.label_id(question.labels[index]) for index in question.order]
            if len(set(ids)) != len(ids):
                raise InvalidQuestionError(f"question {question.name!r}: its labels {question.labels} are not "
                                           "distinct tokens")
        array = np.asarray(ids, dtype=np.int64)
        array.flags.writeable = False
        return array

    def temperature(self, kind: str) -> float:
        return float(self.spec.temperature.get(kind, 1.0))

    # ----------------------------------------------------------------------------------------- prompts
    def _render(self, state: Any, group: list[TemplateQuestion], shown: dict[str, dict[str, Any]]) -> str:
        """One prompt's text; `state` and `shown` (question dicts by name) as the template sees them (control
        tokens marked, or sentinels dropped)."""
        if self.generic:  # the generic prompt as the user turn of the chat template
            content = generic_prompt(state, shown[group[0].name])
            if self._turn is not None:
                return self._turn.head + content + self._turn.tail
            return self._render_turn(content)
        values = {"state": state, "question": shown[group[0].name], "questions": [shown[q.name] for q in group]}
        return self._render_turn("", **{name: value for name, value in values.items() if name in self.variables})

    def _render_turn(self, content: str, **values: Any) -> str:
        return render_bounded(self.template, self.spec.source, self.tokens.max_prompt_tokens,
                              messages=[{"role": "user", "content": content}], add_generation_prompt=True,
                              enable_thinking=False, tools=None, documents=None, **self.special_tokens, **values)

    def _split_turn(self) -> Turn | None:
        """The user turn around its content when the chat template prints the content as it is, so the generic
        prompt of each question is a concatenation; else None (each is rendered: a trimming template too)."""
        if not self.generic:
            return None
        try:
            return split_turn(self._render_turn)
        except (CheckpointError, InvalidQuestionError, StateTooLongError):
            return None

    def _encode(self, text: str, cut: Cut, parts: dict[str, Encoded],
                images: RequestImages | None) -> tuple[Encoded, Encoded]:
        """The ids of `text` before its save point and after it, sentinels dropped. Each part is encoded in
        pieces cut at stable boundaries (the tokenization splits there whatever follows): the part before the
        save point and the state's end after it once for the texts of an ask sharing them (`parts`), and what
        follows the state once per text (a cache: the same questions give the same text there). Texts holding
        marked control tokens are encoded whole, with no save point. A request's images are spliced in where
        its text names them (`images`)."""
        if START in text or END in text:
            encoded = self.encoder.encode(text) if images is None else images.encode(text, self.encoder.encode)
            return NO_HEAD, self._drop_sentinels(encoded)
        if not cut.save:
            return NO_HEAD, self._drop_sentinels(self._piece(text, images))
        end = len(cut.before)
        middle = self._first_boundary(text, end, end + AFTER_STATE) or cut.save
        if images is not None:
            middle = max(images.outside(text, middle), cut.save)
        head, state_end, rest = text[: cut.save], text[cut.save : middle], text[middle:]
        for part in (head, state_end):
            if part not in parts:
                parts[part] = self._drop_sentinels(self._piece(part, images))
        if images is not None and images.holds(rest):  # not cached: its ids are this request's images'
            after = self._drop_sentinels(self._piece(rest, images))
        else:
            with self._lock:
                after = self._after.get(rest)
            if after is None:
                after = self._drop_sentinels(self._piece(rest))
                with self._lock:
                    self._after[rest] = after
                    trim(self._after, TEXT_CACHE)
        before = parts[state_end]
        return parts[head], Encoded(np.concatenate([before.ids, after.ids]),
                                    np.concatenate([before.marks, len(before.ids) + after.marks]))

    def _drop_sentinels(self, raw: np.ndarray) -> Encoded:
        keep = (raw != self.sentinels[0]) & (raw != self.sentinels[1])
        return Encoded(raw[keep], np.cumsum(keep)[raw == self.sentinels[0]])

    def _piece(self, text: str, images: RequestImages | None = None) -> np.ndarray:
        """The ids of `text`: the word encoder (sentinels split out first), else the tokenizer; the images of
        `images` where their placeholders are."""
        if images is not None and images.holds(text):
            return images.encode(text, self._piece)
        if not _SENTINEL_SPLIT.search(text):
            return self.tokens.encode_cut(text, 0)[0]
        parts = []
        for index, part in enumerate(_SENTINEL_SPLIT.split(text)):
            if index % 2:
                parts.append(np.asarray([self.sentinels[part == SPLIT]], dtype=np.int64))
            elif part:
                ids = self.tokens.words.encode(part)
                if ids is None:
                    return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int64)
                parts.append(ids)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _cut(self, marked: str, images: RequestImages | None) -> Cut | None:
        """The save point of a text rendered with a SAVE mark: the last stable boundary before the mark, or the
        start of a placeholder it falls in (None: none, or the mark first)."""
        at = marked.find(SAVE)
        if at < 1:
            return None
        before = marked[:at]
        save = self._boundary(before, 1)
        if save is not None and images is not None:
            save = images.outside(before, save) or None
        return None if save is None else Cut(before, save)

    def _boundary(self, text: str, low: int) -> int | None:
        """The last stable boundary of `text` from `low` on, not inside a sentinel (None: none)."""
        return self._clear(text, self.tokens.boundaries.last(text, low))

    def _first_boundary(self, text: str, low: int, high: int) -> int | None:
        """The first stable boundary of `text` in [low, high], not inside a sentinel (None: none)."""
        return self._clear(text, self.tokens.boundaries.first(text, low, high))

    @staticmethod
    def _clear(text: str, found: int | None) -> int | None:
        if found is None or any(token in text[max(0, found - len(token) + 1): found + len(token) - 1]
                                for token in (MARK, SPLIT)):
            return None
        return found

    def prompts(self, state: Any, questions: list[TemplateQuestion], images: RequestImages | None = None) -> list[Prompt]:
        """Each prompt (sentinels dropped), with its read positions and save point: one prompt per question, or
        one for all when the template reads `questions`. The save point is found in a render with the SAVE mark
        (of the first question of a group), and serves every prompt whose text starts as that render's did up
        to the mark: the text before it is then the true prompt's (a template that reads the state's text
        finds no save point)."""
        state_text = prompt_text(state)  # InvalidStateError, before a template meets a state no prompt can hold
        if images is not None:
            images.check(state_text)
        if not self.spec.sanitize and (MARK in state_text or SPLIT in state_text):
            state = strip_sentinels(state)  # the template escapes nothing: sentinels in the request are dropped
        shown_state = self.encoder.mark(state) if self.spec.sanitize else state
        shown = {q.name: q.shown for q in questions}
        saved_state = with_save_mark(shown_state)
        groups = [questions] if self.reads_all else [[q] for q in questions]
        texts, cuts, found = [], [], []
        for group in groups:
            text = self._render(shown_state, group, shown)
            cut = next((c for c in found if text.startswith(c.before)), None)
            if cut is None and saved_state is not None and SAVE not in text:
                cut = self._cut(self._render(saved_state, group[:1], shown), images)
                if cut is not None and text.startswith(cut.before):
                    found.append(cut)
                else:
                    cut = None
            texts.append(text)
            cuts.append(cut or NO_CUT)
        parts: dict[str, Encoded] = {}
        out = []
        for group, text, cut in zip(groups, texts, cuts):
            head, tail = self._encode(text, cut, parts, images)
            marks = np.concatenate([head.marks, len(head.ids) + tail.marks])
            if len(marks) == 0 and len(group) == 1:
                marks = np.asarray([len(head.ids) + len(tail.ids)])
            if len(marks) != len(group):
                where = " (the request's own <|mark|>, printed unescaped)" if _holds(state, MARK) else ""
                error = InvalidStateError if where else InvalidQuestionError
                raise error(f"{self.spec.source}: renders {len(marks)} {MARK} for {len(group)} question(s){where}")
            if (marks < 1).any():
                raise InvalidQuestionError(f"{self.spec.source}: a {MARK} before any token reads nothing")
            if len(head.marks):  # a mark before the save point: no save point
                head, tail = NO_HEAD, Encoded(np.concatenate([head.ids, tail.ids]), marks)
            out.append(Prompt([q.name for q in group], head.ids, tail.ids, marks - 1, text))
        return out

    # ----------------------------------------------------------------------------------------- groups
    def parts(self, state: State, questions: Mapping[str, Question],
              assets: Mapping[str, DecodedImage] | None = None) -> list[TrunkQuestions]:
        """A request's trunks, each with its questions' branches, read ids, labels and temperatures (and the
        images of `assets` its trunk holds)."""
        if isinstance(state, Trunk):
            raise InvalidStateError(f"{self.spec.source} renders the state itself; pass the state, not a trunk")
        images = self.request_images(assets)
        views = {name: self.view(name, question) for name, question in questions.items()}
        groups, texts = self.groups(state, list(views.values()), images)
        out = []
        for group in groups:
            trunk_images = None
            if images is not None:
                order = images.order(texts[next(iter(group.branches))])
                pads = any((branch == images.pad_id).any() for branch in group.branches.values())
                trunk_images = images.trunk_images(group.trunk, order, pads)
            rendered = {}
            for name, branch in group.branches.items():
                view = views[name]
                branch.flags.writeable = False
                rendered[name] = RenderedQuestion(branch, self.read_ids(view), view.read_labels, texts[name],
                                                  temperature=self.temperature(view.kind), shared=self.reads_all)
            out.append(TrunkQuestions(group.as_trunk(trunk_images), rendered))
        check_lengths(self.tokens, out)
        return out

    def request_images(self, assets: Mapping[str, DecodedImage] | None) -> RequestImages | None:
        """A request's images as this format places them (None: none); InvalidAssetError when it cannot."""
        if not assets:
            return None
        if self.images is None:
            raise InvalidAssetError(next(iter(assets)), "this model reads no images (no vision tower and "
                                                        "preprocessor_config.json)")
        if not self.generic:
            raise InvalidAssetError(next(iter(assets)), f"{self.spec.source} prints the state itself; images are "
                                                        "placed by the generic prompt only")
        return self.images.request(assets)

    def groups(self, state: Any, questions: list[TemplateQuestion],
               images: RequestImages | None = None) -> tuple[list[PromptGroup], dict[str, str]]:
        """The questions' trunks and branches, and each question's whole prompt text. The one prompt of a template
        that reads `questions` is one trunk, up to the first read token, and one branch read at every mark."""
        prompts = self.prompts(state, questions, images)
        if self.reads_all:
            (prompt,) = prompts
            ids = np.concatenate([prompt.head, prompt.tail])
            first = int(prompt.reads.min())
            branches = {name: ids[first : read + 1] for name, read in zip(prompt.names, prompt.reads)}
            group = PromptGroup(ids[:first], min(len(prompt.head), first) or first, branches)
            return [group], dict.fromkeys(prompt.names, prompt.text)
        # per question: its head (shared) and its tail up to its read token; joined with a group of the same
        # head when the prefix shared is worth more than what the group's branches then recompute
        groups: list[tuple[np.ndarray, np.ndarray, list[str]]] = []
        sequences: dict[str, np.ndarray] = {}
        for prompt in prompts:
            (name,), (read,) = prompt.names, prompt.reads.tolist()
            sequence = sequences[name] = prompt.tail[: read - len(prompt.head) + 1]
            best, shared = None, 0
            for index, (head, prefix, _) in enumerate(groups):
                if head is prompt.head:
                    common = _common_prefix(prefix, sequence)
                    if best is None or common > shared:
                        best, shared = index, common
            if best is not None:
                head, prefix, names = groups[best]
                shared = min(shared, len(sequence) - 1)
                if len(head) + shared >= (len(prefix) - shared) * len(names):
                    groups[best] = (head, prefix[:shared], [*names, name])
                    continue
            groups.append((prompt.head, sequence[:-1], [name]))
        result = []
        for head, prefix, names in groups:
            trunk = np.concatenate([head, prefix])
            result.append(PromptGroup(trunk, len(head) or len(trunk),  # no save point found: the trunk's end
                                      {name: sequences[name][len(prefix):] for name in names}))
        return result, {prompt.names[0]: prompt.text for prompt in prompts}


def _holds(value: Any, text: str) -> bool:
    """Whether `text` occurs in a string (or key) of `value`."""
    if isinstance(value, str):
        return text in value
    if isinstance(value, dict):
        return any(_holds(key, text) or _holds(item, text) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(_holds(item, text) for item in value)
    return False


def strip_sentinels(value: Any) -> Any:
    """`value` with <|mark|> and <|split|> removed from its strings and keys."""
    if isinstance(value, str):
        return value.replace(MARK, "").replace(SPLIT, "")
    if isinstance(value, dict):
        return {strip_sentinels(key): strip_sentinels(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strip_sentinels(item) for item in value]
    return value


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n

