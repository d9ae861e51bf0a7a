"""GPTCache's own server app (``gptcache_server.server:app``) with its exact cache, over HTTP.

Runs inside GPTCache's virtual environment (``benchmarks/.envs/gptcache``):

    benchmarks/.envs/gptcache/bin/python benchmarks/peers/gptcache_http.py \
        --port 9003 --upstream http://127.0.0.1:9001/v1 --data-dir /tmp/x

``gptcache_server``'s command line can only build its similarity cache (an ONNX embedding model
fetched from the Hugging Face hub at start, which this machine cannot reach, and which is not an
exact cache anyway). So this launcher builds the exact cache the way GPTCache documents it
(``Cache.init(pre_embedding_func=last_content, data_manager=manager_factory("map", ...))``, the
pre-embedding function the server itself uses for its OpenAI proxy, token counting off) and
hands it to the server module as its ``openai_cache``, exactly what ``gptcache_server --openai
True`` does with its own cache; then serves the module's ``app`` on uvicorn + uvloop + httptools
with the access log off (the stack every target of the benchmark runs on). Its
``POST /v1/chat/completions`` takes the same OpenAI request as the other targets: a hit is answered
from the cache, a miss goes through GPTCache's OpenAI adapter (the ``openai`` 0.28 client) to
``--upstream``.
"""

from __future__ import annotations

import argparse

from gptcache_lookup import refuse_auto_install


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL ending in /v1")
    parser.add_argument("--data-dir", required=True)
    args = parser.parse_args()
    refuse_auto_install()

    import openai
    import uvicorn
    from gptcache import Cache, Config
    from gptcache.manager import manager_factory
    from gptcache.processor.pre import last_content
    from gptcache_server import server

    openai.api_base = args.upstream  # where a miss goes (the openai<1.0 client)
    cache = Cache()
    cache.init(
        pre_embedding_func=last_content,
        config=Config(enable_token_counter=False),
        data_manager=manager_factory("map", data_dir=args.data_dir, max_size=100_000),
    )
    server.openai_cache = cache
    uvicorn.run(
        server.app,
        host=args.host,
        port=args.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        backlog=4096,
    )


if __name__ == "__main__":
    main()
