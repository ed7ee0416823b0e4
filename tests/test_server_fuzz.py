"""Schema-driven fuzzing: bodies drawn from each POST endpoint's request schema in the server's own OpenAPI
document (valid ones, and ones with the schema's field names holding values of any JSON type), sent while long
greedy streams run. No body may get a 5xx or leave a traceback in the log, a stream that is answered must end
properly, and every long stream's text must equal the same request's text run alone (the bundled demo model in
fp32: batching with the fuzz requests cannot flip a tie).

The default run sends 200 bodies per POST endpoint; `-m slow` runs test_fuzz_long with 2000.
"""

from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategy import from_schema
from server_thread import server_thread

from tiermoe.bundled import resolve_model

LONG_STREAM = {"prompt": [40, 41, 42, 43], "max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True}
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8)


class _LogErrors(logging.Handler):
    """Every record at ERROR or above, or carrying a traceback, that the server logs."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        if record.levelno >= logging.ERROR or record.exc_info:
            self.records.append(record)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    errors = _LogErrors()
    logging.getLogger().addHandler(errors)
    # a small token budget keeps every body the schema allows cheap: beyond it, a 400
    with server_thread(tmp_path_factory.mktemp("fuzz"), model_dir=resolve_model(None), max_total_tokens=64,
                       default_max_tokens=4) as (url, _):
        client = httpx.Client(base_url=url, timeout=60)
        alone = stream_text(client)
        yield client, alone, errors
        client.close()
    logging.getLogger().removeHandler(errors)


def stream_text(client: httpx.Client) -> str:
    with client.stream("POST", "/v1/completions", json=LONG_STREAM) as r:
        r.raise_for_status()
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def post_endpoints(client: httpx.Client) -> dict[str, dict | None]:
    """POST path -> its JSON body schema (None: the endpoint takes no body), from the server's OpenAPI document."""
    paths = client.get("/openapi.json").json()["paths"]
    return {path: ops["post"].get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            for path, ops in paths.items() if "post" in ops}


def bodies(schema: dict | None):
    """Valid bodies by the schema, and bodies whose known fields hold values of any type."""
    if schema is None:
        return st.dictionaries(st.text(max_size=8), JSON_VALUES, max_size=3)
    names = sorted(schema.get("properties", {}))
    mistyped = st.dictionaries(st.sampled_from(names), JSON_VALUES, max_size=len(names))
    return st.one_of(from_schema(schema), mistyped)


def check_answer(client: httpx.Client, path: str, body: dict) -> None:
    # Python's encoder writes NaN and Infinity as bare words, as a careless client would: the server must cope
    raw = json.dumps(body).encode("utf-8", "surrogatepass")
    with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        text = "".join(r.iter_text())
    assert r.status_code < 500, (path, body, r.status_code, text[:500])
    assert "Traceback" not in text
    if r.status_code == 200 and "event-stream" in r.headers.get("content-type", ""):
        last = text.rstrip().splitlines()[-1]
        ends = ('data: {"type": "message_stop"}', 'data: {"type": "error"') if path.startswith("/v1/messages") \
            else ("data: [DONE]",)
        assert last.startswith(ends), (path, body, text[-300:])
    elif r.status_code == 200 and "ndjson" in r.headers.get("content-type", ""):
        assert json.loads(text.strip().splitlines()[-1])["done"] is True, (path, body, text[-300:])


class LongStreams:
    """Long greedy streams, one after another on a thread, for as long as the fuzzing runs: each one's text."""

    def __init__(self, client: httpx.Client):
        self.client, self.texts, self._stop = client, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.texts.append(stream_text(self.client))

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=120)


def fuzz(server, examples: int) -> None:
    client, alone, errors = server
    endpoints = post_endpoints(client)
    generation = ("/v1/chat/completions", "/v1/completions", "/generate", "/api/chat", "/api/generate")
    assert all(endpoints.get(path) for path in generation), "each generation endpoint declares its body"
    with LongStreams(client) as streams:
        for path, schema in endpoints.items():
            @settings(max_examples=examples, deadline=None, database=None, derandomize=examples <= 200,
                      suppress_health_check=list(HealthCheck))
            @given(bodies(schema))
            def send(body):
                check_answer(client, path, body)

            send()
    assert streams.texts and all(text == alone for text in streams.texts)
    assert not errors.records, [r.getMessage() for r in errors.records[:3]]


def test_fuzz_every_post_endpoint_while_a_long_stream_runs(server):
    fuzz(server, 80)  # per endpoint; test_fuzz_long (-m slow) sends 2000


@pytest.mark.slow
def test_fuzz_long(server):
    fuzz(server, 2000)
