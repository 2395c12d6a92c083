"""The user's own lm-eval task files (evaluate.include_path), loaded before launch by lm-eval's own task loading
(plugins/evaluate/task_check.py): what fails there is refused naming the file (the catalogue in refusal_catalogue.py
lists one case of each, on the files `user_tasks` writes), what lm-eval reads is accepted, and a task fuzzed one
field at a time is one or the other, never a crash."""
from __future__ import annotations


import pytest

from tests.conftest import make_cfg, problems_of
from tests.user_task_files import user_tasks


def test_good_user_tasks_are_accepted_as_lm_eval_reads_them(tmp_path):
    """A `.yml` task file (given to lm-eval by its path: its index reads `.yaml` only), and a task whose metrics
    come from an `include:` (lm-eval's loader merges it), as a sweep's objective."""
    from plugins.evaluate.harness import task_configs

    corpus = tmp_path
    user_tasks(corpus / "user_tasks")
    include = [f"evaluate.include_path={corpus}/user_tasks"]
    assert problems_of(["evaluate.tasks=[my_yml]", *include], tmp_path / "runs") == []
    assert problems_of(["evaluate.tasks=[my_include]", "sweep.objective=my_include/acc_norm", *include],
                       tmp_path / "runs") == []
    cfg = make_cfg("evaluate.tasks=[my_yml,my_include]", *include)
    assert task_configs(cfg.evaluate, {}) == [str(corpus / "user_tasks" / "my_yml.yml"), "my_include"]


TASK_MUTATIONS = [("output_type", "generate_until"), ("output_type", None), ("doc_to_text", "{% if %}"),
                  ("doc_to_target", "{{ nope.nope }}"), ("doc_to_choice", 7), ("test_split", "train"),
                  ("metric_list", [{"metric": "exact_match"}]), ("metric_list", "acc"), ("dataset_kwargs", None),
                  ("dataset_path", "csv"), ("num_fewshot", 3), ("fewshot_split", "nowhere"), ("task", ["x"]),
                  ("filter_list", [{"name": "x"}]), ("generation_kwargs", {"until": 3}), ("include", "nope.yaml")]


@pytest.mark.parametrize("field,value", TASK_MUTATIONS, ids=[f"{f}={v}" for f, v in TASK_MUTATIONS])
def test_a_mutated_user_task_is_accepted_or_refused_naming_the_file(field, value, tmp_path):
    """The user's task YAML fuzzed one field at a time (the shipped arith_mc as a user's copy): lm-eval's own
    loading before launch either accepts it or the refusal names the key and the file; a check never crashes."""
    import shutil

    import yaml

    from plugins.evaluate.harness import SHIPPED

    folder = tmp_path / "tasks"
    folder.mkdir()
    shutil.copy(SHIPPED / "arith_mc.jsonl", folder / "q.jsonl")
    config = yaml.safe_load((SHIPPED / "arith_mc.yaml").read_text())
    config.update(task="mine", dataset_kwargs={"data_files": {"test": str(folder / "q.jsonl")}})
    config[field] = value
    (folder / "mine.yaml").write_text(yaml.safe_dump(config))
    found = problems_of(["evaluate.tasks=[mine]", f"evaluate.include_path={folder}"], tmp_path / "runs")
    assert all(p.key.startswith("evaluate.") and "report this" not in p.fix for p in found), found
    assert all(str(folder) in p.rule or "no such task" in p.rule for p in found), found
