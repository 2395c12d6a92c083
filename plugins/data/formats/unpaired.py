"""data.format=unpaired: a prompt, a completion and a label, true where the completion is desirable (TRL's unpaired
preference records, KTO's): one document, its label carried by its learned tokens' mark
(plugins/data/prompted_records.Unpaired)."""
from plugins.data.formats.spec import RecordFormat, register_format
from plugins.data.prompted_records import Unpaired

register_format("unpaired", RecordFormat(
    fields=lambda d: {"prompt_field": d.prompt_field, "completion_field": d.completion_field,
                      "label_field": d.label_field},
    document=lambda d, r, where: Unpaired(r["prompt_field"], r["completion_field"], r["label_field"], where, d),
    masks_loss=lambda d: True,
    makes_documents=True,
))
