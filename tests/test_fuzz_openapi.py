"""The API fuzzed from the OpenAPI document it serves (schemathesis), small and derandomized:
for every operation a few generated requests, valid and not, each answered without a 5xx, with
a status, content type and body the document describes. `bench/http/fuzz_api.py` is the long run.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import Case
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)
from schemathesis.core.result import Ok

from tests.server_helpers import shared_daemon

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


EXAMPLES = 6  # per operation: about 30 s for all of them on tiny-moe
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same requests every run
    database=None,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.explicit, Phase.generate],
)


def test_answers_conform_to_the_served_openapi() -> None:
    schema = schemathesis.openapi.from_url(f"{shared_daemon('fuzz').url}/openapi.json")
    tested = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # the document's every operation is readable
        operation = result.ok()

        @FUZZ
        @given(case=operation.as_strategy())
        def answers(case: Case) -> None:
            case.call_and_validate(checks=CHECKS, timeout=60)

        answers()
        tested.append(operation.label)
    assert "POST /v1/chat/completions" in tested and len(tested) >= 9, tested


def test_the_fuzz_left_no_traceback_in_the_log() -> None:
    log = shared_daemon("fuzz").log.read_text()
    assert "Traceback" not in log


def test_a_stream_and_a_wrong_model_are_as_documented() -> None:
    """Found by bench/http/fuzz_api.py: the event-stream answer was documented as one string (each
    event is an object whose `data` is a chunk), and a 404 for a model not served was not
    documented at all."""
    schema = schemathesis.openapi.from_url(f"{shared_daemon('fuzz').url}/openapi.json")
    chat = schema["/v1/chat/completions"]["POST"]
    stream: Any = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    chat.Case(body=stream).call_and_validate(checks=CHECKS, timeout=60)
    for path in ("/v1/completions", "/v1/chat/completions"):
        answers = schema.raw_schema["paths"][path]["post"]["responses"]
        assert "model_not_found" in answers["404"]["description"]
