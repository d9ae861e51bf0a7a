"""``carpool config-reference``: the configuration reference (docs/config.md), as Markdown.

Contract: prints ``carpool.config.reference_markdown()`` exactly (a test checks docs/config.md
against it).
"""

from __future__ import annotations

import click


@click.command("config-reference")
def config_reference() -> None:
    """Print the configuration reference (Markdown), generated from the typed config model."""
    from ..config import reference_markdown

    click.echo(reference_markdown(), nl=False)
