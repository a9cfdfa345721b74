"""The command line every example shares: --model DIR / --device / --dtype, the embedded tiny model by default."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable

import flide_sdk as fl


def engine_from_args(parser: argparse.ArgumentParser) -> tuple[fl.Engine, argparse.Namespace]:
    """Parse the shared options (plus whatever `parser` already has) and load the engine they name."""
    parser.add_argument("--model", help="HF-format Qwen3.5 checkpoint directory (default: embedded tiny model)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when available for --model, else cpu)")
    parser.add_argument("--dtype", help="float32 or bfloat16 (default: bfloat16 on cuda, float32 on cpu)")
    args = parser.parse_args()
    if args.model:
        engine = fl.Engine.load(args.model, device=args.device, dtype=args.dtype)
        print(f"model: {args.model} on {engine.device}")
    else:
        engine = fl.Engine.tiny(device=args.device or "cpu", dtype=args.dtype)
        print("model: embedded tiny Qwen3.5 with RANDOM weights - the answers show the machinery, not judgement")
    return engine, args


def run_steps(description: str, steps: int, run: Callable[[fl.Engine, int], Awaitable[None]]) -> None:
    """Parse --steps (at most `steps`) and the shared options, then await `run(engine, steps)` inside the engine."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=steps, help=f"agent steps to run (at most {steps})")
    engine, args = engine_from_args(parser)

    async def session() -> None:
        async with engine:
            await run(engine, max(1, min(args.steps, steps)))

    asyncio.run(session())
