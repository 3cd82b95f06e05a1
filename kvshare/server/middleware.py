"""The gate in front of the /v1/ routes, as plain ASGI so it runs before any body parsing:
refuse while draining (503), check the API key (401), cap the body (413), count in-flight requests
for the shutdown drain. /tokenize and /detokenize are guarded too; the live KV view (/kv/ and the
/dashboard page) only needs the key; health, readiness, metrics and version stay open.

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
import hmac

from kvshare.server.errors import APIError
from kvshare.server.state import ServerState

# An oversized body is read and dropped (up to this much) before the 413, so a client still
# writing it gets the answer instead of a reset connection.
DISCARD_LIMIT = 64 * 2**20
# Outside /v1/ but guarded like it (vLLM serves them at the root).
GUARDED_PATHS = frozenset({"/tokenize", "/detokenize"})
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
        if scope["type"] == "http" and is_view_path(scope["path"]):
            await self._view(scope, receive, send)
            return
        if scope["type"] != "http" or not (scope["path"].startswith("/v1/") or scope["path"] in GUARDED_PATHS):
            await self.app(scope, receive, send)
            return
        st = self.state
        cfg = st.config
        if st.draining:
            return await self._reject(scope, receive, send, "shutting_down", APIError(
                503, "the server is shutting down and takes no new requests", code="shutting_down",
                headers={"Retry-After": "5"}))
        headers = dict(scope["headers"])
        if cfg.api_key is not None and not self._authorized(headers.get(b"authorization", b"")):
            return await self._reject(scope, receive, send, "unauthorized", unauthorized())
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
        if self.state.config.api_key is not None:
            headers = dict(scope["headers"])
            header = headers.get(b"authorization", b"")
            if not self._authorized(header):
                site = headers.get(b"sec-fetch-site", b"same-origin")
                if header[:6].lower() == b"basic " and site not in OWN_SITE:
                    # Whatever the credentials: another site made the browser send them.
                    return await self._reject(scope, receive, send, "unauthorized", _cross_site_view(site))
                if not self._basic_authorized(header):
                    return await self._reject(scope, receive, send, "unauthorized", _unauthorized_view())
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

    def _authorized(self, header: bytes) -> bool:
        return bearer_key_matches(header, self.state.config.api_key)

    def _basic_authorized(self, header: bytes) -> bool:
        """'Basic base64(user:key)', any user name (a browser's login dialog asks for one)."""
        scheme, _, encoded = header.partition(b" ")
        try:
            _, sep, password = base64.b64decode(encoded.strip(), validate=True).partition(b":")
        except (binascii.Error, ValueError):
            sep, password = b"", b""
        ok = hmac.compare_digest(password, self.state.config.api_key.encode())
        return ok and sep == b":" and scheme.lower() == b"basic"

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


def bearer_key_matches(header: bytes | str, key: str) -> bool:
    """Whether an Authorization header value is 'Bearer <key>': the scheme in any case (RFC 7235),
    the token trimmed. The one parser of the key for `kvshare serve` and the Ray ingress, so a
    client accepted by one is accepted by the other."""
    if isinstance(header, str):
        header = header.encode("latin-1")  # how Starlette decoded it; always encodes back
    scheme, _, token = header.partition(b" ")
    # compare_digest on every attempt, so the time taken says nothing about the key.
    ok = hmac.compare_digest(token.strip(), key.encode())
    return ok and scheme.lower() == b"bearer"


def unauthorized() -> APIError:
    return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                    code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


def is_view_path(path: str) -> bool:
    return path.startswith(VIEW_PREFIX) or path == DASHBOARD_PATH or path.startswith(DASHBOARD_PATH + "/")


def _cross_site_view(site: bytes) -> APIError:
    return APIError(403, f"refused: the browser sent the dashboard's credentials on a request another site made "
                         f"(Sec-Fetch-Site: {site.decode('latin-1')[:20]}); open the dashboard by its own address",
                    code="cross_site_request")


def _unauthorized_view() -> APIError:
    # The Basic challenge makes a browser ask for the key (a script just sends the Bearer header).
    return APIError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>', or open the "
                         "page in a browser and give the key as the password (any user name)",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": f'Basic realm="{BASIC_REALM}", charset="UTF-8"'})
