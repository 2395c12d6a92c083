"""Records of a prompt and its completions, each completion's document the prompt and it encoded together (TRL's
way: plugins/data/preference.prompted_ids): a preference pair (data.format=preference: a chosen and a rejected
completion, two documents side by side) and an unpaired record (data.format=unpaired: one completion and a label
saying whether it is desirable, KTO's records). The label travels with the tokens: its document's learned tokens
are marked 1 (desirable) or 2 (undesirable) in the shards' mask, which the batcher reads back as the row's mark."""
from __future__ import annotations

import numpy as np

from common.problem import InputFault
from plugins.data import tokenizer as tokenizers
from plugins.data.piece_records import BadRecord, preview, text_value
from plugins.data.preference import check_pair, prompted_ids, split_prompt
from plugins.data.records import Chat, Record, check_conversation, messages_problem, render_problem

DESIRABLE, UNDESIRABLE = 1, 2  # an unpaired record's mark on its learned tokens (a mask value, uint8)


class Prompted(Record):
    """A prompt and its completions (texts, or lists of messages: TRL's conversational form), each made into a
    document. Subclasses set prompt, completions, names (each completion's, for a message), kind and marks."""

    kind, names, marks = "record", ("",), (1,)

    @property
    def conversational(self) -> bool:
        return isinstance(self.completions[0], list)

    def render_problem(self, template: str) -> str:
        """Why the template cannot render the record's conversations as meant ('' when it can), as a chat's."""
        return next((why for completion in self.completions
                     if (why := render_problem(Chat(self.prompt + completion, self.where), template))), "")

    def ids(self, tok: tokenizers.Tokenizer) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each completion's document: its ids and which are learned (marked, as the shards' mask holds them)."""
        return [(ids, learned.astype(np.uint8) * mark)
                for (ids, learned), mark in zip(prompted_ids(tok, self.prompt, self.completions), self.marks)]

    def documents(self, tok: tokenizers.Tokenizer, row: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
        """(its documents: each ids and which are learned; 1 when one is longer than a row of `row` tokens, cut
        there, else 0), as the tokenize stage writes them; InputFault naming the record for a conversation the
        template cannot render (BadRecord: the record's own), or a completion that starts past the row (a
        setting's)."""
        if self.conversational and (why := self.render_problem(tok.chat_template)):
            raise BadRecord(why)
        made = self.ids(tok)
        return made, check_pair(self, made, row)


class Pair(Prompted):
    """A preference pair (data.format=preference): its prompt, chosen and rejected completion, all texts or all lists
    of messages (TRL's standard and conversational forms; a record without a prompt has an implicit one, the
    beginning chosen and rejected share: plugins/data/preference.split_prompt; so has one whose prompt is of another
    form than its completions, as TRL's maybe_extract_prompt reads UltraFeedback's text prompt beside conversations
    that repeat it). Its texts (what a BPE learns from)
    are the prompt's and the completions' bytes. A pair with an empty completion, or whose completions are the same
    (its loss is log 2 whatever the model), is refused naming the record."""

    # its rejected document marked undesirable: an objective of pairs reads only which tokens are learned, one of
    # unpaired records (kto) reads the pair unpaired, as TRL's KTOTrainer does (unpair_preference_dataset)
    kind, names, marks = "pair", ("chosen", "rejected"), (DESIRABLE, UNDESIRABLE)

    def __new__(cls, prompt, chosen, rejected, where, d):
        form = "texts, or lists of {role, content} messages (TRL's conversational form)"
        given = [(v if isinstance(v, list) else text_value(v, where, k, d[k]).decode("utf-8"), k)  # (bytes: Arrow's)
                 for v, k in ((prompt, "prompt_field"), (chosen, "chosen_field"), (rejected, "rejected_field"))
                 if v is not None or k != "prompt_field"]
        if prompt is None:
            (chosen, _), (rejected, _) = given
        else:
            (prompt, _), (chosen, _), (rejected, _) = given
        implicit = prompt is None or isinstance(prompt, list) != isinstance(chosen, list)  # TRL's maybe_extract_prompt
        if len({isinstance(v, list) for v, _ in (given[-2:] if implicit else given)}) > 1:
            raise InputFault(f"{where}: the pair mixes texts and lists of messages ("
                             + ", ".join(f"data.{k} is {'messages' if isinstance(v, list) else 'text'}"
                                         for v, k in given) + f"); fix: records whose fields are all {form}")
        for value, k in given[-2:] if implicit else given:
            if isinstance(value, list) and (why := messages_problem(value, f"data.{k} ({d[k]!r})")):
                raise InputFault(f"{where}: {why}; fix: records whose fields are all {form}")
        for value, k in ((chosen, "chosen_field"), (rejected, "rejected_field")):  # each fault its own: before
            if not value:  # the implicit prompt takes what they share
                raise InputFault(f"{where}: the pair's {k.split('_')[0]} completion (data.{k}={d[k]!r}) is empty: "
                                 "there is nothing to compare; fix: leave the pair out, or repair it")
        if chosen == rejected:
            raise InputFault(f"{where}: the pair's chosen and rejected completions are the same: it teaches nothing "
                             "(its loss is log 2 whatever the model); fix: leave the pair out, or repair it")
        if implicit:  # no prompt, or one of another form than the completions' (UltraFeedback's): what they share
            other = prompt is not None
            prompt, chosen, rejected = split_prompt(chosen, rejected)
            if not prompt and other:
                raise InputFault(f"{where}: the record's data.prompt_field ({d.prompt_field!r}) is "
                                 f"{'messages' if isinstance(chosen, str) else 'text'} and its chosen and rejected "
                                 f"completions are {'texts' if isinstance(chosen, str) else 'lists of messages'}: "
                                 "as in TRL (maybe_extract_prompt), the prompt is then the beginning they share "
                                 "(UltraFeedback's form repeats it as their first message), and they share none; "
                                 f"fix: records whose fields are all {form}, or completions that begin with the "
                                 "prompt")
            if not prompt:
                raise InputFault(f"{where}: the record has no field data.prompt_field={d.prompt_field!r} and its "
                                 "chosen and rejected completions share no beginning to be its prompt (TRL's "
                                 "implicit prompt); fix: data.prompt_field= the field that holds the prompt")
            for value, (k, was) in zip((chosen, rejected), (("chosen", "rejected"), ("rejected", "chosen"))):
                if not value:
                    raise InputFault(f"{where}: the pair's {k} completion (data.{k}_field={d[k + '_field']!r}) is "
                                     f"the beginning of its {was} one, and the implicit prompt (the beginning they "
                                     "share, as TRL's extract_prompt takes it) takes all of it: nothing of it is "
                                     "left to compare; fix: data.prompt_field= the field that holds the prompt, or "
                                     "repair the pair")
        parts = [prompt, chosen, rejected]
        pair = super().__new__(cls, _texts(parts), where)
        pair.prompt, pair.chosen, pair.rejected = parts
        pair.completions = (chosen, rejected)
        return pair


def _texts(parts) -> list[bytes]:
    """A record's texts (what a BPE learns from): each part's bytes, a list of messages' contents joined."""
    return [v.encode("utf-8") if isinstance(v, str) else "".join(m["content"] for m in v).encode("utf-8")
            for v in parts]


class Unpaired(Prompted):
    """An unpaired record (data.format=unpaired, TRL's unpaired preference form that KTOTrainer reads): a prompt, a
    completion and a label, true where the completion is desirable; both texts or both lists of messages. Refused,
    naming it: a label that is not true or false, an empty completion (nothing to judge)."""

    kind = "record"

    def __new__(cls, prompt, completion, label, where, d):
        if not isinstance(label, (bool, np.bool_)):
            raise BadRecord(f"{where}: the record's label (data.label_field={d.label_field!r}) is {preview(label)}, "
                            "not true or false; fix: a label that says whether the completion is desirable (true) or "
                            "not (false), as TRL's unpaired preference records hold it")
        if isinstance(prompt, list) or isinstance(completion, list):
            check_conversation(prompt, completion, where, d)
            parts = [prompt, completion]
        else:
            parts = [text_value(v, where, k, d[k]).decode("utf-8") for v, k in ((prompt, "prompt_field"),
                                                                               (completion, "completion_field"))]
        if not parts[1]:
            raise InputFault(f"{where}: the record's completion (data.completion_field={d.completion_field!r}) is "
                             "empty: there is nothing to judge; fix: leave the record out, or repair it")
        record = super().__new__(cls, _texts(parts), where)
        record.prompt, record.completions = parts[0], (parts[1],)
        record.label = bool(label)
        record.names = ("desirable" if record.label else "undesirable",)
        record.marks = (DESIRABLE if record.label else UNDESIRABLE,)
        return record
