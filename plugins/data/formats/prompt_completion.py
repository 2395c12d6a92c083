"""data.format=prompt_completion: a prompt and its completion, texts (encoded apart, or jointly as TRL encodes them:
data.prompt_encoding) or lists of messages (TRL's conversational form: Conversation, rendered with the chat
template); the completion is learned (data.loss_on=completion), and a record whose completion is empty has nothing
to learn: left out and counted."""
from plugins.data.formats.spec import RecordFormat, register_format
from plugins.data.piece_records import text_value
from plugins.data.records import Conversation, Record, Unanswered, answers


def document(d, record: dict, where):
    prompt, completion = record["prompt_field"], record["completion_field"]
    if isinstance(prompt, list) or isinstance(completion, list):
        chat = Conversation(prompt, completion, where, d)
        return chat if answers(chat, d) else Unanswered(chat)
    learned = text_value(completion, where, "completion_field", d.completion_field)
    return Record((text_value(prompt, where, "prompt_field", d.prompt_field), learned), where) if learned else ()


register_format("prompt_completion", RecordFormat(
    fields=lambda d: {"prompt_field": d.prompt_field, "completion_field": d.completion_field},
    document=document,
    masks_loss=lambda d: d.loss_on == "completion",
    probes_turns=True,
))
