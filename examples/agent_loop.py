"""The main job: an agent loop that asks typed decision questions about its growing history every step.

    python examples/agent_loop.py                      # embedded tiny model, random weights, CPU
    python examples/agent_loop.py --model DIR --device cuda

Each step appends the agent's action and the tool's observation to its session (a list of messages) and
asks three questions at once: a Noul (is the agent stuck?), a Choice (what kind of action comes next?)
and a Score (how close to done?). All three run as branches of one request over the same history, and
from the second step on the history resumes from the checkpoint the previous step saved.
"""

from __future__ import annotations

import time

from example_engine import run_steps

import flide_sdk as fl

SCRIPT = [
    ("assistant", "I will look at the failing test first: run `pytest tests/test_orders.py -x`."),
    ("tool", "FAILED tests/test_orders.py::test_refund_total - AssertionError: 17.5 != 17.0"),
    ("assistant", "The refund total is off by the shipping fee. Open `orders/refund.py` around line 40."),
    ("tool", "def refund_total(order):\n    return order.items_total + order.shipping_fee  # line 41"),
    ("assistant", "Shipping is not refundable. Edit line 41 to return only `order.items_total`."),
    ("tool", "Edited orders/refund.py (1 line changed)."),
    ("assistant", "Run the test again: `pytest tests/test_orders.py -x`."),
    ("tool", "1 passed in 0.12s"),
]

QUESTIONS = {
    "stuck": fl.Noul("Is the agent repeating itself without making progress?"),
    "next": fl.Choice(
        "What kind of action should come next?",
        {"inspect": "read code or logs", "edit": "change a file", "test": "run the tests", "submit": None},
    ),
    "progress": fl.Score("How close is the task to done?", ["not started", "investigating", "fix written", "verified"]),
}


def describe(answers: dict) -> str:
    stuck, nxt, progress = answers["stuck"], answers["next"], answers["progress"]
    return (
        f"stuck P(yes)={stuck.noul:.3f} | next={nxt.choice} (conf {nxt.confidence:.2f}) | "
        f"progress={progress.score:.2f}/3 (conf {progress.confidence:.2f})"
    )


async def run(engine: fl.Engine, steps: int) -> None:
    session = engine.session()  # the agent's growing history; each step resumes from the last checkpoint
    session.append({"role": "user", "content": "Fix the failing refund test in the orders service."})
    for step in range(steps):
        for role, content in SCRIPT[2 * step : 2 * step + 2]:
            session.append({"role": role, "content": content})
        before = engine.stats()
        started = time.perf_counter()
        answers = await session.ask(QUESTIONS)
        latency_ms = (time.perf_counter() - started) * 1000
        after = engine.stats()
        computed = after["tokens_computed"] - before["tokens_computed"]
        resumed = after["tokens_resumed"] - before["tokens_resumed"]
        print(f"step {step + 1}: {resumed:4d} tokens resumed, {computed:4d} computed, {latency_ms:7.1f} ms | {describe(answers)}")
    stats = engine.stats()
    print(
        f"done: {stats['rounds']} rounds, {stats['tokens_computed']} tokens computed, {stats['tokens_resumed']} resumed "
        f"from {stats['checkpoint_hits']} checkpoint hits, {stats['round_seconds']:.2f} s in rounds"
    )


def main() -> None:
    run_steps(__doc__.splitlines()[0], len(SCRIPT) // 2, run)


if __name__ == "__main__":
    main()
