"""kvshare: an LLM inference engine that shares KV-cache state and checks isolation."""
from kvshare.config import EngineConfig
from kvshare.llm import LLM
from kvshare.outputs import CompletionOutput, Logprob, RequestOutput
from kvshare.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "EngineConfig", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
