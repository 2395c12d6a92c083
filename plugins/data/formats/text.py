"""data.format=text: a text file is a document, a records file's `data.text_field` of each record is one; every
token is learned, and the stream is packed in windows (pretraining's way) unless rows of whole documents are asked."""
from plugins.data.formats.spec import RecordFormat, register_format

register_format("text", RecordFormat(fields=lambda d: {"text_field": d.text_field}, packing_strategy="wrapped",
                                      may_render=False))
