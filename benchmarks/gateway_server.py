"""The real gateway for the benchmarks: ``create_app(Gateway(Config(upstreams=[URL])))`` on uvicorn.

    python benchmarks/gateway_server.py --port 8080 --upstream http://127.0.0.1:9001/v1

Same stack as ``carpool serve`` (uvicorn, uvloop, httptools, access log off), with the log level
at warning and a listen backlog large enough for 1,000 connections arriving at once.
"""

from __future__ import annotations

import argparse


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True, help="base URL ending in /v1")
    parser.add_argument("--semantic", action="store_true", help="turn the semantic cache on")
    args = parser.parse_args()

    import uvicorn

    from carpool.config import Config
    from carpool.server import create_app
    from carpool.wiring import build_gateway

    config = Config(
        upstreams=[args.upstream],
        host=args.host,
        port=args.port,
        log_level="warning",
        semantic={"enabled": args.semantic},
    )
    uvicorn.run(
        create_app(build_gateway(config)),
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
