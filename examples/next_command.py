"""An agent step that scores candidate next commands by their own text.

    python examples/next_command.py                    # embedded tiny model, random weights, CPU
    python examples/next_command.py --model DIR --device cuda

Each step the agent proposes a few shell commands. A `Choice(..., scoring="text")` lists them as written and
scores each command as the model's whole reply (the sum of its tokens' log-probabilities, then a softmax over
the commands), so commands need no letters and may share prefixes (`pytest` and `pytest -x tests/...`). The
agent runs the most probable one; its session resumes from the previous step's checkpoint.
"""

from __future__ import annotations

import time

from example_engine import run_steps

import flide_sdk as fl

STEPS = [
    ("Fix the failing refund test in the orders service.",
     ["pytest tests/test_orders.py -x", "pytest", "cat orders/refund.py", "git log -n 5"]),
    ("FAILED tests/test_orders.py::test_refund_total - AssertionError: 17.5 != 17.0",
     ["cat orders/refund.py", "sed -n 30,50p orders/refund.py", "pytest tests/test_orders.py -x", "git diff"]),
    ("def refund_total(order):\n    return order.items_total + order.shipping_fee  # line 41",
     ["sed -i 's/ + order.shipping_fee//' orders/refund.py", "cat orders/models.py", "git stash"]),
    ("Edited orders/refund.py (1 line changed).",
     ["pytest tests/test_orders.py -x", "pytest", "git commit -am 'Refund: shipping is not refunded'"]),
]


async def run(engine: fl.Engine, steps: int) -> None:
    session = engine.session()
    for step, (observation, candidates) in enumerate(STEPS[:steps]):
        session.append({"role": "user" if step == 0 else "tool", "content": observation})
        question = fl.Choice("Which command should the agent run next?", {command: None for command in candidates},
                             scoring="text")
        started = time.perf_counter()
        answer = (await session.ask({"command": question}))["command"]
        latency_ms = (time.perf_counter() - started) * 1000
        ranked = sorted(answer.probabilities.items(), key=lambda item: -item[1])
        shown = ", ".join(f"{command!r} {p:.2f}" for command, p in ranked)
        print(f"step {step + 1}: {latency_ms:7.1f} ms | runs {answer.choice!r} (conf {answer.confidence:.2f}) | {shown}")
        session.append({"role": "assistant", "content": f"Run `{answer.choice}`."})
    stats = engine.stats()
    print(f"done: {stats['rounds']} rounds, {stats['tokens_resumed']} tokens resumed from "
          f"{stats['checkpoint_hits']} checkpoint hits")


def main() -> None:
    run_steps(__doc__.splitlines()[0], len(STEPS), run)


if __name__ == "__main__":
    main()
