"""data.format=chat: a list of {role, content} messages (and tools), rendered with the chat template; the assistant's
turns are learned (data.loss_on=completion; data.chat_turns, data.learn_reasoning), and a chat with no answer to
learn is left out and counted."""
from plugins.data.formats.spec import RecordFormat, register_format
from plugins.data.records import Chat, Unanswered, answers


def document(d, record: dict, where):
    chat = Chat(record["messages_field"], where, record.get("tools_field"))
    return chat if answers(chat, d) else Unanswered(chat)


register_format("chat", RecordFormat(
    fields=lambda d: {"messages_field": d.messages_field},
    optional=lambda d: {"tools_field": d.tools_field},
    document=document,
    masks_loss=lambda d: d.loss_on == "completion",
    probes_turns=True,
    always_rendered=True,
    nothing_learned="no assistant message with text",
))
