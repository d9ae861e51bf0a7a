"""What an ACL user must be allowed on a Redis/Valkey shared with other services, checked at start.

Contract
--------
- :data:`NEEDED` is every command carpool sends (its top-level commands, and every command its
  Lua scripts call: a test holds it to the scripts of this package), each with the arguments
  that carry a key (:data:`KEY`, a key under ``distributed.key_prefix``) or the invalidation
  channel (:data:`CHANNEL`, ``<prefix>invalidations``); :data:`ON_A_CLUSTER` what the cluster
  client sends besides (its reading of the topology).
- :func:`permission_problems` (``carpool serve``'s start, after :func:`~.connection.server_mode`)
  asks the server, in one ``EVAL`` of :data:`CHECK`, whether the configured user may run each
  of them: ``redis.acl_check_cmd`` (Redis/Valkey >= 7) checks a command's, its keys' and its
  channels' permissions without running it. It returns what is refused, grouped and named
  (``TIME``; ``PUBLISH, SUBSCRIBE on channel carpool:invalidations``), the ``EVAL`` itself when
  that is refused (``NOPERM``), a command the server does not know (renamed or disabled) as
  such; an empty list when everything is allowed; None when the server gave no verdict (down
  now, or any other error: the instance starts as it would without the check).
  Without this, a refused command was taken for Redis down at every call (``NOPERM`` is a
  ``ResponseError`` like any other): with no channel permission the subscriber flipped the
  instance degraded and up every few ms for ever; without ``@fast`` ``TIME`` failed every
  script; either way nothing was shared, and a keyed retry on another instance ran twice.
- The script runs on the node the URL names, with no keys declared (a keyless script runs on
  any node of a cluster, without a redirection, and before the cluster client could fail on a
  refused ``CLUSTER SLOTS`` with "Cluster mode is not enabled on this node"). ACLs are each
  node's own: the check speaks for that node.
"""

from __future__ import annotations

from typing import Any

from .connection import CONNECT_TIMEOUT, close_client, connect

__all__ = ["CHANNEL", "CHECK", "KEY", "NEEDED", "ON_A_CLUSTER", "permission_problems"]

KEY = "\0key"  # (placeholders, replaced by the probe key and the channel: no command takes them)
CHANNEL = "\0channel"

NEEDED: tuple[tuple[str, ...], ...] = (
    # Sent by the client.
    ("PING",),
    ("EVAL", "return 1", "1", KEY),
    ("EVALSHA", "0" * 40, "1", KEY),  # (a registered script: EVALSHA, SCRIPT LOAD on NOSCRIPT)
    ("SCRIPT", "LOAD", "return 1"),
    ("GET", KEY),
    ("EXISTS", KEY),
    ("PTTL", KEY),
    ("TYPE", KEY),
    ("UNLINK", KEY),
    ("SCAN", "0"),
    ("ZSCAN", KEY, "0"),
    ("ZREM", KEY, "m"),
    ("XADD", KEY, "*", "f", "v"),
    ("XREAD", "COUNT", "1", "BLOCK", "1", "STREAMS", KEY, "0"),
    ("XRANGE", KEY, "-", "+"),
    ("XREVRANGE", KEY, "+", "-"),
    ("PUBLISH", CHANNEL, "m"),
    ("SUBSCRIBE", CHANNEL),
    # Called by the scripts (those above they call too: EXISTS, GET, PTTL, TYPE, UNLINK...).
    ("TIME",),
    ("SET", KEY, "v"),
    ("DEL", KEY),
    ("DECRBY", KEY, "1"),
    ("INCR", KEY),
    ("INCRBY", KEY, "1"),
    ("PEXPIRE", KEY, "1"),
    ("HGET", KEY, "f"),
    ("HMGET", KEY, "f"),
    ("HSET", KEY, "f", "v"),
    ("HDEL", KEY, "f"),
    ("XINFO", "STREAM", KEY),
    ("ZADD", KEY, "1", "m"),
    ("ZCARD", KEY),
    ("ZCOUNT", KEY, "0", "1"),
    ("ZRANGE", KEY, "0", "1"),
    ("ZRANGEBYSCORE", KEY, "0", "1"),
    ("ZREMRANGEBYSCORE", KEY, "0", "1"),
    ("ZSCORE", KEY, "m"),
)
# (redis-py's cluster client reads the topology, and the commands' key positions as it starts.)
ON_A_CLUSTER: tuple[tuple[str, ...], ...] = (("CLUSTER", "SLOTS"), ("COMMAND",))
_SUBCOMMANDS = frozenset({"SCRIPT", "XINFO", "CLUSTER"})

# ARGV: the checks one after the other, each as its number of words then its words. The reply:
# {index, ''} for each check refused, {index, error} for one the server cannot check (a command
# it does not know). Read-only (no-writes: it runs on a replica, and on a full Redis).
CHECK = """#!lua flags=no-writes
local refused, i, index = {}, 1, 0
while i <= #ARGV do
  local n = tonumber(ARGV[i])
  index = index + 1
  local ok, allowed = pcall(redis.acl_check_cmd, unpack(ARGV, i + 1, i + n))
  if not ok then
    table.insert(refused, {index, tostring(allowed.err or allowed)})
  elseif not allowed then
    table.insert(refused, {index, ''})
  end
  i = i + n + 1
end
return refused
"""


def _label(check: tuple[str, ...]) -> str:
    return " ".join(check[:2]) if check[0] in _SUBCOMMANDS else check[0]


async def permission_problems(
    url: str, prefix: str, *, cluster: bool = False, timeout: float = CONNECT_TIMEOUT * 4
) -> list[str] | None:
    """What the user of ``url`` may not run of what carpool needs, named (the module's
    contract); None when the server gave no verdict."""
    from redis.exceptions import NoPermissionError, RedisError

    checks = NEEDED + (ON_A_CLUSTER if cluster else ())
    # (Hash-tagged as every key carpool writes, so a pattern such as ``~carpool:*`` is what
    # is checked, and a cluster's slots are no part of it.)
    key, channel = f"{prefix}{{acl-check}}", f"{prefix}invalidations"
    argv: list[str] = []
    for check in checks:
        argv += [
            str(len(check)),
            *(key if w == KEY else channel if w == CHANNEL else w for w in check),
        ]
    client = connect(url, socket_timeout=timeout, connect_timeout=timeout, retries=0)
    try:
        reply: Any = await client.eval(CHECK, 0, *argv)
    except NoPermissionError as error:
        return [f"EVAL (the server says: {error})"]
    except (RedisError, OSError):
        return None  # (down now, or anything else: no verdict, the start goes on)
    finally:
        await close_client(client)
    by_key, by_channel, plain, unknown = [], [], [], []
    for index, failed in reply:
        check = checks[int(index) - 1]
        name = _label(check)
        if failed:
            unknown.append(name)
        elif KEY in check:
            by_key.append(name)
        elif CHANNEL in check:
            by_channel.append(name)
        else:
            plain.append(name)
    problems = []
    if plain:
        problems.append(", ".join(plain))
    if by_key:
        problems.append(f"{', '.join(by_key)} on keys {prefix}*")
    if by_channel:
        problems.append(f"{', '.join(by_channel)} on channel {channel}")
    if unknown:
        problems.append(f"{', '.join(unknown)} (unknown to the server: renamed or disabled)")
    return problems
