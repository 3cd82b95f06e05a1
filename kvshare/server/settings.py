"""ServerConfig: the one object that carries every server option down to the parts that need it."""
from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass, field, fields

from kvshare.config import parse_bytes
from kvshare.model.tokenizer import check_chat_template
from kvshare.server.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
DEFAULT_LIMIT_CONCURRENCY = 1024
DEFAULT_MAX_TOOLS_BYTES = 2**20
DEFAULT_MAX_CHAT_TEMPLATE_KWARGS_BYTES = 64 * 2**10
ADMIN = "admin"


def server_default(name: str):
    """ServerConfig's declared default for the field `name`: `kvshare serve`'s flags take their
    defaults from here, so each is written once, in ServerConfig."""
    for f in fields(ServerConfig):
        if f.name == name:
            return f.default
    raise KeyError(f"ServerConfig has no field {name!r}")


def flag_key_tenant(n: int) -> str:
    """The tenant of the n-th --api-key (from 1)."""
    return f"api-key-{n}"


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


def is_loopback_name(host: str) -> bool:
    """localhost, or a loopback address (127.0.0.0/8, ::1; IPv6 in brackets or not)."""
    host = host.strip().lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host[1:-1] if host.startswith("[") and host.endswith("]") else host).is_loopback
    except ValueError:
        return False


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the operator opens it up on purpose
    port: int = 8000
    served_model_name: str | None = None  # None: derived from the model file
    # Keys stay out of repr(), so a logged config shows none.
    api_key: str | None = field(default=None, repr=False)  # one key (Ray's option): tenant api-key-1
    # Authentication and tenants (docs/security.md). key -> tenant name: `kvshare serve` fills it
    # from --api-key (tenants api-key-1, api-key-2, ...) and --api-key-file.
    api_keys: dict[str, str] = field(default_factory=dict, repr=False)
    admin_key: str | None = field(default=None, repr=False)  # when set, the only key that opens /kv/ and /dashboard
    # The prefix cache salt is the key's tenant with the client's cache_salt (tenant_cache_salt).
    cache_salt_from_api_key: bool = False
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING).
    allow_runtime_lora_updating: bool = False
    # Derived from the keys in __post_init__: SHA-256(key) -> tenant, what the gate looks a
    # presented key up in (middleware.bearer_tenant).
    key_digests: dict[bytes, str] = field(init=False, repr=False, default_factory=dict)
    admin_digests: dict[bytes, str] = field(init=False, repr=False, default_factory=dict)
    # Requests admitted but not yet scheduled (queued submissions + scheduler waiting); None = unbounded.
    max_waiting: int | None = None
    request_timeout: float | None = None  # seconds from arrival; None = no limit
    shutdown_timeout: float = 30.0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_prompts: bool = False
    access_log: bool = True
    log_level: str = "info"
    chat_template: str | None = None  # template source overriding the model's (--chat-template FILE)
    enable_auto_tool_choice: bool = False  # tool_choice "auto" parses calls out of the reply text
    tool_call_parser: str | None = None  # a name in kvshare.server.tool_parsers.TOOL_PARSERS
    # /ready fails when the engine loop has not come round for this long (a hung step).
    ready_stall_seconds: float = 60.0
    retry_after_seconds: int = 1
    # A structured-output grammar that takes longer to compile is refused (400), not waited on.
    grammar_compile_timeout: float = 10.0
    # Slow clients (issue 33): a request whose body has not fully arrived this many seconds after
    # its headers gets a 408 and its connection closed; uvicorn answers 503 beyond
    # limit_concurrency connections or tasks, and closes an idle keep-alive connection after
    # timeout_keep_alive seconds (uvicorn's and vLLM's names and keep-alive default).
    request_body_timeout: float = 30.0
    limit_concurrency: int | None = DEFAULT_LIMIT_CONCURRENCY
    timeout_keep_alive: float = 5.0
    # Grammars compiled at once, on their own threads (a compile cannot be stopped, so the number is bounded).
    max_concurrent_grammar_compiles: int = 2
    # Request data a chat template renders (serialized JSON), and how long a render may take: a
    # template is code, and chat_template_kwargs can set any variable it reads.
    max_tools_bytes: int = DEFAULT_MAX_TOOLS_BYTES
    max_chat_template_kwargs_bytes: int = DEFAULT_MAX_CHAT_TEMPLATE_KWARGS_BYTES
    chat_template_timeout: float = 10.0
    # Work one request may ask for (400 beyond, before any tokenizing): prompts x n sequences,
    # stop strings (count, characters each) and stop_token_ids.
    max_sequences_per_request: int = 256
    max_stop_strings: int = 64
    max_stop_string_length: int = 256
    max_stop_token_ids: int = 1024
    # A socket bound by the data-parallel front end and inherited (no race for a free port between
    # choosing it and binding it): served instead of binding host:port.
    listen_fd: int | None = None

    @property
    def auth_on(self) -> bool:
        return bool(self.api_keys)

    @property
    def loopback_only(self) -> bool:
        """Whether the server listens on loopback (--host 127.0.0.1, ::1, localhost)."""
        return is_loopback_name(self.host)

    @property
    def checks_browsers(self) -> bool:
        """Whether requests must show no sign of a browser acting for another site (a loopback
        Host, JSON bodies): on a key-less server of its own on loopback. Not on a data-parallel
        replica (it serves the socket its front end bound, listen_fd): the front end checked the
        request, and one it forwards from a --host open to the network keeps its Content-Type."""
        return not self.api_keys and self.loopback_only and self.listen_fd is None

    def _check_keys(self) -> None:
        if self.api_key == "":
            raise ValueError("api_key is empty: give a non-empty key or leave it unset")
        if self.api_key is not None:
            self.api_keys = {self.api_key: flag_key_tenant(1), **self.api_keys}
        if any(not k for k in self.api_keys):
            raise ValueError("an API key is empty: give non-empty keys or none")
        if any(not t for t in self.api_keys.values()):
            raise ValueError("an API key's tenant name is empty")
        if self.admin_key == "":
            raise ValueError("admin_key is empty (--admin-key / KVSHARE_ADMIN_KEY): give a non-empty key or "
                             "leave it unset")
        if self.admin_key is not None and self.admin_key in self.api_keys:
            raise ValueError("the admin key (--admin-key) is also an API key: give the admin a key of its own")
        if self.cache_salt_from_api_key and not self.api_keys:
            raise ValueError("cache_salt_from_api_key (--cache-salt-from-api-key) needs API keys (--api-key or "
                             "--api-key-file): the cache salt is derived from the key's tenant")
        # By digest: a lookup costs the same for one key or thousands (middleware.bearer_tenant).
        self.key_digests = {key_digest(k): t for k, t in self.api_keys.items()}
        self.admin_digests = {key_digest(self.admin_key): ADMIN} if self.admin_key is not None else {}

    def describe_auth(self) -> str:
        """The start-up log's line on authentication: counts, never a key."""
        if self.auth_on:
            tenants = len(set(self.api_keys.values()))
            view = "yes (only it opens /kv/ and /dashboard)" if self.admin_key else "no (any API key opens /kv/)"
            return (f"authentication on: {len(self.api_keys)} API key(s) of {tenants} tenant(s); admin key: {view}; "
                    f"cache salt from the API key's tenant: {'yes' if self.cache_salt_from_api_key else 'no'}")
        view = "admin key: yes (/kv/ and /dashboard need it)" if self.admin_key else "admin key: no"
        if self.loopback_only:
            return (f"authentication off (no --api-key): listening on loopback only, so only requests with a "
                    f"loopback Host and application/json bodies are accepted; {view}")
        return (f"authentication OFF (no --api-key) on --host {self.host}, which is not loopback: anyone who "
                f"reaches the port can use the server; {view}")

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port={self.port} is invalid: must be in [0, 65535]")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting} is invalid: must be >= 0")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout={self.request_timeout} is invalid: must be > 0 seconds")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout={self.grammar_compile_timeout} is invalid: must be > 0 seconds")
        for name in ("request_body_timeout", "timeout_keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} is invalid: must be > 0 seconds")
        if self.limit_concurrency is not None and self.limit_concurrency < 1:
            raise ValueError(f"limit_concurrency={self.limit_concurrency} is invalid: must be >= 1")
        if self.max_concurrent_grammar_compiles < 1:
            raise ValueError(f"max_concurrent_grammar_compiles={self.max_concurrent_grammar_compiles} is invalid: "
                             f"must be >= 1")
        if not self.chat_template_timeout > 0:
            raise ValueError(f"chat_template_timeout={self.chat_template_timeout} is invalid: must be > 0 seconds")
        self.max_tools_bytes = parse_bytes(self.max_tools_bytes, "max_tools_bytes")
        self.max_chat_template_kwargs_bytes = parse_bytes(self.max_chat_template_kwargs_bytes,
                                                          "max_chat_template_kwargs_bytes")
        for name in ("max_sequences_per_request", "max_stop_strings", "max_stop_string_length", "max_stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1 "
                                 f"(--{name.replace('_', '-')})")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} is invalid: must be >= 0 seconds")
        self.max_body_bytes = parse_bytes(self.max_body_bytes, "max_body_bytes")
        self._check_keys()
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser={self.tool_call_parser!r} is unknown: choose from "
                             f"{', '.join(sorted(TOOL_PARSERS))}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (--enable-auto-tool-choice requires "
                             "--tool-call-parser)")
        if self.chat_template is not None:
            try:
                check_chat_template(self.chat_template)
            except ValueError as e:
                raise ValueError(f"chat_template (--chat-template): {e}") from None
