"""Resource limits a long state must not cross: CPU memory grows linearly with the prompt (no T x T matrix)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

GROWTH_LIMIT_BYTES = 1536 << 20  # a 16k-token ask took ~0.4 GB (0.7 GB at 32k); one T x T score matrix alone: 4 GB


def test_a_16k_token_ask_grows_cpu_memory_linearly():
    """A fresh process (the peak RSS is the process's) asks about a 16,905-token state; its peak resident memory
    grows by far less than one float32 [heads, T, T] attention matrix would take."""
    script = textwrap.dedent("""
        import json, resource
        import flide_sdk as fl
        engine = fl.Engine.tiny()
        questions = {"long": fl.Noul("Is this a long state?")}
        engine.ask_sync("warm up " * 50, questions)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        words = "the agent read the file and ran the tests again".split()
        state = " ".join(words[i % len(words)] for i in range(13000))
        tokens = len(engine.render(state, questions).state_ids)
        answer = engine.ask_sync(state, questions)["long"].noul
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print(json.dumps({"tokens": tokens, "growth": (after - before) * 1024, "noul": answer}))
        engine.close()
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    measured = json.loads(result.stdout)
    assert measured["tokens"] > 16_000 and 0.0 <= measured["noul"] <= 1.0
    assert measured["growth"] < GROWTH_LIMIT_BYTES, measured
