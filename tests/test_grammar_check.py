"""Grammar checks in a child process (`stratad.runtime.grammar_check`): llguidance holds the GIL
while it builds a lexer, so a check in a thread stalled every other thread (the event loop's
/health) for its whole length; in the child it stalls none, and one past its time bound is
refused and its worker replaced."""

from __future__ import annotations

import threading
import time

import pytest

from stratad.model.tokenizer import Tokenizer
from stratad.model.tokenizer_build import tokenizer_from_gguf
from stratad.runtime import grammar
from stratad.runtime.grammar_check import GrammarChecker, Vocabulary
from stratad.server.structured import json_grammar

# a pattern whose lexer llguidance builds for about a second before it gives up
NESTED = json_grammar({"type": "string", "pattern": "^a{1000}{1000}$"}, "response_format")
SMALL = json_grammar({"type": "object", "properties": {"n": {"type": "integer"}},
                      "required": ["n"]}, "response_format")  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(smollm_model) -> Tokenizer:  # type: ignore[no-untyped-def]
    return tokenizer_from_gguf(smollm_model.metadata)


def _longest_stall(work: object) -> tuple[object, float]:
    """`work()`'s result, and the longest another thread waited for the GIL meanwhile."""
    gaps: list[float] = []
    done = threading.Event()

    def tick() -> None:
        last = time.monotonic()
        while not done.is_set():
            time.sleep(0.001)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        result = work()  # type: ignore[operator]
    finally:
        done.set()
        ticker.join()
    return result, max(gaps, default=0.0)


def test_a_slow_check_stalls_no_thread_and_says_the_same(tokenizer: Tokenizer) -> None:
    checker = GrammarChecker(Vocabulary.of(tokenizer))
    try:
        assert checker.check(SMALL) is None  # the worker starts
        here, stalled_here = _longest_stall(lambda: grammar.check(tokenizer, NESTED))
        there, stalled_there = _longest_stall(lambda: checker.check(NESTED))
        assert here == there and "too many expressions" in str(there)
        assert stalled_here > 0.3  # in this process the check held everyone up
        assert stalled_there < 0.1
    finally:
        checker.close()


def test_a_check_past_its_time_is_refused_and_its_worker_replaced(tokenizer: Tokenizer) -> None:
    checker = GrammarChecker(Vocabulary.of(tokenizer), timeout_s=0.05, workers=1)
    try:
        assert checker.check(SMALL) is None
        first = checker._all[0].process
        assert checker.check(NESTED) == "it takes more than 0.05 s to compile"
        assert not first.is_alive()
        checker.timeout_s = 10.0
        assert checker.check(SMALL) is None  # a new worker
        assert checker._all[0].process is not first
    finally:
        checker.close()
