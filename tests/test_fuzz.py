"""Fuzzing the public API (issue 61): seeded random asks (states of unicode, control tokens, lone surrogates, deep
JSON, huge numbers, NaN; questions with empty or odd names, bad types, many options, None, nested content), some
through sessions, against the embedded tiny model and two decision checkpoints (a repo's template, a JEV head),
and mutated decision files (decision.json, its template, judge_config.json, calibration.json,
decision_config.json) against `Engine.load`. Every exception must be a FlideError (a checkpoint's a
CheckpointError), no answer NaN, every response encodable as JSON, and the engine must answer a normal ask
afterwards.

Untyped errors raised in files another change owns are listed in ALLOWED / ALLOWED_CHECKPOINTS (where each is
raised, why, one input that raises it); the test fails on any other untyped error, and on an entry the fuzz no
longer meets, so the lists are emptied as those files are fixed. `-m slow` runs a larger sweep of seeds."""

from __future__ import annotations

import json
import math
import random
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

import flide_sdk as fl

from .test_decision_models import JUDGE, QUESTION_TEMPLATE, REPO_CONFIG, copy_tiny, head_tensors, jev_next_to_weights
from .test_temperatures import write_decider

ENGINES = ("tiny", "question", "jev")
ASKS = 100  # random asks per engine (300 in all), after the fixed EDGE_ASKS
CHECKPOINTS = 150  # mutated decision files
SLOW_SEEDS = range(1, 9)  # `-m slow`: eight more seeds of each
FLIDE = Path(fl.__file__).parent

CONTROL = ["<|im_end|>", "<|im_start|>system\n", "<|im_start|>assistant\n", "<|endoftext|>", "<|mark|>",
           "<|split|>", "<think>", "</think>", "<|im_start|>"]
ODD = ["naïve", "東京", "🙂", "\u200b", "\u202e", "e\u0301", "\x00", "\x1b[31m", "\r\n", "\t", "𝔘", "\ufeff",
       " ", "\n\n", "{{ state }}", "{% if %}", "'", '"', "\\", "%s", "{}"]
LONE = ["\udcff", "\ud800", "\udfff"]
WORDS = ["the", "build", "failed", "at", "step", "3", "refund", "order", "customer", "agent", "ran", "tests", "again"]
SCALARS: list[Any] = [0, -1, 10**30, 10**400, 10**5000, 1e308, -1e308, float("nan"), float("inf"), -0.0, True, False,
                      None, ""]


@dataclass(frozen=True)
class KnownFailure:
    """An untyped error the fuzz meets where another change owns the code: its type, the innermost flide_sdk
    function it comes from (`file` under flide_sdk/, `function`), the fuzzed engines or checkpoint kinds that meet
    it (`seen_on`), why, and one input that raises it."""

    exception: str
    file: str
    function: str
    seen_on: tuple[str, ...]
    why: str
    example: str


ALLOWED: list[KnownFailure] = [
]
"""Untyped errors in the prompt layer (text/, engine.py, session.py, models/decision.py) met by the asks:
emptied by its refactor (the test fails on an entry no engine meets any more)."""

ALLOWED_CHECKPOINTS: list[KnownFailure] = [
]
"""Untyped errors loading or asking a mutated decision checkpoint: emptied by the prompt layer's refactor."""


@dataclass(frozen=True)
class Failure:
    """An untyped error (or a NaN answer, or a response JSON cannot encode) met by the fuzz."""

    case: str
    exception: str
    file: str
    function: str
    line: str

    def matches(self, known: KnownFailure) -> bool:
        return (self.exception, self.file, self.function) == (known.exception, known.file, known.function)

    def __str__(self) -> str:
        return f"{self.exception} at flide_sdk/{self.file}:{self.function}: {self.line}  <- {self.case}"


@dataclass
class Findings:
    """What a fuzz run met: untyped errors, typed refusals counted by type, answers checked."""

    failures: list[Failure] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)
    answered: int = 0

    def record(self, case: str, error: BaseException, typed: type[BaseException] = fl.FlideError) -> None:
        if isinstance(error, typed):
            self.refused[type(error).__name__] = self.refused.get(type(error).__name__, 0) + 1
            return
        frames = [frame for frame in traceback.extract_tb(error.__traceback__)
                  if Path(frame.filename).resolve().is_relative_to(FLIDE)]
        frame = frames[-1] if frames else traceback.extract_tb(error.__traceback__)[-1]
        # a comprehension's frame is named for its function, as Python 3.12 inlines it
        function = next((outer.name for outer in reversed(frames) if outer.filename == frame.filename
                         and not outer.name.startswith("<")), frame.name)
        where = Path(frame.filename).resolve()
        file = str(where.relative_to(FLIDE)) if where.is_relative_to(FLIDE) else where.name
        self.failures.append(Failure(case[:300], type(error).__name__, file, function,
                                     f"line {frame.lineno}: {frame.line} ({str(error)[:160]!r})"))


def short(value: Any) -> str:
    """A bounded repr of a fuzzed input (deep data summarised)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # deep data; an int past str()'s digit limit
        text = f"<{type(value).__name__} too deep or too large to repr>"
    return text if len(text) < 240 else text[:200] + f"... ({len(text)} chars)"


# ---- generators -------------------------------------------------------------------------------------------------

def fuzz_text(rng: random.Random, parts: int = 8, lone: float = 0.05) -> str:
    """Words, control tokens, odd unicode and (with probability `lone` a piece) lone surrogates."""
    pieces = []
    for _ in range(rng.randint(0, parts)):
        roll = rng.random()
        pool = LONE if roll < lone else WORDS if roll < 0.55 else CONTROL if roll < 0.75 else ODD
        pieces.append(rng.choice(pool))
    return rng.choice(["", " ", "\n"]).join(pieces)


def valid_question(rng: random.Random) -> Any:
    """A question the engine must answer: odd but valid text (control tokens, unicode), JSON content."""
    kind = rng.choice(["noul", "choice", "score"])

    def text(parts: int) -> str:
        return fuzz_text(rng, parts, lone=0.0) or "x"

    instructions = rng.choice([text(6), {"task": text(3), "n": [1, 2.5, None]}, None])
    if kind == "noul":
        return {"type": "noul", "instructions": instructions,
                **({"criteria": {"true": text(3)}} if rng.random() < 0.3 else {})}
    if kind == "score":
        return {"type": "score", "instructions": instructions, "criteria": [text(3) for _ in range(rng.randint(1, 6))]}
    options = {f"{text(2)} {i}": rng.choice([None, text(3), {"why": text(2)}]) for i in range(rng.randint(1, 8))}
    return {"type": "choice", "instructions": instructions, "criteria": options}


def nested(depth: int, leaf: Any = "x") -> Any:
    value = leaf
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


def fuzz_json(rng: random.Random, depth: int = 3) -> Any:
    roll = rng.random()
    if roll < 0.08:
        return nested(rng.choice([3, 99, 100, 101, 150, 1_200, 20_000]), fuzz_text(rng, 2))
    if depth <= 0 or roll < 0.45:
        return rng.choice(SCALARS) if rng.random() < 0.4 else fuzz_text(rng, 4)
    if roll < 0.7:
        return [fuzz_json(rng, depth - 1) for _ in range(rng.randint(0, 4))]
    keys = [fuzz_text(rng, 2) for _ in range(rng.randint(0, 4))]
    return {key: fuzz_json(rng, depth - 1) for key in keys}


def not_json(rng: random.Random) -> Any:
    return rng.choice([{1, 2}, b"bytes", object(), {(1, 2): "tuple key"}, {1: "int key"}, complex(1, 2),
                       [b"\xff"], {"k": {"nested": {3, 4}}}])


def fuzz_state(rng: random.Random, hostile: bool = True) -> Any:
    if not hostile:  # text and JSON an agent may well hold: control tokens, unicode, huge numbers, NaN
        roll = rng.random()
        if roll < 0.5:
            return fuzz_text(rng, 40, lone=0.0)
        if roll < 0.75:
            return {"log": [fuzz_text(rng, 5, lone=0.0) for _ in range(3)], "n": rng.choice(SCALARS[:10]),
                    "deep": nested(rng.randint(1, 60))}
        return [{"role": rng.choice(["user", "tool"]), "content": fuzz_text(rng, 8, lone=0.0)} for _ in range(2)]
    roll = rng.random()
    if roll < 0.4:
        return fuzz_text(rng, 30)
    if roll < 0.6:
        return fuzz_json(rng)
    if roll < 0.75:
        return [{"role": rng.choice(["user", "tool", "assistant", "system", "", "<|im_end|>"]),
                 "content": fuzz_json(rng, 2)} for _ in range(rng.randint(0, 3))]
    if roll < 0.85:
        return nested(rng.choice([100, 101, 1_000, 50_000]))
    if roll < 0.93:
        return not_json(rng)
    return rng.choice([None, 5, 1.5, float("nan"), True, "x" * 3000, LONE[0] * 3])


def fuzz_content(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.5:
        return fuzz_text(rng, 6)
    if roll < 0.75:
        return fuzz_json(rng, 2)
    if roll < 0.85:
        return None
    return not_json(rng) if roll < 0.93 else rng.choice([3, 1.5, True, float("nan")])


def fuzz_name(rng: random.Random, index: int) -> Any:
    roll = rng.random()
    if roll < 0.75:
        return f"q{index}"
    return rng.choice(["", " ", "\x00", "<|im_end|>", LONE[0], "q" * 500, "naïve 東京", 3, None, ("t",), 1.5,
                       f"q{index}{LONE[1]}"])


def fuzz_options(rng: random.Random) -> Any:
    roll = rng.random()
    count = rng.choice([0, 1, 2, 3, 5, 26, 27, 40])
    if roll < 0.6:
        return {fuzz_text(rng, 2) or f"o{i}": fuzz_content(rng) if rng.random() < 0.4 else None for i in range(count)}
    if roll < 0.8:
        return [fuzz_content(rng) for _ in range(count)]
    return rng.choice([None, "abc", 5, [], {}, {"true": "yes", "false": None}, {1: None}])


def fuzz_question(rng: random.Random) -> Any:
    roll = rng.random()
    if roll < 0.1:
        return rng.choice([None, "Is it?", 5, ["noul"], {"type": "box"}, {"type": "NOUL"}, {"instructions": "?"}])
    kind = rng.choice(["noul", "choice", "score"])
    question: dict[str, Any] = {"type": kind}
    if rng.random() < 0.8:
        question["instructions"] = fuzz_content(rng)
    if kind == "noul":
        if rng.random() < 0.4:
            question["criteria"] = rng.choice([{"true": fuzz_content(rng)}, {"false": fuzz_content(rng), "true": None},
                                               {"maybe": "x"}, fuzz_options(rng)])
    elif rng.random() < 0.95:
        question["criteria"] = fuzz_options(rng)
    if kind == "choice" and rng.random() < 0.2:
        question["scoring"] = rng.choice(["text", "label", "bogus", None])
    if rng.random() < 0.05:
        question["extra"] = 1
    if roll < 0.3:  # the typed form, built in the ask's try: its construction is fuzzed too
        return Typed({"noul": fl.Noul, "choice": fl.Choice, "score": fl.Score}[kind],
                     {key: value for key, value in question.items() if key not in ("type", "extra")})
    return question


@dataclass(frozen=True)
class Typed:
    """A typed question (`fl.Noul(...)`, ...) to construct when the ask is made."""

    kind: type
    fields: dict[str, Any]

    def build(self) -> Any:
        return self.kind(**self.fields)

    def __repr__(self) -> str:
        return f"fl.{self.kind.__name__}(**{short(self.fields)})"


def fuzz_questions(rng: random.Random, hostile: bool) -> Any:
    if not hostile:
        return {f"q{i} {fuzz_text(rng, 2, lone=0.0)}": valid_question(rng) for i in range(rng.randint(1, 4))}
    if rng.random() < 0.05:
        return rng.choice([{}, None, [], "q", {"q": None}])
    return {fuzz_name(rng, i): fuzz_question(rng) if rng.random() < 0.5 else valid_question(rng)
            for i in range(rng.randint(1, 4))}


def built(questions: Any) -> Any:
    """Questions with typed ones constructed (a construction that raises raises here, in the ask's try)."""
    if not isinstance(questions, dict):
        return questions
    return {name: question.build() if isinstance(question, Typed) else question
            for name, question in questions.items()}


# ---- checks -----------------------------------------------------------------------------------------------------

def check_response(case: str, response: Any, findings: Findings) -> None:
    """Every number of every answer is finite, and the response encodes as JSON."""
    try:
        response.to_json()
    except Exception as error:  # noqa: BLE001 - the fuzz records every failure
        findings.record(case + " (to_json)", error)
    for name, answer in response.items():
        values = ([answer.noul] if isinstance(answer, fl.NoulAnswer) else
                  [*answer.probabilities.values(), answer.confidence] +
                  ([answer.score] if isinstance(answer, fl.ScoreAnswer) else []))
        if not all(math.isfinite(value) for value in values):
            findings.failures.append(Failure(case[:300], "NaN answer", "serve/executor.py", "_answers",
                                             f"{short(name)}: {answer!r}"))
    findings.answered += 1


@dataclass(frozen=True)
class AskCase:
    """One fuzzed ask: a state and questions, or items appended to a new session and then its questions."""

    state: Any
    questions: Any
    appended: list[Any] | None = None

    def __str__(self) -> str:
        if self.appended is not None:
            return f"session.append each of {short(self.appended)}, then ask {short(self.questions)}"
        return f"ask({short(self.state)}, {short(self.questions)})"


NOUL = {"q": {"type": "noul", "instructions": "Did the tool fail?"}}
EDGE_ASKS = [  # asked on every engine before the random ones
    AskCase(nested(1_200), NOUL), AskCase(nested(101), NOUL), AskCase(nested(50_000), NOUL),
    AskCase(None, [], [{"role": "tool", "content": nested(5_000)}]), AskCase(None, NOUL, ["ok", nested(3_000)]),
    AskCase(5, NOUL), AskCase(1e308, NOUL), AskCase(None, NOUL), AskCase(True, NOUL), AskCase(float("nan"), NOUL),
    AskCase(10**5000, NOUL), AskCase({(1, 2): "x"}, NOUL), AskCase("".join(CONTROL) * 3, NOUL),
    AskCase("x " * 30_000, NOUL), AskCase(LONE[0], NOUL), AskCase("s", {LONE[0]: NOUL["q"]}),
    AskCase("s", {"": NOUL["q"]}), AskCase("s", {3: NOUL["q"]}), AskCase("s", {"bare": {"type": "noul"}}),
    AskCase("s", {"q": {"type": "noul", "instructions": nested(5_000)}}),
    AskCase("s", {"q": {"type": "choice", "instructions": "?", "criteria": {f"o{i}": None for i in range(27)}}}),
    AskCase("s", {"q": {"type": "choice", "instructions": "?", "criteria": {f"o{i}": None for i in range(200)}}}),
    AskCase("s", {"q": {"type": "choice", "criteria": {"a b": None, "a": None}, "scoring": "text"}}),
    AskCase("s", {"q": {"type": "score", "instructions": {"k": {1, 2}}, "criteria": ["a"]}}),
]


def random_asks(seed: int, count: int) -> Iterator[AskCase]:
    rng = random.Random(seed)
    for _ in range(count):
        hostile = rng.random() < 0.6
        state, questions = fuzz_state(rng, hostile and rng.random() < 0.7), fuzz_questions(rng, hostile)
        appended = ([fuzz_state(rng, hostile and rng.random() < 0.5) for _ in range(rng.randint(1, 3))]
                    if rng.random() < 0.25 else None)
        yield AskCase(state, questions, appended)


def fuzz_asks(engine: fl.Engine, cases: Iterable[AskCase]) -> Findings:
    findings = Findings()
    for case in cases:
        try:
            if case.appended is None:
                response = engine.ask_sync(case.state, built(case.questions))
            else:
                session = engine.session()
                for item in case.appended:
                    try:
                        session.append(item)
                    except Exception as error:  # noqa: BLE001 - the fuzz records every failure
                        findings.record(f"session.append({short(item)})", error)
                response = session.ask_sync(built(case.questions))
        except Exception as error:  # noqa: BLE001
            findings.record(str(case), error)
            continue
        check_response(str(case), response, findings)
    return findings


def assert_only_allowed(findings: Findings, allowed: list[KnownFailure], strict: bool = True) -> None:
    """No failure outside `allowed`; `strict`: every entry of `allowed` met (an entry fixed is removed)."""
    unexpected = [failure for failure in findings.failures if not any(failure.matches(k) for k in allowed)]
    assert not unexpected, "untyped errors or NaN answers:\n" + "\n".join(map(str, unexpected[:20]))
    stale = [known for known in allowed if not any(failure.matches(known) for failure in findings.failures)]
    assert not strict or not stale, f"ALLOWED entries the fuzz no longer meets (remove them): {stale}"


def assert_still_answers(engine: fl.Engine) -> None:
    response = engine.ask_sync("The build failed at step 3.", {"failed": fl.Noul("Did the build fail?"),
                                                               "next": fl.Choice("Next?", {"retry": None, "fix": "x"})})
    assert 0.0 <= response["failed"].noul <= 1.0
    session = engine.session()
    session.append("The agent ran the tests.")
    assert set(session.ask_sync({"ok": fl.Noul("Did they pass?")})) == {"ok"}


# ---- engines and checkpoints -------------------------------------------------------------------------------------

def decision_checkpoint(tiny_path: Path, path: Path, kind: str) -> Path:
    """A decision checkpoint of `kind`: a repo's template ("question"), a JEV head next to the weights ("jev") or
    a vLLM-style decider ("decider"), as tests/test_decision_models.py builds them."""
    if kind == "jev":
        return jev_next_to_weights(tiny_path, path)
    copy_tiny(tiny_path, path)
    if kind == "question":
        (path / "decision_template.jinja").write_text(QUESTION_TEMPLATE)
        (path / "decision.json").write_text(json.dumps(REPO_CONFIG))
    else:
        hidden = json.loads((path / "config.json").read_text())["hidden_size"]
        write_decider(path, head_tensors(hidden, 6, bias=False)["proj.weight"], 1.5)
    return path


@pytest.fixture(scope="module", params=ENGINES)
def fuzzed_engine(request, tiny_path, tmp_path_factory) -> Iterator[tuple[str, fl.Engine]]:
    """(name, engine): the embedded tiny model, and decision checkpoints (a repo template; a JEV head)."""
    if request.param == "tiny":
        with fl.Engine.tiny() as engine:
            yield request.param, engine
        return
    path = decision_checkpoint(tiny_path, tmp_path_factory.mktemp("fuzz") / request.param, request.param)
    with fl.Engine.load(path, device="cpu", dtype="float32") as engine:
        yield request.param, engine


def test_fuzzed_asks_raise_only_typed_errors_and_never_answer_nan(fuzzed_engine):
    # mutations: parse_questions without its name check -> a surrogate name answered, to_json raises -> fails;
    # `_check_content` without check_nesting -> RecursionError in questions.py -> fails
    name, engine = fuzzed_engine
    findings = fuzz_asks(engine, [*EDGE_ASKS, *random_asks(seed=61, count=ASKS)])
    assert findings.answered > ASKS // 4 and sum(findings.refused.values()) > ASKS // 4  # both paths fuzzed
    assert_only_allowed(findings, [known for known in ALLOWED if name in known.seen_on])
    assert_still_answers(engine)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_a_larger_sweep_of_fuzzed_asks(fuzzed_engine, seed):
    name, engine = fuzzed_engine
    findings = fuzz_asks(engine, random_asks(seed, 4 * ASKS))
    assert_only_allowed(findings, [known for known in ALLOWED if name in known.seen_on], strict=False)
    assert_still_answers(engine)


DECISION_FILES = {"question": ["decision.json", "decision_template.jinja"],
                  "jev": ["judge_config.json", "calibration.json"], "decider": ["decision_config.json"]}
JUNK_FILES = ["", "{", "null", "[]", '"text"', "[" * 100_000 + "]" * 100_000, "{\"a\": NaN}", "\ud800"]
TEMPLATE_JUNK = ["{% for %}", "{{ 1 / 0 }}<|mark|>", "{{ state.missing.deeper }}<|mark|>", "no mark at all",
                 "{{ question.instructions|tojson }}<|mark|>", "<|mark|><|mark|>{{ question.name }}",
                 "{% for q in questions %}{{ q.name }}<|mark|>{% endfor %}{% for q in questions %}<|mark|>{% endfor %}",
                 "{{ raise_exception('no') }}", "{{ '<|im_end|>' * 100000 }}<|mark|>", "{{ state }}<|split|>"]


def mutant(rng: random.Random, value: Any, depth: int = 0) -> Any:
    """`value` with one random part changed (a key dropped, a value of another type, NaN, a negative, huge or
    unicode value, an unknown key added)."""
    if isinstance(value, dict) and value and rng.random() < 0.7 and depth < 4:
        key = rng.choice(list(value))
        out = dict(value)
        roll = rng.random()
        if roll < 0.15:
            del out[key]
        elif roll < 0.25:
            out[fuzz_text(rng, 2) or "unknown"] = fuzz_json(rng, 1)
        else:
            out[key] = mutant(rng, value[key], depth + 1)
        return out
    if isinstance(value, list) and value and rng.random() < 0.6 and depth < 4:
        out = list(value)
        index = rng.randrange(len(out))
        if rng.random() < 0.2:
            del out[index]
        else:
            out[index] = mutant(rng, out[index], depth + 1)
        return out
    return rng.choice([None, True, 0, -1, -0.5, 1e308, 10**30, float("nan"), float("inf"), float("-inf"), "",
                       "日本\udcff", "x" * 1000, [], {}, [1, 2, 3], {"a": 1}, ["yes", "yes"], ["hello world", "no"],
                       ["", "x"], "noul", [0, 30], [5, 2], 24, 1000, "A" * 5, fuzz_text(rng, 3), fuzz_json(rng, 2)])


@dataclass(frozen=True)
class Mutation:
    """A decision checkpoint of `kind` whose `files` are replaced (None: removed); `what` says how, in words."""

    kind: str
    files: dict[str, bytes | None]
    what: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.what}"


def json_bytes(value: Any) -> bytes:
    return json.dumps(value).encode()  # NaN and infinities as JSON's extension writes them, surrogates escaped


EDGE_MUTATIONS = [  # loaded before the random ones
    Mutation("decider", {"decision_config.json": json_bytes({"codes": list("AB"), "temperature": 1.5,
                                                             "prompt": [5, 2]})}, "prompt [5, 2]"),
    Mutation("decider", {"decision_config.json": json_bytes({"codes": ["A", "B\udcff"], "temperature": 1.5})},
             "a code with a lone surrogate"),
    Mutation("question", {"decision_template.jinja": b"{{ 1 / 0 }}<|mark|>"}, "a template that divides by zero"),
    Mutation("question", {"decision.json": json_bytes({"temperature": {"noul": float("nan")}})}, "temperature NaN"),
    Mutation("question", {"decision.json": b"[" * 100_000 + b"]" * 100_000}, "JSON nested past the decoder"),
    Mutation("question", {"decision.json": b"\xff\xfe{"}, "not UTF-8"),
    Mutation("jev", {"calibration.json": None}, "calibration.json removed"),
    Mutation("jev", {"judge_config.json": json_bytes({**JUDGE, "slots": {**JUDGE["slots"], "verbalizers": [
        f"v{i}" if i != 9 else "v\udcff" for i in range(24)]}})}, "a verbalizer with a lone surrogate"),
    Mutation("jev", {"judge_config.json": json_bytes({**JUDGE, "softcap": float("inf")})}, "softcap inf"),
]


def random_mutations(seed: int, count: int, bases: dict[str, Path]) -> Iterator[Mutation]:
    """Mutations of one or two of a random kind's decision files."""
    rng = random.Random(seed)
    for _ in range(count):
        kind = rng.choice(list(DECISION_FILES))
        files: dict[str, bytes | None] = {}
        done = []
        for _ in range(rng.choice([1, 1, 2])):
            name = rng.choice(DECISION_FILES[kind])
            roll = rng.random()
            if name.endswith(".jinja"):
                text = rng.choice(TEMPLATE_JUNK) if roll < 0.7 else QUESTION_TEMPLATE.replace("<|mark|>", "")
                files[name] = text.encode("utf-8", "surrogatepass")
                done.append(f"{name} = {short(text)}")
            elif roll < 0.1:
                files[name] = None
                done.append(f"{name} removed")
            elif roll < 0.25:
                junk = rng.choice(JUNK_FILES)
                files[name] = junk.encode("utf-8", "surrogatepass") if rng.random() < 0.8 else b"\xff\xfe\x00{"
                done.append(f"{name} = {short(junk)}")
            else:
                changed = mutant(rng, json.loads((bases[kind] / name).read_text()))
                try:
                    files[name] = json_bytes(changed)
                except (ValueError, RecursionError):  # an int past str()'s digit limit, data too deep to write
                    continue
                done.append(f"{name} = {short(changed)}")
        yield Mutation(kind, files, "; ".join(done))


def fuzz_checkpoints(tiny_path: Path, root: Path, mutations: Iterable[Mutation] | None = None, seed: int = 0,
                     count: int = 0) -> Findings:
    """Load each mutated checkpoint (EDGE_MUTATIONS, then `count` random ones of `seed`) and ask it once."""
    findings = Findings()
    bases = {kind: decision_checkpoint(tiny_path, root / f"base-{kind}", kind) for kind in DECISION_FILES}
    questions = {"n": fl.Noul("Is it?"), "c": fl.Choice("Which?", {"a": None, "b": "bee", "c": None}),
                 "s": fl.Score("How?", ["low", "mid", "high"])}
    cases = [*(mutations or ()), *random_mutations(seed, count, bases)]
    for number, mutation in enumerate(cases):
        path = root / f"m{number}"
        path.mkdir()
        for file in bases[mutation.kind].iterdir():  # the weights and tokenizer linked, the decision files copied
            if file.name not in mutation.files:
                (path / file.name).symlink_to(file)
        for name, content in mutation.files.items():
            if content is not None:
                (path / name).write_bytes(content)
        try:
            engine = fl.Engine.load(path, device="cpu", dtype="float32")
        except Exception as error:  # noqa: BLE001 - the fuzz records every failure
            findings.record(f"Engine.load of {mutation}", error, fl.CheckpointError)
            continue
        with engine:
            try:
                response = engine.ask_sync("The build failed at step 3.", questions)
            except Exception as error:  # noqa: BLE001
                findings.record(f"ask on {mutation}", error)
            else:
                check_response(f"ask on {mutation}", response, findings)
    return findings


def test_mutated_decision_files_load_or_raise_a_checkpoint_error(tiny_path, tmp_path):
    # mutation: `models.decision._temperature` accepting NaN -> a NaN answer -> fails
    findings = fuzz_checkpoints(tiny_path, tmp_path, EDGE_MUTATIONS, seed=61, count=CHECKPOINTS)
    assert findings.answered > 5 and findings.refused.get("CheckpointError", 0) > CHECKPOINTS // 3
    assert_only_allowed(findings, ALLOWED_CHECKPOINTS)


@pytest.mark.slow
@pytest.mark.parametrize("seed", SLOW_SEEDS)
def test_a_larger_sweep_of_mutated_decision_files(tiny_path, tmp_path, seed):
    findings = fuzz_checkpoints(tiny_path, tmp_path, seed=seed, count=2 * CHECKPOINTS)
    assert_only_allowed(findings, ALLOWED_CHECKPOINTS, strict=False)
