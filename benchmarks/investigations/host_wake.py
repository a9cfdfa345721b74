"""What waiting costs the host: the same small numpy workload back to back, after a sleep and after a spin,
and how long a thread blocked on an event takes to run once it is set.

    PYTHONPATH=$PWD python benchmarks/investigations/host_wake.py [--repeat 200]

No device work, but run it on the GPU machine's host (`run_gpu.sh host-wake`): a lone ask's critical path
crosses threads three times (the asyncio thread hands the ask to the round thread, the round thread hands the
answers back through the event loop, and the tokenizer wakes its worker threads), and after each round the
host has sat idle for the whole device replay. The workload (about 1 ms of numpy calls on 2,048-element
arrays) stands for the round thread's planning. Medians in milliseconds; the wake-up in microseconds.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import numpy as np

from benchmarks.common import command_line, median_ms, run_metadata, write_result


def numpy_work() -> np.ndarray:
    a = np.arange(2048)
    for _ in range(60):
        c = np.cumsum(np.repeat(a[:64], 32))
        out = np.concatenate([np.where(c > 5, c, 0), a])
    return out


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def wake_us(repeat: int, gap: float = 0.005) -> dict[str, float]:
    """Microseconds from setting an event to the blocked thread running, each after `gap` s of quiet."""
    wake, ran = threading.Event(), threading.Event()
    woke: list[float] = []

    def waiter() -> None:
        for _ in range(repeat):
            wake.wait()
            woke.append(time.perf_counter())
            wake.clear()
            ran.set()

    thread = threading.Thread(target=waiter)
    thread.start()
    latencies = []
    for i in range(repeat):
        time.sleep(gap)
        started = time.perf_counter()
        wake.set()
        ran.wait()
        ran.clear()
        latencies.append(woke[i] - started)
    thread.join()
    return {"median_us": float(np.median(latencies)) * 1e6, "p90_us": float(np.percentile(latencies, 90)) * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    repeat = args.repeat
    work = {"back_to_back_ms": median_ms(lambda _: numpy_work(), repeat)}
    for gap_ms in (1, 3, 10):
        work[f"after_sleep_{gap_ms}ms_ms"] = median_ms(lambda _: numpy_work(), repeat,
                                                       lambda _, g=gap_ms: time.sleep(g / 1e3))
        work[f"after_spin_{gap_ms}ms_ms"] = median_ms(lambda _: numpy_work(), repeat, lambda _, g=gap_ms: spin(g / 1e3))
    write_result("host_wake", {
        "benchmark": "host_wake", **run_metadata(command_line()), "cpus": os.cpu_count(),
        "settings": {"repeat": repeat, "statistic": "median on this host's CPU"},
        "numpy_work": work, "event_wake": wake_us(repeat),
    })


if __name__ == "__main__":
    main()
