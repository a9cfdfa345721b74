"""Host cost of one append to a session's state, per tokenizer kind: a full-size (262,144-token) synthetic tokenizer
in Gemma's layout (SentencePiece-style BPE, `common.synthetic_gemma_tokenizer`) next to Qwen3.5's real one.

    FLIDE_BENCH_DATA=../shared/data PYTHONPATH=$PWD python benchmarks/gemma_text.py [--repeat 200]

A session in flide_sdk's prompt (Gemma 4's chat template; Qwen3.5's) is grown with the messages of a real agent
run (mini-swe-agent, in steps of up to 600 characters) to about 2,000 and 20,000 tokens; then, from a fork of it each time, one more message is
appended and the trunk taken (`append` + `snapshot`: what a session's ask tokenizes). Next to it: encoding the
whole trunk text again (what exactness would cost without stable boundaries), and building the tokenizer's
boundary tables (once per engine). Then 400-letter appends without spaces, whose tail only token-level cuts bound
(the merge index built at the first cut). CPU only.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

from benchmarks.common import data_path, run_metadata, synthetic_gemma_tokenizer, write_result
from flide_sdk.prompt.chat import ChatFormat, load_chat_template
from flide_sdk.testing import GEMMA_CHAT_TEMPLATE
from flide_sdk.text.tokens import Tokens

SIZES = (2000, 20000)


def agent_messages(chars: int = 600) -> list[str]:
    """The message texts of the mini-swe-agent runs, run after run, cut into steps of at most `chars` characters
    (so a history stops near its size)."""
    files = sorted(data_path("trajectories", "mini-swe-agent").rglob("*.traj.json"))
    texts = [str(message.get("content")) for file in files for message in json.loads(file.read_text())["messages"]]
    return [text[start : start + chars] for text in texts for start in range(0, len(text), chars)]


def measure(chat: ChatFormat, messages: list[str], size: int, repeat: int) -> dict[str, float]:
    history = chat.new_state()
    used = 0
    while len(history.snapshot()) < size:
        history.append(messages[used] + "\n")
        used += 1
    text = chat.head + "".join(m + "\n" for m in messages[:used]) + "\n\n"
    tokens = len(history.snapshot())
    step_ms, tails, step_tokens = [], [], []
    for index in range(repeat):
        fork = history.fork()
        step = messages[used + index % 50] + "\n"
        started = time.perf_counter()
        fork.append(step)
        trunk = fork.snapshot()
        step_ms.append((time.perf_counter() - started) * 1e3)
        tails.append(len(trunk.tail))
        step_tokens.append(len(trunk) - tokens)
    whole_ms = []
    for _ in range(max(5, repeat // 20)):
        started = time.perf_counter()
        chat.tokens.encode(text)
        whole_ms.append((time.perf_counter() - started) * 1e3)
    return {"history_tokens": tokens, "append_snapshot_ms_median": round(statistics.median(step_ms), 4),
            "append_snapshot_ms_p90": round(sorted(step_ms)[int(0.9 * len(step_ms))], 4),
            "step_tokens_median": statistics.median(step_tokens), "tail_tokens_max": max(tails),
            "whole_reencode_ms_median": round(statistics.median(whole_ms), 3)}


def seamless_run(chat: ChatFormat, repeat: int) -> dict[str, float]:
    """Appends of 400 letters without spaces (text every pair of which a large vocabulary merges): the tail stays
    bounded only by token-level cuts; the first cut builds the merge index (timed apart)."""
    rng = random.Random(0)
    history = chat.new_state()
    started = time.perf_counter()
    history.append("x" * 200)
    history.snapshot()
    chat.tokens.boundaries.token_cut("ab" * 100)
    first_s = time.perf_counter() - started
    step_ms, tails = [], []
    for _ in range(repeat // 4):
        history.append("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(400)))
        started = time.perf_counter()
        tails.append(len(history.snapshot().tail))
        step_ms.append((time.perf_counter() - started) * 1e3)
    return {"merge_index_and_first_cut_s": round(first_s, 2), "snapshot_ms_median": round(statistics.median(step_ms), 3),
            "tail_tokens_max": max(tails), "history_tokens": len(history.snapshot())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    messages = agent_messages()
    started = time.perf_counter()
    gemma = synthetic_gemma_tokenizer()
    built_s = time.perf_counter() - started
    qwen = Tokenizer.from_file(str(data_path("tokenizer", "qwen3.5", "tokenizer.json")))
    result = {"meta": run_metadata(" ".join(sys.argv)), "synthetic_gemma_build_s": round(built_s, 1)}
    for name, tokenizer, template in [("gemma (synthetic, 262,144)", gemma, GEMMA_CHAT_TEMPLATE),
                                      ("qwen3.5", qwen, load_chat_template(Path(data_path("tokenizer", "qwen3.5"))))]:
        started = time.perf_counter()
        tokens = Tokens(tokenizer, 1 << 22)
        setup_s = time.perf_counter() - started
        chat = ChatFormat(tokens, template, {"bos_token": "<bos>"} if "gemma" in name else {})
        result[name] = {"kind": tokens.kind.value, "vocab": tokenizer.get_vocab_size(),
                        "tokens_setup_s": round(setup_s, 3),
                        **{f"{size}": measure(chat, messages, size, args.repeat) for size in SIZES},
                        "letters without spaces": seamless_run(chat, args.repeat)}
        print(name, json.dumps(result[name], indent=1), file=sys.stderr, flush=True)
    write_result("gemma_text", result)


if __name__ == "__main__":
    main()
