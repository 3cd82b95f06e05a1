"""The gate in front of the routes, as plain ASGI so it runs before any body parsing: refuse a
foreign Host or a non-JSON body when the server is open on loopback (421 / 415), refuse while
draining (503), check the API key (401) and note its tenant, cap the body (413), count in-flight
requests for the shutdown drain. /tokenize, /detokenize and /openapi.json are guarded like /v1/;
the live KV view (/kv/ and the /dashboard page) needs the admin key when --admin-key is given,
else any API key; health, readiness, metrics and version stay open (as vLLM's).

Without an API key on a loopback --host, only loopback Host names are answered (a DNS-rebinding
page names its own host) and API bodies must be application/json (a cross-site form or fetch
without a CORS preflight can only send text/plain, form or multipart bodies). A request without a
Host header (HTTP/1.0, in-process ASGI calls) is not a browser's and passes. With a key, or a
--host that is not loopback, the operator chose the exposure.

The view also takes the key as HTTP Basic credentials (any user name, the key as password): a
browser cannot add a Bearer header to a page it navigates to, but it asks for Basic credentials
on a 401 that offers them and then sends them with the page's own fetches. Basic is accepted on
the view only (read-only GETs): the browser attaches those credentials by itself, so they must
open nothing that changes state; and a Basic request another site made the browser send
(Sec-Fetch-Site cross-site or same-site) is refused with a 403 of its own and no challenge (a
challenge would only have the browser ask for the key again, for the same refusal).
"""
from __future__ import annotations

import base64
import binascii

from kvshare.server.errors import APIError
from kvshare.server.settings import is_loopback_name, key_digest
from kvshare.server.state import ServerState
from kvshare.server.tenants import TENANT_SCOPE_KEY

# An oversized body is read and dropped (up to this much) before the 413, so a client still
# writing it gets the answer instead of a reset connection.
DISCARD_LIMIT = 64 * 2**20
# Outside /v1/ but guarded like it (vLLM serves them at the root).
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize", "/openapi.json"})
# Where bodies must be application/json when the server is open on loopback.
JSON_BODY_PATHS = frozenset({"/tokenize", "/detokenize"})

# The live KV view: behind the key, but neither drained nor counted in flight (an open event
# stream must not hold a shutdown up: it ends by itself once draining starts) and bodiless.
VIEW_PREFIX = "/kv/"
DASHBOARD_PATH = "/dashboard"  # the page, and its script and style under /dashboard/
BASIC_REALM = "kvshare"
# Sec-Fetch-Site values of a request the user made on the server's own page or by typing the
# address; absent (a script, an older browser): not a browser acting for another site.
OWN_SITE = (b"same-origin", b"none")


class GuardMiddleware:
    def __init__(self, app, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cfg = self.state.config
        path = scope["path"]
        if cfg.checks_browsers:
            refusal = _browser_refusal(scope, path)
            if refusal is not None:
                return await self._reject(scope, receive, send, *refusal)
        if is_view_path(path):
            await self._view(scope, receive, send)
            return
        if not (path.startswith("/v1/") or path in GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        st = self.state
        if st.draining:
            return await self._reject(scope, receive, send, "shutting_down", APIError(
                503, "the server is shutting down and takes no new requests", code="shutting_down",
                headers={"Retry-After": "5"}))
        headers = dict(scope["headers"])
        if cfg.api_keys:
            tenant = bearer_tenant(headers.get(b"authorization", b""), cfg.key_digests)
            if tenant is None:
                return await self._reject(scope, receive, send, "unauthorized", unauthorized())
            scope[TENANT_SCOPE_KEY] = tenant
        limit = cfg.max_body_bytes
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                return await self._reject(scope, receive, send, "invalid_request", APIError(
                    400, f"Content-Length {declared[:40]!r} is not a number", code="invalid_header"))
            if size > limit:
                await self._discard(receive, min(size, DISCARD_LIMIT))
                return await self._too_large(scope, receive, send, size)
        body, total = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > limit:
                await self._discard(receive, DISCARD_LIMIT, message.get("more_body", False))
                return await self._too_large(scope, receive, send, None)
            body.append(chunk)
            if not message.get("more_body", False):
                break
        await self._forward(scope, b"".join(body), receive, send)

    async def _view(self, scope, receive, send) -> None:
        cfg = self.state.config
        # With --admin-key only the admin opens the view: it shows every tenant's requests.
        view_keys = cfg.admin_digests or cfg.key_digests
        if view_keys:
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"")
            site = headers.get(b"sec-fetch-site", b"same-origin")
            if header[:6].lower() == b"basic " and site not in OWN_SITE:
                # Whatever the credentials: another site made the browser send them.
                return await self._reject(scope, receive, send, "unauthorized", _cross_site_view(site))
            token = bearer_token(header)
            presented = basic_password(header) if token is None else token
            digest = key_digest(presented) if presented is not None else None
            if digest not in view_keys:
                refusal = _not_admin() if digest in cfg.key_digests else _unauthorized_view(bool(cfg.admin_digests))
                return await self._reject(scope, receive, send, "unauthorized", refusal)
        await self.app(scope, receive, send)

    async def _forward(self, scope, body: bytes, receive, send) -> None:
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        self.state.inflight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            self.state.inflight -= 1

    @staticmethod
    async def _discard(receive, budget: int, more: bool = True) -> None:
        seen = 0
        while more and seen <= budget:
            message = await receive()
            if message["type"] != "http.request":
                return
            seen += len(message.get("body", b""))
            more = message.get("more_body", False)

    async def _too_large(self, scope, receive, send, size: int | None) -> None:
        limit = self.state.config.max_body_bytes
        got = f"{size} bytes" if size is not None else f"more than {limit} bytes"
        await self._reject(scope, receive, send, "body_too_large", APIError(
            413, f"the request body is {got}; the limit is {limit} bytes (--max-body-bytes)",
            code="request_too_large"))

    async def _reject(self, scope, receive, send, reason: str, err: APIError) -> None:
        self.state.metrics.on_rejected(reason)
        await err.response()(scope, receive, send)


def bearer_token(header: bytes | str) -> bytes | None:
    """The key of an Authorization header value 'Bearer <key>' (the scheme in any case, RFC 7235;
    the token trimmed), or None. The one parser of the key for `kvshare serve`, its data-parallel
    front end and the Ray ingress, so a client accepted by one is accepted by all."""
    if isinstance(header, str):
        header = header.encode("latin-1")  # how Starlette decoded it; always encodes back
    scheme, _, token = header.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def bearer_tenant(header: bytes | str, key_digests: dict[bytes, str]) -> str | None:
    """The tenant of the Bearer key in an Authorization header value, or None.

    `key_digests` maps SHA-256(key) -> tenant (ServerConfig.key_digests): the presented token is
    hashed and looked up, so the time taken is the same for one key or thousands, and whatever
    it depends on (the token's digest, how much of it equals a stored digest) says nothing about
    any key: a digest gives no way back to its key."""
    token = bearer_token(header)
    return key_digests.get(key_digest(token)) if token is not None else None


def bearer_key_matches(header: bytes | str, key: str) -> bool:
    """Whether an Authorization header value is 'Bearer <key>' (bearer_tenant, for one key)."""
    return bearer_tenant(header, {key_digest(key): ""}) is not None


def basic_password(header: bytes) -> bytes | None:
    """The password of 'Basic base64(user:password)', any user name (a browser's login dialog asks for one)."""
    scheme, _, encoded = header.partition(b" ")
    if scheme.lower() != b"basic":
        return None
    try:
        _, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
    except (binascii.Error, ValueError):
        return None
    return password if sep == b":" else None


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def is_view_path(path: str) -> bool:
    return path.startswith(VIEW_PREFIX) or path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


def _cross_site_view(site: bytes) -> APIError:
    return APIError(403, f"refused: the browser sent the dashboard's credentials on a request another site made "
                         f"(Sec-Fetch-Site: {site.decode('latin-1')[:20]}); open the dashboard by its own address",
                    code="cross_site_request")


def _unauthorized_view(admin: bool) -> APIError:
    # The Basic challenge makes a browser ask for the key (a script just sends the Bearer header).
    which = "admin key (--admin-key)" if admin else "API key"
    return APIError(401, f"missing or wrong {which}: send the header 'Authorization: Bearer <key>', or open the "
                         f"page in a browser and give the key as the password (any user name)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": f'Basic realm="{BASIC_REALM}", charset="UTF-8"'})


def _not_admin() -> APIError:
    return APIError(403, "this API key does not open the KV view (/kv/, /dashboard): it shows every tenant's "
                         "requests, so it needs the admin key (--admin-key)", code="admin_key_required")


def _browser_refusal(scope, path: str) -> tuple[str, APIError] | None:
    """Why a request to a key-less loopback server is refused (DNS rebinding, a cross-site POST), or None."""
    host = None
    content_type = None
    for name, value in scope["headers"]:
        if name == b"host":
            host = value.decode("latin-1")
        elif name == b"content-type":
            content_type = value.decode("latin-1")
    if host is not None and not is_loopback_host_header(host):
        return "unauthorized", APIError(
            421, f"Host {host[:100]!r} is not a loopback name: this server has no API key and listens on loopback, so "
                 f"it answers only Host localhost, 127.0.0.1 or [::1] (another name is a page that rebound its DNS "
                 f"to this machine); to serve other names, set --api-key (or bind --host to them)",
            code="misdirected_request")
    if scope["method"] == "POST" and (path.startswith("/v1/") or path in JSON_BODY_PATHS):
        media_type = (content_type or "").partition(";")[0].strip().lower()
        if media_type != "application/json":
            got = f"{content_type[:100]!r}" if content_type is not None else "missing"
            return "invalid_request", APIError(
                415, f"the Content-Type header is {got}: API bodies must be sent as 'Content-Type: application/json' "
                     f"(a server without an API key refuses others, which any web page can make a browser send)",
                param="Content-Type", code="unsupported_media_type")
    return None


def is_loopback_host_header(host: str) -> bool:
    """A Host header value (with or without a port) that names this machine's loopback."""
    host = host.strip()
    if host.startswith("["):
        name = host[:host.find("]") + 1]  # [::1]:8000
    else:
        name = host.rpartition(":")[0] if ":" in host else host
    return bool(name) and is_loopback_name(name)
