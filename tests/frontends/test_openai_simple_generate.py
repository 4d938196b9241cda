"""`POST /generate` (vLLM's simple server) on the OpenAI port: the whole answer or a stream of
NUL-delimited JSON objects with the text so far, read as vLLM's example client reads them;
the offline engine's greedy text; bad bodies are 400s naming the field; the API key holds."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx2
import pytest

from asyncengine.async_engine import AsyncLLMEngine
from frontends.openai_api import OpenAIConfig, OpenAIServer, serve_openai

from .conftest import UNIT, all_blocks_free, offline_greedy

PROMPT = "The quick brown fox"


@pytest.fixture
async def api(engine: AsyncLLMEngine) -> AsyncIterator[OpenAIServer]:
    async with serve_openai(engine, OpenAIConfig(port=0)) as srv:
        yield srv


def client_reads(body: bytes) -> list[dict[str, Any]]:
    """What vLLM's `api_client.py` does: split on NUL, decode each object."""
    return [json.loads(part) for part in body.split(b"\0") if part]


async def post(api: OpenAIServer, body: Any, **kw: Any) -> httpx2.Response:
    async with httpx2.AsyncClient(base_url=api.url, timeout=60 * UNIT) as http:
        return await http.post("/generate", json=body, **kw)


async def test_whole_answer_is_prompt_plus_output(api: OpenAIServer, model_dir: Path,
                                                  engine: AsyncLLMEngine) -> None:
    [exp] = offline_greedy(model_dir, [PROMPT], max_tokens=10)
    r = await post(api, {"prompt": PROMPT, "n": 2, "temperature": 0.0, "max_tokens": 10,
                         "use_beam_search": False, "ignore_eos": False})
    assert r.status_code == 200, r.text
    assert r.json() == {"text": [PROMPT + exp.text] * 2}
    await all_blocks_free(engine)


async def test_stream_holds_the_whole_text_so_far(api: OpenAIServer, model_dir: Path,
                                                  engine: AsyncLLMEngine) -> None:
    [exp] = offline_greedy(model_dir, [PROMPT], max_tokens=8, ignore_eos=True)
    r = await post(api, {"prompt": PROMPT, "stream": True, "temperature": 0, "max_tokens": 8,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.content.endswith(b"\0")
    objs = client_reads(r.content)
    assert len(objs) > 1 and all(list(o) == ["text"] and len(o["text"]) == 1 for o in objs)
    texts = [o["text"][0] for o in objs]
    assert all(t.startswith(PROMPT) for t in texts)
    assert all(b.startswith(a) for a, b in itertools.pairwise(texts))
    assert texts[-1] == PROMPT + exp.text
    await all_blocks_free(engine)


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": 4}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "bogus": 1}, "bogus"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
    ({"prompt": "hi", "max_tokens": 10_000}, "max_tokens"),
    ({"prompt": "hi", "prompt_logprobs": 99}, "prompt_logprobs"),
])
async def test_bad_bodies_are_400_naming_the_field(api: OpenAIServer, body: dict[str, Any],
                                                   param: str) -> None:
    r = await post(api, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_not_an_object_and_not_json(api: OpenAIServer) -> None:
    assert (await post(api, [1, 2])).status_code == 400
    async with httpx2.AsyncClient(base_url=api.url, timeout=60 * UNIT) as http:
        assert (await http.post("/generate", content=b"{nope")).status_code == 400


async def test_needs_the_api_key_when_one_is_set(engine: AsyncLLMEngine) -> None:
    async with serve_openai(engine, OpenAIConfig(port=0, api_key="k")) as srv:
        assert (await post(srv, {"prompt": "hi", "max_tokens": 2})).status_code == 401
        r = await post(srv, {"prompt": "hi", "max_tokens": 2},
                       headers={"Authorization": "Bearer k"})
        assert r.status_code == 200 and r.json()["text"][0].startswith("hi")
