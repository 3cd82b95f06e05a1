"""Authentication and tenants (issue 33): per-tenant API keys whose tenant, with
--cache-salt-from-api-key, is the prefix cache salt (a tenant never hits, nor learns of, another's
cached prompts); the KV view behind --admin-key; empty keys refused at start-up; a key-less
loopback server answers only loopback Host names and JSON bodies; the data-parallel front end
forwards no dot-segment path, and /openapi.json is behind the key on both servers."""
from __future__ import annotations

import asyncio
import base64
import json
import subprocess
import sys
import uuid
from types import SimpleNamespace

import httpx2
import openai
import pytest

from kvshare.ray.asgi import call_asgi
from kvshare.server.middleware import GuardMiddleware, bearer_key_matches, bearer_tenant
from kvshare.server.settings import ServerConfig
from kvshare.server.tenants import keys_from_args, read_api_key_file, tenant_cache_salt
from kvshare.testing.ports import free_port
from server_proc import MODEL, ServerProcess

KEY_FILE = """# key tenant
sk-acme-1 acme
sk-acme-2\tacme

sk-globex-1 globex
"""
ADMIN = "sk-admin-secret"
KEYS = ("sk-acme-1", "sk-acme-2", "sk-globex-1")


# ---- keys, key files and the salt ------------------------------------------------------------------

@pytest.mark.parametrize("text, message", [
    ("sk-1 acme\nsk-2\n", "line 2: expected 'KEY TENANT'"),
    ("sk-1 acme\n\nsk-2 acme extra\n", "line 3: expected 'KEY TENANT' (two fields separated by spaces), got 3"),
    ("# tenants\nsk-1 acme\nsk-1 globex\n", "line 3: the key of line 2 again"),
    ("# nothing\n\n", "no keys in it"),
])
def test_a_bad_key_file_is_an_error_naming_the_line_and_never_the_key(tmp_path, text, message):
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match="--api-key-file") as e:
        read_api_key_file(str(path))
    assert message in str(e.value) and "sk-" not in str(e.value)


def test_keys_come_from_flags_file_and_environment_and_an_empty_one_is_an_error(tmp_path):
    path = tmp_path / "keys"
    path.write_text(KEY_FILE)
    keys = keys_from_args(["sk-x", "sk-y"], str(path), {})
    assert keys == {"sk-x": "api-key-1", "sk-y": "api-key-2", "sk-acme-1": "acme", "sk-acme-2": "acme",
                    "sk-globex-1": "globex"}
    assert keys_from_args(None, None, {"KVSHARE_API_KEY": "sk-env"}) == {"sk-env": "api-key-1"}
    assert keys_from_args(None, None, {}) == {}
    with pytest.raises(ValueError, match="--api-key number 2 is empty"):
        keys_from_args(["sk-x", ""], None, {})
    with pytest.raises(ValueError, match="KVSHARE_API_KEY is set but empty"):
        keys_from_args(None, None, {"KVSHARE_API_KEY": ""})
    with pytest.raises(ValueError, match="also given by --api-key"):
        keys_from_args(["sk-acme-1"], str(path), {})
    with pytest.raises(ValueError, match="admin key .* is also an API key"):
        ServerConfig(api_keys={"sk-a": "a"}, admin_key="sk-a")
    with pytest.raises(ValueError, match="needs API keys"):
        ServerConfig(cache_salt_from_api_key=True)


def test_the_tenant_salt_is_unambiguous():
    salts = {tenant_cache_salt("a", "b:c"), tenant_cache_salt("a:b", "c"), tenant_cache_salt("a", None),
             tenant_cache_salt("a", "null"), tenant_cache_salt('a",null', None), tenant_cache_salt("a", '"')}
    assert len(salts) == 6


def test_bearer_keys_map_to_their_tenant():
    cfg = ServerConfig(api_keys={"sk-a": "acme", "sk-b": "globex"})
    assert bearer_tenant(b"Bearer sk-a", cfg.key_digests) == "acme"
    assert bearer_tenant("bearer  sk-b ", cfg.key_digests) == "globex"  # any case, token trimmed
    assert bearer_tenant(b"Bearer sk-", cfg.key_digests) is None
    assert bearer_tenant(b"Basic sk-a", cfg.key_digests) is None
    assert bearer_key_matches("Bearer k1", "k1") and not bearer_key_matches("Bearer k10", "k1")


@pytest.mark.parametrize("argv, env, flag", [
    (["--api-key", ""], {}, "--api-key number 1 is empty"),
    ([], {"KVSHARE_API_KEY": ""}, "KVSHARE_API_KEY is set but empty"),
    (["--admin-key", ""], {}, "--admin-key is empty"),
])
def test_an_empty_key_is_a_start_up_error_naming_the_flag(argv, env, flag):
    """Before the fix an empty key meant no key: the server started, open to everyone."""
    import os

    proc = subprocess.run([sys.executable, "-m", "kvshare.cli", "serve", "--port", str(free_port()), *argv],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 2 and flag in proc.stderr, proc.stderr[-2000:]


# ---- the gate's Host and Content-Type checks, where the operator chose the exposure ---------------

def _through_gate(config: ServerConfig, method: str, path: str, headers: list[tuple[str, str]]) -> int:
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    state = SimpleNamespace(config=config, draining=False, inflight=0, metrics=SimpleNamespace(on_rejected=lambda r: None))

    async def main():
        return [item async for item in call_asgi(GuardMiddleware(app, state), method, path, "", headers, b"{}")][0]

    return asyncio.run(main())["status"]


def test_only_a_keyless_loopback_server_checks_host_and_content_type():
    foreign = [("host", "evil.example"), ("content-type", "text/plain")]
    assert _through_gate(ServerConfig(), "POST", "/v1/completions", foreign) == 421
    assert _through_gate(ServerConfig(), "POST", "/v1/completions", [("host", "localhost:1")]) == 415
    assert _through_gate(ServerConfig(), "POST", "/v1/completions", [("content-type", "application/json")]) == 200
    assert _through_gate(ServerConfig(host="::1"), "GET", "/kv/snapshot", [("host", "rebound.example:8000")]) == 421
    # Bound elsewhere (the operator opened it up) or behind a key: not the gate's to refuse.
    assert _through_gate(ServerConfig(host="0.0.0.0"), "POST", "/v1/completions", foreign) == 200
    assert _through_gate(ServerConfig(api_key="k"), "POST", "/v1/completions",
                         foreign + [("authorization", "Bearer k")]) == 200
    # A data-parallel replica (serving the socket its front end bound): the front end checked;
    # behind a front end on --host 0.0.0.0 a form-encoded POST it accepted must not come back 415.
    form = [("host", "127.0.0.1:41000"), ("content-type", "application/x-www-form-urlencoded")]
    assert _through_gate(ServerConfig(), "POST", "/v1/completions", form) == 415
    assert _through_gate(ServerConfig(listen_fd=3), "POST", "/v1/completions", form) == 200


# ---- a real server with two tenants and an admin --------------------------------------------------

@pytest.fixture(scope="module")
def tenant_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.txt"
    path.write_text(KEY_FILE)
    srv = ServerProcess("--api-key-file", str(path), "--cache-salt-from-api-key", "--admin-key", ADMIN).wait_ready()
    yield srv
    srv.close()


def _cached(srv: ServerProcess, key: str, prompt: str, **extra) -> int:
    client = openai.OpenAI(base_url=srv.base_url, api_key=key, max_retries=0, timeout=300)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0,
                                    extra_body=extra or None)
    return out.usage.prompt_tokens_details.cached_tokens


def test_a_tenant_never_hits_another_tenants_cached_prompt(tenant_server):
    """Before the fix every key shared one cache: globex's cached_tokens said acme had sent the prompt."""
    srv = tenant_server
    prompt = f"Memo {uuid.uuid4().hex}. " + "It is a truth universally acknowledged, that a single man " * 8
    assert _cached(srv, "sk-acme-1", prompt) == 0
    assert _cached(srv, "sk-globex-1", prompt) == 0
    # No salt it can pick reaches acme's blocks: neither the tenant's name nor the derived salt.
    for salt in ("acme", tenant_cache_salt("acme", None)):
        assert _cached(srv, "sk-globex-1", prompt, cache_salt=salt) == 0, salt
    hit = _cached(srv, "sk-acme-2", prompt)  # another key of the same tenant shares its cache
    assert hit >= 16 and hit % 16 == 0
    assert _cached(srv, "sk-acme-1", prompt, cache_salt="team-1") == 0  # a partition within the tenant
    assert _cached(srv, "sk-globex-1", prompt) == hit  # globex's own first request is cached for it


def test_the_kv_view_opens_to_the_admin_key_only(tenant_server):
    srv = tenant_server

    def basic(password: str) -> str:
        return "Basic " + base64.b64encode(f"user:{password}".encode()).decode()

    for path in ("/kv/snapshot", "/dashboard"):
        status, _, body = srv.request("GET", path, headers={"Authorization": "Bearer sk-acme-1"})
        assert status == 403 and json.loads(body)["error"]["code"] == "admin_key_required", (path, body)
        status, _, body = srv.request("GET", path, headers={"Authorization": basic("sk-globex-1")})
        assert status == 403, (path, body)
        status, headers, body = srv.request("GET", path)
        assert status == 401 and "--admin-key" in json.loads(body)["error"]["message"]
        assert headers["www-authenticate"].startswith("Basic")
        assert srv.request("GET", path, headers={"Authorization": f"Bearer {ADMIN}"})[0] == 200
        assert srv.request("GET", path, headers={"Authorization": basic(ADMIN)})[0] == 200
    # The admin key is not an inference key (no tenant's cache is its to read).
    assert srv.request("GET", "/v1/models", headers={"Authorization": f"Bearer {ADMIN}"})[0] == 401


def test_openapi_json_is_behind_the_key(tenant_server):
    srv = tenant_server
    status, _, body = srv.request("GET", "/openapi.json")
    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key"
    status, _, body = srv.request("GET", "/openapi.json", headers={"Authorization": "Bearer sk-globex-1"})
    assert status == 200 and "/v1/completions" in json.loads(body)["paths"]
    for path in ("/health", "/ready", "/metrics", "/version"):  # open, as vLLM's
        assert srv.request("GET", path)[0] == 200, path


def test_the_start_up_log_says_auth_is_on_and_never_shows_a_key(tenant_server):
    log = tenant_server.log_text()
    assert "authentication on: 3 API key(s) of 2 tenant(s); admin key: yes" in log
    assert "cache salt from the API key's tenant: yes" in log
    assert not any(key in log for key in (*KEYS, ADMIN))


def test_a_keyless_server_logs_that_auth_is_off():
    srv = ServerProcess()
    try:
        srv.wait_ready()
        assert "authentication off (no --api-key): listening on loopback only" in srv.log_text()
    finally:
        srv.close()


def test_tenants_stay_apart_behind_the_data_parallel_front_end(tmp_path):
    """The replicas get the front end's keys (in their environment): each finds a request's tenant
    as the front end did, so the salt the router hashed with is the one the replica caches under,
    and the KV view on a replica needs the admin key too."""
    path = tmp_path / "keys.txt"
    path.write_text(KEY_FILE)
    srv = ServerProcess("--data-parallel-size", "2", "--api-key-file", str(path), "--cache-salt-from-api-key",
                        "--admin-key", ADMIN)
    try:
        srv.wait_ready()
        prompt = f"Memo {uuid.uuid4().hex}. " + "It is a truth universally acknowledged, that a single man " * 8
        assert _cached(srv, "sk-acme-1", prompt) == 0
        assert _cached(srv, "sk-globex-1", prompt) == 0
        assert _cached(srv, "sk-acme-2", prompt) >= 16  # routed to the replica caching acme's prompt: a hit
        status, _, body = srv.request("GET", "/ready")
        replica = json.loads(body)["engines"][0]["url"]
        for key, want in (("sk-acme-1", 403), (ADMIN, 200)):
            assert httpx2.get(replica + "/kv/snapshot", headers={"Authorization": f"Bearer {key}"}).status_code == want
        log = srv.log_text()
        assert "authentication on: 3 API key(s) of 2 tenant(s)" in log
        assert not any(key in log for key in (*KEYS, ADMIN))
    finally:
        srv.close()


# ---- the data-parallel front end, against replicas that record what reaches them -------------------

def _recording_frontend(config: ServerConfig):
    from kvshare.server.data_parallel import DataParallelOptions, FrontendState, build_frontend_app
    from kvshare.server.dp_metrics import RouterMetrics
    from kvshare.server.replica import ReplicaLaunch, ReplicaProcess
    from kvshare.server.routing import Router

    replicas = [ReplicaProcess(ReplicaLaunch(i, 41000 + i, [], "ipc://unused", "ipc://unused", 1, None, None))
                for i in range(2)]
    state = FrontendState(config=config, options=DataParallelOptions(2, "least_loaded", 16, "s"),
                          metrics=RouterMetrics(MODEL, 2, "least_loaded"), router=Router(2, "least_loaded"),
                          replicas=replicas, tokenizer=None, model_name=MODEL)
    seen: list[str] = []

    async def replica_http(request: httpx2.Request) -> httpx2.Response:
        seen.append(request.url.raw_path.decode())
        return httpx2.Response(200, json={"object": "model", "id": MODEL})

    state.client = httpx2.AsyncClient(transport=httpx2.MockTransport(replica_http))
    return state, build_frontend_app(state, []), seen


def _call(app, method: str, path: str, headers=(), body: bytes = b"") -> tuple[int, bytes]:
    """One request with its path exactly as a server hands it over (decoded, dot segments kept)."""
    async def main():
        items = [item async for item in call_asgi(app, method, path, "", list(headers), body)]
        return items[0]["status"], b"".join(items[1:])

    return asyncio.run(main())


def test_the_front_end_forwards_no_path_with_dot_segments():
    """Before the fix /v1/models/../../kv/snapshot reached the replica's /kv/snapshot (the upstream
    client resolved the dots)."""
    _, app, seen = _recording_frontend(ServerConfig())
    # As uvicorn decodes them: '..', '%2e%2e' and '.%2e' all arrive as '..'.
    for path in ("/v1/models/../../kv/snapshot", "/v1/models/x/../../../kv/events", "/v1/models/./x"):
        status, body = _call(app, "GET", path)
        assert status == 404 and "'.' or '..' segments" in json.loads(body)["error"]["message"], (path, body)
    assert seen == []
    assert _call(app, "GET", f"/v1/models/{MODEL}")[0] == 200
    assert _call(app, "GET", "/v1/models/org/a?b#c")[0] == 200  # decoded ? and # stay in the path
    assert seen == [f"/v1/models/{MODEL}", "/v1/models/org/a%3Fb%23c"]


def test_the_front_end_serves_openapi_json_behind_the_key_like_a_single_server():
    _, app, seen = _recording_frontend(ServerConfig(api_key="sk-dp"))
    assert _call(app, "GET", "/openapi.json")[0] == 401
    assert _call(app, "GET", "/openapi.json", [("authorization", "Bearer sk-dp")])[0] == 200
    assert seen == ["/openapi.json"]


def test_the_front_end_routes_by_the_salt_its_replicas_cache_under():
    """The front end finds the key's tenant as its replicas do (it hands them its keys), so the
    prefix-aware router hashes with the salt the replica will cache under."""
    from kvshare.server.data_parallel import replica_auth

    config = ServerConfig(api_keys={"sk-a": "acme", "sk-b": "globex"}, cache_salt_from_api_key=True)
    state, app, _ = _recording_frontend(config)
    salts = []
    route = state.router.route
    state.router.route = lambda ids, salt, exclude=(), hashes=None: salts.append(salt) or route(ids, salt, exclude,
                                                                                                  hashes=hashes)
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": "s"}).encode()
    for key in ("sk-a", "sk-b"):
        status, _ = _call(app, "POST", "/v1/completions", [("authorization", f"Bearer {key}"),
                                                           ("content-type", "application/json")], body)
        assert status == 200
    assert salts == [tenant_cache_salt("acme", "s"), tenant_cache_salt("globex", "s")]
    replica = ServerConfig(**replica_auth(config), cache_salt_from_api_key=True)
    assert replica.key_digests == config.key_digests and replica.admin_digests == config.admin_digests
