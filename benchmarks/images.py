"""Photographs in asks at Qwen3.5 release shapes: flide_sdk next to flide 0.1.4 and transformers' pipeline("decision").

    PYTHONPATH=/tmp/site:$PWD python benchmarks/images.py --model-size 0.8B    (flide 0.1.4, transformers >= 5.25)
    PYTHONPATH=$PWD python benchmarks/images.py --tiny --no-flide               (CPU smoke test)

The checkpoint has random bf16 weights at the release shapes, vision tower included, the real tokenizer and Qwen3-VL's
image processor settings (`common.build_random_vl_checkpoint`). The photographs are scikit-image's sample images
(the files its wheel ships under skimage/data, extracted to $FLIDE_BENCH_DATA/photos: benchmarks/README.md), each at
its own resolution. A request is one photograph in a short state with PHOTO_QUESTIONS (11 yes/no) in one ask; each
ask's text is new (no checkpoint serves it) though a photograph repeats. The engine renders as the pipeline does
(`rendering="transformers"`) and flide gets the same ids and pixels (vs_flide's `sdk_ids` format, with its
`vision`), so the three arms answer the same prompts. Reported per photograph: its image tokens, the tower's own
time (flide_sdk's tower on its patches), lone latency per arm (flide_sdk and flide in alternating blocks, block 0 a
warm-up; the pipeline once over the photographs after a warm-up); 64-client throughput over all photographs (the
pipeline's is 1 / its median lone latency: it answers one request at a time); the largest answer gap between arms.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.vs_flide import Flide, Render, SamePrompt, Sdk, clients, used_bytes

PHOTO = "<photo>"
PHOTO_QUESTIONS = (
    "Is there a person in the photograph?", "Is there an animal in the photograph?", "Was it taken outdoors?",
    "Is the sky visible?", "Is there any text in the photograph?", "Is the main subject in focus?",
    "Is the photograph mostly dark?", "Is there a vehicle in the photograph?", "Is food or drink visible?",
    "Does the photograph look like a medical or scientific image?", "Is the photograph in colour?",
)
QUESTIONS = {f"q{i}": {"type": "noul", "instructions": text} for i, text in enumerate(PHOTO_QUESTIONS)}
LONE_RATIO = 0.75  # issue 63's target: sdk / flide lone latency at most this
FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg"}


@dataclass(frozen=True)
class Photo:
    name: str
    asset: dict[str, str]  # a System One asset dict (base64)
    size: tuple[int, int]  # (width, height)


def photographs(tiny: bool) -> list[Photo]:
    """The sample photographs, smallest first (tiny: two, downscaled so the tiny processor's bounds keep them)."""
    from PIL import Image

    from benchmarks.common import data_path

    photos = []
    for file in sorted(data_path("photos").iterdir()):
        if file.suffix.lower() not in FORMATS:
            continue
        data = file.read_bytes()
        with Image.open(file) as image:
            size = image.size
        photos.append(Photo(file.stem, {"type": "image", "format": FORMATS[file.suffix.lower()],
                                        "data_base64": base64.b64encode(data).decode()}, size))
    photos.sort(key=lambda photo: photo.size[0] * photo.size[1])
    return photos[:2] if tiny else photos


def state(block: int, index: int, photo: Photo) -> str:
    return f"Request {block}-{index}. The camera took this photograph ({photo.name}): {PHOTO}\nAnswer about it."


# ------------------------------------------------------------------------------------------- arms
class SdkPhotos(Sdk):
    def __init__(self, path: Path, device: str, dtype: str, graphs: bool) -> None:
        super().__init__(path, device, dtype, graphs, False, rendering="transformers")

    async def ask_photo(self, text: str, photo: Photo) -> list[float]:
        return await self.ask(text, QUESTIONS, {PHOTO: photo.asset})

    def render(self, image_token: int) -> Render:
        """flide_sdk's rendering of a request with one photograph, and flide's vision inputs for it."""
        from flide_sdk.images import decode_assets
        from flide_sdk.prompt.base import as_rendered
        from flide_sdk.questions import parse_questions

        prompt = self.engine.prompt

        def render(text: Any, questions: dict, images: list) -> SamePrompt:
            decoded = decode_assets({PHOTO: base64.b64decode(images[0])}) if images else None
            parts = prompt.parts(text, parse_questions(questions), decoded)
            rendered = as_rendered(parts)
            patches = parts[0].trunk.images.patches if decoded else ()
            if not patches:
                return SamePrompt(rendered)
            vision = {"pixel_values": torch.cat([p.pixels for p in patches]),
                      "image_grid_thw": torch.tensor([[1, p.rows, p.cols] for p in patches]),
                      "mm_token_type_ids": torch.from_numpy(rendered.state_ids == image_token).long()[None]}
            return SamePrompt(rendered, vision)

        return render


class FlidePhotos(Flide):
    async def ask_photo(self, text: str, photo: Photo) -> list[float]:
        return await self.ask(text, QUESTIONS, [photo.asset["data_base64"]])

    async def client_photo(self, text: str, photo: Photo) -> None:
        await self.client_ask(text, QUESTIONS, [photo.asset["data_base64"]])


class Pipeline:
    name = "pipeline"

    def __init__(self, path: Path, device: str, dtype: str) -> None:
        import transformers

        from tests.vision_checkpoint import tiny_vl_processor

        started = time.perf_counter()
        model = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(path, dtype=getattr(torch, dtype))
        processor = tiny_vl_processor(path)
        self.decide = transformers.pipeline("decision", model=model.to(device).eval(), tokenizer=processor.tokenizer,
                                            processor=processor, image_processor=processor.image_processor)
        self.device = device
        self.load = {"version": transformers.__version__, "load_seconds": time.perf_counter() - started}

    async def ask_photo(self, text: str, photo: Photo) -> list[float]:
        answers = self.decide({"state": text, "questions": QUESTIONS, "assets": {PHOTO: photo.asset}})
        if self.device == "cuda":
            torch.cuda.synchronize()
        return [float(answers[name]["noul"]) for name in QUESTIONS]


# ------------------------------------------------------------------------------------------- measures
async def timed(arm, text: str, photo: Photo) -> tuple[float, list[float]]:
    started = time.perf_counter()
    answers = await arm.ask_photo(text, photo)
    return 1000.0 * (time.perf_counter() - started), answers


def tower_ms(path: Path, device: str, dtype: str, photos: list[Photo]) -> dict[str, dict[str, Any]]:
    """flide_sdk's vision tower alone on each photograph's patches: its time and the image tokens it makes."""
    from benchmarks.common import cuda_time_ms, wall_time_ms
    from flide_sdk.images import decode_assets
    from flide_sdk.models.qwen35_vision import image_patches, load_vision

    vision = load_vision(path, device, getattr(torch, dtype))
    out = {}
    for photo in photos:
        patches = image_patches(decode_assets({PHOTO: photo.asset})[PHOTO].image, vision.processing)
        on_device = [type(patches)(patches.pixels.to(device), patches.rows, patches.cols)]
        with torch.inference_mode():
            timing = (cuda_time_ms if device == "cuda" else wall_time_ms)(lambda: vision.tower(on_device))  # noqa: B023
        out[photo.name] = {"size": list(photo.size), "image_tokens": patches.tokens(vision.config.spatial_merge_size),
                           "tower_ms": timing["median_ms"]}
    return out


async def throughput(arm, photos: list[Photo], block: int, requests: int, count: int) -> float:
    asks = [(state(block, i, photos[i % len(photos)]), photos[i % len(photos)]) for i in range(requests)]
    return await clients(getattr(arm, "client_photo", arm.ask_photo), asks, count)


def main() -> None:
    from benchmarks.common import (
        MODEL_SIZES,
        Phases,
        build_random_vl_checkpoint,
        release_device_memory,
        run_metadata,
        target,
        write_result,
    )

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="0.8B", choices=MODEL_SIZES)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: the tests' tiny VL checkpoint, float32")
    parser.add_argument("--blocks", type=int, default=3, help="measured blocks (block 0, a warm-up, comes on top)")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--client-requests", type=int, default=192)
    parser.add_argument("--no-flide", action="store_true", help="leave out flide 0.1.4's arm")
    parser.add_argument("--no-pipeline", action="store_true", help="leave out the pipeline's arm")
    args = parser.parse_args()
    phases = Phases()
    photos = photographs(args.tiny)
    with phases("checkpoint"):
        if args.tiny:
            from tests.vision_checkpoint import tiny_vl_checkpoint

            path, device, dtype = tiny_vl_checkpoint(), "cpu", "float32"
        else:
            path = build_random_vl_checkpoint(args.model_size, Path(tempfile.mkdtemp(prefix="flide-images-")))
            device, dtype = "cuda", "bfloat16"
    graphs = not args.tiny
    with phases("tower"):
        photo_rows = tower_ms(path, device, dtype, photos)
    memory, loads, errors = {}, {}, {}
    arms: list = []
    for name, make in (("flide_sdk", lambda: SdkPhotos(path, device, dtype, graphs)),
                       ("flide", None if args.no_flide else lambda: FlidePhotos(
                           path, device, dtype, graphs, False, render=arms[0].render(image_token(path))))):
        if make is None:
            continue
        before = used_bytes(device)
        try:
            with phases(f"load {name}"):
                arms.append(make())
        except Exception:  # noqa: BLE001 - a failing peer is recorded, the run goes on
            errors[name] = traceback.format_exc(limit=4)
            print(errors[name], file=sys.stderr)
            continue
        memory[name], loads[name] = used_bytes(device) - before, arms[-1].load

    lone: dict[str, dict[str, list[float]]] = {arm.name: {} for arm in arms}
    answers: dict[str, dict[str, list[float]]] = {}
    rates: dict[str, float] = {}
    for block in range(args.blocks + 1):
        with phases(f"block {block}"):
            for index, photo in enumerate(photos):
                for arm in arms if block % 2 else arms[::-1]:
                    try:
                        ms, answers.setdefault(arm.name, {})[photo.name] = asyncio.run(
                            timed(arm, state(block, index, photo), photo))
                    except Exception:  # noqa: BLE001
                        errors[f"{arm.name} lone"] = traceback.format_exc(limit=4)
                        continue
                    if block:
                        lone[arm.name].setdefault(photo.name, []).append(ms)
    for arm in arms:
        with phases(f"{args.clients} clients {arm.name}"):
            try:
                asyncio.run(throughput(arm, photos, 100, 2 * args.clients, args.clients))  # warm-up
                rates[arm.name] = asyncio.run(throughput(arm, photos, 101, args.client_requests, args.clients))
            except Exception:  # noqa: BLE001
                errors[f"{arm.name} clients"] = traceback.format_exc(limit=4)
    for arm in arms:
        arm.close()
    arms.clear()
    release_device_memory()

    if not args.no_pipeline:
        try:
            with phases("pipeline"):
                pipeline = Pipeline(path, device, dtype)
                asyncio.run(timed(pipeline, state(200, 0, photos[0]), photos[0]))  # warm-up
                lone["pipeline"] = {}
                for index, photo in enumerate(photos):
                    ms, answers.setdefault("pipeline", {})[photo.name] = asyncio.run(
                        timed(pipeline, state(args.blocks, index, photo), photo))
                    lone["pipeline"][photo.name] = [ms]
                rates["pipeline"] = 1000.0 / statistics.median(v[0] for v in lone["pipeline"].values())
                loads["pipeline"] = pipeline.load
                del pipeline
        except Exception:  # noqa: BLE001
            errors["pipeline"] = traceback.format_exc(limit=4)
            print(errors["pipeline"], file=sys.stderr)

    summary: dict[str, Any] = {}
    for photo in photos:
        row = dict(photo_rows[photo.name])
        row.update({f"{name}_ms": statistics.median(times[photo.name]) for name, times in lone.items()
                    if photo.name in times})
        for peer in ("flide", "pipeline"):
            if f"{peer}_ms" in row and "flide_sdk_ms" in row:
                row[f"sdk_over_{peer}"] = row["flide_sdk_ms"] / row[f"{peer}_ms"]
        summary[photo.name] = row
    summary[f"{args.clients}_clients_requests_per_s"] = dict(rates)
    for peer in ("flide", "pipeline"):
        if peer in rates and "flide_sdk" in rates:
            summary[f"{args.clients}_clients_requests_per_s"][f"sdk_over_{peer}"] = rates["flide_sdk"] / rates[peer]
    gaps = {f"flide_sdk_vs_{peer}": max(abs(x - y) for name in answers[peer]
                                        for x, y in zip(answers["flide_sdk"][name], answers[peer][name]))
            for peer in ("flide", "pipeline") if peer in answers and "flide_sdk" in answers}
    ratios = [row["sdk_over_flide"] for row in summary.values() if "sdk_over_flide" in row]
    targets = {"lone_sdk_over_flide_worst_photo": target(max(ratios) if ratios else None, LONE_RATIO)}
    for key, row in summary.items():
        print(f"{key:28s} " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                                        for k, v in row.items()), file=sys.stderr)
    print(f"memory after load (GiB): { {k: round(v / 2**30, 2) for k, v in memory.items()} }", file=sys.stderr)
    print(f"max |dp| between arms: {gaps}; errors: {list(errors)}", file=sys.stderr)
    size = "tiny" if args.tiny else args.model_size
    write_result(f"images-{size}", {
        **run_metadata(" ".join(sys.argv)), "benchmark": "images", "model_size": size, "device": device,
        "dtype": dtype, "photographs": "scikit-image sample images (skimage/data), own resolutions",
        "questions_per_request": len(QUESTIONS), "blocks": args.blocks, "load": loads,
        "memory_after_load_bytes": memory, "summary": summary, "targets": targets,
        "max_abs_probability_difference": gaps, "errors": errors, "lone_values_ms": lone,
        "phases_s": phases.seconds})


def image_token(path: Path) -> int:
    from flide_sdk.models.checkpoint import read_raw_config

    return int(read_raw_config(path)["image_token_id"])


if __name__ == "__main__":
    main()
