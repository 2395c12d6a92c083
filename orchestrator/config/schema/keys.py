"""How a config key is declared: key() with its help text and rules, the bounds numbers are checked against, and
the read_when conditions several sections share."""
from __future__ import annotations

from common.keys import key  # noqa: F401  (declared on the ground floor, where components declare theirs)
from orchestrator.config.schema.objective import without_row_loss
from plugins.parallel.schedules import SCHEDULES


PP_SCHEDULES = tuple(SCHEDULES)
MAX_STEPS = 10**9  # no run takes a billion optimizer steps; a larger number is a typo (and overflows counters)
MAX_SEED = 2**32 - 1  # NumPy's and torch's seeds are unsigned; 32 bits is what every library accepts
# sizes past anything trained (the largest models have ~130 layers, widths of ~50k, vocabularies of ~260k): a larger
# number is a typo, and would make the plan itself loop or allocate for ever before its memory check could say so
MAX_LAYERS, MAX_WIDTH, MAX_VOCAB, MAX_TOKENS, MAX_RANKS = 4096, 2**20, 2**24, 2**24, 2**16
MAX_THREADS, MAX_GPUS, MAX_WAIT_S = 4096, 64, 7 * 24 * 3600  # a node's cores and GPUs; a week (timedelta's range)
class Filled:
    """read_when's values for a list or text key: FILLED holds when the key has something in it, EMPTY when not
    (`actual in FILLED`, as for a tuple of values)."""

    def __init__(self, filled: bool, words: str):
        self.filled, self.words = filled, words

    def __contains__(self, actual) -> bool:
        return bool(actual) == self.filled

    def __iter__(self):
        return iter((self.words,))


FILLED, EMPTY = Filled(True, "<something>"), Filled(False, "[]")
EVALUATING = ("evaluate.tasks", FILLED)  # the evaluate stage runs only with tasks to score
FP16 = ("precision.name", ("fp16",))
COMPILED = ("triton.enabled", (True,))
BPE = ("data.tokenizer", ("bpe",))
PROMPT_COMPLETION = ("data.format", ("prompt_completion",))
CHAT = ("data.format", ("chat",))
CHAT_OR_PROMPT = ("data.format", ("chat", "prompt_completion", "preference", "unpaired"))  # a template may render
PREFERENCE = ("data.format", ("preference",))
UNPAIRED = ("data.format", ("unpaired",))
WITH_COMPLETION = ("data.format", ("prompt_completion", "unpaired"))  # records with a completion field
PROMPT_OR_PAIR = ("data.format", ("prompt_completion", "preference", "unpaired"))  # records with a prompt field
LAYOUT_TUNING = ("tune.name", ("layout",))
COMPLETION_ONLY = ("data.loss_on", ("completion",))

LORA = ("peft.name", ("lora",))
# the objectives whose loss is the head's next-token loss (sft): what keys of that loss are read for
TOKEN_LOSS = ("objective.name", without_row_loss())

