"""Environments for a child process whose semantic model, or Hugging Face hub client, is not
what this one has: the model hidden from carpool (in no package; with ``cache`` also not in the
hub's cache), the hub client given a setting it cannot read. Every ``HF_*`` variable of this
process is left out: a developer's own (``HF_HOME``, another timeout) would change what the
child finds or how its client fails."""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: A value of ``HF_HUB_DOWNLOAD_TIMEOUT`` the hub client cannot read (it reads it on import).
UNREADABLE = "2.5"


def model_env(
    folder: Path | None = None, *, cache: bool = False, hub_setting: str | None = None
) -> dict[str, str]:
    """``os.environ`` without ``HF_*``; with ``folder`` (where a ``sitecustomize.py`` is
    written), the model in no package (``cache``: nor in the hub's cache); with
    ``hub_setting``, ``HF_HUB_DOWNLOAD_TIMEOUT`` set to it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    if folder is not None:
        hidden = "import carpool.semantic.embed.weights as w\nw.MODEL_PACKAGES = ()\n"
        (folder / "sitecustomize.py").write_text(
            hidden + ("w._hub_cache_dir = lambda: None\n" if cache else "")
        )
        env["PYTHONPATH"] = os.pathsep.join([str(folder), *sys.path])
    if hub_setting is not None:
        env["HF_HUB_DOWNLOAD_TIMEOUT"] = hub_setting
    return env
