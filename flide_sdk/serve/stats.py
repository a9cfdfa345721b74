"""The engine's counters: written by the asking threads (submit time) and the round thread, read by `stats()`."""

from __future__ import annotations

import threading

from flide_sdk.serve.scheduler import Request

STAT_KEYS = (
    "rounds", "asks", "questions", "tokens_computed", "tokens_padded", "gdn_chunks", "tokens_resumed",
    "checkpoint_hits", "checkpoint_misses", "graph_replays", "eager_runs", "deferred", "merged_trunks",
    "mutable_tail_tokens", "max_mutable_tail_tokens", "round_seconds", "submit_seconds", "queue_seconds",
    "select_seconds", "plan_seconds", "spec_seconds", "launch_seconds", "buffer_wait_seconds", "pad_seconds",
    "replay_call_seconds", "replay_seconds", "finish_seconds", "graphs_captured", "capture_seconds",
    "graph_memory_bytes", "submit_cpu_seconds", "plan_cpu_seconds", "launch_cpu_seconds", "load_seconds",
    "first_answer_ready_seconds", "image_rounds", "images_encoded",
)


class Stats:
    """Counters since start (DESIGN.md §7), under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, float] = dict.fromkeys(STAT_KEYS, 0)

    def add(self, **amounts: float) -> None:
        with self._lock:
            for key, amount in amounts.items():
                self._counts[key] += amount

    def set(self, **values: float) -> None:
        with self._lock:
            self._counts.update(values)

    def count_round(self, requests: list[Request], tokens: int, seconds: float) -> None:
        with self._lock:
            s = self._counts
            s["rounds"] += 1
            s["tokens_computed"] += tokens
            s["round_seconds"] += seconds
            for request in (request for root in requests for request in root.tree()):
                s["merged_trunks"] += max(0, len(request.asks) - 1)
                for ask in request.asks:
                    s["asks"] += 1
                    s["questions"] += len(ask.questions)
                    s["tokens_resumed"] += request.resume_length
                    s["checkpoint_hits" if request.resume is not None else "checkpoint_misses"] += 1
                    tail = len(ask.trunk) - ask.trunk.boundary
                    s["mutable_tail_tokens"] = tail
                    s["max_mutable_tail_tokens"] = max(s["max_mutable_tail_tokens"], tail)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._counts)
