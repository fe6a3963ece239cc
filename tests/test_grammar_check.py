"""Grammar checks in a child process (`stratad.runtime.grammar_check`): llguidance holds the GIL
while it builds a lexer, so a check in a thread stalled every other thread (the event loop's
/health) for its whole length; in the child it stalls none, and one past its time bound is
refused and its worker replaced."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest

from stratad.grammars import far_bound
from stratad.model.text.tokenizer import Tokenizer
from stratad.model.text.tokenizer_build import tokenizer_from_gguf
from stratad.runtime import grammar
from stratad.runtime.grammar_check import GrammarChecker, Vocabulary
from stratad.server.openai.requests import RequestError
from stratad.server.structured import gbnf_grammar, json_grammar

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


# an integer range clamped to -2^63 at both ends: llguidance's compiler dies of SIGSEGV on it
CRASHING = {"type": "integer", "minimum": -1e301, "maximum": -1e300}


def test_a_grammar_that_kills_its_checker_is_refused_and_the_worker_replaced(
    tokenizer: Tokenizer,
) -> None:
    """Lark (the llama-server `grammar` field) may embed a JSON schema that no bound of ours
    has seen: its compile runs in the worker alone, whose death refuses the grammar."""
    checker = GrammarChecker(Vocabulary.of(tokenizer), workers=1)
    try:
        assert checker.check(SMALL) is None
        first = checker._all[0].process
        lark = gbnf_grammar(f"start: %json {json.dumps(CRASHING)}", "grammar")  # no compile here
        assert "checking process ended" in str(checker.check(lark))
        first.join(5)
        assert first.exitcode == -signal.SIGSEGV
        assert checker.check(SMALL) is None  # a new worker
    finally:
        checker.close()


def test_bounds_past_2_53_are_refused_before_compiling() -> None:
    """As JSON schemas: `1e300` was clamped to 2^63 - 1 (a 200 with a value the schema
    refuses), the range above crashed the daemon; an instance that looks like a bound is none."""
    for schema in (CRASHING, {"type": "integer", "minimum": 1e300, "maximum": 1e301},
                   {"anyOf": [{"type": "integer", "exclusiveMaximum": -(2**63)}]}):  # fmt: skip
        with pytest.raises(RequestError, match="beyond"):
            json_grammar(schema, "response_format")
    assert far_bound({"type": "integer", "minimum": -(2**53), "maximum": 2**53}) is None
    assert far_bound({"enum": [{"minimum": 1e300}], "const": {"maximum": 1e300}}) is None
