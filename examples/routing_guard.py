"""Routing guards in front of an agent's tools and a support inbox, on the embedded engine.

    python examples/routing_guard.py                   # embedded tiny model, random weights, CPU
    python examples/routing_guard.py --model DIR --device cuda

`@fl.guard` stands in front of the agent's shell tool: before a proposed command runs, it asks whether the
command deletes or overwrites data, about the conversation so far plus that command. The conversation is
one session, so each step resumes from the checkpoint the previous step saved and computes only its new
tokens. Commands above the threshold are not run; the guard raises and the agent asks a human instead.

`@fl.route` dispatches support tickets to the handler of the most probable team, or to human triage when
the choice is not confident enough; a burst of tickets routed concurrently shares the engine's rounds.
"""

from __future__ import annotations

import argparse
import asyncio

from example_engine import engine_from_args

import flide_sdk as fl
from flide_sdk.session import Session

BLOCK_ABOVE = 0.5
MIN_CONFIDENCE = 0.2
TASK = "Free some disk space in the repository without losing anyone's work."
PROPOSED = ["du -sh * | sort -h", "rm -rf node_modules .cache", "git clean -fdx", "git gc --aggressive"]
TEAMS = fl.Choice(
    "Which team should handle this support ticket?",
    {"billing": "payments, invoices, refunds", "bugs": "something in the product is broken", "sales": "plans and pricing"},
)
TICKETS = [
    "I was charged twice for my subscription this month.",
    "The export button does nothing when I click it.",
    "Does the annual plan include priority support?",
    "My invoice shows the wrong company name.",
    "The app crashes when I upload a large file.",
    "Can I get a discount for a team of twenty?",
    "I cancelled last week but was billed again.",
    "Search results never load on the mobile app.",
]


def guarded_shell(engine: fl.Engine, conversation: Session):
    @fl.guard(
        engine,
        fl.Noul("Does the last proposed command delete or overwrite data?"),
        block_above=BLOCK_ABOVE,
        session=conversation,
        state=lambda command: {"role": "assistant", "content": f"Proposed command: {command}"},
    )
    async def shell(command: str) -> str:
        return f"(ran `{command}`)"

    return shell


def ticket_router(engine: fl.Engine):
    async def team(name: str, ticket: str) -> str:
        return name

    routes = {name: (lambda ticket, name=name: team(name, ticket)) for name in TEAMS.option_names()}

    @fl.route(engine, TEAMS, routes=routes, min_confidence=MIN_CONFIDENCE, state="Support ticket: {ticket}")
    async def route_ticket(ticket: str) -> str:
        return "human-triage"

    return route_ticket


async def run(engine: fl.Engine) -> None:
    conversation = engine.session()
    conversation.append({"role": "user", "content": TASK})
    shell = guarded_shell(engine, conversation)
    for step, command in enumerate(PROPOSED, start=1):
        before = engine.stats()
        try:
            outcome = f"ran | {await shell(command)}"
        except fl.GuardBlockedError as blocked:
            outcome = f"blocked P(yes)={blocked.probability:.3f} > {BLOCK_ABOVE} | asking a human"
        after = engine.stats()
        resumed = after["tokens_resumed"] - before["tokens_resumed"]
        computed = after["tokens_computed"] - before["tokens_computed"]
        print(f"guard step {step}: {resumed:4d} resumed, {computed:4d} computed | {command} -> {outcome}")

    route_ticket = ticket_router(engine)
    rounds = engine.stats()["rounds"]
    teams = await asyncio.gather(*(route_ticket(ticket) for ticket in TICKETS))
    for ticket, team in zip(TICKETS, teams):
        print(f"route: {team:12s} <- {ticket}")
    print(f"routed {len(TICKETS)} tickets in {engine.stats()['rounds'] - rounds} rounds")


def main() -> None:
    engine, _ = engine_from_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]))
    async def session() -> None:
        async with engine:
            await run(engine)

    asyncio.run(session())

if __name__ == "__main__":
    main()
