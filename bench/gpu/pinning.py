"""Pinning rate and host responsiveness while the resident set is page-locked: paced vs unpaced.

Run on the GPU machine (it needs the RAM: the arena is allocated once per mode, then freed):

    python -m bench.gpu.pinning --gib 16                     # cudaHostRegister when a GPU is there
    python -m bench.gpu.pinning --gib 16 --lock mlock        # the CPU path
    python -m bench.gpu.pinning --gib 16 --out bench/results/pinning-h200.md

Each mode pins `--gib` GiB of expert-sized blobs (filled from a source buffer, as the pinner
fills them from the page cache) through the store's own `Pinner`, while two timer loops sleep
1 ms at a time and record how late they wake: one in a separate process (is the *host*
responsive?) and one thread in this process (is the *daemon's* event loop?). Modes:
  - one-shot: the whole arena locked as one chunk, unpaced (what pin_memory=True does)
  - chunked: `--chunk-mib` chunks, unpaced
  - paced: `--chunk-mib` chunks at `--rate-gbps`
plus an idle baseline. Prints a markdown table (and writes it to --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from stratad.model.spec import ExpertUnit
from stratad.store.sizes import GiB, MiB
from stratad.store.tiers.lock import LockChoice, choose_locker
from stratad.store.tiers.memory import ResidentRAM
from stratad.store.tiers.pinning import Pinner, PinSettings

BLOB = 8 * MiB  # about three a3b experts; a page multiple

# The out-of-process timer: sleeps 1 ms until stdin closes, then prints its lateness samples.
TIMER = r"""
import json, sys, threading, time
late, stop = [], threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
print("ready", flush=True)
while not stop.is_set():
    t = time.perf_counter(); time.sleep(0.001); late.append(time.perf_counter() - t - 0.001)
print(json.dumps(late))
"""


class BufferSource:
    """Fills a blob from one source buffer: a memcpy per blob, like a read from page cache."""

    def __init__(self) -> None:
        self.buf = torch.full((BLOB,), 7, dtype=torch.uint8)

    def read_into(self, layer: int, expert: int, out: torch.Tensor) -> None:
        out[:BLOB].copy_(self.buf)


def percentiles(samples: list[float]) -> str:
    if not samples:
        return "-"
    s = sorted(samples)
    pick = [s[int(q * (len(s) - 1))] * 1e3 for q in (0.5, 0.99)] + [s[-1] * 1e3]
    return " / ".join(f"{v:.2f}" for v in pick)


class InProcessTimer:
    def __init__(self) -> None:
        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            time.sleep(0.001)
            self.late.append(time.perf_counter() - t - 0.001)

    def __enter__(self) -> InProcessTimer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class OtherProcessTimer:
    def __enter__(self) -> OtherProcessTimer:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", TIMER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "ready"
        return self

    def __exit__(self, *exc: object) -> None:
        out, _ = self.proc.communicate("")
        self.late: list[float] = json.loads(out.strip().splitlines()[-1])


@dataclass(frozen=True)
class Row:
    mode: str
    chunk: str
    cap: str
    locker: str
    seconds: float
    gbps: float
    host: str
    daemon: str

    def markdown(self) -> str:
        rate = f"{self.gbps:.2f}" if self.gbps else "-"
        secs = f"{self.seconds:.2f}" if self.seconds else "-"
        return (
            f"| {self.mode} | {self.chunk} | {self.cap} | {self.locker} | {secs} | {rate}"
            f" | {self.host} | {self.daemon} |"
        )


def run_mode(
    mode: str, nbytes: int, chunk: int, rate: float, lock: str, device: torch.device
) -> Row:
    n = nbytes // BLOB
    ram = ResidentRAM([ExpertUnit(0, e) for e in range(n)], [BLOB] * n)
    choice: LockChoice = choose_locker(lock, device, ram.nbytes)
    pinner = Pinner(ram, BufferSource(), choice, PinSettings(chunk, rate))
    with OtherProcessTimer() as host, InProcessTimer() as daemon:
        start = time.perf_counter()
        pinner.start()
        pinner.wait()
        seconds = time.perf_counter() - start
    assert pinner.error is None, pinner.error
    ram.close()
    return Row(
        mode,
        f"{chunk / MiB:.0f} MiB" if chunk < nbytes else "all",
        f"{rate / 1e9:.1f} GB/s" if rate else "none",
        pinner.locker.name,
        seconds,
        nbytes / seconds / 1e9,
        percentiles(host.late),
        percentiles(daemon.late),
    )


def idle(seconds: float) -> Row:
    with OtherProcessTimer() as host, InProcessTimer() as daemon:
        time.sleep(seconds)
    return Row("idle", "-", "-", "-", 0.0, 0.0, percentiles(host.late), percentiles(daemon.late))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=16.0, help="GiB to pin per mode (default 16)")
    p.add_argument("--chunk-mib", type=int, default=64, help="chunk size (default 64)")
    p.add_argument("--rate-gbps", type=float, default=2.0, help="paced mode's cap (default 2)")
    p.add_argument("--lock", default="auto", choices=["auto", "gpu", "mlock", "none"])
    p.add_argument("--out", help="also write the table to this markdown file")
    args = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.init()
    nbytes = int(args.gib * GiB) // BLOB * BLOB
    chunk = args.chunk_mib * MiB
    rows = [idle(2.0)]
    for mode, c, rate in (
        ("one-shot", nbytes, 0.0),
        ("chunked", chunk, 0.0),
        ("paced", chunk, args.rate_gbps * 1e9),
    ):
        rows.append(run_mode(mode, nbytes, c, rate, args.lock, device))
        print(rows[-1].markdown(), file=sys.stderr, flush=True)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "no GPU"
    lines = [
        f"Pinning {nbytes / GiB:.1f} GiB in {BLOB // MiB} MiB blobs on {platform.node()}"
        f" ({gpu}, torch {torch.__version__}, {torch.get_num_threads()} threads).",
        "Timer columns: how late a 1 ms sleep wakes, p50 / p99 / max in ms; host = another"
        " process, daemon = a thread of the pinning process.",
        "",
        "| mode | chunk | cap | locker | time s | GB/s | host timer late ms"
        " | daemon timer late ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *(r.markdown() for r in rows),
    ]
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
