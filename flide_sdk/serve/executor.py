"""The executor: turns a scheduled round into device work and its result into answers (round thread only).

`launch` plans each request's checkpoint save at its stable boundary, lays the round out as one flat stream
and starts the model on it: the replay of the smallest captured CUDA graph it fits, or an eager forward (CPU,
or a round larger than every graph). It publishes the new checkpoints at once (device work is stream-ordered).
A round whose trunks hold images runs eagerly: the vision tower encodes each distinct image whose pads the round
computes once (batched over them), and the forward takes its rows and the round's M-RoPE positions (Qwen3.5)
or each token's last visible key (Gemma 4) (`RoundImages`).
`finish` waits for the one copy of the label log-probabilities to the host and resolves each ask's future (a
text-scored question's come from its reads' log-probabilities, summed on the host); the option probabilities
are their softmax at each question's temperature, in float64 (`tempered`).
`idle_step` captures the next CUDA graph of the ladder, or of a text capacity a round needed (or trims the
pool), which the round thread calls when it is idle (`idle_work_after`), so the engine serves (eagerly) while
its graphs are captured. A failed round
fails its own asks, never the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flide_sdk.device.graphs import GraphRunner, Launch
from flide_sdk.device.pool import Checkpoint, CheckpointPool, PlannedSave, session_bytes
from flide_sdk.kernels.plans import GDN_CHUNK
from flide_sdk.models.gemma4_vision import GemmaVision
from flide_sdk.models.ops import Ops
from flide_sdk.models.qwen35 import LayerCache, Qwen35Model
from flide_sdk.models.qwen35_vision import Vision, mrope_axes
from flide_sdk.options import POOL_SESSION_TOKENS, default_pool_bytes, on_device
from flide_sdk.plan.capacity import capacity_ladder
from flide_sdk.plan.images import TrunkImages, image_bounds, pad_rows, stream_positions
from flide_sdk.plan.layout import Branches, HostRound, RequestSpec, Resume, RoundImages, RoundPlan, Save
from flide_sdk.questions import Answer, SystemOneResponse, Usage
from flide_sdk.serve.asks import Ask
from flide_sdk.serve.scheduler import Request, RoundBatch, RoundLimits, asks_of, schedule
from flide_sdk.serve.stats import Stats
from flide_sdk.startup import Startup
from flide_sdk.text.tokens import Tokens
from flide_sdk.text.word_cache import WordEncoder

LOG = logging.getLogger(__name__)
TRIM_AFTER_S = 10.0  # idle device time before unused pool memory is given back


@dataclass(eq=False)
class Launched:
    """A round on the device: its requests, real stream tokens, and its label log-probabilities (a graph
    `Launch` to wait for, or the array itself when it ran eagerly)."""

    requests: list[Request]
    tokens: int
    result: Launch | np.ndarray
    started: float


def build_executor(model: Qwen35Model, ops: Ops, tokens: Tokens, pool_bytes: int | None,
                   pool_checkpoints: int | None, max_round_tokens: int, max_round_requests: int, graphs: bool,
                   stats: Stats, name: str, startup: Startup, batch_invariant: bool = False,
                   vision: Vision | GemmaVision | None = None) -> Executor:
    """An engine's executor: its checkpoint pool (capped at `pool_bytes`, default `default_pool_bytes`) and, with
    `graphs`, the graph ladder up to `max_round_tokens`; `vision`: the checkpoint's vision tower, if any. Batch-invariant: checkpoints only at multiples of
    GDN_CHUNK tokens, so a resumed trunk runs the chunks (and attention key blocks) of a fresh one."""
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    cap = (default_pool_bytes(device, session_bytes(model.config, dtype, POOL_SESSION_TOKENS)) if pool_bytes is None
           else pool_bytes)
    pool = CheckpointPool(model.config, device, dtype, cap, pool_checkpoints, max_round_requests)
    caches = pool.layer_caches()
    # every question has at least one branch token; with graphs a round must fit the largest capacity:
    # one padding token past its real tokens, and the history pages of its resumed asks
    save_align = GDN_CHUNK if batch_invariant else 1
    limits = RoundLimits(max_round_tokens, max_round_requests, max_round_tokens, save_align=save_align,
                         batch_invariant=batch_invariant)
    runner = None
    ladder = capacity_ladder(pool.layout.conv_kernel, max_round_tokens, max_round_requests,
                             tokens.max_prompt_tokens, sliding=pool.sliding)
    if batch_invariant and device.type == "cuda":
        # cuBLAS where it sums alike at every stream capacity from a floor up; fewer rows (the readout's) are
        # padded up to one
        from flide_sdk.kernels.matmul import plan_linear

        row_counts = {capacity.tokens for capacity in ladder}
        ops = dataclasses.replace(ops, linear=plan_linear(model.projection_shapes(), row_counts, device, dtype))
    if graphs:
        runner = GraphRunner(model, ops, caches, ladder, pool.state_rows, pool.window_sink, pool.kv_sink)
        limits = RoundLimits(max_round_tokens - 1, max_round_requests, ladder[-1].questions, ladder[-1].pages,
                             save_align, batch_invariant)
    return Executor(model, ops, pool, caches, runner, tokens.words, stats, name, limits, startup, vision)


def still_asked(request: Request) -> bool:
    """Mark the request's asks running, dropping those cancelled meanwhile, and its forks that are left with
    nothing to ask; whether anything is left (a request with no asks left still runs for its forks)."""
    request.asks = [ask for ask in request.asks if ask.future.set_running_or_notify_cancel()]
    request.forks = [fork for fork in request.forks if still_asked(fork)]
    return bool(request.asks or request.forks)


class Executor:
    """The model, its checkpoint pool and graphs, driven by the round thread."""

    def __init__(self, model: Qwen35Model, ops: Ops, pool: CheckpointPool, caches: list[LayerCache],
                 graphs: GraphRunner | None, words: WordEncoder, stats: Stats, name: str, limits: RoundLimits,
                 startup: Startup, vision: Vision | GemmaVision | None = None) -> None:
        self.model = model
        self.vision = vision
        self.ops = ops
        self.pool = pool
        self.graphs = graphs
        self.stats = stats
        self.name = name
        self.limits = limits
        self.caches = caches
        self.words = words
        self.startup = startup
        self.answered = False  # whether a round was answered yet
        self.pool_lock = threading.Lock()  # held while the pool is read or changed
        self.captured = threading.Event()  # set once no graph is left to capture
        self.trim_requested = False  # by clear_pool: give unused pool memory back without waiting TRIM_AFTER_S
        if not self.capturing:
            self.captured.set()
        self.device = model.embed_tokens.weight.device
        self.axes = None if not isinstance(vision, Vision) else torch.from_numpy(
            mrope_axes(model.config.rotary_dim, list(vision.config.mrope_section))).to(self.device)

    def select(self, queue: Sequence[Ask]) -> RoundBatch:
        """Schedule the next round and pin the checkpoints it resumes from; its asks are marked running (an
        ask cancelled meanwhile is dropped)."""
        started = time.perf_counter()
        with self.pool_lock:
            batch = schedule(queue, self.pool.lookup, self.limits)
            if not self.pool.hold_scratch(batch.rows):  # the device has no memory for more: rounds keep to those held
                limits = dataclasses.replace(self.limits, requests=self.pool.scratch_held)
                batch = schedule(queue, self.pool.lookup, limits)
            batch.requests = [request for request in batch.requests if still_asked(request)]
            for request in batch.requests:
                if request.resume is not None:
                    self.pool.pin(request.resume)
        self.stats.add(select_seconds=time.perf_counter() - started, deferred=batch.deferred)
        return batch

    def launch(self, batch: RoundBatch) -> Launched | None:
        """Plan the round, start it on the device and publish its checkpoints; None if it failed (its asks
        then hold the error)."""
        started, cpu_started = time.perf_counter(), time.thread_time()
        saves: list[PlannedSave] = []
        launch = None
        with self.pool_lock:
            try:
                specs = [self._request_spec(request, saves) for request in batch.requests]
                specified = time.perf_counter()
                plan = RoundPlan(specs, self.pool.layout.conv_kernel, self.pool.state_rows, self.pool.kv_sink,
                                 not self.limits.batch_invariant, self.pool.sliding)
                planned, cpu_planned = time.perf_counter(), time.thread_time()
                self.pool.copy_pages(saves)
                images = [r.trunk.images for request in batch.requests for r in request.tree()]
                if any(found is not None for found in images):
                    result = self._run_images(plan, specs, images)
                else:
                    launch = None if self.graphs is None else self.graphs.launch(plan)
                    if launch is None and self.capturing:  # a text capacity this round needs is now pending
                        self.captured.clear()
                    result = launch if launch is not None else self._run_eager(plan)
            except Exception as error:
                for save in saves:
                    self.pool.abort(save)
                self._unpin(batch.requests)
                for ask in batch.asks:
                    ask.future.set_exception(error)
                return None
            self._unpin(batch.requests)
            for save in saves:
                self.pool.commit(save)
        launched, cpu_launched = time.perf_counter(), time.thread_time()
        self.stats.add(
            queue_seconds=sum(started - ask.queued_at for ask in batch.asks), plan_seconds=planned - started,
            spec_seconds=specified - started, launch_seconds=launched - planned,
            plan_cpu_seconds=cpu_planned - cpu_started, launch_cpu_seconds=cpu_launched - cpu_planned,
            tokens_padded=plan.num_real if launch is None else launch.capacity.tokens,
            gdn_chunks=sum(level.chunks for level in plan.levels),
            **{"graph_replays" if launch is not None else "eager_runs": 1},
            **({} if launch is None else launch.host_seconds),
        )
        self.words.fill_chunks()  # the device computes meanwhile: cache the chunks of new texts now
        return Launched(batch.requests, plan.num_real, result, started)

    @property
    def capturing(self) -> bool:
        """Whether graphs are left to capture."""
        return self.graphs is not None and bool(self.graphs.pending)

    def idle_work_after(self) -> float | None:
        """After how many seconds of idle device there is idle work (None: none): a graph to capture at once;
        pool memory to give back after TRIM_AFTER_S (at once after `clear_pool`), so that pauses between bursts
        of asks do not give back what the next burst takes again."""
        if self.capturing:
            return 0.0
        with self.pool_lock:
            if not self.pool.trimmable:
                return None
        return 0.0 if self.trim_requested else TRIM_AFTER_S

    def idle_step(self) -> None:
        """One piece of idle work (call it with no round in flight): capture the next graph, else trim the pool."""
        if self.capturing:
            self._capture_step()
            return
        with self.pool_lock:
            self.pool.trim()
        self.trim_requested = False

    def _capture_step(self) -> None:
        """Capture the next graph capacity (call it with no round in flight). A capture that fails leaves the
        engine serving on the graphs captured so far, and eagerly past them."""
        graphs = self.graphs
        try:
            with self.pool_lock:
                report = graphs.capture_next()
        except Exception:  # out of memory, a driver error: serve on what is captured
            LOG.warning("capturing CUDA graphs failed; rounds past %d captured capacities run eagerly",
                        len(graphs.ladder) - len(graphs.pending), exc_info=True)
            graphs.give_up()
        else:
            self.stats.add(graphs_captured=report.capacities, capture_seconds=report.seconds,
                           graph_memory_bytes=report.memory_bytes)
            counts = self.stats.snapshot()
            if not report.text:  # the start-up's progress is the ladder's
                self.startup.graph_captured(graphs.captured, len(graphs.ladder), counts["capture_seconds"],
                                            int(counts["graph_memory_bytes"]))
        if not self.capturing:
            self.captured.set()

    def finish(self, launched: Launched) -> None:
        """Wait for a launched round and resolve its asks."""
        waited = time.perf_counter()
        result = launched.result
        logprobs = result.wait() if isinstance(result, Launch) else result
        finished = time.perf_counter()
        answers = self._answers(launched.requests, logprobs)
        if not self.answered:
            self.answered = True
            self.stats.set(first_answer_ready_seconds=self.startup.elapsed())
        self.stats.count_round(launched.requests, launched.tokens, finished - launched.started)
        self.stats.add(finish_seconds=finished - waited, **(result.device_seconds() if isinstance(result, Launch)
                                                             else {}))
        for ask, response in answers:
            ask.future.set_result(response)

    def fail(self, launched: Launched, error: BaseException) -> None:
        """Fail the asks of a round that could not be finished."""
        for ask in asks_of(launched.requests):
            if not ask.future.done():
                ask.future.set_exception(error)

    def clear_pool(self) -> None:
        """Evict every checkpoint not in use; their memory is given back at the next idle step."""
        with self.pool_lock:
            self.pool.clear()
            self.trim_requested = self.pool.trimmable

    def release(self) -> None:
        """Free the checkpoint pool and the captured graphs (the weights stay)."""
        with self.pool_lock, on_device(self.device):  # from any thread: the driver frees on the pool's device
            self.graphs = None
            self.caches = []
            self.pool.release()

    def _run_eager(self, plan: RoundPlan) -> np.ndarray:
        """The round's forward outside any graph: as its graph would run it while that one is not captured yet
        (the same kernels), unpadded past the largest capacity or without graphs."""
        logprobs = None if self.graphs is None else self.graphs.run_eagerly(plan)
        if logprobs is not None:
            return logprobs
        readout = self.model(HostRound.of(plan).to(self.device), self.ops, self.caches)
        return plan.text_reads.scores(readout.label_logprobs.cpu().numpy(), readout.text_logprobs.cpu().numpy())

    def _run_images(self, plan: RoundPlan, specs: list[RequestSpec], images: list[TrunkImages | None]) -> np.ndarray:
        """A round whose trunks hold images, eagerly: the tower over the distinct images whose pads it computes
        (none for a trunk resumed past its images), their rows at the pads, and the round's M-RoPE positions
        (Qwen3.5) or, where an image's soft tokens see each other, each token's last visible key (Gemma 4)."""
        if self.vision is None:
            raise RuntimeError("a round holds images, but this engine has no vision tower")
        host = HostRound.of(plan)
        pads = pad_rows(specs, images)
        hidden = self.model.config.hidden_size
        embeds = torch.zeros(0, hidden, device=self.device)
        if pads.patches:
            with torch.inference_mode():
                embeds = torch.cat(self.vision.tower(list(pads.patches)))[torch.from_numpy(pads.tower).to(self.device)]
        rnd = host.to(self.device)
        stream = torch.from_numpy(pads.stream).to(self.device)
        if isinstance(self.vision, GemmaVision):
            see_hi = None
            if self.vision.config.bidirectional:
                see_hi = torch.from_numpy(image_bounds(specs, images, len(host.positions))).to(self.device)
            rnd.images = RoundImages(stream, embeds, see_hi=see_hi)
        else:
            rnd.images = RoundImages(stream, embeds,
                                     torch.from_numpy(stream_positions(specs, images, host.positions)).to(self.device),
                                     self.axes)
        readout = self.model(rnd, self.ops, self.caches)
        self.stats.add(image_rounds=1, images_encoded=len(pads.patches))
        return plan.text_reads.scores(readout.label_logprobs.cpu().numpy(), readout.text_logprobs.cpu().numpy())

    def _request_spec(self, request: Request, saves: list[PlannedSave], base: Checkpoint | None = None,
                      forked: bool = False) -> RequestSpec:
        """The request's spec with its forks', its checkpoint (and theirs) planned into `saves`. A fork's
        checkpoint extends its parent's (`base`), so a fork of a request that saves nothing saves nothing."""
        trunk, resume = request.trunk, request.resume
        start = request.resume_length
        at = self.limits.save_point(trunk)
        save = None if forked and base is None else self.pool.plan_save(trunk, base if forked else resume, at)
        if save is not None:
            saves.append(save)
        forks = tuple(self._request_spec(fork, saves, None if save is None else save.checkpoint, True)
                      for fork in request.forks)
        return RequestSpec(
            trunk=trunk.tokens(start),
            branches=Branches.join([ask.branches for ask in request.asks]),
            start=start,
            resume=None if resume is None else Resume(resume.slot, np.asarray(resume.pages, dtype=np.int64),
                                                      np.asarray(resume.sliding_pages, dtype=np.int64)),
            save=None if save is None else Save(at, save.checkpoint.slot, save.kv_slots, save.sliding_kv_slots),
            forks=forks,
        )

    def _unpin(self, requests: list[Request]) -> None:
        for request in requests:
            if request.resume is not None:
                self.pool.unpin(request.resume)

    def _answers(self, requests: list[Request], logprobs: np.ndarray) -> list[tuple[Ask, SystemOneResponse]]:
        # one pass over the round's rows (a question's row: its options' log-probabilities), then Python floats:
        # the answer formulas on a few floats each are cheaper than on numpy rows
        asks = asks_of(requests)
        counts = [count for ask in asks for count in ask.option_counts]
        temperatures = [temperature for ask in asks for temperature in ask.temperatures]
        rows = iter(tempered(logprobs[: len(counts)], counts, temperatures).tolist())
        results = []
        for ask in asks:
            answers: dict[str, Answer] = {name: question.answer(next(rows)[:count])
                                          for (name, question), count in zip(ask.questions.items(), ask.option_counts)}
            usage = Usage(input_tokens=ask.prompt_tokens, output_tokens=ask.output_tokens)
            results.append((ask, SystemOneResponse(answers, model=self.name, usage=usage)))
        return results


def tempered(logprobs: np.ndarray, counts: Sequence[int], temperatures: Sequence[float]) -> np.ndarray:
    """Each row's option probabilities at its temperature T > 0: softmax(log p / T) over its first `counts[r]`
    columns, in float64 (0 past them). Equal to transformers' softmax(z / T) of the logits z (log p = z - c, and
    the constant cancels), from log-probabilities no float32 probability underflowed into: exact for any T, a
    tiny one included (the best option's row term is 0, so no row sums to 0)."""
    counts_at = np.asarray(counts, dtype=np.int64)
    width = int(counts_at.max())
    scaled = logprobs[:, :width].astype(np.float64) / np.asarray(temperatures, dtype=np.float64)[:, None]
    scaled[np.arange(width)[None, :] >= counts_at[:, None]] = -np.inf
    weights = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    return weights / weights.sum(axis=1, keepdims=True)
