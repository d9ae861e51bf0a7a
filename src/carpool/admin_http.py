"""The ``/admin/*`` endpoints: invalidation, and the semantic cache's audits and feedback.

Contract:
- Every one needs ``admin_token``: without one configured they do not exist (404); a request
  without ``Authorization: Bearer <token>`` (the scheme in any case, RFC 9110 §11.1; the token
  compared in constant time) is 401, with its challenge (``WWW-Authenticate: Bearer realm="carpool
  admin"``, RFC 9110 §15.5.2). Errors in OpenAI's shape; bodies are JSON objects read under the gateway's body limits.
- ``POST /admin/invalidate`` ``{"tag"|"namespace"|"prefix": str}`` or ``{"all": true}``:
  ``{"invalidated": n}`` (``admin.invalidate``); with ``--workers N`` and no ``redis``, on every
  worker (``carpool.peers``), ``n`` counting them all. With ``redis``, one that did not reach
  it is a 503 with ``Retry-After`` (done in this process only: the shared answers stay). A
  worker of the run passing it on (through its peers' door, with the run's secret) needs the
  token too. Only such a worker may send ``{"state": tag}`` (a deleted response's, passed on
  by ``Gateway.passthrough``: ``Gateway.forget_state``, what this worker stored under it, by
  key), with or without a token, or ``{"refused": tenant}`` (a key the upstream refused on
  that worker: ``AcceptedCredentials.refused_elsewhere``, each worker accepting by itself);
  from anyone else either is an invalid selector (400).
- ``POST /admin/semantic/feedback`` ``{"entry": id}`` (the ``x-carpool-entry`` of a semantic hit
  that was wrong): the entry is dropped and counts as a wrong hit in its error budget
  (``auditor.Auditor.feedback``: its tenant's in its namespace): ``{"dropped": true,
  "namespace": ns, "tenant": label}`` (``Audits.label``); an id this instance does not hold (any
  more): 404. With ``--workers N`` an id is one worker's: one that does not hold it asks the
  others (``carpool.peers``), and answers with the one that did. Without the semantic cache:
  404.
- Any other method or path under ``/admin``: the same refusals, then 405 (with ``Allow``) or
  404, in OpenAI's shape too.
- ``GET /admin/semantic/audit``: each namespace's audits, estimate and state (as ``/stats``
  ``semantic_audit``, which lists at most ``METRIC_NAMESPACES``: here every one), and its error budgets' by tenant label (``tenants``: only here, never in
  ``/stats``, which may be open; ``Audits.snapshot``); the answering worker's (with ``--workers
  N``, as ``/stats``). ``POST /admin/semantic/audit/reset`` ``{"namespace": ns, "tenant":
  label}`` (either, or ``{}``: all) puts those budgets back to ``serving`` with no audits:
  ``{"reset": n}``, how many, with ``--workers N`` on every worker, ``n`` counting them all (the
  Prometheus counters of audits go on: ``Audits.totals``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .auth import presents
from .errors import BodyTimeout, BodyTooLarge, RequestError
from .peers import PEER
from .pipeline import Gateway
from .store.base import StoreUnavailable

if TYPE_CHECKING:
    from .peers import Peers
    from .semantic.audit import Budget

BodyOf = Callable[[HttpRequest], Awaitable[bytes | None]]
_LEFT = object()  # ``spec_of``: the client left before its body came


def admin_routes(gateway: Gateway, body_of: BodyOf) -> list[Route]:
    """The ``/admin/*`` routes of ``gateway`` (``body_of``: the server's bounded body reader)."""

    def refusal(request: HttpRequest) -> Response | None:
        token = gateway.config.admin_token
        if not token:
            return error(404, "not found", "not_found")
        if not presents(token, request.headers.get("authorization", "")):
            refused = error(401, "admin token required", "unauthorized")
            # A 401 names its scheme (RFC 9110 §15.5.2: MUST): Bearer only, as only it is
            # accepted here (no browser opens these: ``server._admin_refusal`` adds Basic).
            refused.headers["www-authenticate"] = 'Bearer realm="carpool admin"'
            return refused
        return None

    async def spec_of(request: HttpRequest) -> Any:
        """The JSON body; ``_LEFT`` when the client left. Raises ``RequestError`` for bad JSON
        (a body of ``null`` is JSON: the work refuses it as it refuses any other wrong spec)."""
        raw = await body_of(request)
        if raw is None:
            return _LEFT
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise RequestError(f"the body is not JSON: {exc}") from exc

    def admin(
        work: Callable[[HttpRequest, Any], Awaitable[Response]],
        read: bool = True,
        peers: bool = False,
    ) -> Callable[[HttpRequest], Awaitable[Response]]:
        async def endpoint(request: HttpRequest) -> Response:
            response = await answered(request)
            response.headers["cache-control"] = "no-store"  # (``server.NOT_KEPT``)
            return response

        async def answered(request: HttpRequest) -> Response:
            # (``peers``: a worker of this run, token or not: ``work`` checks what it may do.)
            trusted = peers and request.scope.get(PEER) is True
            if not trusted and (refused := refusal(request)) is not None:
                return refused
            try:
                spec = await spec_of(request) if read else None
                if spec is _LEFT:
                    return Response(status_code=499)  # the client left
                return await work(request, spec)
            except (BodyTooLarge, BodyTimeout) as failure:
                return Response(failure.body(), failure.status, headers=failure.headers())
            except RequestError as failure:
                return error(400, str(failure), "invalid_request")
            except StoreUnavailable as failure:  # (not done: say so, the caller retries)
                response = error(503, str(failure), "store_unavailable", "server_error")
                response.headers["retry-after"] = "1"
                return response

        return endpoint

    async def invalidate(request: HttpRequest, spec: Any) -> Response:
        peer = request.scope.get(PEER) is True
        if peer and isinstance(spec, dict) and set(spec) == {"state"}:
            # A deleted response's answers, by key (a worker's DELETE passed on): only a peer.
            tag = spec["state"]
            if not isinstance(tag, str) or not tag.startswith("\n"):
                raise RequestError("a state is a stored response's tag")
            return JSONResponse({"invalidated": await gateway.forget_state(tag)})
        if peer and isinstance(spec, dict) and set(spec) == {"refused"}:
            # A key the upstream refused on another worker: refused here too (only a peer).
            tenant = spec["refused"]
            if not isinstance(tenant, str):
                raise RequestError("refused names a tenant")
            gateway.accepted.refused_elsewhere(tenant)
            return JSONResponse({"invalidated": 0})
        if peer and (refused := refusal(request)) is not None:
            return refused  # (an invalidation of every layer: the operator's, token and all)
        # Passed on to the other workers, unless a worker passed it on to this one.
        everywhere = not peer
        return JSONResponse({"invalidated": await gateway.invalidate(spec, everywhere=everywhere)})

    def others(request: HttpRequest) -> Peers | None:
        """This run's other workers, to pass a request on to; None when a worker passed it on
        (it went to every one) or there are none."""
        return gateway.layers.peers if request.scope.get(PEER) is not True else None

    async def feedback(request: HttpRequest, spec: Any) -> Response:
        entry = spec.get("entry") if isinstance(spec, dict) else None
        if not isinstance(entry, str) or not entry:
            raise RequestError('give {"entry": "<the x-carpool-entry of the wrong hit>"}')
        if gateway.semantic is None or gateway.layers.audits is None:
            return error(404, "the semantic cache is off", "not_found")
        budget = gateway.auditor.feedback(entry)
        if budget is not None:
            return JSONResponse(reported(budget))
        if (peers := others(request)) is not None:
            # An entry id is one worker's (keyed with its own secret): the one holding it.
            for status, answer in await peers.admin("/admin/semantic/feedback", spec):
                if status == 200:
                    return JSONResponse(answer)
        return error(404, "no such semantic entry here (any more)", "not_found")

    def reported(budget: Budget) -> dict[str, Any]:
        assert gateway.layers.audits is not None  # (a report is recorded only with audits)
        label = gateway.layers.audits.label(budget.tenant)
        return {"dropped": True, "namespace": budget.namespace, "tenant": label}

    async def audit(_: HttpRequest, __: Any) -> Response:
        audits = gateway.layers.audits
        return JSONResponse(audits.snapshot(tenants=True) if audits is not None else {})

    async def audit_reset(request: HttpRequest, spec: Any) -> Response:
        if (
            not isinstance(spec, dict)
            or set(spec) - {"namespace", "tenant"}  # (a misspelt name is no {}: that is all)
            or not all(isinstance(value, str) for value in spec.values())  # (null: no "all")
        ):
            raise RequestError(
                'give {"namespace": "<name>", "tenant": "<label>"} (either), or {} for all'
            )
        audits = gateway.layers.audits
        count = audits.reset(spec.get("namespace"), spec.get("tenant")) if audits is not None else 0
        if (peers := others(request)) is not None:
            for status, answer in await peers.admin("/admin/semantic/audit/reset", spec):
                reset = answer.get("reset")
                count += reset if status == 200 and isinstance(reset, int) else 0
        return JSONResponse({"reset": count})

    routes = [
        Route("/admin/invalidate", admin(invalidate, peers=True), methods=["POST"]),
        Route("/admin/semantic/feedback", admin(feedback), methods=["POST"]),
        Route("/admin/semantic/audit", admin(audit, read=False), methods=["GET"]),
        Route("/admin/semantic/audit/reset", admin(audit_reset), methods=["POST"]),
    ]
    allowed = {
        route.path: ", ".join(sorted((route.methods or set()) - {"HEAD"})) for route in routes
    }

    async def other(request: HttpRequest) -> Response:
        """Any other method or path under /admin: refused as the admin paths refuse (404
        without a token, 401 without the right one), then 405 or 404, in OpenAI's shape."""
        if (refused := refusal(request)) is not None:
            return refused
        methods = allowed.get(request.url.path)
        if methods is None:
            return error(404, "not found", "not_found")
        response = error(405, f"use {methods}", "method_not_allowed")
        response.headers["allow"] = methods
        return response

    every = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return [*routes, Route("/admin/{rest:path}", other, methods=every)]


def error(status: int, message: str, code: str, kind: str = "invalid_request_error") -> Response:
    return Response(
        # (``param`` too, null: OpenAI's shape, as every other error of the gateway's own)
        orjson.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}),
        status,
        headers={"cache-control": "no-store"},  # (``server.NOT_KEPT``)
        media_type="application/json",
    )
