"""Grammar checks in a child process, bounded in time.

llguidance holds the GIL while it builds a grammar's lexer: a nested quantifier took 0.9 s, a
5,000-property schema 1 s, and a thread running that stalls the event loop (/health) and the
engine's steps alike. So the daemon's checks (`stratad.grammars.probe`) run in a worker
process of their own (spawned: no torch in it, only llguidance and the tokenizer's vocabulary),
one check at a time per worker. A check that runs past `timeout_s` is the client's: the
grammar is refused as too complex to compile in bounded time, and the worker is killed and
replaced. The workers start on first use.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import sys
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from stratad.grammars import probe
from stratad.model.text.tokenizer import Tokenizer

log = logging.getLogger("stratad.engine")

TIMEOUT_S = 10.0  # a check that takes longer refuses the grammar
START_S = 60.0  # a worker's start (an interpreter, llguidance, the vocabulary) at most
WORKERS = 2  # checks that run at once


@dataclass(frozen=True)
class Vocabulary:
    """What a worker needs of the tokenizer (plain data: it crosses to the child)."""

    hf_json: str
    vocab: int
    eos: tuple[int, ...]

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> Vocabulary:
        return cls(tokenizer.hf.to_str(), tokenizer.vocab_size, tuple(sorted(tokenizer.eos_ids)))


def _serve(conn: Connection, words: Vocabulary) -> None:
    """A worker: check each grammar it is sent, until its parent goes."""
    import llguidance

    lexicon = llguidance.LLTokenizer(words.hf_json, n_vocab=words.vocab, eos_token=list(words.eos))
    eos = frozenset(words.eos)
    conn.send(("ready", "torch" in sys.modules))
    while True:
        try:
            grammar = conn.recv()
        except (EOFError, OSError):
            return
        try:
            conn.send(("ok", probe(lexicon, grammar, eos, words.vocab)))
        except Exception as e:  # noqa: BLE001 (llguidance's own failure: the grammar's fault)
            conn.send(("error", f"{type(e).__name__}: {e}"))


@dataclass
class _Worker:
    process: BaseProcess
    conn: Connection

    def stop(self) -> None:
        self.conn.close()
        self.process.kill()
        self.process.join(timeout=5)


@dataclass
class GrammarChecker:
    """`check(grammar)` from any thread: why the grammar cannot constrain the model, or None."""

    words: Vocabulary
    timeout_s: float = TIMEOUT_S
    workers: int = WORKERS
    _idle: queue.Queue[_Worker | None] = field(init=False, repr=False)
    _all: list[_Worker] = field(init=False, repr=False, default_factory=list)
    _lock: threading.Lock = field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._idle = queue.Queue()
        for _ in range(self.workers):
            self._idle.put(None)  # a place: its worker starts when first needed

    def check(self, grammar: str) -> str | None:
        worker = self._idle.get()
        try:
            if worker is None:
                worker = self._start()
            worker.conn.send(grammar)
            if not worker.conn.poll(self.timeout_s):
                log.warning("a grammar check ran past %g s: refused, its worker replaced",
                            self.timeout_s)  # fmt: skip
                self._retire(worker)
                worker = None
                return f"it takes more than {self.timeout_s:g} s to compile"
            kind, said = worker.conn.recv()
            return said if kind == "ok" else f"it cannot be compiled ({said})"
        except (EOFError, OSError) as e:  # the worker died (out of memory?): the next starts anew
            log.warning("a grammar check's worker failed (%s): replaced", e)
            if worker is not None:
                self._retire(worker)
            worker = None
            return "its check failed (the checking process ended); retry, or simplify it"
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        with self._lock:
            workers, self._all = self._all, []
        for w in workers:
            w.stop()

    def _start(self) -> _Worker:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        process = ctx.Process(target=_serve, args=(child, self.words), name="grammar-check",
                              daemon=True)  # fmt: skip
        process.start()
        child.close()
        worker = _Worker(process, parent)
        with self._lock:
            self._all.append(worker)
        if not parent.poll(START_S):  # the check's own time starts once it is up
            self._retire(worker)
            raise OSError(f"a grammar check's worker did not start in {START_S:.0f} s")
        parent.recv()
        return worker

    def _retire(self, worker: _Worker) -> None:
        with self._lock:
            if worker in self._all:
                self._all.remove(worker)
        worker.stop()
