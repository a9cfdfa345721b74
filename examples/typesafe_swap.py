"""Run unchanged TypeSafe System One SDK code on the embedded engine: only the client's construction changes.

    python examples/typesafe_swap.py                   # embedded tiny model, random weights, CPU
    python examples/typesafe_swap.py --model DIR --device cuda

The block marked "unchanged TypeSafe SDK code" is ordinary code written against `typesafe-sdk`: it knows
nothing of flide_sdk. The script builds its clients with `flide_sdk.adapters.typesafe.client(engine)` (and its async
twin), answered by the engine in this process instead of the hosted API, runs it synchronously and asynchronously (the concurrent requests
share the engine's rounds), and checks that every answer equals `engine.ask` on the same request — the
engine takes the TypeSafe question objects natively too. Needs `pip install "flide_sdk[typesafe]"`.
"""

from __future__ import annotations

import argparse
import asyncio

from example_engine import engine_from_args

try:
    from typesafe_sdk import AsyncTypeSafeClient, Choice, Noul, Score, SystemOneResponse, TypeSafeClient
except ImportError:
    raise SystemExit('this example needs the TypeSafe SDK: pip install "flide_sdk[typesafe]"') from None

import flide_sdk as fl
from flide_sdk.adapters import typesafe

# ----------------------------------------------------------------------- unchanged TypeSafe SDK code
QUESTIONS = {
    "billing": Noul(instructions="Is this ticket about billing?"),
    "tone": Choice(
        instructions="What is the customer's tone?",
        criteria={"calm": None, "frustrated": None, "angry": "hostile or threatening"},
    ),
    "urgency": Score(instructions="How urgent is this ticket?", criteria=["can wait", "this week", "today"]),
}


def triage(client: TypeSafeClient, ticket: str) -> SystemOneResponse:
    return client.system_one(state=ticket, questions=QUESTIONS)


async def triage_all(client: AsyncTypeSafeClient, tickets: list[str]) -> list[SystemOneResponse]:
    return list(await asyncio.gather(*(client.system_one(state=t, questions=QUESTIONS) for t in tickets)))


# ------------------------------------------------------------------------------ end of unchanged code

TICKETS = [
    "I was charged twice for my subscription this month. Please refund one of the charges.",
    "The export button does nothing when I click it. Not urgent, just letting you know.",
    "This is the third time I write. If my account is not restored today I am cancelling.",
    "Could you tell me whether the annual plan includes priority support?",
]


def probabilities(answer) -> list[float]:
    return [answer.noul, 1.0 - answer.noul] if hasattr(answer, "noul") else list(answer.probabilities.values())


def describe(result: SystemOneResponse) -> str:
    return (
        f"billing P(yes)={result.nouls['billing'].noul:.3f} | tone={result.choices['tone'].choice} "
        f"(conf {result.choices['tone'].confidence:.2f}) | urgency={result.scores['urgency'].score:.2f}/2 "
        f"| {result.usage.input_tokens} input tokens"
    )


def run(engine: fl.Engine) -> None:
    with typesafe.client(engine) as client:
        results = [triage(client, ticket) for ticket in TICKETS]
        models = client.models.list()
    for i, result in enumerate(results):
        print(f"sync ticket {i}: {describe(result)}")
    print(f"models: {[m.name for m in models.models]}")

    async def concurrently() -> list[SystemOneResponse]:
        async with typesafe.async_client(engine) as client:
            return await triage_all(client, TICKETS)

    rounds = engine.stats()["rounds"]
    concurrent = asyncio.run(concurrently())
    print(f"async: {len(TICKETS)} requests in {engine.stats()['rounds'] - rounds} rounds")

    worst = 0.0
    for ticket, result, other in zip(TICKETS, results, concurrent):
        native = engine.ask_sync(ticket, QUESTIONS)  # the same TypeSafe question objects, no HTTP, no JSON
        for name in QUESTIONS:
            for a, b, c in zip(probabilities(native[name]), probabilities(result.answers[name]), probabilities(other.answers[name])):
                worst = max(worst, abs(a - b), abs(a - c))
    print(f"parity with engine.ask: max |dp| = {worst:.2e} over {len(TICKETS)} tickets")


def main() -> None:
    engine, _ = engine_from_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    with engine:
        run(engine)

if __name__ == "__main__":
    main()
