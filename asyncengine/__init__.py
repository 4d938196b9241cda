"""asyncengine: a high-throughput LLM inference engine (paged KV cache, continuous batching,
Triton kernels, streaming). The public API follows vLLM's names."""

from asyncengine.config import EngineArgs
from asyncengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from asyncengine.sampling_params import RequestOutputKind, SamplingParams
from asyncengine.structured_outputs import StructuredOutputsParams

__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestMetrics",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]


def __getattr__(name: str) -> object:
    # The engine classes pull in torch and the models; import them only when asked for.
    if name == "LLM":
        from asyncengine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from asyncengine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from asyncengine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(f"module 'asyncengine' has no attribute {name!r}")
