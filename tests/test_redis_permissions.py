"""`carpool serve` on a Redis shared with other services, as an ACL user: what that user may not
run is refused at start (exit 2, each command, key or channel named), never found later as a
Redis that seems down while it answers (carpool/redis/permissions.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("redis")

from fakes.instances import free_port, instances  # noqa: E402

SOURCE = Path(__file__).resolve().parents[1] / "src" / "carpool" / "redis"
RECOMMENDED = "~carpool:* &carpool:* +@all -@dangerous"


def with_user(target, rules: str) -> str:
    """``target``'s URL as the user ``tenant``, made on every node with ``rules``."""
    import redis

    for node in getattr(target, "nodes", [target]):
        client = redis.Redis(host=node.host, port=node.port)
        try:
            client.execute_command("ACL", "SETUSER", "tenant", "reset", "on", ">pw", *rules.split())
        finally:
            client.close()
    return re.sub(r"^redis://", "redis://tenant:pw@", target.url)


def serve_refused(url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CARPOOL_")}
    return subprocess.run(
        [sys.executable, "-m", "carpool.cli", "serve", "--redis", url, "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


def test_a_redis_user_without_the_invalidation_channel_is_refused_at_start_naming_it(
    redis_server,
):
    """Since Redis 7 a new user has no channels: without ``&carpool:*`` its SUBSCRIBE got NOPERM,
    taken for Redis down, and the instance flipped degraded and up every few ms for ever."""
    result = serve_refused(with_user(redis_server, "~carpool:* +@all -@dangerous"))
    assert result.returncode == 2, result.stderr
    said = result.stderr
    assert "SUBSCRIBE" in said and "PUBLISH" in said and "carpool:invalidations" in said
    assert "docs/scaling.md" in said and "&carpool:*" in said and "pw" not in said
    assert "TIME" not in said and "GET" not in said  # (only what is refused is named)


@pytest.mark.parametrize("target", ["redis_server", "redis_cluster"])
def test_a_redis_user_without_time_is_refused_at_start_naming_it(target, request):
    """A list of categories without ``@fast``: ``TIME`` is refused inside every script ("ACL
    failure in script"), so every shared call failed. On a cluster too (the check runs through
    the cluster client)."""
    server = request.getfixturevalue(target)
    categories = "+@read +@write +@keyspace +@scripting +@pubsub +@connection +@stream"
    result = serve_refused(with_user(server, f"~carpool:* &carpool:* {categories}"))
    assert result.returncode == 2, result.stderr
    assert re.search(r"\bTIME\b", result.stderr) and "docs/scaling.md" in result.stderr


def test_a_cluster_user_that_may_not_run_command_is_refused_at_start_naming_it(redis_cluster):
    """redis-py's cluster client reads the commands' key positions (``COMMAND``) as it starts:
    refused, the instance served from its own memory only, Redis taken for down."""
    result = serve_refused(with_user(redis_cluster, f"{RECOMMENDED} -command"))
    assert result.returncode == 2, result.stderr
    assert re.search(r"\bCOMMAND\b", result.stderr), result.stderr


def test_a_redis_user_that_may_not_run_scripts_is_refused_at_start(redis_server):
    result = serve_refused(with_user(redis_server, f"{RECOMMENDED} -@scripting"))
    assert result.returncode == 2 and "EVAL" in result.stderr, result.stderr


async def test_the_recommended_acl_starts_and_a_keyed_retry_on_another_instance_is_replayed(
    fake, redis_server
):
    """The ACL docs/scaling.md gives (INFO, a @dangerous command, refused: only said)."""
    url = with_user(redis_server, RECOMMENDED)
    body = {"model": "m", "messages": [{"role": "user", "content": "charge"}], "temperature": 0}
    key = {"Idempotency-Key": "order-7"}
    async with instances(2, fake.url, url) as (first, second):
        ran = await first.client.post("/v1/chat/completions", json=body, headers=key)
        retried = await second.client.post("/v1/chat/completions", json=body, headers=key)
        state = [(await i.stats())["redis"]["state"] for i in (first, second)]
    assert ran.status_code == 200 and retried.headers.get("idempotent-replayed") == "true"
    assert retried.json() == ran.json() and fake.count("/v1/chat/completions") == 1
    assert state == ["up", "up"]


def test_the_start_check_covers_every_command_carpools_scripts_call():
    """A command a script gains later is checked at start too (``NEEDED``'s list)."""
    from carpool.redis.permissions import NEEDED

    called = {
        name
        for path in SOURCE.glob("*.py")
        for name in re.findall(r"redis\.p?call\('([A-Za-z]+)'", path.read_text())
    }
    checked = {check[0].upper() for check in NEEDED}
    assert called and called <= checked, called - checked


@pytest.mark.parametrize(
    ("target", "mode"), [("redis_server", "standalone"), ("redis_cluster", "cluster")]
)
async def test_a_user_that_may_not_run_info_still_has_its_servers_mode_read(target, mode, request):
    """``-@dangerous`` refuses INFO: the start warned that Redis did not answer though it did,
    and a cluster went undetected (MOVED for the other masters' keys, until
    ``distributed.cluster`` was set by hand). HELLO, which such a user may send, tells the
    server's mode and version."""
    from carpool.redis.connection import server_mode

    url = with_user(request.getfixturevalue(target), RECOMMENDED)
    assert await server_mode(url) == mode


@pytest.mark.parametrize("target", ["redis_server", "redis_cluster"])
def test_a_wrong_redis_password_is_refused_at_start_naming_the_credentials(target, request):
    """Redis answered, refusing the user and password (``WRONGPASS``): taken for a Redis that
    does not answer, the instance started on its own memory, trying again for ever (every
    keyed retry on another instance ran twice) with a warning that said nothing of the
    password. A verdict, as a refused command is: exit 2, the password never said."""
    server = request.getfixturevalue(target)
    url = with_user(server, RECOMMENDED).replace("tenant:pw@", "tenant:wrong-secret@")
    result = serve_refused(url)
    assert result.returncode == 2, result.stderr
    assert "password" in result.stderr and "wrong-secret" not in result.stderr, result.stderr
