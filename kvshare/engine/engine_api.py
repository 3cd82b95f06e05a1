"""The engine API: the members of LLMEngine that its callers (the server, Ray, the doctor) may use.
Everything else on an engine (its scheduler, KV core, runner, model, pool, request records) is its
own, so that the parts can change without the callers noticing; tests/test_architecture.py holds
the callers to this list."""

ENGINE_API = frozenset((
    # facts fixed at build
    "config", "layout", "tokenizer", "model_source", "transparency", "startup", "kv_events_endpoints",
    # requests
    "tokenize", "compile_grammar", "add_request", "abort_request", "step", "has_request", "unfinished",
    "has_unfinished_requests", "get_num_unfinished_requests",
    # LoRA adapters (vLLM's names)
    "add_lora", "remove_lora", "list_loras",
    # state, audit and the live view
    "status", "step_count", "is_idle", "kv_snapshot", "cached_block_hashes", "audit_checks", "set_audit",
    "set_view_tap", "take_view_events", "publish_prefix_updates",
    # resets (idle only) and shutdown
    "reset_prefix_cache", "zero_kv_cache", "close",
))
