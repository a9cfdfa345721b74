"""The question block of transformers' generic decision prompt (`Engine.load(..., rendering="transformers")`).

transformers' `pipeline("decision")` asks a model without a decision template with `DECISION_PROMPT`: one user
turn of the state, a blank line, the instructions, one line per option and a reply instruction, the options'
labels (`Yes`/`No`, else `A`, `B`, ...) read as the first reply token. Its trunk is flide_sdk's own (template
head, state, blank line); this module writes the rest as that template does, so both read the same logits.
"""

from __future__ import annotations

import json
import string

from flide_sdk.errors import InvalidQuestionError
from flide_sdk.questions import Choice, Content, Noul, Question

NOUL_LABELS = ("Yes", "No")
LETTERS = tuple(string.ascii_uppercase)


def _text(value: Content | None) -> str:
    """A value as the template's `text` macro prints it: nothing for none, a string as is, else its JSON."""
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def labels(question: Question) -> tuple[str, ...]:
    """The single-token labels of the options: Yes/No for a Noul, else letters (at most 26 options)."""
    if isinstance(question, Choice) and question.scoring == "text":
        raise InvalidQuestionError("rendering='transformers' reads options by their labels; scoring='text' "
                                   "has no counterpart in transformers' decision prompt")
    if isinstance(question, Noul):
        return NOUL_LABELS
    count = len(question.option_names())
    if count > len(LETTERS):
        raise InvalidQuestionError(f"a {type(question).__name__} has {count} options; transformers' decision prompt "
                                   f"labels at most {len(LETTERS)}")
    return LETTERS[:count]


def question_text(question: Question) -> str:
    """The prompt after the state's blank line, up to the end of the user turn: as `DECISION_PROMPT` renders it."""
    marks = labels(question)
    lines = [_text(question.instructions)]
    for label, name, description in zip(marks, question.option_names(), question.option_descriptions()):
        answer = _text(description)
        if isinstance(question, Noul):
            lines.append(f"{label}: {answer}" if answer else "")
        elif isinstance(question, Choice):
            lines.append(f"{label}. {name}: {answer}" if answer else f"{label}. {name}")
        else:
            lines.append(f"{label}. {answer}")
    block = "\n".join(line for line in lines if line)
    if not block or block[0].isspace():
        # the state's blank line and this block must stay apart in tokens (the trunk ends before it)
        raise InvalidQuestionError("rendering='transformers' needs instructions or option text that starts with "
                                   "a non-space character")
    if isinstance(question, Noul):
        reply = f"Answer {marks[0]} or {marks[1]} only."
    else:
        option = "option" if isinstance(question, Choice) else "level"
        reply = f"Answer with the letter of the {option} that fits best ({marks[0]} to {marks[-1]}) only."
    return f"{block}\n{reply}"
