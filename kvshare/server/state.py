"""ServerState: what the routes, the middleware and the shutdown path share for one server."""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from kvshare.server.async_engine import AsyncEngine
from kvshare.server.lora_routes import ServedAdapters
from kvshare.server.metrics import ServerMetrics
from kvshare.server.settings import ServerConfig
from kvshare.server.structured import GrammarCompiles

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_name(model_arg: str | None) -> str:
    if model_arg is None:
        return BUNDLED_MODEL_NAME
    base = os.path.basename(os.path.normpath(model_arg))
    return base[:-5] if base.endswith(".gguf") else base


@dataclass
class ServerState:
    config: ServerConfig
    engine: AsyncEngine
    metrics: ServerMetrics
    model_name: str
    model_source: str
    tokenizer: object | None
    max_model_len: int
    max_num_seqs: int
    # The engine's transparency gaps (kvshare.engine.model_setup.transparency_gaps; empty: a
    # request's bits cannot depend on what it shares): /version says so, for `kvshare doctor --url`.
    transparency_gaps: tuple[str, ...] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    draining: bool = False  # set by SIGTERM: new API requests get 503
    inflight: int = 0  # API requests inside the app (streams until their last byte)
    ignored_fields_logged: set[str] = field(default_factory=set)  # accepted-and-ignored names already logged
    grammar_compiles: GrammarCompiles = field(init=False)
    adapters: ServedAdapters = field(default_factory=ServedAdapters)  # LoRA adapters a request's `model` may name

    def __post_init__(self) -> None:
        self.grammar_compiles = GrammarCompiles(self.config.max_concurrent_grammar_compiles,
                                                self.config.grammar_compile_timeout)
