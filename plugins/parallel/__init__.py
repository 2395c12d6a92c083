"""Parallel layouts on PyTorch's own machinery: one DeviceMesh (pp, dp, hp), DTensor tensor parallelism
(the model's `parallelize`), FSDP2 data parallelism, torch.distributed.pipelining schedules, plus the two
pieces torch does not provide: the tied embedding shared by the first and last pipeline stage, and a
gradient norm that is global across meshes and pipeline stages."""


def world_size(parallel) -> int:
    """The ranks a layout runs as (the `parallel` config section): one per (dp, hp, pp) coordinate."""
    return parallel.dp * parallel.hp * parallel.pp
