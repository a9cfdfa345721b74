"""Gemma 4 images through the engine, float32 on CPU: `engine.ask(..., assets=)` and sessions of screenshots answer
as transformers' `pipeline("decision")` on `Gemma4ForConditionalGeneration` with the same images (max |dp| <= 1e-4),
the generic prompt's ids are the pipeline's, and flide_sdk's own format equals the model on the processor's ids. The
checkpoint (tests/gemma_vision_checkpoint.py) has image tokens attending both ways on its sliding layers (a 16-token
window over images of up to 70 soft tokens) and per-layer inputs."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")

import flide_sdk as fl
from flide_sdk.engine import Engine
from flide_sdk.models.gemma4_vision import load_gemma_vision
from flide_sdk.models.ops import kernel_ops
from flide_sdk.questions import parse_questions
from tests.gemma_vision_checkpoint import gemma_vision_checkpoint, gemma_vision_processor
from tests.test_decision_pipeline import assert_as_pipeline, probabilities
from tests.test_images_engine import QUESTIONS, pipeline_prompts
from tests.test_vision import noise

from .conftest import TOLERANCE


@pytest.fixture(scope="module")
def path():
    return gemma_vision_checkpoint()


@pytest.fixture(scope="module")
def processor(path):
    return gemma_vision_processor(path)


@pytest.fixture(scope="module")
def decide(path, processor):
    """transformers' decision pipeline on the tiny Gemma 4 vision-language model and its processor: the reference."""
    model = transformers.Gemma4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    return transformers.pipeline("decision", model=model, tokenizer=processor.tokenizer, processor=processor,
                                 image_processor=processor.image_processor)


@pytest.fixture(scope="module")
def generic(path):
    with fl.Engine.load(path, device="cpu", dtype="float32", graphs=False, rendering="transformers") as engine:
        yield engine


@pytest.fixture(scope="module")
def own(path):
    with fl.Engine.load(path, device="cpu", dtype="float32", graphs=False) as engine:
        yield engine


STATES = {
    1: "The agent took a screenshot: <screen-0>. The dialog is open.",
    2: [{"role": "user", "content": "Before: <screen-0>"}, {"role": "assistant", "content": "clicked Save"},
        {"role": "user", "content": "After: <screen-1> and the log"}],
}


def screens(count: int, seed: int) -> dict:
    """`count` screenshots of different sizes (63 and 70 soft tokens) by placeholder."""
    return {f"<screen-{k}>": noise(50 + 30 * k, 70 - 20 * k, seed=seed + k) for k in range(count)}


@pytest.mark.parametrize("count", [1, 2])
def test_generic_prompt_ids_are_the_pipelines(generic, decide, count):
    # mutations: one image token per image (soft tokens not expanded); boi left out; the images spliced in
    # asset order
    assets = screens(count, seed=0)
    rendered = generic.render(STATES[count], QUESTIONS, assets=assets)
    want = pipeline_prompts(decide, STATES[count], QUESTIONS, assets)
    for name in QUESTIONS:
        assert np.array_equal(rendered.prompt_ids(name), want[name]), name


@pytest.mark.parametrize("count", [1, 2])
def test_asks_with_images_answer_as_the_pipeline(generic, decide, count):
    # mutations: soft tokens keep their (scaled) token embedding; the tower's rows scaled by sqrt(hidden); the
    # per-layer inputs looked up at the image token's id, not pad; soft tokens causal on sliding layers (no
    # see_hi); see_hi on the full layer too; each soft token seeing its whole image on the sliding layers but
    # past the window
    assets = screens(count, seed=10 * count)
    before = generic.stats()
    answers = generic.ask_sync(STATES[count], QUESTIONS, assets=assets)
    assert_as_pipeline(decide, STATES[count], QUESTIONS, answers, assets=assets)
    after = generic.stats()
    assert after["image_rounds"] - before["image_rounds"] == 1
    assert after["images_encoded"] - before["images_encoded"] == count


def test_kernel_ops_answer_as_the_pipeline(path, generic, decide):
    """The Triton kernels (interpreted) on an ask with an image: ForkAttention's tile tables and masked keys with
    the sliding layers' `see_hi`."""
    # mutations: see_hi set on the sliding plans after their tile tables are built (refused); a tile's masked
    # keys not extended to see_hi of its last row; a row's masked keys bounded by itself, not its see_hi
    vision = load_gemma_vision(path, generic.device, torch.float32)
    with Engine(generic.model, generic.prompt, generic.device, ops=kernel_ops(), vision=vision) as engine:
        assets = screens(1, seed=20)
        answers = engine.ask_sync(STATES[1], QUESTIONS, assets=assets)
        assert engine.stats()["image_rounds"] == 1
    assert_as_pipeline(decide, STATES[1], QUESTIONS, answers, assets=assets)


def test_mixed_rounds_answer_as_the_pipeline(generic, decide):
    # mutations: see_hi of a second trunk's soft tokens at its own request's stream rows (no cursor); the tower
    # run once per trunk (images_encoded 3); a text-only round after it kept on the image path
    assets = screens(2, seed=40)
    states = ["Left <screen-0> right <screen-1>", "Only text: the dialog closed.", "Again <screen-1> alone"]

    async def run():
        return await asyncio.gather(*(generic.ask(state, QUESTIONS, assets=assets) for state in states))

    before = generic.stats()
    answers = asyncio.run(run())
    after = generic.stats()
    for state, answer in zip(states, answers):
        assert_as_pipeline(decide, state, QUESTIONS, answer, assets=assets)
    assert after["rounds"] - before["rounds"] == 1
    assert after["images_encoded"] - before["images_encoded"] == 2
    text_only = generic.ask_sync(states[1], QUESTIONS)
    assert_as_pipeline(decide, states[1], QUESTIONS, text_only)
    assert generic.stats()["image_rounds"] == after["image_rounds"]


def test_a_session_of_screenshots_resumes_past_its_images(generic, decide):
    # mutations: the tower run again on a checkpointed image (images_encoded 2); the session's assets forgotten
    # between steps; digests left out of the history's hashes (a later step resumes inside an older image)
    session = generic.session()
    assets: dict = {}
    state = ""
    for step in range(3):
        name = f"<shot-{step}>"
        picture = noise(40 + 8 * step, 60, seed=100 + step)
        text = f"Step {step}: the agent clicked and saw {name} on the screen. "
        session.append(text, assets={name: picture})
        state += text
        assets[name] = picture
        before = generic.stats()
        answers = session.ask_sync(QUESTIONS)
        after = generic.stats()
        assert_as_pipeline(decide, state, QUESTIONS, answers, assets=assets)
        assert after["images_encoded"] - before["images_encoded"] == 1
        if step:
            assert after["checkpoint_hits"] > before["checkpoint_hits"]
            assert after["tokens_resumed"] > before["tokens_resumed"]


def own_expected(own, decide, processor, state: str, pictures: list, answers) -> None:
    """`answers` against the model on the processor's ids of own's prompt with each placeholder as an image."""
    shown = state
    for name in [f"<shot-{k}>" for k in range(len(pictures))]:
        shown = shown.replace(name, processor.image_token)
    for name, question in parse_questions(QUESTIONS).items():
        inputs = processor(text=[own.prompt.prompt_text(shown, question)], images=pictures, return_tensors="pt",
                           add_special_tokens=False)  # the text starts with its <bos>
        labels = own.render("x", {name: QUESTIONS[name]}).questions[name].label_ids
        with torch.no_grad():
            logits = decide.model(**inputs, use_cache=False).logits[0, -1]
        want = torch.softmax(logits[torch.tensor(labels)], -1).numpy()
        got = probabilities(answers[name])
        want = want[:1] if isinstance(answers[name], fl.NoulAnswer) else want
        assert np.abs(want - got).max() <= TOLERANCE, (name, want, got)


def test_own_format_asks_and_sessions_equal_transformers(own, decide, processor):
    # mutations: own format's image ids with the Qwen3.5 start token (no boi); a session's kept image spans at
    # the pads' merge of Qwen (wrong soft-token count); the resumed image's rows recomputed
    pictures = [noise(50, 70, seed=300), noise(60, 40, seed=301)]
    state = "Window <shot-0> over <shot-1>, then a log line"
    answers = own.ask_sync(state, QUESTIONS, assets={"<shot-0>": pictures[0], "<shot-1>": pictures[1]})
    own_expected(own, decide, processor, state, pictures, answers)
    session, state, pictures = own.session(), "", []
    for step in range(3):
        name = f"<shot-{step}>"
        pictures.append(noise(40 + 8 * step, 60, seed=310 + step))
        text = f"Step {step}: the agent saw {name} and clicked. "
        session.append(text, assets={name: pictures[-1]})
        state += text
        before = own.stats()
        answers = session.ask_sync(QUESTIONS)
        after = own.stats()
        own_expected(own, decide, processor, state, pictures, answers)
        assert after["images_encoded"] - before["images_encoded"] == 1
        if step:
            assert after["checkpoint_hits"] > before["checkpoint_hits"]
