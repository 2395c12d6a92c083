"""data.format=preference: a prompt with a chosen and a rejected completion (TRL's three forms: texts, lists of
messages, or chosen and rejected alone, their common beginning the prompt): two documents side by side, which an
objective of pairs compares (plugins/data/prompted_records.Pair)."""
from plugins.data.formats.spec import RecordFormat, register_format
from plugins.data.prompted_records import Pair

register_format("preference", RecordFormat(
    fields=lambda d: {"chosen_field": d.chosen_field, "rejected_field": d.rejected_field},
    optional=lambda d: {"prompt_field": d.prompt_field},  # (else an implicit prompt)
    document=lambda d, r, where: Pair(r["prompt_field"], r["chosen_field"], r["rejected_field"], where, d),
    masks_loss=lambda d: True,
    makes_documents=True,
    per_example=2,
    unit="pairs",
))
