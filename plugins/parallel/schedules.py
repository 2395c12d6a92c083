"""The pipeline schedules: one table that the schema, validation, the pipeline runner, the partition plan, the
memory estimate and `tune=layout` read (a new schedule is one row here)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    torch_class: str        # in torch.distributed.pipelining.schedules
    min_chunks: int         # model chunks (virtual stages) per rank: at least this many ...
    max_chunks: int | None  # ... and at most this many (None: no limit)
    v_shape: bool = False   # stages go down the ranks and back up (rank r holds stages r and 2*pp-1-r)
    in_rounds: bool = False  # microbatches run in rounds of pp: their number is a multiple of the rounds
    all_forwards_first: bool = False  # every microbatch's activations are held at once (GPipe)
    # the backward is split into an input pass (I) and a weight pass (W) (zero-bubble): torch finds the weights of
    # the W pass from the stage's registered parameters when the I pass starts, before autograd runs FSDP's
    # pre-backward gather; FSDP2 must then keep them gathered from forward on (parallelize.apply_dp), or the
    # stage's weights get no gradient at all
    split_backward: bool = False

    @property
    def multi_chunk(self) -> bool:
        return self.min_chunks > 1

    def chunks_rule(self) -> str:
        if self.max_chunks == self.min_chunks:
            return f"== {self.min_chunks}"
        return f">= {self.min_chunks}"

    def chunks_ok(self, chunks: int) -> bool:
        return chunks >= self.min_chunks and (self.max_chunks is None or chunks <= self.max_chunks)

    @staticmethod
    def min_microbatches(pp: int, chunks: int) -> int:
        return pp  # every stage has work in flight


SCHEDULES = {
    "gpipe": Schedule("ScheduleGPipe", 1, 1, all_forwards_first=True),
    "1f1b": Schedule("Schedule1F1B", 1, 1),
    "interleaved_1f1b": Schedule("ScheduleInterleaved1F1B", 2, None, in_rounds=True),
    "looped_bfs": Schedule("ScheduleLoopedBFS", 2, None),
    "interleaved_zb": Schedule("ScheduleInterleavedZeroBubble", 2, None, in_rounds=True, split_backward=True),
    "zbv": Schedule("ScheduleZBVZeroBubble", 2, 2, v_shape=True, split_backward=True),
}
