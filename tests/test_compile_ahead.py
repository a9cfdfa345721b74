"""`kernels.compile_ahead` where it cannot compile ahead (the interpreter, which compiles nothing): the call is
not run, so its dry run's writes can never reach an engine that then runs it for real."""

from __future__ import annotations

from flide_sdk.kernels.compile_ahead import available, compile_ahead


def test_nothing_is_run_ahead_under_the_interpreter():
    calls = []
    compile_ahead(lambda: calls.append("dry run"))
    assert not available() and calls == []
