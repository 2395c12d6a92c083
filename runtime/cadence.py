"""When the training loop does what besides stepping: log, evaluate, save, read metrics back (TorchTitan's trainer
asks its components "is it time?"; here one object answers for all of them)."""
from __future__ import annotations

from dataclasses import dataclass

WARMUP_STEPS_EXCLUDED = 3  # first steps of an attempt are slower (allocator, caches): not in tokens/s
FLUSH_EVERY = 50            # metrics are read back from the device at least this often when train.log_every=0


@dataclass(frozen=True)
class Cadence:
    start: int              # the step this attempt starts from (0, or a checkpoint's)
    steps: int
    eval_every: int         # 0: at the end only
    checkpoint_every: int   # 0: at the end only
    log_every: int          # 0: no step lines (metrics still flushed every FLUSH_EVERY steps)

    @staticmethod
    def of(cfg, start: int) -> "Cadence":
        t = cfg.train
        return Cadence(start, t.steps, t.eval_every, t.checkpoint_every, t.log_every)

    def evaluates(self, done: int) -> bool:
        return done == self.steps or bool(self.eval_every and done % self.eval_every == 0)

    def saves(self, done: int) -> bool:
        return done == self.steps or bool(self.checkpoint_every and done % self.checkpoint_every == 0)

    def warmed_up(self, done: int) -> bool:
        """The window ends with the warm-up: its queued GPU work is timed with its own steps, not the timed ones."""
        return done - self.start == WARMUP_STEPS_EXCLUDED

    def flushes(self, done: int) -> bool:
        return done % (self.log_every or FLUSH_EVERY) == 0

    def timed(self, step: int) -> bool:
        """Whether a step counts in tokens/s."""
        return step - self.start > WARMUP_STEPS_EXCLUDED

    def prints(self, step: int) -> bool:
        return bool(self.log_every) and (step % self.log_every == 0 or step == self.steps)
