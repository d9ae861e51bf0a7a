"""GPTCache's exact cache, in process: per-lookup time of a hit for a ~1 KB chat body.

Runs inside GPTCache's own virtual environment (``benchmarks/.envs/gptcache``), never carpool's:

    benchmarks/.envs/gptcache/bin/python benchmarks/peers/gptcache_lookup.py '<json spec>'

spec: ``body_file`` (the request body, JSON bytes), ``answer_file`` (the chat completion the
upstream would answer), ``number``, ``repeat``, ``data_dir`` (scratch directory). Prints one JSON
object.

The setup is GPTCache's documented exact cache: ``Cache.init(pre_embedding_func=...,
data_manager=manager_factory("map", ...))`` with the defaults for everything else
(``string_embedding``, ``ExactMatchEvaluation``, ``temperature_softmax``) except token counting,
which is turned off (``Config(enable_token_counter=False)``: on, every hit would count the
prompt's tokens with ``tiktoken``, which loads its encoding from the network), queried through its
OpenAI adapter (``gptcache.adapter.openai.ChatCompletion.create(cache_obj=..., **body)``), which
answers a hit from the cache and builds the chat-completion response. The cache is filled by one
miss whose LLM call is replaced by a function returning the upstream's answer (no network).

Variants (one ``Cache`` each, measured interleaved):
- ``last_content``: the default pre-embedding function: the key is the *last message's content*
  only (the system prompt, the model and the sampling parameters are not part of it).
- ``all_content``: every message's content joined: closer to a correct key, still without the
  model or parameters.
Each is timed from the parsed body (``adapter``) and from the raw bytes (``json.loads`` + the
adapter: ``adapter_with_loads``); ``dm_lookup`` is the data manager's ``search`` +
``get_scalar_data`` alone (the store lookup without the adapter around it).
"""

from __future__ import annotations

import json
import statistics
import sys
import timeit
from importlib.metadata import version
from pathlib import Path
from typing import Any


def refuse_auto_install() -> None:
    """GPTCache pip-installs a missing optional package at run time (``pip`` on the PATH);
    the benchmark installs what it needs up front and lets nothing else in."""
    import gptcache.utils as utils
    import gptcache.utils.dependency_control as control

    def refuse(package: str, warn: bool = False) -> None:
        raise ModuleNotFoundError(
            f"{package} is not installed in GPTCache's environment "
            "(the benchmark does not let GPTCache pip-install at run time)"
        )

    utils.prompt_install = control.prompt_install = refuse  # type: ignore[assignment]


def main() -> None:
    spec = json.loads(sys.argv[1])
    refuse_auto_install()
    raw = Path(spec["body_file"]).read_bytes()
    answer = json.loads(Path(spec["answer_file"]).read_bytes())
    number, repeat = spec["number"], spec["repeat"]

    from gptcache import Cache, Config
    from gptcache.adapter import openai as gpt_openai
    from gptcache.manager import manager_factory
    from gptcache.processor.pre import all_content, last_content

    def fake_llm(*args: Any, **kwargs: Any) -> dict[str, Any]:
        fake_llm.calls += 1  # type: ignore[attr-defined]
        return answer

    fake_llm.calls = 0  # type: ignore[attr-defined]
    gpt_openai.ChatCompletion.llm = fake_llm  # the adapter's hook for a custom LLM call

    caches: dict[str, Cache] = {}
    for name, pre in (("last_content", last_content), ("all_content", all_content)):
        cache = Cache()
        cache.init(
            pre_embedding_func=pre,
            config=Config(enable_token_counter=False),
            data_manager=manager_factory(
                "map", data_dir=f"{spec['data_dir']}/{name}", max_size=100_000
            ),
        )
        caches[name] = cache
        body = json.loads(raw)
        first = gpt_openai.ChatCompletion.create(cache_obj=cache, **body)  # miss: fills
        assert not first.get("gptcache"), "the first call must be a miss"
        for i in range(10_000):  # other entries too, as in a live cache
            cache.data_manager.save(
                f"other question {i:05d}", f"answer {i}", f"other question {i:05d}"
            )

    def adapter(cache: Cache) -> Any:
        body = json.loads(raw)
        return lambda: gpt_openai.ChatCompletion.create(cache_obj=cache, **body)

    def with_loads(cache: Cache) -> Any:
        return lambda: gpt_openai.ChatCompletion.create(cache_obj=cache, **json.loads(raw))

    def dm_lookup(cache: Cache, pre: Any) -> Any:
        key = pre(json.loads(raw))
        dm = cache.data_manager

        def lookup() -> Any:
            found = dm.search(key)
            return dm.get_scalar_data(found[0]) if found else None

        return lookup

    calls_before = fake_llm.calls
    parts = {}
    for name, cache in caches.items():
        check = gpt_openai.ChatCompletion.create(cache_obj=cache, **json.loads(raw))
        assert check.get("gptcache") is True, f"{name}: not a cache hit"
        parts[f"{name}.adapter"] = adapter(cache)
        parts[f"{name}.adapter_with_loads"] = with_loads(cache)
        parts[f"{name}.dm_lookup"] = dm_lookup(
            cache, last_content if name == "last_content" else all_content
        )
    parts["json_loads"] = lambda: json.loads(raw)
    for fn in parts.values():
        for _ in range(1000):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in parts}
    for _ in range(repeat):
        for name, fn in parts.items():
            samples[name].append(timeit.Timer(fn).repeat(repeat=1, number=number)[0] / number)
    hits_were_real = fake_llm.calls == calls_before
    print(
        json.dumps(
            {
                "gptcache_version": version("gptcache"),
                "python": sys.version.split()[0],
                "body_bytes": len(raw),
                "number": number,
                "repeat": repeat,
                "entries": 10_001,
                "llm_calls_during_timing": fake_llm.calls - calls_before,
                "hits_were_real": hits_were_real,
                "us": {n: round(statistics.median(v) * 1e6, 3) for n, v in samples.items()},
                "best_us": {n: round(min(v) * 1e6, 3) for n, v in samples.items()},
            }
        )
    )


if __name__ == "__main__":
    main()
