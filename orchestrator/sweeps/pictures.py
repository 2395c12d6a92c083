"""A sweep as pictures, for its parent run: what a person looks at first (Optuna's and Weights & Biases' plots).

- `sweep_objective.png`: the objective against each swept value, one panel per key that varies between points
  (numbers on their axis, log-scaled where they span a factor of 10 or more; other values as categories).
- `sweep_loss_curves.png`: every point's training loss on one chart, each labelled by the values it was swept to.
- an Optuna study's `optuna_history.png` (the objective trial by trial, and the best so far) and
  `optuna_importance.png` (each parameter's share of the objective's variation), from the study as saved
  (orchestrator/sweeps/study.py).

Builders return the figure (tests read its data back), `draw` saves them beside sweep_summary.json.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Optional

from orchestrator.sweeps.optuna_compat import directions, study_from_saved

OBJECTIVE, LOSSES = "sweep_objective.png", "sweep_loss_curves.png"
HISTORY, IMPORTANCE = "optuna_history.png", "optuna_importance.png"


def _plt():
    from common.figures import plt

    return plt


def swept(rows: list[dict]) -> dict[str, list[str]]:
    """key -> each row's value, for the keys whose values differ between the points (a point without the key: "")."""
    values = [dict(o.split("=", 1) for o in r["all_overrides"] if "=" in o) for r in rows]
    keys = sorted({k for v in values for k in v}, key=lambda k: next(i for i, v in enumerate(values) if k in v))
    return {k: [v.get(k, "") for v in values] for k in keys if len({v.get(k, "") for v in values}) > 1}


def _number(text: str) -> Optional[float]:
    try:
        return float(text)
    except ValueError:
        return None


def objective_figure(rows: list[dict], name: str):
    """One panel per swept key: the objective of each point that has one, against the point's value."""
    plt = _plt()
    keys = swept(rows)
    fig, axes = plt.subplots(1, max(len(keys), 1), figsize=(4.5 * max(len(keys), 1), 3.6), dpi=100, squeeze=False)
    for ax, (key, values) in zip(axes[0], keys.items()):
        shown = [(v, r["objective"]) for v, r in zip(values, rows) if math.isfinite(r["objective"])]
        numbers = [_number(v) for v, _ in shown]
        if shown and all(n is not None for n in numbers):
            pairs = sorted(zip(numbers, (o for _, o in shown)))
            ax.plot([x for x, _ in pairs], [y for _, y in pairs], "o-")
            if min(numbers) > 0 and max(numbers) / min(numbers) >= 10:
                ax.set_xscale("log")
        else:
            labels = list(dict.fromkeys(v for v, _ in shown))
            ax.plot([labels.index(v) for v, _ in shown], [o for _, o in shown], "o")
            ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_xlabel(key)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    if not keys:
        axes[0][0].set_title("no key varies between the points")
    fig.suptitle(f"{name} against the swept values ({len(rows)} points)")
    fig.tight_layout()
    return fig


def losses_figure(rows: list[dict]):
    """Each point's training loss (its train stage's metrics.jsonl), labelled by its swept values."""
    plt = _plt()
    keys = swept(rows)
    labels = [" ".join(f"{k}={values[i]}" for k, values in keys.items()) or f"point {r['point']}"
              for i, r in enumerate(rows)]
    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    for r, label in sorted(zip(rows, labels), key=lambda pair: pair[0]["point"]):
        metrics = Path(r["run_dir"]) / "stages" / "train" / "output" / "metrics.jsonl"
        if not metrics.is_file():
            continue
        steps = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        curve = [(s["step"], s["loss"]) for s in steps if "loss" in s and "step" in s]
        if curve:
            ax.plot(*zip(*curve), label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(f"the loss of every point ({len(rows)})")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def optuna_figures(saved: dict):
    """(history, importance) of a study as KeptStudy saved it: Optuna's optimisation history, and each parameter's
    importance (Optuna's mean-decrease-impurity evaluator: its default, fANOVA, fails on this numpy in Optuna 2.10,
    as its matplotlib importance plot does on this matplotlib, so the bars are drawn here); importance None where
    fewer than two trials finished."""
    import optuna
    from optuna.distributions import json_to_distribution
    from optuna.trial import create_trial

    study = study_from_saved(directions=directions(saved["search"]["direction"]))  # a copy, for its plots
    # a trial that did not train scores the worst value (inf): told to Optuna, left out of its pictures
    finished = [t for t in saved["trials"] if t["state"] == "COMPLETE" and t["values"]
                and all(math.isfinite(v) for v in t["values"])]
    with warnings.catch_warnings():  # add_trial and the matplotlib plots are "experimental" in Optuna 2
        warnings.simplefilter("ignore")
        for t in finished:
            study.add_trial(create_trial(params=t["params"], values=t["values"], distributions={
                k: json_to_distribution(d) for k, d in t["distributions"].items()}))
        history = optuna.visualization.matplotlib.plot_optimization_history(study).figure
        if len(finished) < 2:
            return history, None
        shares = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.MeanDecreaseImpurityImportanceEvaluator(seed=0))
    fig, ax = _plt().subplots(figsize=(6, 0.5 * len(shares) + 1.5), dpi=100)
    names = list(shares)[::-1]
    ax.barh(range(len(names)), [shares[n] for n in names], tick_label=names)
    ax.set_xlabel("importance for the objective (share)")
    ax.set_title(f"parameter importance ({len(finished)} trials)")
    fig.tight_layout()
    return history, fig


def draw(rows: list[dict], name: str, folder: Path, study: Optional[dict] = None) -> list[Path]:
    """The pictures of this sweep (and its Optuna study), saved in folder: their paths."""
    plt = _plt()
    figures = {OBJECTIVE: objective_figure(rows, name), LOSSES: losses_figure(rows)}
    if study is not None:
        figures[HISTORY], figures[IMPORTANCE] = optuna_figures(study)
    saved = []
    for file, fig in figures.items():
        if fig is not None:
            fig.savefig(folder / file)
            plt.close(fig)
            saved.append(folder / file)
    return saved
