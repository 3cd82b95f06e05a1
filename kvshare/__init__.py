"""kvshare: an LLM inference engine that shares KV-cache state and checks isolation."""
from kvshare.config import EngineConfig
from kvshare.engine.beam_search import BeamSearchParams
from kvshare.llm import LLM
from kvshare.lora_request import LoRARequest
from kvshare.outputs import BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput
from kvshare.sampling_params import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "BeamSearchParams", "BeamSearchOutput", "BeamSearchSequence", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
