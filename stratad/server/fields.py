"""Request fields we do not implement: refused by name, or, if ignoring them changes nothing
the client relies on, served with one WARNING per field name for the daemon's life.

Nothing is dropped in silence: a field that would change the output (audio, vLLM's
guided decoding, ...) gets a 400 naming it; bookkeeping fields (store, metadata, ...) and
names we do not know at all are logged once.
"""

from __future__ import annotations

import logging
import threading

import msgspec

from stratad.server.openai.requests import RequestError

log = logging.getLogger("stratad.server")

REFUSED = {
    "functions": "functions (the deprecated form of tools) are not supported",
    "function_call": "function_call (the deprecated form of tool_choice) is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "guided_json": "guided_json is not supported; use response_format json_schema",
    "guided_regex": "guided_regex is not supported",
    "guided_choice": "guided_choice is not supported",
    "guided_grammar": "guided_grammar is not supported",
    "repetition_penalty": "repetition_penalty is not supported; use frequency_penalty",
    "min_tokens": "min_tokens is not supported",
}
HARMLESS = {  # bookkeeping and hints that do not change what a reply says
    "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
    "safety_identifier", "reasoning_effort", "verbosity", "modalities",
}  # fmt: skip

_warned: set[str] = set()
_lock = threading.Lock()


def known_fields(struct: type[msgspec.Struct]) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(struct))


def check(body: bytes, known: frozenset[str]) -> None:
    """Refuse (RequestError) or warn about the top-level fields of `body` outside `known`."""
    try:
        fields = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return  # the request's own decoding says what is wrong
    for name in fields.keys() - known:
        raw = bytes(fields[name])
        if raw == b"null":
            continue  # null is the default, whatever the field
        if name in REFUSED:
            raise RequestError(REFUSED[name], name)
        if name == "modalities" and msgspec.json.decode(raw) not in (["text"], []):
            raise RequestError("only text output is supported (modalities)", name)
        with _lock:
            if name in _warned:
                continue
            _warned.add(name)
        why = "it changes nothing we serve" if name in HARMLESS else "it is not a field we know"
        log.warning("request field %r is ignored (%s); said once", name[:64], why)
