"""The sweep's result on one page: ``summary.html`` on the parent run.

MLflow 3.17's artifact viewer renders an ``.html`` artifact inline (a sandboxed frame of the file
alone, so the plots are embedded as data URIs, not linked): the best configuration, which knob
mattered, what the sweep spent and which trials were cheapest for their result, the configurations
over seeds, every trial, and the plots, for whoever is handed the link.
"""
from __future__ import annotations

import base64
import html
import re
from pathlib import Path

from pipeline.components.lr_scaling import EFFECTIVE_LR_PARAM, GLOBAL_BATCH_PARAM, RATE_INPUTS, recorded_params
from pipeline.config.papers import closest_row, shown
from pipeline.config.schema import ExperimentConfig
from pipeline.sweeps.importance import KnobImportance, format_importance
from pipeline.sweeps.report import REPORTED, TrialRow, cell, has_seeds, knob_keys, seed_table, table
from pipeline.sweeps.spaces import short_keys
from pipeline.sweeps.spend import SweepSpend, format_spend

SUMMARY_NAME = "summary.html"

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #1f2328; }
h1 { font-size: 22px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #d0d7de; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #d0d7de; padding: 3px 8px; }
th { background: #f6f8fa; text-align: left; } td { font-variant-numeric: tabular-nums; }
pre { background: #f6f8fa; padding: 8px; font-size: 13px; } img { max-width: 100%; margin: 8px 0; }
figure { margin: 0 0 16px 0; } figcaption { font-size: 12px; color: #59636e; }
"""


def _markdown_inline(text: str) -> str:
    """The run description's **bold** and `code` (all it uses), as HTML."""
    escaped = html.escape(text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", escaped))


def _table(header: list[str], body: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    lines = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in line) + "</tr>" for line in body)
    return f"<table><tr>{head}</tr>{lines}</table>"


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode()
    return (f'<figure><img alt="{html.escape(path.stem)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{html.escape(path.name)}</figcaption></figure>")


def _best(best: TrialRow | None, metric: str) -> str:
    if best is None:
        return "<p>No trial trained every epoch (see the reasons in the table below).</p>"
    names = short_keys(best.knobs)
    knobs = [[names[key], cell(value)] for key, value in best.knobs.items()]
    metrics = [[m, cell(best.value(m))] for m in (metric, *(m for m in REPORTED if m != metric))]
    epochs = f"{best.epochs} epoch{'s' if best.epochs > 1 else ''}"
    return (f"<p>Trial <b>{html.escape(best.trial_id)}</b> (MLflow run <code>{html.escape(best.run_id)}</code>): "
            f"{html.escape(metric)} <b>{cell(best.value(metric))}</b> after {epochs}.</p>"
            + _table(["knob", "value"], knobs) + "<br>" + _table(["metric (last epoch)", "value"], metrics))


def _spend(spend: SweepSpend, metric: str, plots: list[Path]) -> str:
    """What the sweep spent, its Pareto front over accelerator-hours as a table, and its figure."""
    parts = [f"<pre>{html.escape(format_spend(spend, metric))}</pre>"]
    if spend.front:
        keys = knob_keys(spend.front)
        parts.append(_table(["trial", metric, spend.unit, *short_keys(keys).values()],
                            [[row.trial_id, cell(row.value(metric)), cell(row.accelerator_hours),
                              *(cell(row.knobs.get(key)) for key in keys)] for row in spend.front]))
    parts += [_image(path) for path in plots if path.stem.endswith("_vs_accelerator_hours")]
    return "".join(parts)


def describe_recipe(cfg: ExperimentConfig, knobs: set[str]) -> str:
    """The paper recipe a sweep's base config is closest to, and where it departs from it besides its knobs."""
    flat = {**cfg.flat(), **recorded_params(cfg.optim, cfg.scaling.num_workers)}
    derived = {EFFECTIVE_LR_PARAM: {"optim.lr", "scaling.num_workers", *RATE_INPUTS},
               GLOBAL_BATCH_PARAM: {"optim.micro_batch_size", "optim.grad_accum_steps", "scaling.num_workers"}}
    searched = knobs | {key for key, inputs in derived.items() if knobs & inputs}  # a knob moves what it derives
    recipe, row, found = closest_row(flat, searched)
    diff = f"`vitsweep config diff --against paper:{recipe.paper}:{row.name}` lists each with its source"
    if not found:
        return f"Recipe: {recipe.describe(row)}, with no departure besides the knobs searched."
    listed = ", ".join(f"{d.key} {'(model default)' if d.paper is None else shown(d.paper)} → {shown(d.config)}" for d in found)
    return (f"Recipe: closest to {recipe.describe(row)}; besides the knobs searched it departs in "
            f"{len(found)} key{'s' if len(found) > 1 else ''} ({diff}): {listed}.")


def summary_html(name: str, state: str, description: str, recipe: str, rows: list[TrialRow], metric: str, mode: str,
                 best: TrialRow | None, found: KnobImportance, importance_plot: Path | None,
                 plots: list[Path], spend: SweepSpend) -> str:
    """The page: ``recipe`` is ``describe_recipe``'s line, ``rows`` every trial and pruned sample, ``plots`` the
    sweep's figures."""
    trials = [r for r in rows if r.run_id]
    parts = [f"<h1>Sweep {html.escape(name)} ({html.escape(state)})</h1>", f"<p>{_markdown_inline(description)}</p>",
             "<h2>Best configuration</h2>", _best(best, metric),
             "<h2>Which knob mattered</h2>", f"<pre>{html.escape(format_importance(found))}</pre>"]
    if importance_plot is not None:
        parts.append(_image(importance_plot))
    parts += [f"<h2>What it cost ({html.escape(spend.unit)})</h2>", _spend(spend, metric, plots),
              "<h2>The recipe it ran under</h2>", f"<p>{_markdown_inline(recipe)}</p>"]
    if has_seeds(trials):
        parts += ["<h2>Each configuration over its seeds (completed trials)</h2>", _table(*seed_table(trials, metric, mode))]
    parts += [f"<h2>Trials, best first ({len(trials)} trials, {len(rows) - len(trials)} pruned)</h2>",
              _table(*table(rows, metric, mode)), "<h2>Plots</h2>",
              *(_image(path) for path in plots if not path.stem.endswith("_vs_accelerator_hours"))]
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>Sweep {html.escape(name)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n")
