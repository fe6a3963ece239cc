"""Every fenced block of README.md and docs/*.md is run or checked here, so that none drifts.

By the fence's language: `sh` — curl commands are sent with urllib (a bare machine may have no
curl), other commands run in bash with this checkout's `stratactl` against the shared daemon;
`python` — executed, the documented URL pointed at the daemon; `json` — parsed, and sent when
a marker names its route; `toml` — through the daemon's config loader; `text` — a line stratad
writes, matched against lines it wrote here (tests/doc_output.py). A block that cannot run here
says why on the line right above its fence, `<!-- example: not run (REASON) -->`; the
repository paths, configuration keys and stratactl commands it names are checked all the same.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pytest

from stratad.config import Config, load_config
from stratad.env import Env
from tests.daemon import free_port
from tests.doc_blocks import DOC_URL, REPO, Block, all_blocks, blocks_of
from tests.doc_output import (
    canonical,
    damaged_pack_lines,
    decode_timing_lines,
    sample_pattern,
    store_start_lines,
)
from tests.server_helpers import Daemon, shared_daemon

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

BLOCKS = all_blocks()
SECONDS = 30  # an example answers in seconds (the README's first curl once ran for minutes)

# Commands a shell example may call that have no place in a test: stubs that do nothing.
STUBS = {"systemctl": "the shared daemon stands for the service"}

# README's synopsis (`<!-- example: synopsis -->`): placeholders, the commands not run, and
# what each run must answer here. The GPUs are hidden: these are a CPU host's answers.
PLACEHOLDERS = {"MODEL": "tiny-moe.gguf", "PACK_DIR": "tiny-moe.pack", "H": "127.0.0.1",
                "P": "8080"}  # fmt: skip
SYNOPSIS_NOT_RUN = {
    "stratad": "the daemon these tests talk to starts this way (tests/daemon.py): parsed",
    "stratactl synth a3b": "writes 17.5 GB: parsed",
}
SYNOPSIS_EXTRA = {"bench": ["--quick"]}  # a smoke run (docs/operations.md lists the flag)
SOCKET_VERBS = {"status", "coverage", "plan", "stats"}
EXPECT: dict[str, tuple[set[int], str]] = {  # exit codes (docs/operations.md), a line of output
    "synth": ({0}, r"^wrote tiny-moe\.gguf: tiny-moe \(qwen3moe"),
    "pack": ({0}, r"^wrote tiny-moe\.pack: qwen3moe"),
    "status": ({0}, r": serving, up "),
    "coverage": ({0}, r"^coverage: "),
    "plan": ({0}, r"^plan dense"),
    "stats": ({0}, r"^requests \d+"),
    "check": ({0}, r"\A(?:(?:ok|warn) +\w+ .*\n)+\Z"),
    "logs": ({0}, r"(?s).*"),  # the journal's lines, or where the log goes without one
    "tables": ({0, 3}, r"nothing to select on a CPU|tuning table"),
    "tune": ({0}, r"^no GPU: nothing to tune on a CPU"),
    "bench": ({0}, r"^slowest: "),
}


@pytest.fixture(scope="module")
def daemon() -> Daemon:
    return shared_daemon("default")


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.id)
def test_block(block: Block, request: pytest.FixtureRequest) -> None:
    _check_names(block)
    if block.not_run is not None:
        assert block.not_run.strip(), f"{block.where}: say why it is not run"
        return
    _handler(block)(block, request)


def test_the_docs_hold_every_kind_of_block() -> None:
    """What the handlers are for is in the docs: none of them is tested on nothing."""
    kinds = {b.lang for b in BLOCKS if b.not_run is None} | {
        b.marker.split()[0] for b in BLOCKS if b.marker
    }
    assert {"sh", "python", "json", "toml", "text", "synopsis", "POST", "not"} <= kinds, kinds
    streamed = [b for b in BLOCKS if b.lang == "sh" and '"stream": true' in b.text]
    assert streamed, "a streamed curl example"


def _handler(block: Block) -> Callable[[Block, pytest.FixtureRequest], None]:
    if block.marker == "synopsis":
        return _run_synopsis
    assert not block.marker or block.marker.startswith("POST /"), (
        f"{block.where}: unknown marker {block.marker!r} (tests/doc_blocks.py lists them)"
    )
    handlers = {"sh": _run_shell, "bash": _run_shell, "python": _run_python,
                "json": _check_json, "toml": _check_toml, "text": _check_output}  # fmt: skip
    assert block.lang in handlers, (
        f"{block.where}: no test runs a ```{block.lang} block: name the fence's language (`text`"
        " for a line stratad writes), teach tests/test_docs_examples.py, or mark it"
        " <!-- example: not run (REASON) -->"
    )
    return handlers[block.lang]


# --- what every block names ----------------------------------------------------------------

_REPO_PATH = re.compile(
    r"(?<![\w./-])((?:bench|containers|docs|kernels|scripts|stratactl|stratad|systemd|tests)"
    r"/[\w./-]*[\w-])"
)
_CONFIG_KEY = re.compile(r"(?<![\w./-])(model|server|engine|store|control|log)\.([a-z_]+)\b")
_SHELL_WORDS = {"until", "while", "if", "then", "do", "else", "!", "{", "time"}


def _check_names(block: Block) -> None:
    for path in _REPO_PATH.findall(block.text):
        assert (REPO / path).exists(), f"{block.where}: {path} is not in the repository"
    if block.lang != "python":
        sections = {f.name: f.type for f in msgspec.structs.fields(Config)}
        for section, key in _CONFIG_KEY.findall(block.text):
            keys = {f.name for f in msgspec.structs.fields(sections[section])}
            assert key in keys, f"{block.where}: {section}.{key} is no configuration key"
    if block.lang in ("sh", "bash") and block.marker != "synopsis":
        for words in _stratactl_calls(block.text):
            _parses(block, words)


def _commands(text: str) -> list[str]:
    """The block's commands: its lines, continuations joined, a quote left open carried on."""
    commands, pending = [], ""
    for line in text.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{line}" if pending else line
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open
            continue
        if words:
            commands.append(pending)
        pending = ""
    assert not pending, f"a quote never closed: {pending}"
    return commands


def _stratactl_calls(text: str) -> list[list[str]]:
    calls = []
    for command in _commands(text):
        lex = shlex.shlex(command, posix=True, punctuation_chars=True)
        lex.whitespace_split, lex.commenters = True, "#"
        segment: list[str] = []
        for token in [*lex, ";"]:
            if token and set(token) <= set("&|;()"):
                while segment and segment[0] in _SHELL_WORDS:
                    segment.pop(0)
                if segment[:1] == ["stratactl"]:
                    calls.append(segment)
                segment = []
            else:
                segment.append(token)
    return calls


def _parses(block: Block, words: list[str]) -> None:
    """`words` as the command line of stratactl or stratad: their own parsers read it."""
    from stratactl.__main__ import build_parser
    from stratad.__main__ import parse_args

    parsers: dict[str, Callable[[list[str]], object]] = {
        "stratactl": build_parser()[0].parse_args,
        "stratad": parse_args,
    }
    parse = parsers[words[0]]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            parse(words[1:])
    except SystemExit as e:
        raise AssertionError(f"{block.where}: `{shlex.join(words)}`: {err.getvalue()}") from e


# --- HTTP: curl, JSON bodies -------------------------------------------------------------------


def _send(url: str, method: str, headers: dict[str, str], data: bytes | None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=2 * SECONDS) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _curl(words: list[str], daemon: Daemon) -> None:
    """A curl command line, sent as curl would send it."""
    url, method, headers, data = "", "", {}, None
    args = iter(words[1:])
    for w in args:
        if re.fullmatch(r"-[sSNf]+|--silent|--show-error|--no-buffer|--fail", w):
            continue  # what curl shows, not what it sends
        if w in ("-H", "--header"):
            name, value = next(args).split(":", 1)
            headers[name.strip().lower()] = value.strip()
        elif w in ("-d", "--data", "--data-raw"):
            data = next(args).encode()
        elif w in ("-X", "--request"):
            method = next(args)
        elif w.startswith("http"):
            url = w
        else:
            raise AssertionError(f"curl {w}: this test does not send it yet (teach _curl)")
    assert url.startswith(DOC_URL), url
    if data is not None:
        headers.setdefault("content-type", "application/x-www-form-urlencoded")  # curl's own
    t0 = time.monotonic()
    status, raw = _send(url.replace(DOC_URL, daemon.url), method or ("POST" if data else "GET"),
                        headers, data)  # fmt: skip
    sent = json.loads(data) if data and headers["content-type"] == "application/json" else {}
    _check_answer(urlsplit(url).path, sent, status, raw, time.monotonic() - t0)


def _check_answer(route: str, sent: dict, status: int, raw: bytes, seconds: float) -> None:
    assert 200 <= status < 300, (status, raw[:1000])
    assert seconds < SECONDS, f"{seconds:.0f} s: an example must answer in seconds (max_tokens?)"
    if sent.get("stream"):
        return _check_stream(route, raw.decode())
    body = json.loads(raw)
    if route == "/v1/chat/completions":
        message = body["choices"][0]["message"]
        assert isinstance(message["content"], str) or message.get("tool_calls"), body
        if sent.get("temperature") == 0:  # greedy: the same reply, never an empty one
            assert message["content"] or message.get("tool_calls"), body
        assert body["usage"]["completion_tokens"] <= sent.get("max_tokens", 1 << 30), body
    elif route == "/v1/completions":
        assert isinstance(body["choices"][0]["text"], str), body
    elif route == "/v1/messages":
        assert body["type"] == "message" and body["content"], body
    elif route == "/completion":
        assert isinstance(body["content"], str), body
    return None


def _check_stream(route: str, text: str) -> None:
    """Server-sent events that end as their protocol ends them."""
    data = [line[5:].strip() for line in text.splitlines() if line.startswith("data:")]
    assert data, text[:1000]
    if route == "/v1/messages":
        events = [line for line in text.splitlines() if line.startswith("event:")]
        assert events[-1] == "event: message_stop", text[-1000:]
    elif route in ("/completion", "/completions", "/infill"):
        assert json.loads(data[-1])["stop"] is True, text[-1000:]
    else:
        assert data[-1] == "[DONE]", text[-1000:]
        chunks = [json.loads(d) for d in data[:-1]]
        assert chunks and chunks[-1]["choices"][0]["finish_reason"], text[-1000:]


def _check_json(block: Block, request: pytest.FixtureRequest) -> None:
    body = json.loads(block.text)
    if block.marker.startswith("POST /"):
        route = block.marker.removeprefix("POST ")
        daemon = request.getfixturevalue("daemon")
        t0 = time.monotonic()
        status, raw = _send(daemon.url + route, "POST", {"content-type": "application/json"},
                            block.text.encode())  # fmt: skip
        _check_answer(route, body, status, raw, time.monotonic() - t0)


# --- shell ---------------------------------------------------------------------------------


def _run_shell(block: Block, request: pytest.FixtureRequest) -> None:
    daemon: Daemon = request.getfixturevalue("daemon")
    commands = _commands(block.text)
    if all(shlex.split(c)[0] == "curl" for c in commands):
        for c in commands:
            _curl(shlex.split(c, comments=True), daemon)
        return
    tmp: Path = request.getfixturevalue("tmp_path")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    shims = {"stratactl": f'exec "{sys.executable}" -m stratactl "$@"'} | {
        name: "exit 0" for name in STUBS
    }
    for name, body in shims.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "STRATA_CONTROL_SOCKET": str(daemon.control_socket)}  # fmt: skip
    try:
        r = subprocess.run(["bash", "-c", block.text.replace(DOC_URL, daemon.url)], cwd=tmp,
                           env=env, capture_output=True, text=True, timeout=SECONDS)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{block.where}: still running after {SECONDS} s: {e}") from None
    assert r.returncode == 0, f"{block.where}: exit {r.returncode}\n{r.stdout}\n{r.stderr}"


@dataclass(frozen=True)
class Ran:
    words: list[str]
    why_not: str = ""  # a command not run: why
    unparsed: str = ""  # what its parser said of a command line it refused
    code: int = 0
    out: str = ""
    err: str = ""


def _expand(line: str) -> list[list[str]]:
    """A synopsis line's commands: optional parts given, `a|b` its first, `x | y` each."""
    words = [w.strip("[]") for w in shlex.split(line, comments=True)]
    words = [w if w == "|" else w.split("|")[0] for w in words]
    if "|" not in words:
        return [words] if words else []
    first = words.index("|") - 1
    assert set(words[first + 1 :: 2]) == {"|"}, line
    return [[*words[:first], alternative] for alternative in words[first::2]]


@pytest.fixture(scope="module")
def synopsis(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Ran]]:
    """The commands of README's synopsis, each run once, in order, in one folder."""
    (block,) = [b for b in blocks_of(REPO / "README.md") if b.marker == "synopsis"]
    work = tmp_path_factory.mktemp("synopsis")
    (work / "check.toml").write_text(  # `stratactl check` of a daemon yet to start
        f'[server]\nport = {free_port()}\n[control]\nsocket = "{work / "check.sock"}"\n'
    )
    hidden = {"CUDA_VISIBLE_DEVICES": "", "HIP_VISIBLE_DEVICES": ""}
    values = {**PLACEHOLDERS, "FILE": str(daemon.log.parent / "stratad.toml")}
    ran = []
    for line in block.text.splitlines():
        for words in _expand(line):
            words = [values.get(w, w) for w in words]
            try:
                assert not [w for w in words if re.fullmatch(r"[A-Z_]+", w)], "a placeholder"
                _parses(block, words)
            except AssertionError as e:  # the test says so; the other lines still run
                ran.append(Ran(words, unparsed=str(e)))
                continue
            why_not = next((why for cmd, why in SYNOPSIS_NOT_RUN.items()
                            if shlex.join(words).startswith(cmd + " ")), "")  # fmt: skip
            if why_not:
                ran.append(Ran(words, why_not))
                continue
            verb = words[1]
            env = {**os.environ, **hidden, "STRATA_CONFIG": str(work / "check.toml")}
            if verb in SOCKET_VERBS:
                env["STRATA_CONTROL_SOCKET"] = str(daemon.control_socket)
            argv = [sys.executable, "-m", *words, *SYNOPSIS_EXTRA.get(verb, [])]
            r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                               timeout=180)  # fmt: skip
            ran.append(Ran(words, code=r.returncode, out=r.stdout, err=r.stderr))
    return work, ran


def _run_synopsis(block: Block, request: pytest.FixtureRequest) -> None:
    work, ran = request.getfixturevalue("synopsis")
    used = {cmd for cmd in SYNOPSIS_NOT_RUN for r in ran if r.why_not == SYNOPSIS_NOT_RUN[cmd]}
    assert used == set(SYNOPSIS_NOT_RUN), "a command SYNOPSIS_NOT_RUN names is gone from README"
    for r in ran:
        assert not r.unparsed, r.unparsed
        if r.why_not:
            continue
        assert r.words[1] in EXPECT, f"{block.where}: what must `{r.words[1]}` answer? (EXPECT)"
        codes, line = EXPECT[r.words[1]]
        assert r.code in codes and re.search(line, r.out, re.M), (
            f"{block.where}: `{shlex.join(r.words)}` exit {r.code}\n{r.out}\n{r.err}"
        )
    assert (work / "tiny-moe.pack" / "manifest.json").is_file()


# --- python, toml, output samples ------------------------------------------------------------


def _names(code: str) -> tuple[set[str], set[str]]:
    """(names the code binds, names it reads)."""
    bound: set[str] = set()
    read: set[str] = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (bound if isinstance(node.ctx, ast.Store) else read).add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
    return bound, read


def _setup(block: Block) -> list[Block]:
    """The earlier python blocks of its page that define what it uses (`client`), as a reader
    who runs the page in order has them."""
    bound, read = _names(block.text)
    free = read - bound - set(dir(builtins))
    needed: list[Block] = []
    for earlier in reversed(blocks_of(block.path)[: block.index]):
        if earlier.lang != "python" or not free:
            continue
        e_bound, e_read = _names(earlier.text)
        if free & e_bound:
            needed.insert(0, earlier)
            free = (free - e_bound) | (e_read - e_bound - set(dir(builtins)))
    assert not free, f"{block.where}: {sorted(free)} is defined by no earlier example"
    return needed


def _run_python(block: Block, request: pytest.FixtureRequest) -> None:
    daemon: Daemon = request.getfixturevalue("daemon")
    namespace: dict[str, object] = {"__name__": "__example__"}
    for b in [*_setup(block), block]:
        printed = io.StringIO()
        t0 = time.monotonic()
        with contextlib.redirect_stdout(printed):
            code = compile(b.text.replace(DOC_URL, daemon.url), b.where, "exec")
            exec(code, namespace)  # noqa: S102 - the docs' own example
    assert time.monotonic() - t0 < SECONDS, "an example must answer in seconds (max_tokens?)"
    assert printed.getvalue().strip(), f"{block.where}: printed nothing"


def _plain(value: object) -> object:
    return [_plain(v) for v in value] if isinstance(value, (tuple, list)) else value


def _check_toml(block: Block, request: pytest.FixtureRequest) -> None:
    data = tomllib.loads(block.text)
    path = request.getfixturevalue("tmp_path") / "stratad.toml"
    path.write_text(block.text)
    config = load_config(path, Env())  # the daemon's loader: unknown keys and wrong types fail
    for section, keys in data.items():
        for key, value in keys.items():
            assert _plain(getattr(getattr(config, section), key)) == value, f"{section}.{key}"


@pytest.fixture(scope="module")
def written_lines(
    synopsis: tuple[Path, list[Ran]], tmp_path_factory: pytest.TempPathFactory
) -> list[str]:
    """Lines stratad writes, written here (on the tiny-moe the synopsis made)."""
    gguf = synopsis[0] / "tiny-moe.gguf"
    assert gguf.is_file(), "README's synopsis writes tiny-moe.gguf"
    work = tmp_path_factory.mktemp("written")
    return [*store_start_lines(), *damaged_pack_lines(gguf, work), *decode_timing_lines(gguf)]


def _check_output(block: Block, request: pytest.FixtureRequest) -> None:
    lines: list[str] = request.getfixturevalue("written_lines")
    pattern = sample_pattern(block.text)
    assert any(pattern.search(canonical(line)) for line in lines), (
        f"{block.where}: stratad wrote no line of this form:\n{canonical(block.text)}\n"
        f"(as a pattern: {pattern.pattern})\nit wrote:\n" + "\n".join(lines)
    )
