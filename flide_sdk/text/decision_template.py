"""Rendering asks with a decision model's own prompt (`models.decision.DecisionSpec`) into trunks and branches.

The template renders the whole prompt of one question (it reads `question`) or of all of them (`questions`),
in the environment of transformers' chat templates; `<|mark|>` marks where an answer is read (the token before
it), `<|split|>` only breaks the encoding, and both are dropped from the ids. Each question's prompt, cut after
its read token, is what it is asked alone; questions are grouped by the prefix their prompts share, each group
one trunk (saved at the end of the state when the state is found in it) with a branch per question, so
questions whose prompts share little are separate trunks of one round.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.sandbox
import numpy as np
from tokenizers import AddedToken, Tokenizer

from flide_sdk.errors import CheckpointError, InvalidQuestionError
from flide_sdk.models.decision import DecisionSpec
from flide_sdk.questions import Choice, Noul, Question, Score
from flide_sdk.text.decision_prompts import generic_prompt
from flide_sdk.text.history import TokenBuffer, Trunk, chain_hashes, prompt_text
from flide_sdk.text.marked_encoding import END, START, MarkedEncoder, template_literals
from flide_sdk.text.render import RenderedQuestion, Renderer

MARK, SPLIT = "<|mark|>", "<|split|>"
_SENTINEL_SPLIT = re.compile(f"({re.escape(MARK)}|{re.escape(SPLIT)})")
DEFAULT_LABELS = {"noul": ("Yes", "No"), "choice": tuple(string.ascii_uppercase),
                  "score": tuple(string.ascii_uppercase)}
TYPE_OF = {Noul: "noul", Choice: "choice", Score: "score"}


def environment() -> jinja2.Environment:
    """A sandbox like transformers' for chat templates: trimmed blocks, loop controls, its `tojson` (no HTML
    escaping), `raise_exception` and `strftime_now`."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


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

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.kind, "instructions": self.instructions, "options": self.options,
                "labels": self.labels, "descriptions": self.descriptions}


@dataclass(frozen=True)
class Prompt:
    """One rendered prompt: the questions it asks, its ids (sentinels dropped), each question's read position,
    how many ids come before its save point (0: none found), and its text."""

    names: list[str]
    ids: np.ndarray
    reads: np.ndarray
    save: int
    text: str


@dataclass(frozen=True)
class PromptGroup:
    """Questions sharing one trunk: its ids (`trunk`, saved at `boundary`) and each question's branch ids."""

    trunk: np.ndarray
    boundary: int
    branches: dict[str, np.ndarray]

    def as_trunk(self) -> Trunk:
        buffer = TokenBuffer(max(256, len(self.trunk)))
        buffer.extend(self.trunk[: self.boundary])
        stable = buffer.view()
        tail = self.trunk[self.boundary:].copy()
        tail.flags.writeable = False
        return Trunk(stable, tail, chain_hashes(stable), buffer, len(self.trunk))


@dataclass(frozen=True)
class TrunkQuestions:
    """One trunk of a request and the branches of the questions it holds."""

    trunk: Trunk
    questions: dict[str, RenderedQuestion]


class DecisionTemplate:
    """Renders (state, questions) with a decision spec into groups of trunk + branches and each question's
    read ids and temperature."""

    def __init__(self, spec: DecisionSpec, renderer: Renderer, chat_template: str,
                 special_tokens: Mapping[str, str]) -> None:
        self.spec = spec
        self.words, self.boundaries = renderer.words, renderer.boundaries
        # its own copy of the tokenizer: the sentinels are added to it
        self.tokenizer = Tokenizer.from_str(renderer.tokenizer.to_str())
        self.tokenizer.add_tokens([AddedToken(token, special=True, normalized=False) for token in (MARK, SPLIT)])
        self.sentinels = tuple(self.tokenizer.token_to_id(token) for token in (MARK, SPLIT))
        env = environment()
        source = spec.template if spec.template is not None else chat_template
        try:
            self.template = env.from_string(source)
            variables = jinja2.meta.find_undeclared_variables(env.parse(source))
        except jinja2.exceptions.TemplateError as error:
            raise CheckpointError(f"{spec.source}: not a valid template ({error})") from error
        self.reads_all = spec.template is not None and "questions" in variables
        self.variables = variables
        self.encoder = MarkedEncoder(self.tokenizer, template_literals(env, source))
        self.special_tokens = dict(special_tokens)
        self._label_ids: dict[str, int] = {}

    # ----------------------------------------------------------------------------------------- questions
    def question(self, name: str, question: Question) -> TemplateQuestion:
        """The template's view of one question; InvalidQuestionError for what this model cannot read."""
        kind = TYPE_OF[type(question)]
        if isinstance(question, Choice) and question.scoring == "text":
            raise InvalidQuestionError(f"question {name!r}: scoring='text' is not served with a decision model's "
                                       "prompt (it reads labels or a head)")
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
        return TemplateQuestion(name, kind, question.instructions, options, list(labels[: len(options)]),
                                list(descriptions), order)

    def read_ids(self, question: TemplateQuestion) -> np.ndarray:
        """Where each of the SDK's options is read: a head's rows from the type's offset, or label token ids."""
        head = self.spec.head
        if head is not None:
            start = head.offsets.get(question.kind)
            if start is None or start + len(question.options) > head.rows:
                raise InvalidQuestionError(f"question {question.name!r}: this model's head has no rows for "
                                           f"{len(question.options)} {question.kind} options")
            ids = [start + index for index in question.order]
        else:
            ids = [self._label_id(question.labels[index]) for index in question.order]
            if len(set(ids)) != len(ids):
                raise InvalidQuestionError(f"question {question.name!r}: its labels {question.labels} are not "
                                           "distinct tokens")
        array = np.asarray(ids, dtype=np.int64)
        array.flags.writeable = False
        return array

    def temperature(self, kind: str) -> float:
        return float(self.spec.temperature.get(kind, 1.0))

    def _label_id(self, label: str) -> int:
        if label not in self._label_ids:
            ids = self.tokenizer.encode(label, add_special_tokens=False).ids
            if len(ids) != 1 or ids[0] in self.sentinels:
                raise InvalidQuestionError(f"label {label!r} is {len(ids)} tokens in this tokenizer, not one")
            self._label_ids[label] = ids[0]
        return self._label_ids[label]

    # ----------------------------------------------------------------------------------------- prompts
    def _render(self, state: Any, shown_state: Any, group: list[TemplateQuestion],
                shown: dict[str, dict[str, Any]]) -> str:
        """One prompt's text; `shown_state` and `shown` (question dicts by name) as the template sees them
        (control tokens marked, or sentinels dropped)."""
        if self.spec.template is None:  # the generic prompt as the user turn of the chat template
            content = generic_prompt(state, group[0].as_dict())
            values: dict[str, Any] = {}
        else:
            content = ""
            values = {"state": shown_state, "question": shown[group[0].name],
                      "questions": [shown[q.name] for q in group]}
            values = {name: value for name, value in values.items() if name in self.variables}
        if self.spec.sanitize:
            content = self.encoder.mark(content)
        try:
            return self.template.render(messages=[{"role": "user", "content": content}], add_generation_prompt=True,
                                        enable_thinking=False, tools=None, documents=None, **self.special_tokens,
                                        **values)
        except jinja2.exceptions.TemplateError as error:
            raise InvalidQuestionError(f"{self.spec.source}: does not render this request ({error})") from error

    def _encode(self, texts: list[str], state_text: str) -> list[tuple[np.ndarray, int]]:
        """Each text's ids (sentinels kept) and how many of them come before its save point: the last stable
        boundary inside the state, when the state is printed once, verbatim (0 otherwise). The text before
        that point is encoded once for the texts sharing it, and the rest apart: the tokenization splits there
        whatever follows. Texts holding marked control tokens are encoded whole."""
        if any(START in text or END in text for text in texts):
            return [(self.encoder.encode(text), 0) for text in texts]
        cuts = [self._state_cut(text, state_text) for text in texts]
        heads = {text[:cut]: None for text, cut in zip(texts, cuts)}
        rests = {text[cut:]: None for text, cut in zip(texts, cuts)}
        for parts in (heads, rests):
            for part in parts:
                parts[part] = self._fast(part)
            declined = [part for part, ids in parts.items() if ids is None]
            for part, encoding in zip(declined, self.tokenizer.encode_batch_fast(declined, add_special_tokens=False)):
                parts[part] = np.asarray(encoding.ids, dtype=np.int64)
        return [(np.concatenate([heads[text[:cut]], rests[text[cut:]]]), len(heads[text[:cut]]))
                for text, cut in zip(texts, cuts)]

    def _fast(self, text: str) -> np.ndarray | None:
        """The ids of `text` from the renderer's word encoder, the sentinels split out first (None: declined)."""
        parts = []
        for index, part in enumerate(_SENTINEL_SPLIT.split(text)):
            if index % 2:
                parts.append(np.asarray([self.sentinels[part == SPLIT]], dtype=np.int64))
            elif part:
                ids = self.words.encode(part)
                if ids is None:
                    return None
                parts.append(ids)
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _state_cut(self, text: str, state_text: str) -> int:
        if not state_text or text.count(state_text) != 1:
            return 0
        start = text.index(state_text)
        cut = self.boundaries.last(text[: start + len(state_text)], start + 1)
        if cut is None or any(token in text[max(0, cut - len(token) + 1): cut + len(token) - 1]
                              for token in (MARK, SPLIT)):
            return 0
        return cut

    def prompts(self, state: Any, questions: list[TemplateQuestion]) -> list[Prompt]:
        """Each prompt (sentinels dropped), with its read positions: one prompt per question, or one for all
        when the template reads `questions`."""
        if not self.spec.sanitize:  # the template escapes nothing: sentinels in the request are dropped
            state = strip_sentinels(state)
            questions = [dataclasses.replace(q, instructions=strip_sentinels(q.instructions),
                                             options=strip_sentinels(q.options),
                                             descriptions=strip_sentinels(q.descriptions)) for q in questions]
        shown_state, shown = state, {q.name: q.as_dict() for q in questions}
        if self.spec.sanitize and self.spec.template is not None:  # each value marked once, not once a prompt
            shown_state, shown = self.encoder.mark(state), self.encoder.mark(shown)
        state_text = prompt_text(state)  # InvalidStateError, before a template meets a state no prompt holds
        groups = [questions] if self.reads_all else [[q] for q in questions]
        texts = [self._render(state, shown_state, group, shown) for group in groups]
        out = []
        for group, text, (raw, saved) in zip(groups, texts, self._encode(texts, state_text)):
            keep = (raw != self.sentinels[0]) & (raw != self.sentinels[1])
            marks = np.cumsum(keep)[raw == self.sentinels[0]]
            ids = raw[keep]
            if len(marks) == 0 and len(group) == 1:
                marks = np.asarray([len(ids)])
            if len(marks) != len(group):
                raise InvalidQuestionError(f"{self.spec.source}: renders {len(marks)} {MARK} for "
                                           f"{len(group)} question(s)")
            if (marks < 1).any():
                raise InvalidQuestionError(f"{self.spec.source}: a {MARK} before any token reads nothing")
            out.append(Prompt([q.name for q in group], ids, marks - 1, int(keep[:saved].sum()), text))
        return out

    # ----------------------------------------------------------------------------------------- groups
    def render(self, state: Any, questions: Mapping[str, Question]) -> list[TrunkQuestions]:
        """A request's trunks, each with its questions' branches, read ids, labels and temperatures."""
        views = {name: self.question(name, question) for name, question in questions.items()}
        groups, texts = self.groups(state, list(views.values()))
        out = []
        for group in groups:
            rendered = {}
            for name, branch in group.branches.items():
                view = views[name]
                branch.flags.writeable = False
                rendered[name] = RenderedQuestion(branch, self.read_ids(view),
                                                  tuple(view.labels[i] for i in view.order), texts[name],
                                                  temperature=self.temperature(view.kind))
            out.append(TrunkQuestions(group.as_trunk(), rendered))
        return out

    def groups(self, state: Any, questions: list[TemplateQuestion]) -> tuple[list[PromptGroup], dict[str, str]]:
        """The questions' trunks and branches, and each question's whole prompt text."""
        sequences: dict[str, np.ndarray] = {}
        texts: dict[str, str] = {}
        saves: dict[str, int] = {}
        for prompt in self.prompts(state, questions):
            for name, read in zip(prompt.names, prompt.reads):
                sequences[name], texts[name], saves[name] = prompt.ids[: read + 1], prompt.text, prompt.save
        groups: list[tuple[np.ndarray, list[str]]] = []
        for name, sequence in sequences.items():
            best, shared = None, 0
            for index, (prefix, _) in enumerate(groups):
                common = _common_prefix(prefix, sequence)
                if common > shared:
                    best, shared = index, common
            if best is not None:
                prefix, names = groups[best]
                shared = min(shared, len(sequence) - 1)
                # join when the prefix shared is worth more than what the group's branches then recompute
                if shared >= (len(prefix) - shared) * len(names):
                    groups[best] = (prefix[:shared], [*names, name])
                    continue
            groups.append((sequence[:-1], [name]))
        result = []
        for prefix, names in groups:
            save = min(saves[name] for name in names) or len(prefix)  # no save point found: the trunk's end
            result.append(PromptGroup(prefix, min(save, len(prefix)),
                                      {name: sequences[name][len(prefix):] for name in names}))
        return result, texts


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
