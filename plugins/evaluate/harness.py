"""EleutherAI's lm-evaluation-harness (lm-eval) on a Hugging Face folder: the tasks, their files, the scores.

Tasks are lm-eval's own YAML. Three kinds of name:
- shipped: the YAML files in plugins/evaluate/tasks (not conf/: Hydra reads every YAML there as a config option),
  with their data beside them; a relative `data_files` is made absolute here (lm-eval reads it from the working
  directory), so they run from any folder;
- the user's: YAML files in `evaluate.include_path` (lm-eval's --include_path), read by lm-eval as its CLI reads
  them (their relative paths, as there, from the working directory);
- lm-eval's own (`hellaswag`, ...): their data is on the Hugging Face Hub, so they are refused before launch when
  the Hub cannot be reached.
Every file of the shipped folder and of include_path enters the stage's key (`fingerprint`), with lm-eval's version.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import socket
from pathlib import Path
from typing import Any, Optional

from common.problem import Problem

SHIPPED = Path(__file__).resolve().with_name("tasks")
HUB = ("huggingface.co", 443)
INSTALL = "pip install -e '.[eval]' -c constraints.txt (lm-eval with its hf model)"


def installed() -> bool:
    return importlib.util.find_spec("lm_eval") is not None and importlib.util.find_spec("accelerate") is not None


def version() -> str:
    from importlib.metadata import version as of

    return of("lm_eval")


def _yaml(path: Path) -> Any:
    """A task file as data; lm-eval's own tags (`!function utils.process`) read as their text."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, tag, node: f"{tag} {getattr(node, 'value', '')}")
    return yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)


def task_yaml(path: Path, functions: bool = True) -> dict:
    """A task file as lm-eval reads it: its `include:` files merged under it (its own keys win) and, with
    `functions`, its `!function` helpers imported (lm-eval's own loader; the raw file where lm-eval is missing)."""
    if not installed():
        return _yaml(path)
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=functions)


def task_files(folder: Path) -> list[Path]:
    """A folder's task files: `.yaml` (what lm-eval's index reads) and `.yml` (given to lm-eval by path)."""
    return sorted(p for pattern in ("*.yaml", "*.yml") for p in Path(folder).rglob(pattern))


def local_tasks(folder: Path) -> dict[str, Path]:
    """The tasks a folder's YAML files define: name -> file (a group's file, or one without `task:`, names none)."""
    found: dict[str, Path] = {}
    for path in task_files(folder):
        data = _yaml(path)
        if isinstance(data, dict) and isinstance(data.get("task"), str):
            found.setdefault(data["task"], path)
    return found


def shipped_config(path: Path) -> dict:
    """A shipped task's config with its data files' paths made absolute."""
    config = _yaml(path)
    files = (config.get("dataset_kwargs") or {}).get("data_files")
    if isinstance(files, dict):
        config["dataset_kwargs"]["data_files"] = {split: str((path.parent / f).resolve()) for split, f in files.items()}
    return config


def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the Hub answers (Hugging Face's HF_HUB_OFFLINE=1 says it must not be asked)."""
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return False
    try:
        with socket.create_connection(HUB, timeout=timeout_s):
            return True
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def builtin_file(name: str) -> Optional[Path]:
    """The file of lm-eval's that defines a task of this name (its task files, read as text: its TaskManager takes
    15-40 s), None if none does. Once per name and process: the installed package does not change, and a sweep's
    summary asks for a score's direction at every row."""
    import lm_eval

    needle = f"task: {name}\n"
    return next((p for p in sorted((Path(lm_eval.__file__).parent / "tasks").rglob("*.yaml"))
                 if needle in p.read_text(encoding="utf-8", errors="replace")), None)


def local_tasks_of(ev) -> dict[str, Path]:
    """The shipped tasks and evaluate.include_path's (its own win a name both define, as lm-eval's include does)."""
    return {**local_tasks(SHIPPED), **(local_tasks(Path(ev.include_path).expanduser()) if ev.include_path else {})}


def problems(ev) -> list[Problem]:
    """evaluate.* before launch: lm-eval installed, the folder there and readable, every task found."""
    if not ev.tasks:
        return []
    if not installed():
        return [Problem("evaluate.tasks", list(ev.tasks), "the evaluate stage runs lm-evaluation-harness, which is not "
                        "installed", INSTALL)]
    out: list[Problem] = []
    include: dict[str, Path] = {}
    if ev.include_path is not None:
        folder = Path(ev.include_path).expanduser()
        if not ev.include_path.strip() or not folder.is_dir():
            return [Problem("evaluate.include_path", ev.include_path, "not a folder", "a folder of lm-eval task YAML "
                            "files (lm-eval's --include_path)")]
        for path in task_files(folder):
            try:
                _yaml(path)
            except Exception as e:  # noqa: BLE001 (yaml's errors: said with the file)
                out.append(Problem("evaluate.include_path", str(path), f"does not parse as YAML: {e}",
                                   "correct the file (lm-eval's task format), or move it out of the folder"))
        if out:
            return out
        include = local_tasks(folder)
    shipped = local_tasks(SHIPPED)
    for name in ev.tasks:
        if name in shipped or name in include:
            continue
        if builtin_file(name) is None:
            known = ", ".join(sorted({*shipped, *include}))
            out.append(Problem("evaluate.tasks", name, f"no such task: not shipped ({known}), not in "
                               "evaluate.include_path and not one of lm-eval's", "a task name a YAML file defines "
                               "(`task: <name>`), with its folder as evaluate.include_path"))
        elif not hub_reachable():
            out.append(Problem("evaluate.tasks", name, "lm-eval's own task reads its data from the Hugging Face Hub, "
                               f"which cannot be reached from here ({HUB[0]})", "copy the task's YAML into a folder, "
                               "point its dataset_path/data_files at local files, and give the folder as "
                               "evaluate.include_path"))
    return out


def task_file(name: str, ev) -> Optional[Path]:
    """The YAML file that defines a task: shipped, in evaluate.include_path, or lm-eval's own."""
    found = local_tasks_of(ev)
    if name in found:
        return found[name]
    return builtin_file(name) if installed() else None


def task_metrics(name: str, ev) -> dict[str, Optional[bool]]:
    """A task's metrics as metrics() names them (a filter's name appended where the task has several), each with
    whether it is better higher (None: the task does not say; lm-eval's registry does)."""
    path = task_file(name, ev)
    config = _quiet_yaml(path) if path is not None else {}
    listed = {m["metric"]: m.get("higher_is_better") for m in config.get("metric_list") or []
              if isinstance(m, dict) and isinstance(m.get("metric"), str)}
    filters = [f["name"] for f in config.get("filter_list") or [] if isinstance(f, dict) and f.get("name")]
    return {f"{m}_{f}": better for m, better in listed.items() for f in filters} if filters else listed


def higher_is_better(objective: str, ev) -> bool:
    task, _, metric = objective.partition("/")
    better = task_metrics(task, ev).get(metric)
    if better is None:
        from lm_eval.api.registry import is_higher_better

        better = is_higher_better(metric.split("_")[0] if metric not in ("acc_norm", "exact_match") else metric)
    return bool(better)


def objective_problems(objective: str, ev, plain: tuple[str, ...]) -> list[Problem]:
    """sweep.objective=<task>/<metric>: an evaluate task's metric that the task produces (plain: the train
    stage's objectives, named in the fix)."""
    task, _, metric = objective.partition("/")
    choices = f"one of {', '.join(plain)}, or <task>/<metric> of a task in evaluate.tasks (e.g. arith_mc/acc)"
    if not metric or not task:
        return [Problem("sweep.objective", objective, f"not an objective: {choices}", f"sweep.objective={plain[0]}")]
    if task not in ev.tasks:
        return [Problem("sweep.objective", objective, f"{task} is not scored: evaluate.tasks=[{', '.join(ev.tasks)}]",
                        f"evaluate.tasks=[{task}] (its scores are the objective), or {choices}")]
    produced = task_metrics(task, ev)
    if metric.endswith("_stderr") or metric not in produced:
        return [Problem("sweep.objective", objective, f"the task {task} produces {', '.join(produced) or 'no metric'}"
                        + (" (a stderr is not an objective)" if metric.endswith("_stderr") else ""),
                        f"sweep.objective={task}/{next(iter(produced), 'acc')}")]
    return []


def fingerprint(ev) -> Optional[dict]:
    """What decides the scores besides the weights and evaluate.*: lm-eval's version and every task file's bytes."""
    if not ev.tasks:
        return None
    from storage.file_hashes import sha256

    folders = [SHIPPED] + ([Path(ev.include_path).expanduser()] if ev.include_path else [])
    return {"lm_eval": version() if installed() else None,
            "files": {f"{i}/{p.relative_to(folder)}": sha256(p) for i, folder in enumerate(folders)
                      for p in sorted(folder.rglob("*")) if p.is_file()}}


def data_bytes(ev) -> tuple[int, list[str]]:
    """The bytes of the local tasks' data files (the first evaluate.limit lines of each), and the tasks whose data
    is not a local file (lm-eval's own, val_perplexity's documents written by the stage): the plan's time floor."""
    total, unknown = 0, []
    local, shipped = local_tasks_of(ev), local_tasks(SHIPPED)
    for name in ev.tasks:
        path = local.get(name)
        # as lm-eval reads them: a shipped task's files beside it (shipped_config), the user's from the working folder
        config = {} if path is None else shipped_config(path) if shipped.get(name) == path else _quiet_yaml(path)
        files = (config.get("dataset_kwargs") or {}).get("data_files")
        found = [Path(f).expanduser() for f in (files.values() if isinstance(files, dict) else [])]
        if not found or not all(f.is_file() for f in found):
            unknown.append(name)
            continue
        for f in found:
            with open(f, "rb") as lines:
                total += sum(len(line) for i, line in enumerate(lines) if ev.limit is None or i < ev.limit)
    return total, unknown


def _quiet_yaml(path: Path) -> dict:
    """task_yaml without its helpers, else the raw file (an include lm-eval cannot read: task_check refuses it
    before launch)."""
    try:
        return task_yaml(path, functions=False)
    except Exception:  # noqa: BLE001 (lm-eval's loader raises what its YAML and files give it)
        return _yaml(path)


def task_spec(name: str, path: Optional[Path]) -> str:
    """How a user's (or lm-eval's own) task is named to lm-eval: by name; a `.yml` file by its path (lm-eval's index
    reads `*.yaml` only; its loader reads a path as it reads a `.yaml`)."""
    return str(path) if path is not None and path.suffix == ".yml" else name


def task_configs(ev, data: dict[str, Path]) -> list:
    """The tasks as lm-eval takes them: a shipped one as its config (its data files' paths absolute; `data`: files
    the stage wrote for a task, val_perplexity's documents), the others by name (a user's `.yml` file, which
    lm-eval's index does not read, by its path)."""
    shipped = local_tasks(SHIPPED)
    include = local_tasks(Path(ev.include_path).expanduser()) if ev.include_path else {}
    out: list = []
    for name in ev.tasks:
        if name not in shipped:
            out.append(task_spec(name, include.get(name)))
            continue
        config = shipped_config(shipped[name])
        if name in data:
            config["dataset_kwargs"]["data_files"] = {config["test_split"]: str(data[name])}
        out.append(config)
    return out


def score(lm, ev, tasks: list) -> dict:
    """lm-eval's results for the tasks (task_configs) on a model of plugins/evaluate/models.py, with every
    example's responses (`samples`)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    local = local_tasks_of(ev)
    builtin = any(isinstance(t, str) and t not in local for t in tasks)  # lm-eval's index: 15-40 s
    manager = TaskManager(include_path=str(Path(ev.include_path).expanduser()) if ev.include_path else None,
                          include_defaults=builtin)
    from unittest import mock

    # lm-eval records the git commit of the folder the command runs in (`git describe`, whose "fatal: not a git
    # repository" lands in the stage's output) and torch's collect_env (pip, nvidia-smi, ... run as processes): not
    # the scored model's, and the stage keeps none of it
    with mock.patch("lm_eval.evaluator.get_git_commit_hash", lambda: None), \
            mock.patch("lm_eval.evaluator.add_env_info", lambda results: None):
        return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager,
                                       num_fewshot=ev.num_fewshot or None, limit=ev.limit,
                                       apply_chat_template=ev.apply_chat_template, log_samples=True,
                                       random_seed=ev.seed, numpy_random_seed=ev.seed, torch_random_seed=ev.seed,
                                       fewshot_random_seed=ev.seed)


LOGLIKELIHOOD = ("multiple_choice", "loglikelihood", "loglikelihood_rolling")


def loglikelihood_tasks(results: dict) -> list[str]:
    """The scored tasks whose examples are loglikelihoods (the ones a forward pass alone decides)."""
    return [t for t, c in results.get("configs", {}).items() if c.get("output_type") in LOGLIKELIHOOD]


def _numbers(value) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, (int, float)):
        return [float(value)]
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _numbers(v)]
    return []


def loglikelihood_gap(ours: dict, theirs: dict, task: str) -> float:
    """The largest difference between two results' loglikelihoods of one task, example by example (relative to
    the loglikelihood where it is above 1 in size: a document's rolling sum is large)."""
    a, b = ours["samples"][task], theirs["samples"][task]
    if len(a) != len(b):
        raise RuntimeError(f"{task}: {len(a)} examples scored against {len(b)}")
    gap = 0.0
    for x, y in zip(a, b):
        xs, ys = _numbers(x["filtered_resps"]), _numbers(y["filtered_resps"])
        if len(xs) != len(ys):
            raise RuntimeError(f"{task}: example {x.get('doc_id')} has {len(xs)} responses against {len(ys)}")
        gap = max([gap, *(abs(p - q) / max(1.0, abs(q)) for p, q in zip(xs, ys))])
    return gap


def metrics(results: dict) -> dict[str, float]:
    """Each task's numeric results as `<task>/<metric>` (lm-eval's `acc,none` -> `acc`; another filter's name kept:
    `exact_match,strict-match` -> `exact_match_strict-match`; its stderr as `<metric>_stderr`)."""
    out: dict[str, float] = {}
    for task, values in results["results"].items():
        for k, v in values.items():
            if "," not in k or not isinstance(v, (int, float)) or isinstance(v, bool):
                continue
            metric, filt = k.split(",", 1)
            out[f"{task}/{metric}" + ("" if filt == "none" else f"_{filt}")] = float(v)
    return out
