"""A web page cannot drive the server behind the user's back. Bound to loopback, a Host that is not a loopback name
(DNS rebinding) gets 421; a request whose Origin is neither the server's own nor in --allowed-origins gets 403 and
generates nothing (a browser's text/plain POST needs no preflight); a GET from another site's page (an <img>, no
Origin) is refused by its Sec-Fetch-Site; the recorder endpoints take POST only. Allowed origins get CORS for
themselves, never a wildcard. Clients that send no Origin (curl, the SDKs) are served as before; /health stays
open. All this happens before the API key check (a preflight carries no key)."""

from __future__ import annotations

import argparse
import json

import httpx
import pytest
from conftest import run_cli
from server_thread import GOOD_BODIES, server_thread
from test_cli_bad_input import assert_one_line_error

from tiermoe.config import ServerConfig
from tiermoe.errors import TiermoeError

APP = "http://app.example:8080"
EVIL = "http://evil.example"
KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with server_thread(tmp_path_factory.mktemp("origin"), api_key="k", allowed_origins=(APP,)) as (url, state):
        yield url, state


def _error(path: str, r: httpx.Response) -> str:
    return r.json()["error"] if path.startswith("/api/") else r.json()["error"]["message"]


def test_a_dns_rebinding_host_is_refused_before_anything_runs(served):
    url, state = served
    port = url.rsplit(":", 1)[1]
    requests = state.metrics.requests_total
    for path, body in GOOD_BODIES.items():
        r = httpx.post(url + path, json=body, headers={"Host": f"evil.example:{port}", **KEY}, timeout=10)
        assert r.status_code == 421, r.text
        assert _error(path, r).startswith(f"Host 'evil.example:{port}' is not this server's")
    assert httpx.get(url + "/v1/models", headers={"Host": "evil.example"}).status_code == 421  # before the key
    assert state.metrics.requests_total == requests
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LOCALHOST:1"):
        assert httpx.get(url + "/v1/models", headers={"Host": host, **KEY}).status_code == 200, host
    health = httpx.get(url + "/health", headers={"Host": "evil.example", "Origin": EVIL,
                                                 "Sec-Fetch-Site": "cross-site"})
    assert health.status_code == 200 and health.json() == {"status": "ok"}  # /health stays open


def test_a_foreign_pages_text_plain_post_gets_403_and_generates_nothing(served):
    url, state = served
    requests, steps = state.metrics.requests_total, state.service.steps
    for path, body in GOOD_BODIES.items():
        r = httpx.post(url + path, content=json.dumps(body), timeout=10,
                       headers={"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8", **KEY})
        assert r.status_code == 403, r.text
        assert _error(path, r) == f"a web page of origin '{EVIL}' may not use this server; start it with " \
                                  "--allowed-origins to allow one"
        assert "access-control-allow-origin" not in r.headers
    for origin in ("null", "http://app.example:9999", "http://localhost:1"):  # sandboxed, another port
        assert httpx.get(url + "/v1/models", headers={"Origin": origin, **KEY}).status_code == 403, origin
    preflight = httpx.options(url + "/v1/chat/completions", headers={"Origin": EVIL,
                                                                     "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 403 and "access-control-allow-origin" not in preflight.headers
    assert (state.metrics.requests_total, state.service.steps) == (requests, steps)


def test_another_sites_get_without_origin_is_refused_by_its_fetch_metadata(served):
    url, _ = served
    for site in ("cross-site", "same-site"):
        r = httpx.get(url + "/v1/models", headers={"Sec-Fetch-Site": site, **KEY})
        assert r.status_code == 403 and "Sec-Fetch-Site: " + site in r.json()["error"]["message"]
    for site in ("same-origin", "none"):  # the server's own page; the user typing the address
        assert httpx.get(url + "/v1/models", headers={"Sec-Fetch-Site": site, **KEY}).status_code == 200
    allowed = httpx.get(url + "/v1/models", headers={"Sec-Fetch-Site": "cross-site", "Origin": APP, **KEY})
    assert allowed.status_code == 200


def test_the_recorder_endpoints_take_post_only(served):
    url, _ = served
    for name in ("start", "stop", "dump"):
        path = f"/{name}_expert_distribution_record"
        r = httpx.get(url + path, headers=KEY)
        assert r.status_code == 405 and r.headers["allow"] == "POST", r.text
        assert r.json()["error"]["message"] == f"{path} takes POST only (a GET could come from any web page's " \
                                               "<img> tag)"
        assert httpx.post(url + path, headers=KEY).status_code == 400  # as before: the recorder is off here


def test_an_allowed_origin_gets_cors_for_itself_and_clients_without_origin_are_served_as_before(served):
    url, _ = served
    port = url.rsplit(":", 1)[1]
    for origin in (APP, url, f"http://localhost:{port}"):  # --allowed-origins, the server's own origins
        r = httpx.post(url + "/v1/completions", json=GOOD_BODIES["/v1/completions"], timeout=60,
                       headers={"Origin": origin, **KEY})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == origin and r.headers["vary"] == "Origin"
    wrong_key = httpx.get(url + "/v1/models", headers={"Origin": APP})  # the page can read why it failed
    assert wrong_key.status_code == 401 and wrong_key.headers["access-control-allow-origin"] == APP
    preflight = httpx.options(url + "/v1/chat/completions", headers={
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == APP and preflight.headers["vary"] == "Origin"
    assert preflight.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"
    assert preflight.headers["access-control-allow-headers"] == "Authorization, Content-Type, x-stainless-os"
    plain = httpx.post(url + "/v1/completions", json=GOOD_BODIES["/v1/completions"], headers=KEY, timeout=60)
    assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_allowed_origins_are_origins_and_never_a_wildcard():
    for value in ("*", "null"):
        with pytest.raises(TiermoeError, match="would let any web page"):
            ServerConfig(allowed_origins=(value,))
        assert_one_line_error(run_cli("serve", "--allowed-origins", value), "would let any web page")
    assert_one_line_error(run_cli("serve", "--allowed-origins", "http://a.example/app"), "is not an origin")
    assert ServerConfig(allowed_origins=("HTTP://App.Example:80/", "https://[::1]:8443")).allowed_origins == \
        ("http://app.example", "https://[::1]:8443")


def test_allowed_origins_come_as_a_list_or_repeated_and_reach_the_ranks_as_given():
    import argparse

    from tiermoe.cli.serve_flags import add_serve_flags, server_config_from_args
    from tiermoe.cli.serve_ranks import rank_flags

    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    args = parser.parse_args(["--allowed-origins", "http://a.example, https://B.example:8443/",
                              "--allowed-origins", "http://c.example:80"])
    assert server_config_from_args(args).allowed_origins == ("http://a.example", "https://b.example:8443",
                                                             "http://c.example")
    flags = rank_flags(args)
    assert flags[flags.index("--allowed-origins") + 1] == "http://a.example,https://b.example:8443,http://c.example"


def test_off_loopback_the_server_starts_only_with_a_key_or_the_host_names_it_answers_to():
    """The measured hole: --host 0.0.0.0 with no key answered `Host: evil.example` with 200 and CORS for a matching
    Origin (DNS rebinding). Now such a server does not start; with --allowed-hosts other Hosts get 421."""
    with pytest.raises(TiermoeError, match=r"--host 0.0.0.0 lets other machines reach the server.*--allowed-hosts"):
        ServerConfig(host="0.0.0.0")
    assert_one_line_error(run_cli("serve", "--host", "0.0.0.0", "--port", "1"), "give --api-key-file PATH")
    ServerConfig(host="0.0.0.0", api_key="k")
    ServerConfig(host="0.0.0.0", allowed_hosts=("*",))
    from tiermoe.cli.serve_flags import host_names

    assert host_names("chat.example, 10.0.0.5,[::1]") == ["chat.example", "10.0.0.5", "[::1]"]
    with pytest.raises(argparse.ArgumentTypeError, match="expected host names"):
        host_names("http://chat.example/")

    from starlette.responses import PlainTextResponse
    from starlette.testclient import TestClient

    from tiermoe.server.origin_check import OriginCheck

    config = ServerConfig(host="0.0.0.0", port=8080, allowed_hosts=("Chat.Example", "[::1]"))
    client = TestClient(OriginCheck(PlainTextResponse("ran"), config), base_url="http://chat.example:8080")
    assert client.get("/v1/models").text == "ran"
    assert client.get("/v1/models", headers={"Host": "[::1]:8080"}).text == "ran"
    rebound = client.post("/v1/completions", content="{}", headers={"Host": "evil.example:8080", "Origin": EVIL,
                                                                     "Content-Type": "text/plain"})
    assert rebound.status_code == 421 and "access-control-allow-origin" not in rebound.headers
    assert "--allowed-hosts: ::1, chat.example" in rebound.json()["error"]["message"]
    anyone = ServerConfig(host="0.0.0.0", port=8080, allowed_hosts=("*",))
    assert TestClient(OriginCheck(PlainTextResponse("ran"), anyone)).get(
        "/v1/models", headers={"Host": "evil.example"}).text == "ran"
