"""The engine's loaded LoRA adapters: by vLLM's lora_int_id, each with its cache key, shared with
the runner (which applies them by key) and dropped from the prefix cache when unloaded."""
from __future__ import annotations

import logging

from kvshare.errors import InvalidRequestError
from kvshare.lora_request import LoRARequest
from kvshare.model.lora import LoRAAdapter, LoRAAdapterError, load_adapter

logger = logging.getLogger("kvshare")


class LoRARegistry:
    def __init__(self, config, model_config, runner, kv, tensor_parallel: bool) -> None:
        self.enabled = config.enable_lora
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.model_config = model_config
        self.runner, self.kv = runner, kv
        self.tensor_parallel = tensor_parallel
        self.by_id: dict[int, tuple[LoRARequest, LoRAAdapter]] = {}
        if self.enabled:
            logger.info("  lora: up to %d adapters of rank <= %d; adapter rows take the path they take without one, "
                        "the delta %s", self.max_loras, self.max_rank,
                        "in C++ (inside the fused decode step where it runs)" if runner.model.fused_decode.takes_adapters
                        else "in PyTorch (this model is not on the fused C++ step)")

    def _check_enabled(self, field: str) -> None:
        if not self.enabled:
            raise InvalidRequestError("LoRA adapters need an engine built with enable_lora=True (--enable-lora)", field)
        if self.tensor_parallel:
            raise InvalidRequestError("LoRA adapters are not served with tensor parallelism", field)

    def add(self, req: LoRARequest) -> bool:
        self._check_enabled("lora_request")
        if req.lora_int_id in self.by_id:
            return False
        if any(r.lora_name == req.lora_name for r, _ in self.by_id.values()):
            raise InvalidRequestError(f"lora_name {req.lora_name!r} is already loaded under another lora_int_id",
                                      "lora_name")
        if len(self.by_id) >= self.max_loras:
            raise InvalidRequestError(f"max_loras={self.max_loras} adapters are loaded already "
                                      f"({', '.join(sorted(r.lora_name for r, _ in self.by_id.values()))}); "
                                      f"remove one first", "lora_request")
        try:
            adapter = load_adapter(req.lora_name, req.lora_path, self.model_config, self.max_rank)
        except LoRAAdapterError as e:
            raise InvalidRequestError(f"adapter {req.lora_name!r}: {e} (field {e.field})", "lora_path") from None
        self.by_id[req.lora_int_id] = (req, adapter)
        self.runner.adapters[adapter.key] = adapter
        return True

    def remove(self, lora_id: int, in_use: set) -> bool:
        entry = self.by_id.get(lora_id)
        if entry is None:
            return False
        key = entry[1].key
        if key in in_use:
            raise InvalidRequestError(f"adapter {entry[0].lora_name!r} is in use by unfinished requests", "lora_id")
        del self.by_id[lora_id]
        self.runner.adapters.pop(key, None)
        self.kv.drop_adapter(key)
        return True

    def ids(self) -> set[int]:
        return set(self.by_id)

    def adapter_for(self, req: LoRARequest | None) -> str | None:
        """The cache key of the adapter a request names (loaded now if it is not yet: vLLM loads on
        first use), or None for the base model."""
        if req is None:
            return None
        if not isinstance(req, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a kvshare.LoRARequest, not {type(req).__name__}",
                                      "lora_request")
        self._check_enabled("lora_request")
        entry = self.by_id.get(req.lora_int_id)
        if entry is None:
            self.add(req)
            entry = self.by_id[req.lora_int_id]
        elif entry[0] != req:
            raise InvalidRequestError(f"lora_int_id {req.lora_int_id} is loaded as {entry[0].lora_name!r} from "
                                      f"{entry[0].lora_path!r}, not {req.lora_name!r} from {req.lora_path!r}",
                                      "lora_request")
        return entry[1].key



# LLMEngine's adapter members (vLLM's names), over its `loras` registry and its request records.
def add_lora(engine, lora_request: LoRARequest) -> bool:
    """Load an adapter; False when this lora_int_id is loaded already."""
    return engine.loras.add(lora_request)


def remove_lora(engine, lora_id: int) -> bool:
    """Unload an adapter and forget its cached blocks; False when no adapter has this id."""
    return engine.loras.remove(lora_id, {s.adapter for s in engine.requests.values() if not s.finished})


def list_loras(engine) -> set[int]:
    return engine.loras.ids()


LORA_ENGINE_METHODS = (add_lora, remove_lora, list_loras)
