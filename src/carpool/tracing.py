"""OpenTelemetry spans, one per layer a request goes through.

Contract:
- ``Tracer.span(name, **attributes)`` is a context manager yielding an object with
  ``set_attribute``. It records a real OpenTelemetry span only when ``opentelemetry-api`` is
  installed (extra ``otel``), ``tracing`` is not ``"off"``, and (for ``"auto"``, the default) an
  application has installed a real tracer provider: the OpenTelemetry SDK set up by hand, or
  ``opentelemetry-instrument carpool serve``. Otherwise it is one shared no-op object, so a
  gateway nobody traces pays one attribute lookup per layer, not a span.
- The provider is looked up when the gateway is built and again when it starts serving, so a
  provider installed in between is picked up.
- Span names: ``carpool.request`` (attributes ``carpool.route``, ``carpool.outcome``: ``rejected``
  for the gateway's own refusals, as ``/stats`` counts them) with children
  ``carpool.exact``, ``carpool.flight`` (``carpool.role``: leader or joiner),
  ``carpool.semantic`` (``carpool.similarity`` of a served hit) and ``carpool.upstream``
  (``carpool.replica``, ``carpool.decision``). No prompt text or credential is ever an attribute.
"""

from __future__ import annotations

from typing import Any, Literal

Mode = Literal["auto", "on", "off"]


class _NoSpan:
    """What ``span`` yields when nobody traces: enters, exits and drops attributes."""

    __slots__ = ()

    def __enter__(self) -> _NoSpan:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def set_attribute(self, _key: str, _value: Any) -> None:
        return None


NO_SPAN = _NoSpan()


class Tracer:
    def __init__(self, mode: Mode = "auto", provider: Any = None) -> None:
        self.mode = mode
        self.provider = provider  # None: OpenTelemetry's global provider
        self._tracer: Any = None
        self.refresh()

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def refresh(self) -> None:
        """(Re)decide whether spans are recorded, from the mode and the installed provider."""
        self._tracer = None
        if self.mode == "off":
            return
        try:
            from opentelemetry import trace
        except ImportError:
            return
        provider = self.provider or trace.get_tracer_provider()
        if self.mode == "auto" and type(provider).__name__ in (
            "ProxyTracerProvider",
            "NoOpTracerProvider",
        ):
            return  # nobody collects: stay free
        self._tracer = provider.get_tracer("carpool")

    def span(self, name: str, **attributes: Any) -> Any:
        if self._tracer is None:
            return NO_SPAN
        return self._tracer.start_as_current_span(name, attributes=attributes or None)
