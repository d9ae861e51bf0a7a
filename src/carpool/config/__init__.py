"""One typed configuration for the whole gateway.

Contract:
- Every tunable lives here, with its unit and default in its description; no layer hides a literal.
- Sources, strongest first: explicit overrides (CLI flags) > ``CARPOOL_*`` environment variables >
  the YAML file > the defaults. Nested keys in the environment use ``__``:
  ``CARPOOL_CACHE__MAX_BYTES=1000``; values are read as YAML scalars (``true``, ``1.5``, ``[a, b]``).
  The rules in full, and how pydantic-settings applies them: carpool.config.loader.
- Unknown keys are errors (a typo must not silently keep a default). ``load`` raises ``ConfigError``
  naming the field and what is allowed; the CLI turns it into exit status 2.
- Durations are seconds unless the name ends in ``_ms``; sizes are bytes.

Modules: ``model`` (``Config``, the top-level keys), one per group of sections (``caching``,
``perimeter``, ``upstream``, ``distributed``), ``loader`` (the sources and their merging),
``reference`` (docs/config.md). Everything is importable from ``carpool.config``.
"""

from __future__ import annotations

from .base import ConfigError
from .caching import (
    DEFAULT_TYPES,
    CacheConfig,
    CoalesceConfig,
    FingerprintConfig,
    JudgeConfig,
    SemanticConfig,
    TypePolicy,
)
from .distributed import DistributedConfig
from .loader import CONFIG_FILE_VARIABLE, ENV_PREFIX
from .model import Config
from .perimeter import (
    AuthConfig,
    IdempotencyConfig,
    LimitsConfig,
    PassthroughConfig,
    ShutdownConfig,
    TenantConfig,
)
from .reference import reference_markdown
from .upstream import BatchingConfig, RoutingConfig, SimConfig, UpstreamConfig

__all__ = [
    "AuthConfig",
    "CONFIG_FILE_VARIABLE",
    "DEFAULT_TYPES",
    "ENV_PREFIX",
    "BatchingConfig",
    "CacheConfig",
    "CoalesceConfig",
    "Config",
    "ConfigError",
    "DistributedConfig",
    "FingerprintConfig",
    "IdempotencyConfig",
    "JudgeConfig",
    "LimitsConfig",
    "PassthroughConfig",
    "RoutingConfig",
    "SemanticConfig",
    "ShutdownConfig",
    "SimConfig",
    "TenantConfig",
    "TypePolicy",
    "UpstreamConfig",
    "reference_markdown",
]
