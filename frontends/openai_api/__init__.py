"""The OpenAI-compatible HTTP API: `/v1/models`, `/v1/completions`, `/v1/chat/completions`,
`/health` and `/metrics`, a Starlette app under uvicorn on the `AsyncLLMEngine`'s event loop.

`schemas` decodes request bodies, `errors` shapes refusals as OpenAI does, `responses` maps
engine outputs to completion objects and stream chunks, `app` routes requests, `server` runs
uvicorn beside the WebSocket server.
"""

from frontends.openai_api.server import OpenAIConfig, OpenAIServer, serve_openai

__all__ = ["OpenAIConfig", "OpenAIServer", "serve_openai"]
