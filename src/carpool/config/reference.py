"""The configuration reference (docs/config.md), generated from the model so it cannot drift.

Contract: one table row per leaf key, in the model's order, with its type, its default (as YAML)
and its description; ``carpool config-reference`` prints it and a test checks that the committed
docs/config.md is exactly this output.
"""

from __future__ import annotations

import re
from typing import Literal, get_args, get_origin

import yaml
from pydantic import BaseModel

from .model import Config


def reference_markdown() -> str:
    """The config reference (docs/config.md), generated from the model so it cannot drift."""
    lines = [
        "# Configuration reference",
        "",
        "Generated from `carpool.config.Config` by `carpool config-reference`; do not edit.",
        "Sources, strongest first: CLI flags, `CARPOOL_*` environment variables (nested keys "
        "joined with `__`, e.g. `CARPOOL_CACHE__MAX_BYTES`), the YAML file (`--config`), "
        "these defaults. A variable set empty is null, but for a secret (`admin_token` and the "
        "keys held), where an empty value is refused as a secret that was not mounted: `null` "
        "says none. A list key's variable is a YAML list (`'[a, b]'`), one item, or items "
        "separated by commas, each trimmed (`CARPOOL_UPSTREAMS=http://a:8000/v1,http://b:8000/v1`"
        ", `CARPOOL_TENANT__SHARED_NAMESPACES=pub`). A section's or mapping's variable may be "
        "YAML too (`CARPOOL_CACHE='{max_bytes: 1000}'`); any other key's value is the string "
        "as written (`CARPOOL_ADMIN_TOKEN='{tok}'` is that token). The file is UTF-8 text; a "
        "key given twice in one of its mappings is refused, naming it and its lines. "
        '`--config ""` is refused (it names no file); an empty `CARPOOL_CONFIG` is no file. '
        "Durations are seconds unless the key ends in `_ms` or its meaning says ms "
        "(`sim.prefill_ms_per_token`); "
        "sizes are bytes. A number is never a boolean: `port: true` is refused, not read as 1; "
        "an integer is at most 2**53.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, f"{prefix}{name}.")
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, dict):
                default = {
                    k: (v.model_dump() if isinstance(v, BaseModel) else v)
                    for k, v in default.items()
                }
            shown = yaml.safe_dump(default, default_flow_style=True, width=1000).strip()
            shown = shown.removesuffix("\n...").removesuffix("...").strip()
            if get_origin(annotation) is Literal:
                kind = "one of " + ", ".join(f"`{a}`" for a in get_args(annotation))
            else:
                kind = str(annotation).replace("typing.", "").replace("<class '", "")
                kind = kind.replace("'>", "").replace("|", "\\|")
                # A section by the path it is imported from, not the module defining it.
                kind = re.sub(r"\bcarpool\.config\.\w+\.(\w+)", r"carpool.config.\1", kind)
            meaning = (field.description or "").replace("|", "\\|")
            lines.append(f"| `{prefix}{name}` | {kind} | `{shown}` | {meaning} |")

    walk(Config, "")
    return "\n".join(lines) + "\n"
