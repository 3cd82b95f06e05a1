"""The server's gates as plain ASGI, driven in-process with no engine: the guard in front of the
routes (key -> tenant, 401/403/413/503, body reassembly, in-flight counting, the KV view's admin
and Basic rules; server/middleware.py), the request-body deadline (408; body_deadline.py), and the
server options that decide them (settings.ServerConfig, tenants.py)."""
from __future__ import annotations

import asyncio
import base64
import json
from types import SimpleNamespace

import pytest

from kvshare.server.body_deadline import BodyDeadlineMiddleware
from kvshare.server.middleware import (
    DISCARD_LIMIT,
    GuardMiddleware,
    basic_password,
    bearer_token,
    is_loopback_host_header,
    is_view_path,
)
from kvshare.server.settings import ServerConfig, is_loopback_name, key_digest
from kvshare.server.tenants import (
    TENANT_SCOPE_KEY,
    admin_key_from_args,
    effective_cache_salt,
    tenant_cache_salt,
)

KEYS = {"sk-acme": "acme", "sk-globex": "globex"}
ADMIN = "sk-root"


class Recorder:
    """The app behind the gate: records what reached it and answers 200 with what it read."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[dict] = []
        self.fail = fail
        self.state = None

    async def __call__(self, scope, receive, send):
        messages = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        self.calls.append({"scope": scope, "messages": messages,
                           "inflight": self.state.inflight if self.state else None})
        if self.fail:
            raise RuntimeError("the route failed")
        body = b"".join(m.get("body", b"") for m in messages)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})


def gate_state(**config) -> SimpleNamespace:
    rejected: list[str] = []
    return SimpleNamespace(config=ServerConfig(**config), draining=False, inflight=0,
                           metrics=SimpleNamespace(on_rejected=rejected.append), rejected=rejected)


def call(app, method="POST", path="/v1/completions", headers=(), chunks=(b"{}",), content_length=True,
         disconnect_after=None):
    """(status, headers dict, body) of one request through an ASGI app; chunks arrive one per receive()."""
    chunks = list(chunks)
    hdrs = [(k.encode(), v.encode()) for k, v in headers]
    if content_length and method == "POST":
        hdrs.append((b"content-length", str(sum(map(len, chunks))).encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": hdrs, "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5)}
    sent = []
    index = 0

    async def receive():
        nonlocal index
        if disconnect_after is not None and index >= disconnect_after or index >= max(len(chunks), 1):
            await asyncio.sleep(0)
            return {"type": "http.disconnect"}
        body = chunks[index] if chunks else b""
        index += 1
        return {"type": "http.request", "body": body, "more_body": index < len(chunks)}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    if not sent:
        return None, {}, None
    start = sent[0]
    body = b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, body


def error_of(body: bytes) -> dict:
    return json.loads(body)["error"]


def bearer(key: str) -> tuple[str, str]:
    return ("authorization", f"Bearer {key}")


def basic(password: str, user: str = "anyone") -> tuple[str, str]:
    return ("authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())


def guarded(**config):
    state = gate_state(**config)
    app = Recorder()
    app.state = state
    return GuardMiddleware(app, state), app, state


# ---- keys and tenants --------------------------------------------------------------------------

def test_a_missing_or_wrong_key_is_a_401_with_a_bearer_challenge_and_never_reaches_the_app():
    gate, app, state = guarded(api_keys=KEYS)
    for headers in ([], [bearer("sk-acm")], [bearer("sk-acme-x")], [("authorization", "sk-acme")],
                    [basic("sk-acme")]):
        status, hdrs, body = call(gate, headers=headers)
        assert status == 401 and hdrs["www-authenticate"] == "Bearer"
        err = error_of(body)
        assert err["code"] == "invalid_api_key" and err["type"] == "invalid_request_error"
        assert "sk-acme" not in body.decode()  # the refusal never echoes a key
    assert app.calls == [] and state.rejected == ["unauthorized"] * 5


def test_a_good_key_puts_its_tenant_in_the_scope():
    gate, app, _ = guarded(api_keys=KEYS)
    for key, tenant in KEYS.items():
        status, _, _ = call(gate, headers=[bearer(key)])
        assert status == 200 and app.calls[-1]["scope"][TENANT_SCOPE_KEY] == tenant


def test_paths_outside_the_api_stay_open_and_the_root_api_paths_are_guarded():
    gate, app, _ = guarded(api_keys=KEYS)
    for path in ("/health", "/ready", "/metrics", "/version", "/v1", "/tokenizex"):
        assert call(gate, "GET", path)[0] == 200, path
    for path in ("/tokenize", "/detokenize", "/openapi.json", "/v1/models", "/v1/chat/completions"):
        assert call(gate, "POST", path)[0] == 401, path
    assert TENANT_SCOPE_KEY not in app.calls[0]["scope"]


def test_draining_refuses_new_api_requests_with_a_retry_after_but_not_health():
    gate, app, state = guarded()
    state.draining = True
    status, hdrs, body = call(gate, headers=[("content-type", "application/json")])
    assert status == 503 and hdrs["retry-after"] == "5" and error_of(body)["code"] == "shutting_down"
    assert call(gate, "GET", "/health")[0] == 200
    assert state.rejected == ["shutting_down"]


def test_non_http_scopes_pass_untouched():
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["type"])

    state = gate_state(api_keys=KEYS)
    asyncio.run(GuardMiddleware(app, state)({"type": "lifespan"}, None, None))
    asyncio.run(BodyDeadlineMiddleware(app, 0.01)({"type": "websocket"}, None, None))
    assert seen == ["lifespan", "websocket"]


# ---- bodies ------------------------------------------------------------------------------------

JSON = ("content-type", "application/json")


def test_a_body_in_chunks_reaches_the_app_as_one_message():
    gate, app, _ = guarded()
    status, _, body = call(gate, headers=[JSON], chunks=[b'{"prompt":', b' "a",', b' "n": 1}'])
    assert status == 200 and body == b'{"prompt": "a", "n": 1}'
    (first,) = [m for m in app.calls[0]["messages"] if m["type"] == "http.request"]
    assert first == {"type": "http.request", "body": b'{"prompt": "a", "n": 1}', "more_body": False}


def test_a_declared_length_over_the_limit_is_a_413_naming_both_sizes():
    gate, app, state = guarded(max_body_bytes=100)
    status, _, body = call(gate, headers=[JSON], chunks=[b"x" * 101])
    err = error_of(body)
    assert status == 413 and err["code"] == "request_too_large"
    assert "101 bytes" in err["message"] and "limit is 100 bytes (--max-body-bytes)" in err["message"]
    assert app.calls == [] and state.rejected == ["body_too_large"]
    assert call(gate, headers=[JSON], chunks=[b"x" * 100])[0] == 200


def test_an_undeclared_body_is_counted_as_it_arrives():
    gate, app, _ = guarded(max_body_bytes=100)
    status, _, body = call(gate, headers=[JSON], chunks=[b"x" * 60, b"y" * 60], content_length=False)
    assert status == 413 and "more than 100 bytes" in error_of(body)["message"]
    assert app.calls == []
    assert call(gate, headers=[JSON], chunks=[b"x" * 50, b"y" * 50], content_length=False)[0] == 200


def test_a_content_length_that_is_not_a_number_is_a_400():
    gate, app, _ = guarded()
    status, _, body = call(gate, headers=[JSON, ("content-length", "ten")], content_length=False)
    assert status == 400 and error_of(body)["code"] == "invalid_header" and "'ten'" in error_of(body)["message"]
    assert app.calls == []


def test_a_client_gone_before_its_body_ends_gets_nothing_and_the_app_is_not_called():
    gate, app, state = guarded()
    status, _, _ = call(gate, headers=[JSON], chunks=[b"{", b"}"], content_length=False, disconnect_after=1)
    assert status is None and app.calls == [] and state.inflight == 0


def test_in_flight_requests_are_counted_while_inside_and_released_on_failure():
    state = gate_state()
    app = Recorder()
    app.state = state
    assert call(GuardMiddleware(app, state), headers=[JSON])[0] == 200
    assert app.calls[0]["inflight"] == 1 and state.inflight == 0
    failing = Recorder(fail=True)
    failing.state = state
    with pytest.raises(RuntimeError):
        call(GuardMiddleware(failing, state), headers=[JSON])
    assert failing.calls[0]["inflight"] == 1 and state.inflight == 0


def test_the_discard_budget_is_bounded():
    assert DISCARD_LIMIT == 64 * 2**20
    gate, _, _ = guarded(max_body_bytes=10)
    # A declared huge body: the gate reads what arrives (here one chunk) and answers.
    status, _, body = call(gate, headers=[JSON, ("content-length", str(10**12))], chunks=[b"x" * 20],
                           content_length=False)
    assert status == 413 and f"{10**12} bytes" in error_of(body)["message"]


# ---- the KV view -------------------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/kv/snapshot", "/kv/events", "/dashboard", "/dashboard/app.js"])
def test_the_view_opens_to_the_admin_key_only_when_one_is_set(path):
    gate, app, _ = guarded(api_keys=KEYS, admin_key=ADMIN)
    assert call(gate, "GET", path, [bearer(ADMIN)])[0] == 200
    assert call(gate, "GET", path, [basic(ADMIN)])[0] == 200
    status, hdrs, body = call(gate, "GET", path, [bearer("sk-acme")])
    assert status == 403 and error_of(body)["code"] == "admin_key_required" and "www-authenticate" not in hdrs
    status, hdrs, body = call(gate, "GET", path, [bearer("nope")])
    assert status == 401 and hdrs["www-authenticate"] == 'Basic realm="kvshare", charset="UTF-8"'
    assert "admin key (--admin-key)" in error_of(body)["message"]


def test_without_an_admin_key_any_api_key_opens_the_view_and_without_keys_it_is_open():
    gate, _, _ = guarded(api_keys=KEYS)
    assert call(gate, "GET", "/kv/snapshot", [bearer("sk-globex")])[0] == 200
    assert call(gate, "GET", "/kv/snapshot", [basic("sk-acme", user="")])[0] == 200
    status, _, body = call(gate, "GET", "/kv/snapshot")
    assert status == 401 and "missing or wrong API key" in error_of(body)["message"]
    open_gate, _, _ = guarded(host="0.0.0.0")
    assert call(open_gate, "GET", "/kv/snapshot")[0] == 200


def test_basic_credentials_another_site_made_the_browser_send_are_refused_without_a_challenge():
    gate, _, state = guarded(api_keys=KEYS, admin_key=ADMIN)
    for site in ("cross-site", "same-site"):
        status, hdrs, body = call(gate, "GET", "/dashboard", [basic(ADMIN), ("sec-fetch-site", site)])
        assert status == 403 and "www-authenticate" not in hdrs
        assert error_of(body)["code"] == "cross_site_request" and site in error_of(body)["message"]
    for site in ("same-origin", "none"):
        assert call(gate, "GET", "/dashboard", [basic(ADMIN), ("sec-fetch-site", site)])[0] == 200
    # A Bearer key is not something a browser attaches by itself.
    assert call(gate, "GET", "/dashboard", [bearer(ADMIN), ("sec-fetch-site", "cross-site")])[0] == 200
    assert state.rejected == ["unauthorized", "unauthorized"]


def test_basic_is_not_accepted_on_the_api():
    gate, _, _ = guarded(api_keys=KEYS)
    assert call(gate, headers=[basic("sk-acme")])[0] == 401


def test_the_view_is_neither_drained_nor_counted_in_flight():
    gate, app, state = guarded()
    state.draining = True
    assert call(gate, "GET", "/kv/events")[0] == 200
    assert app.calls[0]["inflight"] == 0


# ---- header parsing ------------------------------------------------------------------------------

def test_bearer_token_parsing():
    assert bearer_token(b"Bearer abc") == b"abc"
    assert bearer_token("BEARER  abc  ") == b"abc"
    assert bearer_token(b"Bearer") == b""  # an empty token: no key has that digest
    assert bearer_token(b"Token abc") is None and bearer_token(b"") is None
    assert bearer_token("Bearer caf\u00e9") == "caf\u00e9".encode("latin-1")


def test_basic_password_parsing():
    encode = lambda s: b"Basic " + base64.b64encode(s)  # noqa: E731
    assert basic_password(encode(b"user:pw")) == b"pw"
    assert basic_password(encode(b":pw:with:colons")) == b"pw:with:colons"
    assert basic_password(encode(b"no-colon")) is None
    assert basic_password(b"Basic not base64!") is None
    assert basic_password(b"Bearer abc") is None
    assert basic_password(b"basic " + base64.b64encode(b"u:p")) == b"p"


@pytest.mark.parametrize("host,loopback", [
    ("localhost", True), ("LOCALHOST:8000", True), ("127.0.0.1", True), ("127.9.9.9:1", True),
    ("[::1]", True), ("[::1]:8000", True), ("localhost.evil.example", False), ("evil.example:80", False),
    ("10.0.0.1", False), ("[::2]:8000", False), ("", False), (":8000", False), ("0.0.0.0", False),
])
def test_loopback_host_headers(host, loopback):
    assert is_loopback_host_header(host) is loopback


def test_loopback_names_and_view_paths():
    assert is_loopback_name("::1") and is_loopback_name("[::1]") and is_loopback_name(" LocalHost ")
    assert not is_loopback_name("example.com") and not is_loopback_name("::")
    assert is_view_path("/kv/") and is_view_path("/dashboard") and is_view_path("/dashboard/x.css")
    assert not is_view_path("/kv") and not is_view_path("/dashboards") and not is_view_path("/v1/kv/")


# ---- the body deadline -------------------------------------------------------------------------

def slow_client(delays, chunks):
    """A receive() that sleeps delays[i] before handing chunk i, then waits for ever (a client that stops)."""
    index = 0

    async def receive():
        nonlocal index
        if index < len(chunks):
            await asyncio.sleep(delays[index])
            index += 1
            return {"type": "http.request", "body": chunks[index - 1], "more_body": index < len(chunks)}
        await asyncio.sleep(3600)

    return receive


def run_deadline(app, timeout, receive, path="/v1/completions"):
    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(asyncio.wait_for(BodyDeadlineMiddleware(app, timeout)(scope, receive, send), 5))
    return sent


def test_a_body_that_does_not_arrive_in_time_is_a_408_that_closes_the_connection():
    seen = []

    async def app(scope, receive, send):
        while True:
            message = await receive()
            seen.append(message["type"])
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                return

    sent = run_deadline(app, 0.05, slow_client([0, 1.0], [b"{", b"}"]))
    assert seen == ["http.request", "http.disconnect"]  # the app is told the client left
    start = sent[0]
    assert start["status"] == 408
    assert (b"connection", b"close") in start["headers"]
    err = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["error"]
    assert err["code"] == "request_timeout" and "0.05s (--request-body-timeout)" in err["message"]


def test_a_route_that_raises_on_the_disconnect_still_gets_its_408():
    async def app(scope, receive, send):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client gone")

    sent = run_deadline(app, 0.02, slow_client([1.0], [b"{}"]))
    assert sent[0]["status"] == 408


def test_a_body_in_time_passes_and_reads_after_it_have_no_deadline():
    reads = []

    async def app(scope, receive, send):
        reads.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        reads.append(await receive())  # a stream waiting for its client to leave

    index = 0

    async def receive():
        nonlocal index
        index += 1
        if index == 1:
            return {"type": "http.request", "body": b"{}", "more_body": False}
        await asyncio.sleep(0.2)  # past the deadline, after the body: no 408, no early disconnect
        return {"type": "http.disconnect"}

    sent = run_deadline(app, 0.05, receive)
    assert [m["type"] for m in reads] == ["http.request", "http.disconnect"]
    assert [m.get("status") for m in sent] == [200, None]


def test_a_response_already_started_is_not_followed_by_a_408():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        message = await receive()
        assert message["type"] == "http.disconnect"
        await send({"type": "http.response.body", "body": b""})

    sent = run_deadline(app, 0.02, slow_client([1.0], [b"{}"]))
    assert [m.get("status") for m in sent] == [200, None]


def test_an_app_error_that_is_not_the_deadlines_propagates():
    async def app(scope, receive, send):
        await receive()
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_deadline(app, 1.0, slow_client([0], [b"{}"]))


# ---- options that decide the gate -----------------------------------------------------------------

def test_keys_and_tenants_in_the_config():
    cfg = ServerConfig(api_key="sk-one", api_keys={"sk-two": "team"}, admin_key=ADMIN)
    assert cfg.api_keys == {"sk-one": "api-key-1", "sk-two": "team"}
    assert cfg.key_digests == {key_digest("sk-one"): "api-key-1", key_digest("sk-two"): "team"}
    assert cfg.auth_on and not cfg.checks_browsers
    assert "sk-" not in repr(cfg) and ADMIN not in repr(cfg)
    line = cfg.describe_auth()
    assert "2 API key(s) of 2 tenant(s)" in line and "sk-" not in line and ADMIN not in line


@pytest.mark.parametrize("config,words", [
    (dict(api_key=""), "api_key is empty"),
    (dict(api_keys={"": "t"}), "an API key is empty"),
    (dict(api_keys={"k": ""}), "tenant name is empty"),
    (dict(admin_key=""), "admin_key is empty"),
    (dict(api_keys={"k": "t"}, admin_key="k"), "also an API key"),
    (dict(cache_salt_from_api_key=True), "needs API keys"),
    (dict(port=70000), "port=70000"),
    (dict(max_waiting=-1), "max_waiting=-1"),
    (dict(request_timeout=0), "request_timeout=0"),
    (dict(request_body_timeout=0), "request_body_timeout=0"),
    (dict(limit_concurrency=0), "limit_concurrency=0"),
    (dict(max_stop_strings=0), "(--max-stop-strings)"),
    (dict(max_sequences_per_request=True), "(--max-sequences-per-request)"),
    (dict(tool_call_parser="nope"), "choose from hermes, llama3_json, pythonic"),
    (dict(enable_auto_tool_choice=True), "requires --tool-call-parser"),
    (dict(chat_template="{% for %}"), "chat_template (--chat-template): the chat template does not parse"),
])
def test_bad_server_options_are_refused_naming_the_option(config, words):
    with pytest.raises(ValueError) as err:
        ServerConfig(**config)
    assert words in str(err.value)


def test_the_auth_line_says_what_is_exposed():
    assert "listening on loopback only" in ServerConfig().describe_auth()
    assert "authentication OFF" in ServerConfig(host="0.0.0.0").describe_auth()
    assert "admin key: yes" in ServerConfig(admin_key=ADMIN).describe_auth()
    assert "cache salt from the API key's tenant: yes" in ServerConfig(
        api_keys=KEYS, cache_salt_from_api_key=True).describe_auth()
    assert ServerConfig(listen_fd=3).checks_browsers is False
    assert ServerConfig(host="localhost").checks_browsers is True


def test_the_cache_salt_is_the_clients_unless_derived_from_the_tenant():
    plain = ServerConfig(api_keys=KEYS)
    derived = ServerConfig(api_keys=KEYS, cache_salt_from_api_key=True)
    scope = {TENANT_SCOPE_KEY: "acme"}
    assert effective_cache_salt(plain, scope, "mine") == "mine"
    assert effective_cache_salt(plain, scope, None) is None
    assert effective_cache_salt(derived, scope, "mine") == tenant_cache_salt("acme", "mine") == '["acme","mine"]'
    assert effective_cache_salt(derived, scope, None) == '["acme",null]'
    assert effective_cache_salt(derived, {TENANT_SCOPE_KEY: "globex"}, None) != effective_cache_salt(
        derived, scope, None)
    assert tenant_cache_salt("é", "ü") == '["é","ü"]'  # text as is, not escaped


def test_the_admin_key_comes_from_the_flag_else_the_environment_and_is_never_empty():
    assert admin_key_from_args("a", {"KVSHARE_ADMIN_KEY": "b"}) == "a"
    assert admin_key_from_args(None, {"KVSHARE_ADMIN_KEY": "b"}) == "b"
    assert admin_key_from_args(None, {}) is None
    with pytest.raises(ValueError, match="KVSHARE_ADMIN_KEY is set but empty"):
        admin_key_from_args(None, {"KVSHARE_ADMIN_KEY": ""})
    with pytest.raises(ValueError, match="--admin-key is empty"):
        admin_key_from_args("", {"KVSHARE_ADMIN_KEY": "b"})
