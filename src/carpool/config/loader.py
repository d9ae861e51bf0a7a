"""Where a configuration comes from: the YAML file, ``CARPOOL_*`` environment variables and
explicit overrides, merged by pydantic-settings.

Contract:
- Sources, strongest first: explicit overrides (CLI flags) > ``CARPOOL_*`` environment variables >
  the YAML file > the defaults. Mappings merge key by key (a file's ``cache.types`` and
  ``CARPOOL_CACHE__DEFAULT_TTL`` both apply); anything else is replaced by the stronger source.
  ``cache.types``' keys are lower-cased in each source before the merge, as a request's type is
  read (``_types_in_lower_case``): a variable's ``realtime`` replaces a file's ``Realtime``; two
  keys of one source that differ only in case are refused.
- A variable is ``CARPOOL_`` (in capitals) followed by the key in any case; nested keys are joined
  with ``__``: ``CARPOOL_CACHE__MAX_BYTES=1000``, ``CARPOOL_CACHE__TYPES__FAQ__TTL=5``. A section
  or a list can also be given whole (``CARPOOL_UPSTREAMS='[http://a:8000/v1, http://b:8000/v1]'``,
  ``CARPOOL_CACHE='{max_bytes: 1000}'``); the nested variables of that section apply over it.
  ``CARPOOL_CONFIG`` names the file (the CLI reads it), ``CARPOOL_RUN`` and ``CARPOOL_PEERS``
  the workers' directory (``carpool serve`` sets them), ``CARPOOL_REDIS_SERVER`` the server binary
  ``carpool bench`` starts; they are not keys.
- A value is the string as written, read by its key's type (``8080``, ``1.5``, ``yes``); a
  list or mapping (``[a, b]``, ``{k: v}``) given to a key that holds one (a section, a mapping,
  a list: ``_is_structured``) is read as YAML, to any other key it is the string (an
  ``admin_token`` of ``{Xy7}``, as the file's ``"{Xy7}"``); an empty value or ``null`` is null
  (``_read_value``). A list key's value (found by its type, at any depth) can also be one item
  or items separated by commas, each trimmed: ``CARPOOL_UPSTREAMS=http://a:8000/v1`` (as
  ``--upstream`` takes it), ``CARPOOL_TENANT__SHARED_NAMESPACES=pub,docs`` (``_items``); an
  item holding a comma is written in the YAML list (``'["a,b"]'``). An empty value or ``null``
  is null there too, but for a secret's (``admin_token``, the keys held: ``SecretStr``):
  there an empty value is what a secret that was not mounted looks like, and stays the empty
  string, which the key refuses ("give one, or null"); ``null`` turns it off.
- A ``CARPOOL_*`` variable that names no key is an error, like an unknown key in the file: a typo
  must not silently keep a default. The error names the key, never its value (a misspelt
  secret's name is anything).
- Any invalid source raises ``ConfigError`` naming the field and what is allowed; a file that is
  not UTF-8 text too, naming the byte where it stops being so; a key given twice in one mapping
  of the file (at any depth; PyYAML kept the last) too, naming it and its lines
  (``_OneValuePerKey``); and the path ``""``, which names no file. A URL given to the ``upstream``
  section (``CARPOOL_UPSTREAM``, the flag's name, or ``upstream:`` in the file) asks whether
  ``upstreams`` was meant, by the name of the source it came from (``_NEAR_MISSES``).
- ``resolved_text(config)``: the file from which a child process (a worker of ``carpool serve
  --workers N``) rebuilds exactly ``config`` with ``load_resolved(path)``: the keys given
  (``Config.with_secrets``) as YAML, every character outside ASCII escaped, so that what is read
  back is what was written, whatever the text. It holds values, not their sources: read alone
  (no environment), each held key as written (a resolved key that looks like ``${OTHER}`` is
  that key, never a variable's name again: ``upstream.keys_resolved``).

pydantic-settings finds the variables of each field (prefix, ``__`` nesting, case) and merges the
sources in order (``settings_customise_sources``); what is carpool's own is above: YAML values
instead of JSON, unknown variables as errors, and the file's error messages.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from types import UnionType
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, SecretStr, ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    InitSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from .base import ConfigError
from .model import Config
from .upstream import keys_resolved
from .urls import without_credentials

ENV_PREFIX = "CARPOOL_"
# Names the config file (read by the CLI and by each worker process), not a key.
CONFIG_FILE_VARIABLE = "CARPOOL_CONFIG"
# Names the workers' meeting place (``carpool.peers.slots``), set by ``carpool serve``: not a key.
PEERS_VARIABLE = "CARPOOL_PEERS"
# Names the run's private directory (``carpool.rundir``), set by ``carpool serve --workers N``
# for its workers: not a key.
RUN_VARIABLE = "CARPOOL_RUN"
# The pid of ``carpool serve --workers N``'s parent, set for its workers (``server``): not a key.
PARENT_VARIABLE = "CARPOOL_PARENT"
# The Redis/Valkey server binary that `carpool bench` and the tests start (``bench.redis_server``):
# not a key (set in a shell, every other command refused to start).
REDIS_SERVER_VARIABLE = "CARPOOL_REDIS_SERVER"
# Set by ``carpool serve --workers N`` started with SIGINT ignored (a background job's): its
# workers keep ignoring it too (``supervisor``, ``server``): not a key.
SIGINT_IGNORED_VARIABLE = "CARPOOL_SIGINT_IGNORED"
NOT_KEYS = frozenset(
    {
        CONFIG_FILE_VARIABLE,
        PEERS_VARIABLE,
        RUN_VARIABLE,
        PARENT_VARIABLE,
        REDIS_SERVER_VARIABLE,
        SIGINT_IGNORED_VARIABLE,
    }
)
NESTED_DELIMITER = "__"


def load(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """``Config.load``: the file at ``path``, ``env`` (``os.environ`` unless given) and
    ``overrides`` merged over the defaults, validated."""
    file_values = _types_in_lower_case(_read_file(path) if path is not None else {})
    env = os.environ if env is None else env
    with _sources(env, file_values):
        try:
            merged = _Sources(**_types_in_lower_case(overrides or {}))
        except ValidationError as exc:
            raise ConfigError(describe(exc, _variables_named(env))) from exc
    # The fields are validated already; this makes the result a plain Config.
    return Config.model_validate(dict(merged))


def _types_in_lower_case(values: Mapping[str, Any]) -> dict[str, Any]:
    """One source's values, its ``cache.types`` keys lower-cased (as a request's type is read):
    so that a stronger source's ``realtime`` (a variable's name is read lower-cased) replaces a
    weaker one's ``Realtime`` when the sources merge, instead of both reaching the validator as
    two keys. Two keys of this source that differ only in case are left as they are, for the
    validator to refuse (``CacheConfig._merge_default_types``)."""
    cache = values.get("cache")
    types = cache.get("types") if isinstance(cache, Mapping) else None
    if not isinstance(cache, Mapping) or not isinstance(types, Mapping):
        return dict(values)
    lowered = {k.lower() if isinstance(k, str) else k: v for k, v in types.items()}
    if len(lowered) < len(types):
        return dict(values)
    return {**values, "cache": {**cache, "types": lowered}}


def load_resolved(path: str | Path | None) -> Config:
    """The config written by ``resolved_text`` to ``path``, as a child process rebuilds it (the
    module contract)."""
    with keys_resolved():
        return load(path, env={})


def resolved_text(config: Config) -> str:
    """``config`` as the text of a file that ``load_resolved(path)`` reads back as exactly it
    (the module contract): its secrets included, so only for a 0600 file."""
    # PyYAML writes what PyYAML reads: escaped, a string outside the BMP or with a YAML line
    # break in it comes back whole (JSON's surrogate-pair escapes came back as two lone
    # surrogates), and a string that looks like another type is quoted.
    text: str = yaml.safe_dump(
        config.with_secrets(), sort_keys=False, width=2**31, allow_unicode=False
    )
    return text


def describe(exc: ValidationError, variables: frozenset[str] = frozenset()) -> str:
    """One line naming every invalid field, what it got and what is allowed.

    What it got is shown only when it is one plain value of a known field that holds no
    secret: the input of a section or of the whole config holds every key and token in it, a
    URL its user and password (those go through ``without_credentials``; a validator's own
    message does the same), and an unknown key may be a secret's, misspelt (``admin_tokn``,
    ``CARPOOL_REDIS_PASS``): its name is no guide, so its value is never shown.

    ``variables``: the keys (lower case, ``__``-joined) that a ``CARPOOL_*`` variable set, to
    name a near miss by the variable rather than by the file's key.
    """
    lines = []
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        field = ".".join(loc) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"{field}: unknown key")
            continue
        # pydantic's messages already say what is allowed ("Input should be 'a' or 'b'").
        line = f"{field}: {err['msg']}{_got(loc, err.get('input'))}"
        lines.append(line + _near_miss(loc, err.get("input"), variables))
    return "invalid config: " + "; ".join(lines)


_SECRET_PARTS = ("key", "token", "secret", "password")

# A section whose name, with an ``s``, is a list key's: a string given to the section was meant
# for the list. ``upstream`` holds the key the gateway sends; ``--upstream``, the flag, fills
# ``upstreams``, so ``CARPOOL_UPSTREAM=http://...`` is the natural mistake.
_NEAR_MISSES = {"upstream": ("upstreams", "the replicas' URLs, as --upstream takes them")}


def _near_miss(loc: list[str], value: Any, variables: frozenset[str]) -> str:
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        # A section or list written whole that YAML could not read (a brace or quote missing):
        # said so, as its text is not shown (``_got``).
        return " (written as YAML that cannot be read: a bracket, brace or quote missing?)"
    if len(loc) != 1 or loc[0] not in _NEAR_MISSES or not isinstance(value, str):
        return ""
    section = loc[0]
    meant, what = _NEAR_MISSES[section]
    if section in variables:  # the environment is stronger than the file: it was the variable's
        variable = (ENV_PREFIX + section).upper()
        return (
            f" ({variable} is the `{section}` section, set key by key as "
            f"{variable}__<KEY>; did you mean {(ENV_PREFIX + meant).upper()}, {what}?)"
        )
    return f" (`{section}` is a section of keys; did you mean `{meant}`, {what}?)"


def _variables_named(env: Mapping[str, str]) -> frozenset[str]:
    """The keys that ``env``'s ``CARPOOL_*`` variables set, as ``_Environment`` reads them."""
    return frozenset(
        name[len(ENV_PREFIX) :].lower()
        for name in env
        if name.startswith(ENV_PREFIX) and name not in NOT_KEYS
    )


def _got(loc: list[str], value: Any) -> str:
    if any(part in name.lower() for name in loc for part in _SECRET_PARTS):
        return ""
    # Only a plain value's: a string given to a section, a mapping or a list (a variable
    # ``CARPOOL_UPSTREAM='{api_key: sk-..., '`` that YAML could not read, or ``upstream:
    # "api_key=sk-..."`` in the file) is that section's keys, secrets among them, as written;
    # and a place no key names (a validator's union branch) is not known to be plain.
    annotation = _annotation_at(tuple(loc))
    if annotation is None or _is_structured(annotation):
        return ""
    if isinstance(value, str):
        shown = without_credentials(value) if "@" in value or "://" in value else value
        return f"; got {shown!r}"
    if value is None or isinstance(value, int | float):
        return f"; got {value!r}"
    return ""  # (a mapping or a list given to a plain key: it may hold anything)


def _read_file(path: str | Path) -> dict[str, Any]:
    # Read here rather than by pydantic-settings' YAML source, which skips a missing file: a
    # --config that cannot be read is an error.
    if str(path) == "":  # (Path("") is ".", the directory: "Is a directory" said nothing useful)
        raise ConfigError("config file '': an empty path names no file")
    try:
        raw = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        # Where, never the bytes: they may be a key's.
        raise ConfigError(
            f"config file {path}: not UTF-8 text (byte {exc.start} cannot be decoded)"
        ) from None
    try:
        loaded = yaml.load(text, Loader=_OneValuePerKey) or {}  # (a SafeLoader)
    except yaml.YAMLError as exc:
        # Where and what, never the text: PyYAML's message quotes the line, a key perhaps.
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ConfigError(f"config file {path}{where}: {problem}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path}: the top level must be a mapping")
    return loaded


class _OneValuePerKey(yaml.SafeLoader):  # type: ignore[misc]  # (PyYAML has no types)
    """PyYAML's safe loader, refusing a key given twice in one mapping, at any depth: PyYAML
    keeps the last, so a second ``cache:`` section silently dropped the first one's keys. A
    key that a merge (``<<: *base``) brings in may be given again: that is what a merge is
    for."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # (an unhashable key: PyYAML's own error names it below)
                continue
            if first is not key_node:
                # The key and where, never a value: a value may be a secret.
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"the key {key!r} is given twice (first at line "
                    f"{first.start_mark.line + 1}); give it once",
                    key_node.start_mark,
                )
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


# The environment and file of the ``load`` in progress: settings_customise_sources, which builds
# the sources, takes no arguments. A context variable, so concurrent loads cannot mix them up.
_LOADING: ContextVar[tuple[Mapping[str, str], dict[str, Any]]] = ContextVar("carpool_config_load")


@contextmanager
def _sources(env: Mapping[str, str], file_values: dict[str, Any]) -> Iterator[None]:
    token = _LOADING.set((env, file_values))
    try:
        yield
    finally:
        _LOADING.reset(token)


class _Sources(BaseSettings, Config):
    """Config's fields read from the sources of one ``load``; only ``load`` builds one."""

    model_config = SettingsConfigDict(
        extra="forbid",
        validate_assignment=True,
        allow_inf_nan=False,
        validate_default=False,
        # For the file and the overrides: their keys are matched as written (``Port:`` is an
        # unknown key). The environment source matches names in any case.
        case_sensitive=True,
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        env, file_values = _LOADING.get()
        # Strongest first; no .env file, no secrets directory.
        return (
            init_settings,
            _Environment(settings_cls, env),
            InitSettingsSource(settings_cls, init_kwargs=file_values),
        )


class _Raw(str):
    """An environment value as written, not read as YAML yet."""


def _read_value(raw: str, structured: bool) -> Any:
    """A variable's value: empty or ``null`` is null; for a key that holds a list or mapping
    (``structured``: ``_is_structured``), one written as such (``[...]``, ``{...}``) is read as
    YAML; anything else is the string as written, which the key's type reads (pydantic:
    ``8080`` for a port, ``yes`` for a flag). Read as YAML, a token ``&Xyz`` was an anchor
    (null), ``abc #x`` lost its tail, ``off`` was a boolean, and a string key's ``{Xy7}`` a
    mapping its key refused (the file's ``"{Xy7}"`` was accepted)."""
    if raw == "" or raw == "null":
        return None
    if structured and raw.lstrip()[:1] in ("[", "{"):
        try:
            return yaml.safe_load(raw)
        except yaml.YAMLError:
            return str(raw)
    return str(raw)


def _items(raw: str) -> list[str]:
    """A list key's value written without brackets: one item, or items separated by commas,
    each trimmed (no URL, namespace, header or script name has a comma in practice; one that
    does is written as a YAML list). An empty item stays, for the key to refuse: ``pub,`` is a
    mistake, not ``[pub]``."""
    return [item.strip() for item in raw.split(",")]


def _annotation_at(path: tuple[str, ...]) -> Any:
    """The type of the key at ``path`` (the environment's names, lower case), through sections
    and mappings of sections (``cache.types.<name>.ttl``); None where it names no key."""
    annotation: Any = Config
    rest = list(path)
    while rest:
        annotation = _without_none(annotation)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        field = annotation.model_fields.get(rest.pop(0))
        if field is None:
            return None
        annotation = field.annotation
        if get_origin(_without_none(annotation)) is dict and rest:  # a mapping's key: any name
            annotation = get_args(_without_none(annotation))[1]
            rest.pop(0)
        elif get_origin(_without_none(annotation)) is list and rest and rest[0].isdigit():
            annotation = get_args(_without_none(annotation))[0]  # (an error's place in a list)
            rest.pop(0)
    return annotation


def _without_none(annotation: Any) -> Any:
    """``X`` of ``X | None`` (a section that may be null: ``semantic.judge``); else as given."""
    args = [arg for arg in get_args(annotation) if arg is not type(None)]
    if get_origin(annotation) in (Union, UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _is_structured(annotation: Any) -> bool:
    """Whether a key holds a section, a mapping or a list (through ``| None`` and the like):
    what a variable may give as YAML. None (a name no key has): no."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return True
    if get_origin(annotation) in (list, tuple, dict, set, frozenset):
        return True
    return any(_is_structured(arg) for arg in get_args(annotation))


def _is_list(annotation: Any) -> bool:
    """``list[...]``, or ``list[...] | None``."""
    return get_origin(annotation) is list or any(
        get_origin(arg) is list for arg in get_args(annotation)
    )


def _secrets(model: type[BaseModel], path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """The paths of the keys that hold a secret: a ``SecretStr`` (the keys held), or a field
    marked ``{"secret": True}`` (``admin_token``)."""
    for name, field in model.model_fields.items():
        where = (*path, name)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from _secrets(annotation, where)
        elif _holds_a_secret(annotation) or (
            isinstance(field.json_schema_extra, dict) and field.json_schema_extra.get("secret")
        ):
            yield where


def _holds_a_secret(annotation: Any) -> bool:
    """Whether a type is, or is made of, ``SecretStr`` (``SecretStr | None``, a list of them)."""
    return annotation is SecretStr or any(_holds_a_secret(arg) for arg in get_args(annotation))


# An empty variable of one of these is the empty string, not null (the module contract).
_SECRETS = frozenset(_secrets(Config))


def _decoded(values: dict[str, Any], path: tuple[str, ...] = ()) -> dict[str, Any]:
    decoded: dict[str, Any] = {}
    for key, value in values.items():
        where = (*path, key)
        if isinstance(value, _Raw):
            if value == "" and where in _SECRETS:
                decoded[key] = ""
                continue
            annotation = _annotation_at(where)
            read = _read_value(value, _is_structured(annotation))
            # Not a YAML list (a ``[`` that YAML cannot read stays the string, refused as one).
            if isinstance(read, str) and read.lstrip()[:1] not in ("[", "{"):
                if _is_list(annotation):
                    read = _items(read)
            decoded[key] = read
        elif isinstance(value, dict):
            decoded[key] = _decoded(value, where)
        else:
            decoded[key] = value
    return decoded


class _Environment(EnvSettingsSource):
    """The ``CARPOOL_*`` variables of ``env``, each value read once (``_read_value``)."""

    def __init__(self, settings_cls: type[BaseSettings], env: Mapping[str, str]) -> None:
        self._env = env  # read by _load_env_vars, which the base __init__ calls
        super().__init__(
            settings_cls,
            case_sensitive=False,
            env_prefix=ENV_PREFIX,
            env_nested_delimiter=NESTED_DELIMITER,
        )

    def _load_env_vars(self) -> Mapping[str, str | None]:
        # The prefix as written: ``carpool_port`` is not one of ours. Values are marked raw so
        # that each is read exactly once, whether pydantic-settings decoded it (a whole
        # section or list) or not (a scalar).
        return {
            name.lower(): _Raw(value)
            for name, value in self._env.items()
            if name.startswith(ENV_PREFIX) and name not in NOT_KEYS
        }

    def decode_complex_value(self, field_name: str, field: FieldInfo, value: Any) -> Any:
        # YAML (of which JSON is a subset) instead of JSON. A mapping or list is decoded here, so
        # that nested variables merge into it; anything else stays raw and is read in __call__
        # (an empty or null value then stays set, as null, instead of being dropped).
        decoded = _read_value(value, structured=True)  # (only a complex field's comes here)
        return decoded if isinstance(decoded, (dict, list)) else value

    def __call__(self) -> dict[str, Any]:
        data = super().__call__()
        prefix = self.env_prefix  # lower case, as the names
        fields = self.settings_cls.model_fields
        for name, value in self.env_vars.items():
            key, *nested = name[len(prefix) :].split(NESTED_DELIMITER)
            field = fields.get(key)
            if field is not None and (not nested or self.field_is_complex(field)):
                continue  # read by pydantic-settings
            # Names no key (pydantic-settings ignores it): put it where it points, so that
            # validation reports it like a wrong key in the file ("bogus: unknown key").
            *parents, last = [key, *nested]
            node = data
            for part in parents:
                if not isinstance(node.get(part), dict):
                    node[part] = {}
                node = node[part]
            node[last] = value
        return _types_in_lower_case(_decoded(data))
