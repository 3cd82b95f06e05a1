"""LoRA adapters on the server (vLLM's surface): `--lora-modules name=path ...` loaded at start, a
request's `model` naming an adapter, /v1/models listing them with the base model as `parent`, and
with `--allow-runtime-lora-updating` (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING) POST
/v1/load_lora_adapter and /v1/unload_lora_adapter, behind the API key like every /v1/ route."""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from starlette.responses import PlainTextResponse

from kvshare.errors import InvalidRequestError
from kvshare.lora_request import LoRARequest
from kvshare.server.errors import APIError
from kvshare.server.protocol import load_json_object


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """--lora-modules: each `name=path`, or vLLM's JSON form {"name": ..., "path": ...}."""
    out: list[tuple[str, str]] = []
    for v in values or []:
        if v.lstrip().startswith("{"):
            try:
                obj = json.loads(v)
            except json.JSONDecodeError as e:
                raise ValueError(f"--lora-modules {v!r}: not valid JSON ({e.msg})") from None
            unknown = sorted(set(obj) - {"name", "path", "base_model_name"}) if isinstance(obj, dict) else []
            if not isinstance(obj, dict) or unknown or not isinstance(obj.get("name"), str) \
                    or not isinstance(obj.get("path"), str):
                raise ValueError(f"--lora-modules {v!r}: the JSON form is {{\"name\": NAME, \"path\": PATH}}"
                                 + (f" (unknown keys: {', '.join(unknown)})" if unknown else ""))
            name, path = obj["name"], obj["path"]
        else:
            name, sep, path = v.partition("=")
            if not sep:
                raise ValueError(f"--lora-modules {v!r}: give NAME=PATH (or {{\"name\": NAME, \"path\": PATH}})")
        if not name or not path:
            raise ValueError(f"--lora-modules {v!r}: the adapter's name and path must not be empty")
        if any(name == n for n, _ in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append((name, path))
    return out


class ServedAdapters:
    """The adapters clients can name in `model`, by name, each with the lora_int_id the engine
    knows it by (ids are never reused: a reloaded adapter is a new one)."""

    def __init__(self) -> None:
        self.by_name: dict[str, LoRARequest] = {}
        self._next_id = 1

    def new(self, name: str, path: str) -> LoRARequest:
        req = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        return req

    def resolve(self, model: str | None, base_name: str) -> LoRARequest | None:
        """The adapter a request's `model` names; None for the base model (or no `model`)."""
        if model is None or model == base_name:
            return None
        if model in self.by_name:
            return self.by_name[model]
        served = ", ".join([f"'{base_name}'"] + [f"'{n}'" for n in sorted(self.by_name)])
        raise APIError(404, f"the model '{model}' does not exist: this server serves {served}", param="model",
                       code="model_not_found")


def adapter_cards(state) -> list[dict]:
    return [{"id": name, "object": "model", "created": state.created, "owned_by": "kvshare", "root": req.lora_path,
             "parent": state.model_name, "max_model_len": state.max_model_len}
            for name, req in sorted(state.adapters.by_name.items())]


def _body(obj: dict, allowed: set[str], required: set[str]) -> dict:
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise InvalidRequestError(f"unknown field '{unknown[0]}': this endpoint takes {', '.join(sorted(allowed))}",
                                  unknown[0])
    for key in sorted(required):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise InvalidRequestError(f"'{key}' must be a non-empty string", key)
    return obj


def add_lora_routes(app: FastAPI, state) -> None:
    if not state.config.allow_runtime_lora_updating:
        return
    engine = state.engine

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(raw: Request):
        obj = _body(load_json_object(await raw.body()), {"lora_name", "lora_path", "load_inplace"},
                    {"lora_name", "lora_path"})
        name, path = obj["lora_name"], obj["lora_path"]
        if name == state.model_name:
            raise InvalidRequestError(f"'{name}' is the base model's name", "lora_name")
        if name in state.adapters.by_name:
            raise InvalidRequestError(f"the LoRA adapter '{name}' has already been loaded", "lora_name")
        req = state.adapters.new(name, path)
        await engine.call(lambda: engine.engine.add_lora(req))  # (a bad file: 400 naming what is wrong)
        state.adapters.by_name[name] = req
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(raw: Request):
        obj = _body(load_json_object(await raw.body()), {"lora_name", "lora_int_id"}, {"lora_name"})
        name = obj["lora_name"]
        req = state.adapters.by_name.get(name)
        if req is None:
            raise APIError(404, f"the LoRA adapter '{name}' cannot be found", param="lora_name",
                           code="model_not_found")
        await engine.call(lambda: engine.engine.remove_lora(req.lora_int_id))
        del state.adapters.by_name[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
