"""Prompt formats: how questions about a state become trunks, branches and read rows (`base.PromptFormat`).

`load_format` picks one per checkpoint: a decision model's own prompt (its files, `models.decision`), else
`rendering=`: flide_sdk's own (`chat.ChatFormat`) or transformers' generic decision prompt (`template.TemplateFormat`
with the generic spec). Tokenizing lives apart, in `text.tokens.Tokens`, which every format is given.
"""

from __future__ import annotations

from pathlib import Path

from flide_sdk.errors import CheckpointError, InvalidOptionError
from flide_sdk.models.decision import DecisionSpec, read_decision
from flide_sdk.prompt.base import PromptFormat, Rendered, RenderedQuestion, TrunkQuestions
from flide_sdk.prompt.chat import ChatFormat, chat_template, special_tokens_of
from flide_sdk.prompt.images import ImagePrompt
from flide_sdk.prompt.template import TemplateFormat
from flide_sdk.text.tokens import Tokens

RENDERINGS = ("flide", "transformers")
GENERIC = DecisionSpec(None, "transformers' generic decision prompt (rendering='transformers')")


def load_format(path: Path, raw_config: dict, tokens: Tokens, rendering: str = "flide") -> PromptFormat:
    """The prompt format of the checkpoint at `path` (whose config.json holds `raw_config`). CheckpointError for
    decision files or a chat template that cannot be served; InvalidOptionError for an unknown `rendering`, or one
    asked of a decision model (its files give its prompt)."""
    if rendering not in RENDERINGS:
        raise InvalidOptionError(f"rendering must be one of {', '.join(map(repr, RENDERINGS))}, got {rendering!r}")
    spec = read_decision(path, raw_config)
    if spec is not None and rendering != "flide":
        raise InvalidOptionError(f"rendering={rendering!r} is for plain models; {spec.source} gives this "
                                 "decision model's own prompt")
    template, source = chat_template(path)
    images = ImagePrompt.of_checkpoint(path, raw_config)
    if spec is None and rendering == "flide":
        try:
            return ChatFormat(tokens, template, special_tokens_of(path), images)
        except CheckpointError as error:  # the tokenizer passed its checks: this is the template's
            raise CheckpointError(f"{source}: {error}") from error
    return TemplateFormat(spec or GENERIC, tokens, template, special_tokens_of(path),
                          "transformers" if spec is None else "decision", images)


__all__ = ["PromptFormat", "Rendered", "RenderedQuestion", "TrunkQuestions", "load_format"]
