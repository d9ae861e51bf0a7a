"""The semantic cache's commands: ``carpool eval-semantic`` (score its decisions on labeled
pairs) and ``carpool fetch-model`` (download its model).

Contract: both need the semantic extra and say so (exit 2) without it. ``eval-semantic`` scores
the semantic cache configured as every command reads it (``--config``, else ``CARPOOL_CONFIG``,
and the ``CARPOOL_*`` variables: ``load_config``), its flags winning: ``semantic.threshold``
(``--threshold``), ``semantic.verifier_threshold`` (``--verifier-threshold``), the models the
gateway would load (``semantic.model_dir`` / ``--model-dir``, ``semantic.verifier_dir`` /
``--verifier-dir``, ``semantic.embedder_precision``) and, for ``--labeled-judge``,
``semantic.judge.verifier_band`` and ``overrules``; the report's first line says the thresholds
used. Which prompts are compared by meaning at all is read from the same config
(``semantic.english_only``, ``scripts``, ``max_text_chars``, ``fingerprint``), as the gateway
reads it. It always embeds with the local model (``semantic.embedder: upstream`` is not
scored). A bad config, a folder without its files, or pairs files with no pair to score, or a
``--decisions`` file that cannot be opened or is a ``--pairs`` file (before the run), exit 2
saying which; one that cannot be written (a full disk) exits 1 saying so. It is written once
every pair is scored: a run that fails or is stopped before leaves the file as it was. ``fetch-model`` is the only thing that ever
downloads the model: it checks the SHA-256 digests and prints the directory (exit 1 when the
download fails or a digest differs: the bytes refused are deleted from the cache, so that the
next run downloads them afresh).
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

import click
from pydantic import ValidationError

from ..config.caching import JudgeConfig
from .common import load_config, missing_extra


def _as_judge_setting(field: str) -> Any:
    """A callback reading an option as ``semantic.judge.<field>`` reads it in a config: a band
    out of [0, 1] or a rule the judge may not overrule is an error naming the option (exit 2),
    not a report of a judge no config could have."""

    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is None:
            return None
        setting = (
            [r.strip() for r in value.split(",") if r.strip()] if field == "overrules" else value
        )
        try:
            return getattr(JudgeConfig.model_validate({field: setting}), field)
        except ValidationError as error:
            raise click.BadParameter(error.errors()[0]["msg"]) from None

    return check


@click.command("eval-semantic")
@click.option(
    "--config",
    "config_file",
    default=None,
    type=click.Path(dir_okay=False),
    help="YAML config file (also CARPOOL_CONFIG): its semantic section, under the CARPOOL_* "
    "variables, sets what the flags below do not.",
)
@click.option(
    "--pairs",
    "pair_files",
    multiple=True,
    required=True,
    type=click.Path(exists=True, dir_okay=False),
    help="JSONL of {a, b, same_answer[, category]} (repeatable).",
)
@click.option(
    "--decisions",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write one JSONL row per pair with its decision (once every pair is scored; - for "
    "standard output, after the report).",
)
@click.option(
    "--threshold",
    type=click.FloatRange(0, 1),
    default=None,
    help="Similarity threshold [semantic.threshold, else the calibrated default].",
)
@click.option(
    "--verifier-threshold",
    type=click.FloatRange(0, 1),
    default=None,
    help="The verifier's threshold [semantic.verifier_threshold, else the model's calibrated one].",
)
@click.option("--sweep", is_flag=True, help="Also print hit/wrong rates over thresholds.")
@click.option(
    "--one-scope",
    is_flag=True,
    help="Also every pair's first prompt cached in one cache, each second one looked up among "
    "them as the gateway does (semantic.candidates nearest): how often it is served its own "
    "pair's answer, and another prompt's (never with --labeled-judge's judge: it answers from "
    "a pair's label, and another prompt's entry has none).",
)
@click.option(
    "--labeled-judge",
    "band",
    type=float,
    nargs=2,
    default=None,
    callback=_as_judge_setting("band"),
    metavar="LOW HIGH",
    help="A judge answering from each pair's label decides the pairs in this similarity band "
    "that passed the exact rules (semantic.judge at its best): served/wrong and judge calls "
    "per lookup.",
)
@click.option(
    "--judge-verifier-band",
    type=float,
    nargs=2,
    default=None,
    callback=_as_judge_setting("verifier_band"),
    metavar="LOW HIGH",
    help="With --labeled-judge: only pairs whose verifier score is in this band are asked "
    "[semantic.judge.verifier_band].",
)
@click.option(
    "--judge-overrules",
    default=None,
    callback=_as_judge_setting("overrules"),
    metavar="REASONS",
    help="With --labeled-judge: rules whose refusals the judge may overrule in the band "
    "(comma-separated: entity,identifier,number) [semantic.judge.overrules].",
)
@click.option(
    "--half",
    type=click.Choice(["even", "odd"]),
    default=None,
    help="Only the even (development) or odd (held-out) rows of each file [all].",
)
@click.option(
    "--model-dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="The embedding model's folder [semantic.model_dir, else the Hugging Face cache, filled "
    "by carpool fetch-model].",
)
@click.option(
    "--verifier-dir",
    type=click.Path(exists=True, file_okay=False),
    default=None,
    help="The verifier's folder [semantic.verifier_dir, else the one packaged with carpool].",
)
def eval_semantic(
    config_file: str | None,
    pair_files: tuple[str, ...],
    decisions: str | None,
    threshold: float | None,
    verifier_threshold: float | None,
    sweep: bool,
    one_scope: bool,
    half: str | None,
    band: tuple[float, float] | None,
    judge_overrules: list[str] | None,
    judge_verifier_band: tuple[float, float] | None,
    model_dir: str | None,
    verifier_dir: str | None,
) -> None:
    """Score the semantic cache's hit/miss decisions on labeled prompt pairs."""
    # A file not regular (a FIFO, a device) is opened now, once, as a reader waits on it;
    # a regular one is checked now and written at the end.
    opened = _check_decisions(decisions, pair_files) if decisions not in (None, "-") else None
    # The settings as `carpool serve` would read them (the file, the variables); a flag given
    # wins. Read first: a bad config exits 2 before any model loads.
    flags = {
        "threshold": threshold,
        "verifier_threshold": verifier_threshold,
        "model_dir": model_dir,
        "verifier_dir": verifier_dir,
    }
    config = load_config(
        config_file, {"semantic": {k: v for k, v in flags.items() if v is not None}}
    )
    semantic = config.semantic
    threshold, verifier_threshold = semantic.threshold, semantic.verifier_threshold
    model_dir, verifier_dir = semantic.model_dir, semantic.verifier_dir
    if judge_verifier_band is None:
        judge_verifier_band = semantic.judge.verifier_band
    if judge_overrules is None:
        judge_overrules = list(semantic.judge.overrules)
    try:
        from ..semantic.cache import CALIBRATED_THRESHOLD
        from ..semantic.embed import LocalEmbedder
        from ..semantic.evaluate import (
            Evaluator,
            LabeledJudge,
            format_one_scope,
            format_report,
            load_pairs,
            percent,
            write_decisions,
        )
        from ..semantic.guard import RulesThenVerifier
        from ..semantic.verifier import shared_cross_encoder
    except ImportError as error:
        missing_extra("the semantic cache", "semantic", error)
    threshold = CALIBRATED_THRESHOLD if threshold is None else threshold
    try:
        pairs = load_pairs(pair_files, half)
    except ValueError as error:  # a line that is no labeled pair, no pair at all: said, exit 2
        raise click.BadParameter(str(error), param_hint="--pairs") from None
    try:
        embedder = LocalEmbedder(model_dir, precision=semantic.embedder_precision)
        guard = RulesThenVerifier(shared_cross_encoder(verifier_dir), threshold=verifier_threshold)
    except ImportError as error:
        missing_extra("the semantic cache", "semantic", error)
    except ValueError as error:  # a model folder without its files, or not the model's files
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)
    try:
        # The whole config, not the semantic section's thresholds only: which prompts get a
        # semantic view at all (english_only, scripts, max_text_chars, the fingerprint's
        # whitespace rule) is decided as the gateway decides it.
        evaluator = Evaluator(pairs, embedder, guard, config)
    except ValueError as error:  # a side that is no chat request the gateway takes
        raise click.BadParameter(str(error), param_hint="--pairs") from None
    # The same judge decides the report, the sweep and the decisions written.
    judge = (
        None
        if band is None
        else LabeledJudge(band, frozenset(judge_overrules), judge_verifier_band)
    )
    report = evaluator.report(threshold, None, judge)
    click.echo(format_report(report, threshold, guard.threshold))
    if sweep:
        click.echo(f"\n{'threshold':>10}{'verifier':>10}{'served':>9}{'wrong':>8}")
        verifier = [0.5, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.96, 0.97, 0.98, 0.99]
        for row in evaluator.sweep([0.3, 0.4, 0.5, 0.6, 0.7, 0.8], verifier, judge):
            click.echo(
                f"{row['threshold']:>10.2f}{row['verifier_threshold']:>10.2f}"
                f"{percent(row['hit_rate']):>9}{percent(row['wrong_rate']):>8}"
            )
    if one_scope:
        click.echo(format_one_scope(evaluator.one_scope(threshold, semantic.candidates)))
        if judge is not None:  # (the tables would disagree, unexplained)
            click.echo("(one scope without the labeled judge: another prompt's entry has no label)")
    if decisions is not None:
        # Written after the report: a disk that fills up here (or at the close, the rows still
        # buffered) is said, exit 1, not a traceback, nor an empty file and exit 0.
        try:
            if decisions == "-":  # (standard output, after the report)
                write_decisions(evaluator, threshold, sys.stdout, None, judge)
                sys.stdout.flush()
            else:
                with opened or open(decisions, "w", encoding="utf-8") as out:
                    write_decisions(evaluator, threshold, out, None, judge)
        except OSError as error:
            click.echo(f"carpool: cannot write --decisions {decisions}: {error}", err=True)
            sys.exit(1)


def _check_decisions(path: str, pair_files: tuple[str, ...]) -> TextIO | None:
    """A usage error (exit 2) before the run if ``path`` cannot be written or is a ``--pairs``
    file; a regular file itself untouched (it was emptied as the options were read: a run that
    then failed, or was stopped, left an empty file where the last one's rows were). A file
    that is not regular (a FIFO: opened and closed, its reader would have read its end) is
    returned open."""
    try:
        if os.path.exists(path):
            if any(os.path.samefile(path, pairs) for pairs in pair_files):
                raise click.BadParameter(
                    f"{path} is also a --pairs file: it would be written over",
                    param_hint="--decisions",
                )
            if not os.path.isfile(path):
                return open(path, "w", encoding="utf-8")  # noqa: SIM115  (written at the end)
            with open(path, "a", encoding="utf-8"):  # (opened, nothing written)
                pass
        else:
            with open(path, "x", encoding="utf-8"):
                pass
            os.remove(path)
        return None
    except OSError as error:
        raise click.BadParameter(
            f"cannot write {path}: {error.strerror or error}", param_hint="--decisions"
        ) from None


#: What a client reads its proxy from (in either case: ``fetch-model``'s message names them).
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy")


@click.command("fetch-model")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False),
    default=None,
    help="Where to keep it [the Hugging Face cache: $HF_HOME or ~/.cache/huggingface].",
)
def fetch_model(cache_dir: str | None) -> None:
    """Download the semantic cache's model (all-MiniLM-L6-v2 at its pinned revision) with the
    Hugging Face hub client, check its SHA-256 digests and print its directory. The only command
    that downloads it: the gateway never does."""
    try:
        from ..semantic.embed import (
            MODEL_REPO,
            MODEL_REVISION,
            HubClientError,
            SemanticDependencyError,
        )
        from ..semantic.embed import fetch_model as fetch
    except ImportError as error:
        missing_extra("fetching the model", "semantic", error)
    click.echo(f"fetching {MODEL_REPO} at revision {MODEL_REVISION}", err=True)
    try:
        directory = fetch(cache_dir)
    except (SemanticDependencyError, HubClientError) as error:  # (the setting up, not a fetch)
        click.echo(f"carpool: {error}", err=True)
        sys.exit(2)
    except Exception as error:  # no network, no such revision, a digest differs...
        # (Any: the hub client's HTTP client raised its own InvalidURL for a proxy setting it
        # could not read, a traceback naming no setting.)
        said = str(error) if isinstance(error, OSError | ValueError) else f"{error!r}"
        said = "; ".join(line.strip() for line in said.splitlines() if line.strip())
        named = sorted(k for k, v in os.environ.items() if v and k.lower() in _PROXY_VARIABLES)
        if named:
            said += f" (the environment names a proxy: {', '.join(named)})"
        click.echo(f"carpool: could not fetch the model: {said}", err=True)
        sys.exit(1)
    click.echo(str(directory))
    if cache_dir is not None:
        click.echo(f"(outside the default cache: set semantic.model_dir to {directory})", err=True)
