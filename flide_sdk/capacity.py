"""Fixed round shapes for CUDA graphs: the capacity ladder, bucket choice, and padding a round to a capacity.

A captured graph reads fixed-size buffers, so every round quantity has a capacity: stream tokens T (the
ladder, 128 to 16,384 by default), requests, questions, label columns, history pages, and per Gated
DeltaNet level its chunks and segments. Requests and questions scale with T (a request needs tokens; a
question's branch needs some too), so a small graph also has small tables. `choose` picks the smallest
capacity a round fits; `pad_round` pads the round's arrays to it, only at the tail: padding tokens form
one region of their own after the real tokens (they see nothing real and nothing real sees them), padded
segments and chunks are empty (and each level's `sizes` keeps the real counts, so the Gated DeltaNet
kernels never visit them), padded saves go to the pool's sink slot and page, padded readout rows read
the first padding token. Everything here is host code (numpy), tested on CPU against the unpadded layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flide_sdk.layout import (
    DEVICE_FIELDS,
    DISCARD_ROW,
    GDN_CHUNK,
    LEVEL_FIELDS,
    PAGE,
    HostLevel,
    HostRound,
)

# steps of at most 1.25x above 384 tokens: 64 tokens (at most 1.17x) up to 768, where a lone RACE passage with
# its questions lands (390-680 tokens), and 128 tokens (at most 1.08x) from 1,536 to 3,072 tokens, where a
# lone ask about a 2,000-token state with 1 to 16 questions lands (its padding is computed by the token-wise
# kernels; the GDN kernels skip it): on the H200 the 128-token steps took 0.1-0.17 ms off the replay of Q = 4
# and Q = 16 (questions_per_state at e46ac80 against cb0e20c)
TOKEN_LADDER = (128, 256, 384, 448, 512, 576, 640, 704, 768, 896, 1024, 1280, 1536, 1664, 1792, 1920, 2048, 2176,
                2304, 2432, 2560, 2688, 2816, 2944, 3072, 3584, 4096, 4608, 5120, 5632, 6144, 7168, 8192, 10240,
                12288, 14336, 16384)
LABELS = 32  # label columns of a graph (a question has at most 26 options: letters)
TOKENS_PER_REQUEST = 64  # requests capacity = T / this (at least MIN_REQUESTS)
TOKENS_PER_QUESTION = 16  # questions capacity = T / this (at least MIN_QUESTIONS)
MIN_REQUESTS, MIN_QUESTIONS = 4, 16


@dataclass(frozen=True)
class Capacity:
    """The fixed shape of one captured round."""

    tokens: int
    requests: int
    questions: int
    labels: int
    pages: int
    conv_kernel: int

    @property
    def segments(self) -> tuple[int, int, int]:
        """Segments per level: trunks to their save point, trunk remainders, branches."""
        return self.requests, self.requests, self.questions

    @property
    def chunks(self) -> tuple[int, ...]:
        """Chunks per level: a level's segments hold at most T tokens, each segment starts a chunk."""
        return tuple(self.tokens // GDN_CHUNK + segments for segments in self.segments)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every array of a round of this capacity, named as `HostRound.arrays()`."""
        t, r, q, k = self.tokens, self.requests, self.questions, self.conv_kernel
        shapes: dict[str, tuple[int, ...]] = {
            "ids": (t,), "positions": (t,), "key_lo": (t,), "ctx_hi": (t,), "seg_lo": (t,), "request_of": (t,),
            "history_len": (r + 1,), "page_offset": (r + 1,), "pages": (self.pages,), "conv_src": (t, k),
            "resume_slots": (r,), "save_slots": (r,), "save_window_src": (r, k - 1), "kv_slots": (t,),
            "readout_rows": (q,), "label_ids": (q, self.labels), "num_tokens": (1,),
        }
        for index, (chunks, segments) in enumerate(zip(self.chunks, self.segments)):
            shapes[f"level{index}.chunk_tokens"] = (chunks, GDN_CHUNK)
            shapes[f"level{index}.sizes"] = (2,)
            for name in ("init_row", "final_row", "chunk_count", "step_base", "chain"):
                shapes[f"level{index}.{name}"] = (segments,)
        return shapes

    @property
    def elements(self) -> int:
        return sum(int(np.prod(shape)) for shape in self.shapes().values())

    def fits(self, host: HostRound) -> bool:
        """Whether `host` (unpadded) fits, with at least one padding token (padded readout rows read it)."""
        return (
            host.num_real < self.tokens
            and len(host.request_bounds) <= self.requests
            and host.num_questions <= self.questions
            and host.label_ids.shape[1] <= self.labels
            and len(host.pages) <= self.pages
            and len(host.resume_slots) <= self.requests
            and all(len(level.init_row) <= s and len(level.chunk_tokens) <= c
                    for level, s, c in zip(host.levels, self.segments, self.chunks))
        )


def capacity_ladder(
    conv_kernel: int,
    max_tokens: int = TOKEN_LADDER[-1],
    max_requests: int = 64,
    max_prompt_tokens: int = 32768,
    tokens: tuple[int, ...] = TOKEN_LADDER,
) -> list[Capacity]:
    """Capacities from the smallest to `max_tokens` (which is always the last rung)."""
    rungs = sorted({t for t in tokens if t < max_tokens} | {max_tokens})
    history_pages = -(-max_prompt_tokens // PAGE)
    return [
        Capacity(
            tokens=t,
            requests=min(max_requests, max(MIN_REQUESTS, t // TOKENS_PER_REQUEST)),
            questions=max(MIN_QUESTIONS, t // TOKENS_PER_QUESTION),
            labels=LABELS,
            pages=max(history_pages, t // 2),
            conv_kernel=conv_kernel,
        )
        for t in rungs
    ]


def choose(ladder: list[Capacity], host: HostRound) -> Capacity | None:
    """The smallest capacity `host` fits, or None (the round runs eagerly)."""
    return next((capacity for capacity in ladder if capacity.fits(host)), None)


def pad_into(host: HostRound, capacity: Capacity, out: dict[str, np.ndarray], window_sink: int, kv_sink: int,
             zero_row: int) -> None:
    """Write `host` padded to `capacity` into the arrays `out` (shaped as `capacity.shapes()`).

    window_sink: a pool slot that padded conv-window saves write to (and padded resumes read);
    kv_sink: the flat pool position padding tokens' keys/values go to; zero_row: the always-zero state row.
    """
    real, total = host.num_real, capacity.tokens
    requests, questions = len(host.request_bounds), host.num_questions

    def put(name: str, array: np.ndarray, fill: int) -> np.ndarray:
        """`array` into the head of `out[name]` (rows, and columns where it is narrower), `fill` elsewhere."""
        target = out[name]
        head = target[: len(array)]
        if array.shape[1:] == target.shape[1:]:
            head[...] = array
        else:
            head.fill(fill)
            head[:, : array.shape[1]] = array
        target[len(array) :] = fill
        return target

    def shift_windows(target: np.ndarray, rows: int) -> None:
        """Conv-table rows past the real tokens (resumed windows) move up by the padding tokens."""
        head = target[:rows]
        np.add(head, total - real, out=head, where=head > real)

    put("ids", host.ids, 0)
    put("positions", host.positions, 0)
    for name in ("key_lo", "ctx_hi", "seg_lo"):
        put(name, getattr(host, name), real)  # padding: one region starting at the first padding token
    put("request_of", host.request_of, requests)  # a request with no history
    put("history_len", host.history_len, 0)
    put("page_offset", host.page_offset, 0)
    put("pages", host.pages, 0)
    shift_windows(put("conv_src", host.conv_src, 0), real)
    put("resume_slots", host.resume_slots, window_sink)
    put("save_slots", host.save_slots, window_sink)
    shift_windows(put("save_window_src", host.save_window_src, 0), len(host.save_window_src))
    put("kv_slots", host.kv_slots, kv_sink)
    put("readout_rows", host.readout_rows, real)
    labels = put("label_ids", host.label_ids, -1)
    labels[questions:, 0] = 0  # padded questions read one label, so their softmax stays finite
    out["num_tokens"][0] = real
    for index, level in enumerate(host.levels):
        prefix = f"level{index}."
        chunks = put(prefix + "chunk_tokens", level.chunk_tokens, total)[: len(level.chunk_tokens)]
        chunks[chunks == real] = total  # padding positions of real chunks read the padded tail instead
        put(prefix + "step_base", level.step_base, 0)
        put(prefix + "init_row", level.init_row, zero_row)
        put(prefix + "final_row", level.final_row, DISCARD_ROW)
        put(prefix + "chunk_count", level.chunk_count, 0)
        put(prefix + "chain", level.chain, -1)
        put(prefix + "sizes", level.sizes, 0)  # the real chunk rows and segments: kernels skip the padding


def pad_round(host: HostRound, capacity: Capacity, window_sink: int, kv_sink: int, zero_row: int) -> HostRound:
    """`host` padded to `capacity` as a new HostRound (the host-side lists are kept as they are)."""
    if not capacity.fits(host):
        raise ValueError(f"the round does not fit {capacity}")
    arrays = {name: np.empty(shape, dtype=np.int64) for name, shape in capacity.shapes().items()}
    pad_into(host, capacity, arrays, window_sink, kv_sink, zero_row)
    levels = [HostLevel(active=level.active, chained=level.chained,
                        **{name: arrays[f"level{i}.{name}"] for name in LEVEL_FIELDS})
              for i, level in enumerate(host.levels)]
    return HostRound(
        **{name: arrays[name] for name in DEVICE_FIELDS},
        num_real=host.num_real,
        request_bounds=host.request_bounds,
        history=host.history,
        levels=levels,
        num_rows=host.num_rows,
    )
