"""Images in asks, end to end (issue 63, step 3): the prompt ids of `engine.render(..., assets=)` are the pipeline's
(image pads expanded) for the generic prompt and flide_sdk's own chat format; `engine.ask(..., assets=)` answers
as `pipeline("decision")` with the same assets (float32 CPU, max |dp| <= 1e-4), alone and beside text-only asks;
sessions resume past their images; bad assets are typed before anything is queued. The checkpoint is the tiny
vision-language one of tests/vision_checkpoint.py."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("PIL")
transformers = pytest.importorskip("transformers")

import flide_sdk as fl
from flide_sdk.errors import InvalidAssetError
from flide_sdk.prompt.base import as_rendered
from flide_sdk.questions import parse_questions
from tests.test_vision import noise
from tests.vision_checkpoint import tiny_vl_checkpoint, tiny_vl_processor

from .conftest import TOLERANCE
from .test_decision_pipeline import assert_as_pipeline, probabilities

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTIONS = {
    "red": {"type": "noul", "instructions": "Is the button red?"},
    "where": {"type": "choice", "instructions": "Where is the cursor?",
              "criteria": {"top": "upper half", "bottom": None, "gone": "not on screen"}},
    "busy": {"type": "score", "instructions": "How busy is the screen?", "criteria": ["empty", "some", "full"]},
}


@pytest.fixture(scope="module")
def vl_path():
    return tiny_vl_checkpoint()


@pytest.fixture(scope="module")
def processor(vl_path):
    return tiny_vl_processor(vl_path)


@pytest.fixture(scope="module")
def decide(vl_path, processor):
    """transformers' decision pipeline on the tiny VL model and its processor, float32: the reference."""
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(vl_path, dtype=torch.float32).eval()
    return transformers.pipeline("decision", model=model, tokenizer=processor.tokenizer, processor=processor,
                                 image_processor=processor.image_processor)


@pytest.fixture(scope="module")
def generic(vl_path):
    with fl.Engine.load(vl_path, device="cpu", dtype="float32", graphs=False, rendering="transformers") as engine:
        yield engine


@pytest.fixture(scope="module")
def own(vl_path):
    with fl.Engine.load(vl_path, device="cpu", dtype="float32", graphs=False) as engine:
        yield engine


def screens(count: int, seed: int = 0) -> dict:
    """`count` screenshots of different sizes by placeholder (one as an asset dict, one as a PNG file's path)."""
    out = {}
    for k in range(count):
        picture = noise(40 + 20 * k, 70 - 10 * k, seed=seed + k)
        if k == 1:
            buffer = io.BytesIO()
            picture.save(buffer, format="PNG")
            picture = {"type": "image", "format": "png", "data_base64": base64.b64encode(buffer.getvalue()).decode()}
        elif k == 2:
            file = Path(tempfile.mkdtemp()) / f"screen-{seed}.png"
            picture.save(file, format="PNG")
            picture = str(file)
        out[f"<screen-{k}>"] = picture
    return out


def pipeline_prompts(decide, state, questions: dict, assets: dict) -> dict[str, np.ndarray]:
    from transformers.decision.template_utils import prepare_inputs

    prompts = prepare_inputs(decide.decision_config, {"state": state, "questions": questions, "assets": assets},
                             decide.processor)
    return {question.name: inputs["input_ids"][0].numpy() for inputs, (question,) in prompts}


STATES = {
    1: "The agent took a screenshot: <screen-0>. The dialog is open.",
    2: [{"role": "user", "content": "Before: <screen-0>"}, {"role": "assistant", "content": "clicked Save"},
        {"role": "user", "content": "After: <screen-1> and the log"}],
    3: "Three windows: <screen-0>, <screen-1> and <screen-2>",
}


@pytest.mark.parametrize("count", [1, 2, 3])
def test_generic_prompt_ids_are_the_pipelines(generic, decide, count):
    # mutations: pads not expanded (one <|image_pad|> per image); images spliced in placeholder-name order, not
    # text order; the save point inside a placeholder name; the vision tokens escaped as text
    assets = screens(count)
    rendered = generic.render(STATES[count], QUESTIONS, assets=assets)
    want = pipeline_prompts(decide, STATES[count], QUESTIONS, assets)
    for name in QUESTIONS:
        assert np.array_equal(rendered.prompt_ids(name), want[name]), name


def test_own_chat_format_ids_are_the_processors(own, processor):
    # mutations: the text after the last image encoded with the image's end token; the blank line dropped
    assets = screens(2)
    state = "Window <screen-1> over <screen-0>, then text"
    rendered = own.render(state, QUESTIONS, assets=assets)
    order = [fl.images.decode_assets(assets)[name].image for name in ("<screen-1>", "<screen-0>")]
    shown = state.replace("<screen-1>", IMAGE).replace("<screen-0>", IMAGE)
    for name, question in parse_questions(QUESTIONS).items():
        text = own.prompt.prompt_text(shown, question)
        want = processor(text=[text], images=order, return_tensors="pt")["input_ids"][0].numpy()
        assert np.array_equal(rendered.prompt_ids(name), want), name


def test_a_trunk_carries_its_images(generic, processor):
    # mutations: spans from the placeholder's text index; digests in asset order; patches of another image
    assets = screens(2)
    decoded = fl.images.decode_assets(assets)
    state = "First <screen-1>, then <screen-0>."
    (part, *_) = generic.prompt.parts(state, parse_questions(QUESTIONS), decoded)
    images = part.trunk.images
    ids = part.trunk.tokens()
    pads = np.flatnonzero(ids == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>"))
    grid = processor.image_processor([decoded["<screen-1>"].image, decoded["<screen-0>"].image],
                                     return_tensors="pt")["image_grid_thw"].tolist()
    assert [(s.rows * 2, s.cols * 2) for s in images.spans] == [tuple(g[1:]) for g in grid]
    assert [s.start for s in images.spans] == [int(pads[0]), int(pads[len(pads) - images.spans[1].rows *
                                                                    images.spans[1].cols])]
    assert images.digests == (decoded["<screen-1>"].digest, decoded["<screen-0>"].digest)
    assert [(p.rows, p.cols) for p in images.patches] == [tuple(g[1:]) for g in grid]
    assert as_rendered([part]).state_ids.tolist() == ids.tolist()


@pytest.mark.parametrize("count", [1, 2, 3])
def test_asks_with_images_answer_as_the_pipeline(generic, decide, count):
    # mutations: pads keep their token embedding (no tower rows); the text after an image at index positions;
    # the tower run on the images in asset order, not text order
    assets = screens(count, seed=10 * count)
    before = generic.stats()
    answers = generic.ask_sync(STATES[count], QUESTIONS, assets=assets)
    assert_as_pipeline(decide, STATES[count], QUESTIONS, answers, assets=assets)
    after = generic.stats()
    assert after["image_rounds"] - before["image_rounds"] == 1
    assert after["images_encoded"] - before["images_encoded"] == count


def test_mixed_rounds_answer_as_the_pipeline(generic, decide):
    # mutations: the tower run once per trunk, not per digest (images_encoded 3); a text-only ask in an image
    # round given the image trunk's position offset; the image rows placed at the first request's stream rows
    assets = screens(2, seed=40)
    states = ["Left <screen-0> right <screen-1>", "Only text: the dialog closed.", "Again <screen-1> alone",
              "More text, nothing to see."]

    async def run():
        return await asyncio.gather(*(generic.ask(state, QUESTIONS, assets=assets) for state in states))

    before = generic.stats()
    answers = asyncio.run(run())
    after = generic.stats()
    for state, answer in zip(states, answers):
        assert_as_pipeline(decide, state, QUESTIONS, answer, assets=assets)
    assert after["rounds"] - before["rounds"] == 1
    assert after["images_encoded"] - before["images_encoded"] == 2  # <screen-1> encoded once for both trunks
    text_only = generic.ask_sync(states[1], QUESTIONS)  # a text round after them: no tower, answers as before
    assert_as_pipeline(decide, states[1], QUESTIONS, text_only)
    assert generic.stats()["image_rounds"] == after["image_rounds"]


BAD = {
    "truncated": lambda png: {"<screen-0>": png[: len(png) // 2]},
    "gif declared": lambda png: {"<screen-0>": {"format": "gif", "data_base64": base64.b64encode(png).decode()}},
    "no data": lambda png: {"<screen-0>": {"format": "png", "data_base64": ""}},
    "elongated": lambda png: {"<screen-0>": noise(2, 600, seed=1)},
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_assets_are_typed_before_anything_is_queued(generic, decide, case):
    # mutations: decode the assets in the round thread (the error fails a round); patches made after queueing
    buffer = io.BytesIO()
    noise(30, 30, seed=3).save(buffer, format="PNG")
    before = generic.stats()
    with pytest.raises(InvalidAssetError) as info:
        generic.ask_sync(STATES[1], QUESTIONS, assets=BAD[case](buffer.getvalue()))
    assert info.value.name == "<screen-0>"
    assert generic.stats()["asks"] == before["asks"] and generic.stats()["rounds"] == before["rounds"]
    assets = screens(1, seed=5)
    assert_as_pipeline(decide, STATES[1], QUESTIONS, generic.ask_sync(STATES[1], QUESTIONS, assets=assets),
                       assets=assets)


def test_a_model_without_vision_refuses_assets(tiny_path):
    # mutation: assets ignored by a text-only checkpoint
    with fl.Engine.load(tiny_path, device="cpu", rendering="transformers") as engine, \
            pytest.raises(InvalidAssetError, match="reads no images"):
        engine.ask_sync("see <a>", QUESTIONS, assets={"<a>": noise(20, 20, seed=0)})


@pytest.mark.parametrize("kind", ["text", "messages"])
def test_a_session_of_screenshots_resumes_past_its_images(generic, decide, kind):
    # mutations: digests left out of the history's hashes and prefix checks is caught by the next test; here: the
    # resumed trunk's text at index positions (no image offset), the tower run again on a checkpointed image
    # (images_encoded 2 at step 2), a session's assets forgotten between steps
    session = generic.session()
    assets: dict = {}
    state = "" if kind == "text" else []
    for step in range(3):
        name = f"<shot-{step}>"
        picture = noise(40 + 8 * step, 60, seed=100 + step)
        text = f"Step {step}: the agent clicked and saw {name} on the screen. "
        item = text if kind == "text" else {"role": "user", "content": text}
        session.append(item, assets={name: picture})
        state = state + text if kind == "text" else [*state, item]
        assets[name] = picture
        before = generic.stats()
        answers = session.ask_sync(QUESTIONS)
        after = generic.stats()
        assert_as_pipeline(decide, state, QUESTIONS, answers, assets=assets)
        # only the new screenshot: the earlier ones are in the checkpoint the ask resumed from
        assert after["images_encoded"] - before["images_encoded"] == 1
        if step:
            assert after["checkpoint_hits"] > before["checkpoint_hits"]
            assert after["tokens_resumed"] > before["tokens_resumed"]


def test_a_session_placeholder_names_one_image(generic):
    # mutations: a later image silently replacing an earlier one under its placeholder; a bad asset appended
    # with its message (the history changed though the append raised)
    session = generic.session()
    session.append("first <a>", assets={"<a>": noise(20, 20, seed=1)})
    with pytest.raises(InvalidAssetError, match="already names another image"):
        session.append("second <a>", assets={"<a>": noise(20, 20, seed=2)})
    with pytest.raises(InvalidAssetError):
        session.append("third <b>", assets={"<b>": b"not an image"})
    alone = generic.ask_sync("first <a>", QUESTIONS, assets={"<a>": noise(20, 20, seed=1)})
    assert session.ask_sync(QUESTIONS)["red"].noul == pytest.approx(alone["red"].noul, abs=1e-6)  # history as it was


def test_different_images_of_one_size_share_no_checkpoint(generic, decide):
    # mutation: chain_hashes ignoring the digests and prefix_equals comparing tokens only -> the second ask
    # resumes from the first's checkpoint and answers about the first image
    state = "A long screen recording follows. " * 6 + "Frame: <frame>. " + "The user waits for the result. " * 4
    first, second = noise(48, 64, seed=7), noise(48, 64, seed=8)
    answers = [generic.ask_sync(state, QUESTIONS, assets={"<frame>": first})]
    before = generic.stats()
    answers.append(generic.ask_sync(state, QUESTIONS, assets={"<frame>": second}))
    assert generic.stats()["checkpoint_hits"] == before["checkpoint_hits"]  # the first's checkpoint is past its image
    before = generic.stats()
    again = generic.ask_sync(state, QUESTIONS, assets={"<frame>": second})
    after = generic.stats()
    assert after["checkpoint_hits"] - before["checkpoint_hits"] >= 1  # the same image: its checkpoint serves
    for picture, answer in zip((first, second), answers):
        assert_as_pipeline(decide, state, QUESTIONS, answer, assets={"<frame>": picture})
    assert_as_pipeline(decide, state, QUESTIONS, again, assets={"<frame>": second})
    assert probabilities(answers[0]["red"]) != pytest.approx(probabilities(answers[1]["red"]), abs=1e-6)


def test_the_typesafe_client_sends_images_the_engine_answers(generic, decide):
    # mutations: the multipart 'request' part read as the whole body; a part's bytes dropped for its asset
    # entry; `extra_body` assets ignored; a bad image answered 500 instead of 422
    ts = pytest.importorskip("typesafe_sdk")
    from flide_sdk.adapters.typesafe import client

    buffer = io.BytesIO()
    noise(44, 60, seed=21).save(buffer, format="PNG")
    png = buffer.getvalue()
    state = "The checkout page: <shot>. The user hovers over Pay. " * 12  # > 1 KiB: a zstd body
    native = generic.ask_sync(state, QUESTIONS, assets={"<shot>": png})
    assert_as_pipeline(decide, state, QUESTIONS, native, assets={"<shot>": noise(44, 60, seed=21)})
    image = ts.Image(png)
    with client(generic, retry=ts.RetryPolicy(max_retries=0)) as local:
        multipart = local.system_one(state=state, questions=QUESTIONS, assets={"<shot>": image})
        assert multipart.raw_http_response.request.headers["content-type"].startswith("multipart/form-data")
        as_json = local.system_one(state=state, questions=QUESTIONS, extra_body={"assets": {"<shot>": {
            "type": "image", "format": "png", "data_base64": base64.b64encode(png).decode()}}})
        placed = local.system_one(state={"page": image, "note": "the user hovers over Pay"}, questions=QUESTIONS)
        with pytest.raises(ts.TypeSafeUnprocessableEntityError):
            local.system_one(state=state, questions=QUESTIONS, extra_body={"assets": {"<shot>": {
                "type": "image", "format": "gif", "data_base64": base64.b64encode(png).decode()}}})
    for through in (multipart, as_json):
        assert through.nouls["red"].noul == pytest.approx(native["red"].noul, abs=1e-9)
        assert through.choices["where"].probabilities == pytest.approx(native["where"].probabilities, abs=1e-9)
    reference = str(image)
    json_state = {"page": reference, "note": "the user hovers over Pay"}
    assert_as_pipeline(decide, json_state, QUESTIONS, generic.ask_sync(json_state, QUESTIONS, assets={reference: png}),
                       assets={reference: noise(44, 60, seed=21)})
    assert placed.nouls["red"].noul == pytest.approx(
        generic.ask_sync({"page": reference, "note": "the user hovers over Pay"}, QUESTIONS,
                         assets={reference: png})["red"].noul, abs=1e-9)


def test_own_format_asks_with_images_equal_transformers(own, decide, processor):
    # mutations: the trunk's stable part ending before the last image (its pads recomputed without rows); the
    # branches at the trunk's index positions (no image offset)
    assets = screens(2, seed=60)
    state = "Window <screen-1> over <screen-0>, then a long log line of text"
    answers = own.ask_sync(state, QUESTIONS, assets=assets)
    decoded = fl.images.decode_assets(assets)
    pictures = [decoded["<screen-1>"].image, decoded["<screen-0>"].image]
    shown = state.replace("<screen-1>", IMAGE).replace("<screen-0>", IMAGE)
    model = decide.model
    for name, question in parse_questions(QUESTIONS).items():
        inputs = processor(text=[own.prompt.prompt_text(shown, question)], images=pictures, return_tensors="pt")
        labels = own.render(state, {name: QUESTIONS[name]}, assets=assets).questions[name].label_ids
        with torch.no_grad():
            logits = model(**inputs, use_cache=False).logits[0, -1]
        want = torch.softmax(logits[torch.tensor(labels)], -1).numpy()
        got = probabilities(answers[name])
        want = want[:1] if isinstance(answers[name], fl.NoulAnswer) else want
        assert np.abs(want - got).max() <= TOLERANCE, (name, want, got)


@pytest.mark.parametrize("kind", ["text", "messages"])
def test_own_format_sessions_resume_past_their_images(own, decide, processor, kind):
    # mutations: the text before an image left in the mutable tail (encoded again with the image's tokens as
    # text); the image's first pad recorded at its start token; a fork sharing the history's image list
    session = own.session()
    state: str | list = "" if kind == "text" else []
    pictures = []
    for step in range(3):
        name = f"<shot-{step}>"
        picture = noise(40 + 8 * step, 60, seed=200 + step)
        text = f"Step {step}: the agent saw {name} and clicked. "
        item = text if kind == "text" else {"role": "user", "content": text}
        session.append(item, assets={name: picture})
        state = state + text if kind == "text" else [*state, item]
        pictures.append(picture)
        before = own.stats()
        answers = session.ask_sync(QUESTIONS)
        after = own.stats()
        shown = state if kind == "text" else json.dumps(state, ensure_ascii=False)
        for k in range(step + 1):
            shown = shown.replace(f"<shot-{k}>", IMAGE)
        for name_q, question in parse_questions(QUESTIONS).items():
            inputs = processor(text=[own.prompt.prompt_text(shown, question)], images=pictures, return_tensors="pt")
            labels = own.render("x", {name_q: QUESTIONS[name_q]}).questions[name_q].label_ids
            with torch.no_grad():
                logits = decide.model(**inputs, use_cache=False).logits[0, -1]
            want = torch.softmax(logits[torch.tensor(labels)], -1).numpy()
            got = probabilities(answers[name_q])
            want = want[:1] if isinstance(answers[name_q], fl.NoulAnswer) else want
            assert np.abs(want - got).max() <= TOLERANCE, (step, name_q, want, got)
        assert after["images_encoded"] - before["images_encoded"] == 1  # earlier screenshots: in the checkpoint
        if step:
            assert after["checkpoint_hits"] > before["checkpoint_hits"]
    forked = session.fork()
    end = " The end: <end>" if kind == "text" else {"role": "user", "content": "The end: <end>"}
    forked.append(end, assets={"<end>": noise(30, 30, seed=299)})
    forked.ask_sync(QUESTIONS)
    assert session.ask_sync(QUESTIONS)["red"].noul == pytest.approx(answers["red"].noul, abs=1e-6)


def test_an_engine_group_passes_assets(vl_path, decide):
    # mutation: EngineGroup.ask_sync dropping `assets` (the placeholder read as text)
    group = fl.EngineGroup.load(vl_path, ["cpu", "cpu"], dtype="float32", graphs=False, rendering="transformers")
    try:
        assets = screens(1, seed=80)
        assert_as_pipeline(decide, STATES[1], QUESTIONS, group.ask_sync(STATES[1], QUESTIONS, assets=assets),
                           assets=assets)
        want = pipeline_prompts(decide, STATES[1], QUESTIONS, assets)
        assert np.array_equal(group.render(STATES[1], QUESTIONS, assets=assets).prompt_ids("red"), want["red"])
    finally:
        group.close()


def test_batch_invariant_sessions_with_images_answer_as_the_pipeline(vl_path, decide):
    # checkpoints at multiples of 64 tokens may cut an image's pads: the rest of them is encoded from the tower's
    # rows of the whole image (mutation: tower rows taken from the image's first pad, not from the resume point)
    with fl.Engine.load(vl_path, device="cpu", dtype="float32", graphs=False, rendering="transformers",
                        batch_invariant=True) as engine:
        session, state, assets = engine.session(), "", {}
        for step in range(3):
            name = f"<s{step}>"
            text = f"Step {step} of a long task where the agent reads a lot of text before it sees {name} and types. "
            session.append(text, assets={name: noise(120, 200, seed=300 + step)})
            state, assets[name] = state + text, noise(120, 200, seed=300 + step)
            assert_as_pipeline(decide, state, QUESTIONS, session.ask_sync(QUESTIONS), assets=assets)
        assert engine.stats()["checkpoint_hits"] >= 2


def test_decide_sends_image_arguments_as_assets(generic, decide):
    # mutations: the image argument dropped from the assets (its reference read as text); the reference not the
    # digest's (two calls with one image hashing apart); a TypeSafe Image's path not read
    from pydantic import BaseModel, Field

    class Screen(BaseModel):
        red: bool = Field(description="Is the button red?")

    @fl.decide(generic)
    def look(screen, note: str) -> Screen:
        """Look at the screen."""

    picture = noise(40, 64, seed=90)
    file = Path(tempfile.mkdtemp()) / "screen.png"
    picture.save(file, format="PNG")
    ts = pytest.importorskip("typesafe_sdk")
    got = look.decision(picture, "after the click")
    again = look.decision(ts.Image(file), "after the click")
    reference = f"<image:{fl.images.decode_assets({'s': picture})['s'].digest.hex()}>"
    state = {"screen": reference, "note": "after the click"}
    answers = generic.ask_sync(state, look.questions, assets={reference: picture})
    assert got.probabilities["red"] == pytest.approx(again.probabilities["red"], abs=1e-9)
    assert got.probabilities["red"][True] == pytest.approx(answers["red"].noul, abs=1e-6)
    text_only = generic.ask_sync(state, look.questions)  # the reference read as text: another answer
    assert text_only["red"].noul != pytest.approx(answers["red"].noul, abs=1e-6)


@pytest.mark.asyncio
async def test_cluster_sessions_carry_their_images_to_the_replica_that_takes_them_over(vl_path, decide):
    # mutations: a replica's session append dropping an item's assets (the placeholder read as text); assets
    # checked on the replica, not before sending (a bad one is then a ReplicaError with every replica lost); a bad
    # asset or a placeholder's second image accepted into the client's history
    from flide_sdk.cluster import ClusterClient, FlideReplica
    from tests.test_cluster import FakeHandle

    load = {"device": "cpu", "dtype": "float32", "graphs": False, "rendering": "transformers"}
    replicas = [FlideReplica(str(vl_path), load) for _ in range(2)]
    handle = FakeHandle(replicas)
    client = ClusterClient(handle)
    try:
        assets = {"<screen-2>": screens(3, seed=60)["<screen-2>"]}  # a PNG file's path
        lone = await client.ask("The third window: <screen-2>", QUESTIONS, assets=assets)
        assert_as_pipeline(decide, "The third window: <screen-2>", QUESTIONS, lone,
                           assets={"<screen-2>": noise(80, 50, seed=62)})
        session, state, seen = client.session(), "", {}
        for step in range(3):
            name, picture = f"<shot-{step}>", noise(40 + 8 * step, 60, seed=200 + step)
            text = f"Step {step}: the agent clicked and saw {name}. "
            session.append(text, assets={name: picture})
            state, seen[name] = state + text, picture
            if step == 2:
                handle.lost.add(handle.routes[session.family])  # its replica is lost: the other one recomputes
            assert_as_pipeline(decide, state, QUESTIONS, await session.ask(QUESTIONS), assets=seen)
        assert len(set(session.replicas)) == 2
        with pytest.raises(InvalidAssetError):
            session.append("a bad one <bad>", assets={"<bad>": b"not an image"})
        with pytest.raises(InvalidAssetError, match="already names another image"):
            session.append("again <shot-0>", assets={"<shot-0>": noise(20, 20, seed=9)})
        assert_as_pipeline(decide, state, QUESTIONS, await session.ask(QUESTIONS), assets=seen)  # history as it was
        handle.lost.update((0, 1))
        with pytest.raises(InvalidAssetError):
            await client.ask("see <a>", QUESTIONS, assets={"<a>": b"GIF89a"})
    finally:
        for replica in replicas:
            replica.engine.close()


def test_a_decision_checkpoint_with_images_answers_as_the_pipeline(vl_path, processor, tmp_path):
    # a decision.json without a template (the generic prompt with the repo's labels and temperatures) next to a
    # vision-language checkpoint: lone asks and a session of screenshots as `pipeline("decision")` answers them.
    # Mutations: the repo's labels or temperatures dropped when images are present (the plain generic prompt's
    # answers differ); a template that prints the state itself taking images it cannot place (a typed error instead)
    import shutil

    from tests.test_decision_models import GENERIC_CONFIG, QUESTION_TEMPLATE

    path = tmp_path / "vl-decision"
    shutil.copytree(vl_path, path)
    (path / "decision.json").write_text(json.dumps(GENERIC_CONFIG))
    model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    decide = transformers.pipeline("decision", model=model, tokenizer=processor.tokenizer, processor=processor,
                                   image_processor=processor.image_processor)
    with fl.Engine.load(path, device="cpu", dtype="float32", graphs=False) as engine:
        for count in (1, 2):
            assets = screens(count, seed=90 + count)
            answers = engine.ask_sync(STATES[count], QUESTIONS, assets=assets)
            assert_as_pipeline(decide, STATES[count], QUESTIONS, answers, assets=assets)
        with fl.Engine.load(vl_path, device="cpu", dtype="float32", graphs=False,
                            rendering="transformers") as plain:  # the same model without its decision.json
            without = plain.ask_sync(STATES[1], QUESTIONS, assets=screens(1, seed=91))
        with_config = engine.ask_sync(STATES[1], QUESTIONS, assets=screens(1, seed=91))
        assert np.abs(probabilities(with_config["busy"]) - probabilities(without["busy"])).max() > 1e-3
        session, state, seen = engine.session(), [], {}
        for step in range(3):
            name = f"<shot-{step}>"
            item = {"role": "user", "content": f"Step {step}: the agent saw {name}."}
            session.append(item, assets={name: noise(40 + 8 * step, 60, seed=120 + step)})
            state, seen[name] = [*state, item], noise(40 + 8 * step, 60, seed=120 + step)
            assert_as_pipeline(decide, state, QUESTIONS, session.ask_sync(QUESTIONS), assets=seen)
        assert engine.stats()["checkpoint_hits"] >= 2
    (path / "decision_template.jinja").write_text(QUESTION_TEMPLATE)
    with fl.Engine.load(path, device="cpu", dtype="float32", graphs=False) as templated:
        before = templated.stats()["asks"]
        with pytest.raises(InvalidAssetError, match="prints the state itself"):
            templated.ask_sync(STATES[1], QUESTIONS, assets=screens(1, seed=91))
        assert templated.stats()["asks"] == before
