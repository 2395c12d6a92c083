"""lm-eval task files a user might write, broken in the ways the evaluate stage's checks refuse (tests/test_task_files.py,
the refusal catalogue)."""
from __future__ import annotations

from pathlib import Path


def user_tasks(folder: Path) -> None:
    """lm-eval task files that parse as YAML and fail in lm-eval (one task each), beside good ones: a `.yml`, one
    whose metrics come from an `include:`."""
    import shutil

    import yaml

    from plugins.evaluate.harness import SHIPPED

    folder.mkdir()
    data = folder / "questions.jsonl"
    shutil.copy(SHIPPED / "arith_mc.jsonl", data)
    base = yaml.safe_load((SHIPPED / "arith_mc.yaml").read_text())
    base["dataset_kwargs"]["data_files"] = {"test": str(data)}

    def task(name: str, file: str = "", **changed) -> None:
        (folder / (file or f"{name}.yaml")).write_text(yaml.safe_dump({**base, "task": name, **changed}))

    task("my_metric", metric_list=[{"metric": "acuracy"}])
    task("my_otype", output_type="multiple_chose")
    task("my_jinja", doc_to_text="{{ question ")
    task("my_nodata", dataset_kwargs={"data_files": {"test": str(folder / "nope.jsonl")}})
    task("my_split", test_split="validation")
    task("my_hub", dataset_path="someone/some_dataset", dataset_kwargs={})
    task("my_nofiles", dataset_kwargs={})  # json with no data_files: every JSON file under the working folder
    task("arith_mc", "shadow.yaml")  # the shipped task's name
    task("my_yml", "my_yml.yml")
    task("my_helper", "helper.yaml", doc_to_text="HELPER")
    (folder / "helper.yaml").write_text((folder / "helper.yaml").read_text().replace(
        "doc_to_text: HELPER", "doc_to_text: !function missing_utils.doc_to_text"))
    (folder / "inc_base.yaml").write_text(yaml.safe_dump({k: v for k, v in base.items() if k != "task"}))
    (folder / "inc.yaml").write_text("include: inc_base.yaml\ntask: my_include\n")
