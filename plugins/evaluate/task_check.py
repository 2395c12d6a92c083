"""The user's evaluate tasks loaded before launch by lm-eval itself, as the evaluate stage will load them.

A task file that parses as YAML can still fail in the evaluate stage, after training: a metric lm-eval does not know
(`acuracy`: lm-eval looks for it on the Hub, finds nothing and scores no metric, an empty metrics.json), an unknown
`output_type`, Jinja that does not compile, a `!function` helper that is not there, data files that are not where
lm-eval looks, a split the data does not have, a Hub dataset with no Hub. Each of these lm-eval's own task loading
(its TaskManager: `include:` merged, `!function` imported, the templates compiled, the data read) raises at once, so
each task of `evaluate.include_path` named in `evaluate.tasks` is loaded here and a failure is a refusal naming the
file. The shipped tasks are this project's own (tests load them); lm-eval's own tasks need the Hub (harness.py).

Besides loading, the rules lm-eval would not raise but that would leave a run doing something other than meant:
- a task of the user's that has a shipped task's name: the stage would score one of them and say nothing, so both
  files are named and one must be renamed;
- a metric that is neither lm-eval's nor a `!function`: refused before lm-eval goes to the Hub for it;
- a local builder (`dataset_path: json`) with no `data_files`: datasets would read every JSON file under the folder
  the command starts in (measured: thousands in a repository, for 90 s) and score those;
- `evaluate.num_fewshot` where no task draws examples (a rolling loglikelihood, val_perplexity, has none);
- `evaluate.onnx` where no task is a loglikelihood task (generation is scored from hf/ only).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from common.problem import Problem
from plugins.evaluate.harness import LOGLIKELIHOOD, SHIPPED, hub_reachable, local_tasks, task_spec, task_yaml

LOCAL_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas")  # datasets' builders that read local files
ROLLING = "loglikelihood_rolling"


def problems(ev) -> list[Problem]:
    """evaluate.* checks that need the tasks' content (after harness.problems found every task)."""
    shipped = local_tasks(SHIPPED)
    include = local_tasks(Path(ev.include_path).expanduser()) if ev.include_path else {}
    out: list[Problem] = []
    for name in sorted(set(shipped) & set(include) & set(ev.tasks)):
        out.append(Problem("evaluate.include_path", ev.include_path, f"the task {name} is defined twice: by "
                           f"{include[name]} and by the project's shipped {shipped[name]}; the stage would score "
                           "one of them", f"give your task another name (`task: my_{name}` in {include[name].name}) "
                           "and list that in evaluate.tasks"))
    configs: dict[str, dict] = {}
    for name in ev.tasks:
        path = include.get(name) if name not in shipped else shipped[name]
        if path is None:
            continue  # lm-eval's own: harness.problems asks the Hub
        try:
            configs[name] = task_yaml(path)
        except Exception as e:  # noqa: BLE001 (an include that is not there, an Include cycle, a helper missing)
            out.append(_refusal(name, path, e))
    for name, config in configs.items():
        if name in include and name not in shipped:
            out.extend(_user_task_problems(name, include[name], config))
    out.extend(_setting_problems(ev, configs))
    if out:
        return out
    user = [n for n in ev.tasks if n in include and n not in shipped]
    return _load(ev, user, include) if user else []


def _refusal(name: str, path: Path, e: BaseException) -> Problem:
    text = f"{type(e).__name__}: {e}".strip().splitlines()[0][:400]
    return Problem("evaluate.tasks", name, f"lm-eval cannot load the task from {path}: {text}",
                   "correct the task file (lm-eval's task format: docs/evaluate.md), or leave the task out of "
                   "evaluate.tasks")


def _user_task_problems(name: str, path: Path, config: dict) -> list[Problem]:
    """What lm-eval would accept and then score wrongly or reach the Hub for."""
    from lm_eval.api import metrics  # noqa: F401  (registers lm-eval's metrics)
    from lm_eval.api.registry import METRIC_REGISTRY

    out = []
    for item in config.get("metric_list") or []:
        metric = item.get("metric") if isinstance(item, dict) else None
        if isinstance(metric, str) and metric not in METRIC_REGISTRY:
            out.append(Problem("evaluate.tasks", name, f"{path}: metric {metric!r} is not one of lm-eval's "
                               f"({', '.join(sorted(METRIC_REGISTRY))}): lm-eval would look for it on the Hugging "
                               "Face Hub and, not finding it, score nothing", "a metric of that list, or a "
                               "`!function` of your own"))
    source = config.get("dataset_path")
    if isinstance(source, str) and source not in LOCAL_BUILDERS and not _local(source, path) and not hub_reachable():
        out.append(Problem("evaluate.tasks", name, f"{path}: dataset_path {source!r} is a Hugging Face Hub "
                           "dataset, and the Hub cannot be reached from here", "dataset_path: json with "
                           "dataset_kwargs.data_files naming a local copy"))
    kwargs = config.get("dataset_kwargs")
    named = isinstance(kwargs, dict) and (kwargs.get("data_files") or kwargs.get("data_dir"))
    if source in LOCAL_BUILDERS and not named:
        out.append(Problem("evaluate.tasks", name, f"{path}: dataset_path {source!r} names no files "
                           "(dataset_kwargs.data_files): datasets would read every file of that kind under the "
                           "folder the command starts in and score those", "dataset_kwargs: {data_files: {test: "
                           "your_questions.jsonl}} in the task file"))
    return out


def _local(source: str, task_file: Path) -> bool:
    return Path(source).expanduser().exists() or (task_file.parent / source).exists()


def _setting_problems(ev, configs: dict[str, dict]) -> list[Problem]:
    kinds = {name: config.get("output_type") for name, config in configs.items()}
    out = []
    if ev.num_fewshot and kinds and len(kinds) == len(ev.tasks) and all(k == ROLLING for k in kinds.values()):
        out.append(Problem("evaluate.num_fewshot", ev.num_fewshot, f"no task of evaluate.tasks=[{', '.join(ev.tasks)}] "
                           "takes few-shot examples (a rolling loglikelihood scores whole documents), so it would "
                           "do nothing", "evaluate.num_fewshot=0, or add a task that asks questions (arith_mc)"))
    if ev.onnx and kinds and len(kinds) == len(ev.tasks) and not any(k in LOGLIKELIHOOD for k in kinds.values()):
        out.append(Problem("evaluate.onnx", True, f"the ONNX model scores loglikelihood tasks only, and every task "
                           f"of evaluate.tasks=[{', '.join(ev.tasks)}] generates text (scored from hf/ only)",
                           "evaluate.onnx=false, or add a loglikelihood task (arith_mc, val_perplexity)"))
    return out


def _load(ev, names: list[str], include: dict[str, Path]) -> list[Problem]:
    """The user's tasks built by lm-eval's TaskManager, data included, from the folder the command starts in (where
    the stage reads their relative paths from, as lm-eval's CLI does)."""
    import logging

    import datasets
    from lm_eval.tasks import TaskManager

    out = []
    quiet = logging.getLogger("lm_eval")
    level, quiet.level = quiet.level, logging.ERROR
    bars = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # the plan's output, not datasets' "Generating test split"
    try:
        manager = TaskManager(include_path=str(Path(ev.include_path).expanduser()), include_defaults=False)
        for name in names:
            try:
                built = manager.load([task_spec(name, include[name])])
                if name not in built["tasks"]:
                    raise LookupError(f"lm-eval built {sorted(built['tasks'])}, not {name}")
                _first_doc(built["tasks"][name])
            except Exception as e:  # noqa: BLE001 (lm-eval's and datasets' errors, said with the file)
                out.append(_refusal(name, include[name], e))
    finally:
        quiet.level = level
        if bars:
            datasets.enable_progress_bars()
    return out


def _first_doc(task) -> Optional[str]:
    """The first test document rendered as lm-eval will render it (its Jinja run on real data)."""
    docs = task.test_docs() if task.has_test_docs() else task.validation_docs()
    if docs is None:
        raise LookupError("the task has no test or validation split in its data")
    for doc in docs:
        return task.doc_to_text(doc)
    raise LookupError("the task's data holds no document")
