"""carpool as a library: wrap any async model call; no HTTP server needed.

Run: python examples/library.py
"""

import asyncio

from carpool import Config, FunctionUpstream, build_gateway

calls = 0


async def call_model(path: str, body: dict) -> dict:
    """Your model call (here a stand-in that takes 100 ms and counts how often it runs)."""
    global calls
    calls += 1
    await asyncio.sleep(0.1)
    question = body["messages"][-1]["content"]
    return {"id": f"chatcmpl-{calls}", "object": "chat.completion", "created": 0,
            "model": body["model"],
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": f"You asked: {question}"}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}


async def main() -> None:
    gateway = build_gateway(Config(), upstreams=[FunctionUpstream(call_model)])
    request = {"model": "my-model", "temperature": 0,
               "messages": [{"role": "user", "content": "What is carpool?"}]}
    # 50 identical requests at once share one call; the next one is a cache hit.
    replies = await asyncio.gather(*(gateway.request("/v1/chat/completions", request)
                                     for _ in range(50)))
    later = await gateway.request("/v1/chat/completions", request)
    outcomes = [r.outcome.value for r in replies]
    print(f"model calls: {calls}")
    print(f"outcomes: miss={outcomes.count('miss')} coalesced={outcomes.count('coalesced')}, "
          f"then {later.outcome.value}")
    print("answer:", later.json()["choices"][0]["message"]["content"])
    await gateway.aclose()


if __name__ == "__main__":
    asyncio.run(main())
