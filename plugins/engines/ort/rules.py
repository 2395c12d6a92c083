"""engine=ort's rules: ONNX Runtime's training build is installed (with CUDA where the ranks run on a GPU), and the
settings it cannot honour (mixed precision, sequence parallelism, Triton kernels without CUDA, recomputation by
operator, rows of whole documents) are refused."""
from __future__ import annotations

import sys

from common.problem import Problem
from plugins.data.packing import whole_documents
from runtime import machine


def check(cfg) -> list[Problem]:
    problems = []
    if cfg.triton.enabled and not (machine.has_cuda() and machine.ort_has_triton()):
        missing = "no CUDA device" if not machine.has_cuda() else "an onnxruntime-training build without CUDA and Triton"
        problems.append(Problem("triton.enabled", True, "engine=ort with triton=on runs ONNX Runtime's Triton "
                                f"kernels, which need a CUDA GPU and ORT's Triton build; this machine has {missing}",
                                "triton=off (engine=ort runs ORT's CPU kernels), or engine=torch triton=on "
                                "(torch.compile generates C++ on CPU)"))
    if cfg.precision.name in ("bf16", "fp16"):
        problems.append(Problem("precision.name", cfg.precision.name, "engine=ort trains each unit as an fp32 ONNX "
                                "graph (exported and differentiated in fp32): it has no mixed precision",
                                "precision=fp32 (or auto), or engine=torch for bf16/fp16"))
    if cfg.parallel.sequence_parallel:
        problems.append(Problem("parallel.sequence_parallel", True, "engine=ort runs each unit (LayerNorm through the "
                                "row-parallel matmul) as one graph, but sequence parallelism needs a collective "
                                "between the LayerNorm and the matmuls", "parallel.sequence_parallel=false, or "
                                "engine=torch"))
    if cfg.memory.level == 3:
        problems.append(Problem("memory.level", 3, "engine=ort runs each unit as an ONNX graph, but memory level 3 "
                                "keeps the outputs of torch's own matmul and attention operators, which those graphs "
                                "never show it (it would recompute the whole layer, as level 1)",
                                "memory=level1 or memory=level2, or engine=torch"))
    if whole_documents(cfg.data) is not None:
        problems.append(Problem("data.packing_strategy", cfg.data.get("packing_strategy", "auto"),
                                "engine=ort runs each unit as an ONNX graph exported with the hidden states as its "
                                "only input; rows of whole documents (the bfd strategy; auto picks it for "
                                f"data.format={cfg.data.format}) need a document mask and positions beside them, "
                                "which that graph cannot take", "data.packing_strategy=wrapped (documents attend "
                                "across each other), data.packing=false (one document a row), or engine=torch"))
    installed = install_problems()
    problems += installed
    if not installed and cfg.cluster.name != "slurm" and machine.has_cuda() and not machine.ort_has_cuda():
        import onnxruntime

        problems.append(Problem("engine", "ort", "the train stage runs on this machine's CUDA GPU, but the "
                                f"installed onnxruntime-training {onnxruntime.__version__} has no CUDA execution "
                                "provider (PyPI's wheel is CPU-only), so ORT could not run the units on the GPU",
                                "install onnxruntime-training's CUDA build (ONNX Runtime's package index, for your "
                                "CUDA version), or engine=torch, or CUDA_VISIBLE_DEVICES= to train on the CPU"))
    return problems


def install_problems(python: tuple[int, int] = tuple(sys.version_info[:2])) -> list[Problem]:
    """engine=ort needs ONNX Runtime's training build; say which package to install, or why none can be."""
    from plugins.engines.ort.install import LAST_PYTHON_WITH_WHEEL, ort_install

    found = ort_install()
    if found.can_train:
        return []
    this = ".".join(map(str, python))
    last = ".".join(map(str, LAST_PYTHON_WITH_WHEEL))
    no_wheel = python > LAST_PYTHON_WITH_WHEEL
    install = "pip install -e '.[ort]' (onnxruntime-training 1.19.2)"
    fix = (f"engine=torch, or a Python {last} environment with {install}" if no_wheel
           else f"{install}, or engine=torch")
    why_no_wheel = (f"; onnxruntime-training publishes no wheel for Python {this} (its last release has wheels up to "
                    f"Python {last})" if no_wheel else "")
    if not found.installed:
        rule = f"engine=ort trains with ONNX Runtime's training build, package onnxruntime-training, which is not installed{why_no_wheel}"
    elif found.import_error:
        rule = f"engine=ort needs onnxruntime-training, but the installed onnxruntime does not import: {found.import_error}"
    else:
        rule = (f"the installed onnxruntime {found.version} is an inference-only build (package onnxruntime or "
                f"onnxruntime-gpu): it lacks the training API engine=ort uses ({', '.join(found.missing_api)})"
                f"{why_no_wheel}")
        fix = f"pip uninstall onnxruntime onnxruntime-gpu, then {fix}" if not no_wheel else fix
    return [Problem("engine", "ort", rule, fix)]
