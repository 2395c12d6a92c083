"""Per-row inputs by provider: what an objective names in its spec's row_inputs comes with each batch's rows, one
column a provider in the order named (a single one: a vector). Two exist: "reference", the reference model's
log-probability of each row (reference.py: cached by the reference stage, or computed online), and "label", each
row's label where its records carry one (an unpaired record's: 1 where its completion is desirable, read from the
mark its tokens carry in the shards, plugins/data/prompted_records.py)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

from plugins.data.prompted_records import DESIRABLE
from plugins.objectives.reference import REFERENCE

if TYPE_CHECKING:
    import torch

LABEL = "label"


def labels_of(batch) -> torch.Tensor:
    """(rows,) float64: 1 where a row's record is desirable, 0 where it is not (or the row is empty)."""
    import torch

    return torch.from_numpy((batch.marks == DESIRABLE).astype("float64"))


def row_inputs_of(names: tuple[str, ...], reference) -> Optional[object]:
    """What the batcher gives each batch for an objective that names `names`: None (none named), the reference's
    values alone as the reference stage or the online pass gives them, or a function of the batch giving a column
    a provider. reference: per split a value a document (cached), or a function of the batch (online)."""
    if not names:
        return None
    if names == (REFERENCE,):
        return reference
    if REFERENCE in names and not callable(reference):
        raise ValueError(f"row inputs {names}: the cached reference gives one column; with others it is computed "
                         "online (the objective's rules say so before launch)")
    providers: dict[str, Callable] = {REFERENCE: reference, LABEL: labels_of}

    def columns(batch) -> torch.Tensor:
        import torch

        return torch.stack([providers[name](batch).double() for name in names], 1)
    return columns
