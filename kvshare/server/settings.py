"""ServerConfig: the one object that carries every server option down to the parts that need it."""
from __future__ import annotations

from dataclasses import dataclass

from kvshare.config import parse_bytes
from kvshare.model.tokenizer import check_chat_template
from kvshare.server.tool_parsers import TOOL_PARSERS

DEFAULT_MAX_BODY_BYTES = 4 * 2**20


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # loopback unless the operator opens it up on purpose
    port: int = 8000
    served_model_name: str | None = None  # None: derived from the model file
    api_key: str | None = None
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
    # Work one request may ask for (400 beyond, before any tokenizing): prompts x n sequences,
    # stop strings (count, characters each) and stop_token_ids.
    max_sequences_per_request: int = 256
    max_stop_strings: int = 64
    max_stop_string_length: int = 256
    max_stop_token_ids: int = 1024
    # A socket bound by the data-parallel front end and inherited (no race for a free port between
    # choosing it and binding it): served instead of binding host:port.
    listen_fd: int | None = None

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ValueError(f"port={self.port} is invalid: must be in [0, 65535]")
        if self.max_waiting is not None and self.max_waiting < 0:
            raise ValueError(f"max_waiting={self.max_waiting} is invalid: must be >= 0")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout={self.request_timeout} is invalid: must be > 0 seconds")
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout={self.grammar_compile_timeout} is invalid: must be > 0 seconds")
        for name in ("max_sequences_per_request", "max_stop_strings", "max_stop_string_length", "max_stop_token_ids"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1 "
                                 f"(--{name.replace('_', '-')})")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} is invalid: must be >= 0 seconds")
        self.max_body_bytes = parse_bytes(self.max_body_bytes, "max_body_bytes")
        if self.api_key == "":
            raise ValueError("api_key is empty: give a non-empty key or leave it unset")
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
