"""The data's rules: a registered source (built in, or added through the `orchestrator.data` entry points), a
tokenizer we know whose ids the model's embedding holds, and the source's own checks (files, amounts). What they read
of the corpus is handed on with their verdict (tokenize_cost.DataRead), for the plan to weigh and say."""
from __future__ import annotations

import math

import difflib
from pathlib import Path

from common.problem import Found, Problem
from plugins.data.bad_records import BadRecords, skips
from plugins.data.formats.spec import format_of
from plugins.data import tokenizer as tokenizers
from plugins.data.chat import NotExtending, compiled, has_generation_tags, templates_of
from plugins.data.chat_turns import examples
from plugins.data.corpus import corpus_layouts, sources_of
from plugins.data.longer_rows import longer_rows
from plugins.data.packing import whole_documents
from plugins.data.registry import get_source, source_names
from plugins.data.tokenize_cost import DataRead
from storage.fsio import why_not_a_file


def check(cfg) -> list[Problem]:
    """The data's problems; where there are none, a Found whose facts are what was read of the corpus (DataRead):
    its layouts, and the bad records that data.bad_records=skip leaves out among the first records the source's check
    read. The plan weighs and says those instead of reading the corpus again."""
    problems, bad = _problems(cfg)
    if problems:
        return problems
    return Found([], DataRead([lay for _, lay in corpus_layouts(cfg)], bad if skips(cfg.data) else None))


def _bad_read(found) -> BadRecords:
    """The bad records a source's check read, where it hands them on (the files source's: a Found)."""
    return (found.facts if isinstance(found, Found) else None) or BadRecords()


def _problems(cfg) -> tuple[list[Problem], BadRecords]:
    """(the data's problems, the bad records among the first records its source's check read)."""
    d = cfg.data
    if d.name not in source_names():
        return [Problem("data.name", d.name, "the data source must be registered (plugins/data, or a package's "
                        "orchestrator.data entry point)", f"one of: {', '.join(source_names())}")], BadRecords()
    source = get_source(d.name)
    problems = _tokenizer_problems(cfg, source)
    if not source.carries(d.format):
        return problems + [Problem("data.format", d.format, f"{d.format} records are read from JSON Lines or "
                                   f"Parquet files by data=text; data={d.name} has none",
                                   "data=text 'data.paths=[/path/to/records.jsonl]', or data.format=text")], \
            BadRecords()
    if {"prompt_field", "completion_field"} <= set(format_of(d).fields(d)) and d.prompt_field == d.completion_field:
        problems.append(Problem("data.prompt_field", d.prompt_field, f"the prompt and the completion would both be "
                                f"read from the field {d.prompt_field!r} (data.completion_field): every record would "
                                "learn its own prompt again", "data.prompt_field= the field that holds the prompt "
                                "(e.g. prompt), data.completion_field= the one that holds the answer"))
    if format_of(d).may_render:
        problems += _chat_problems(d)
    if d.get("mix"):
        if cfg.train.get("epochs"):
            problems.append(Problem("train.epochs", cfg.train.epochs, "a data.mix draws each row's source by weight, "
                                    "so the run has no epochs of one split's examples to count steps from",
                                    "train.steps= the steps to train, or one corpus"))
        mixed, bad = _mix_problems(cfg, source)
        return problems + mixed, bad
    found = source.check(cfg) if source.check is not None else []
    problems += [p if isinstance(p, Problem) else Problem(*p) for p in found]
    if not problems:
        problems += _long_text_problems(cfg)
    if d.text_field != "text" and not source.fields:
        problems.append(Problem("data.text_field", d.text_field, f"data.text_field names the field of JSON Lines or "
                                f"Parquet records, which data=text reads; data={d.name} has no fields and would "
                                "ignore it", "data=text with data.paths, or leave data.text_field unset"))
    return problems, _bad_read(found)


def _long_text_problems(cfg) -> list[Problem]:
    """data.long_documents=refuse where rows hold whole text documents: a text file is one document (a lone one, two:
    its held-out tail apart), and one longer than a row whatever its text (its bytes over the most bytes one token
    covers) is refused now, not by the tokenize stage after the other stages started. A BPE learned by the tokenize
    stage has no such bound before it is learned: the stage refuses its documents, naming the file."""
    d = cfg.data
    if whole_documents(d) != "refuse" or format_of(d).records:
        return []
    widest = tokenizers.widest_token(d)  # a tokenizer folder read only where documents may be refused
    if widest is None:
        return []
    row, long = cfg.train.seq_len + 1, []
    try:
        corpora = corpus_layouts(cfg)
    except (OSError, ValueError):  # said by the source's own checks
        return []
    for _, lay in corpora:
        size = 0
        for piece in lay.pieces if lay is not None else ():
            if piece.kind == "text":
                size = (0 if piece.opens else size) + piece.size
                if piece.closes and -(-size // widest) > row:
                    long.append((size, piece.path))
    if not long:
        return []
    size, path = max(long)
    least = -(-size // widest)
    return [Problem("data.long_documents", d.long_documents, f"rows hold whole documents, a text file is one "
                    f"document, and {len(long):,} of them are longer than a row (train.seq_len+1={row:,} tokens) "
                    f"whatever their text: {path} holds {size:,} bytes, {least:,} tokens at least with "
                    f"data.tokenizer={d.tokenizer}", "data.long_documents=split (pieces that overlap by one token), "
                    f"data.packing_strategy=wrapped (windows of the text, pretraining's way), or "
                    + longer_rows(cfg, least - 1))]


def _tokenizer_problems(cfg, source) -> list[Problem]:
    """data.tokenizer is one we know, and the model's embedding has a row for every id it produces."""
    d, m = cfg.data, cfg.model
    if source.tokens is not None:
        return []  # token sources adapt to the model's vocabulary
    spec = d.tokenizer
    folder = tokenizers.hf_folder(spec)
    if spec not in ("bytes", "bpe") and folder is None:
        return [Problem("data.tokenizer", spec, "a tokenizer is auto, bytes, bpe or hf:<folder>",
                        "data.tokenizer=auto (train.init_from's own, else bytes)")]
    if folder is not None:
        file = folder / "tokenizer.json" if folder.is_dir() else folder
        why = why_not_a_file(file)
        if why:
            return [Problem("data.tokenizer", spec, f"{folder} holds no tokenizer.json" if why == "does not exist"
                            else f"{file} {why}", "hf:<a folder saved with tokenizer.save_pretrained>")]
    try:
        need = tokenizers.vocab_needed(d)
    except (OSError, ValueError) as e:
        return [Problem("data.tokenizer", spec, f"the tokenizer cannot be loaded: {e}",
                        "another tokenizer folder, or save this one again (tokenizer.save_pretrained)")]
    if need is not None and need > m.vocab_size:
        return [Problem("model.vocab_size", m.vocab_size, f"data.tokenizer={spec} produces token ids up to {need - 1}",
                        f"model.vocab_size={-(-need // 64) * 64} or more (a multiple of 64 is fastest)"
                        + (f", or data.vocab_size={m.vocab_size}" if spec == "bpe" and m.vocab_size >= 259 else ""))]
    return _model_tokenizer_problems(cfg)


def _model_tokenizer_problems(cfg) -> list[Problem]:
    """A model and its tokenizer together: train.init_from=hf:<folder> that ships a tokenizer.json was trained on its
    ids; data.tokenizer must give every id it produces the token the folder's gives it (the same tokenizer, or one
    whose ids are a part of it; the embedding's rows past the vocabulary are fine)."""
    start = cfg.train.init_from or ""
    model = tokenizers.hf_folder(start)
    if model is None or not (model / "tokenizer.json").is_file():
        return []
    spec = cfg.data.tokenizer
    fix = f"data.tokenizer=auto or hf:{model} (the folder's own)"
    if spec == "bpe":
        return [Problem("data.tokenizer", spec, f"train.init_from={start} ships its own tokenizer, whose ids its "
                        "embeddings were trained on; a BPE learned on this corpus gives the same ids other tokens",
                        fix)]
    from tokenizers import Tokenizer as HFTokenizer

    ours_folder = tokenizers.hf_folder(spec)
    if ours_folder is not None and ours_folder.resolve() == model.resolve():
        return []
    try:
        theirs = HFTokenizer.from_file(str(model / "tokenizer.json")).get_vocab(with_added_tokens=True)
        ours = (tokenizers.load_hf(ours_folder) if ours_folder is not None else
                tokenizers.make(cfg.data)).with_offsets().get_vocab(with_added_tokens=True)
    except Exception as e:  # noqa: BLE001 (the tokenizers library raises bare Exceptions)
        return [Problem("train.init_from", start, f"{model}/tokenizer.json cannot be read as a tokenizer ({e})",
                        "save the model's tokenizer again (tokenizer.save_pretrained)")]
    by_id = {i: t for t, i in theirs.items()}
    differ = sorted((i, t) for t, i in ours.items() if by_id.get(i) != t)
    if not differ:
        return []
    i, token = differ[0]
    return [Problem("data.tokenizer", spec, f"train.init_from={start} ships its own tokenizer ({len(theirs)} tokens), "
                    f"and data.tokenizer={spec} ({len(ours)} tokens) gives {len(differ)} id(s) another token, e.g. "
                    f"id {i}: {token!r} here, {by_id.get(i)!r} in the model's: the embeddings would be fed ids they "
                    "were not trained on", fix)]


def _mix_problems(cfg, source) -> tuple[list[Problem], BadRecords]:
    """data.mix: sources of files (data=text), data.paths left empty, a positive weight each, and each source's own
    checks under its own key (data.mix[i].paths). -> (the problems, the bad records the sources' checks read)."""
    d = cfg.data
    if source.files is None and source.indexed is None:
        return [Problem("data.mix", "[...]", f"data.mix mixes sources of files (or of Megatron corpora); data={d.name} "
                        "has none", "data=text with data.mix, or data.mix=[] for this source")], BadRecords()
    problems, bad = [], BadRecords()
    if d.paths:
        problems.append(Problem("data.paths", list(d.paths), "with data.mix every source names its own paths; "
                                "data.paths would be a source without a weight", "data.paths=[] (move them into a "
                                "data.mix entry: {paths: [...], weight: 1.0})"))
    weights = [float(m.weight) for m in d.mix]
    if not any(w > 0 for w in weights):
        problems.append(Problem("data.mix", weights, "at least one source needs a weight above 0",
                                "weights such as 0.7 and 0.3 (relative: they need not sum to 1)"))
    elif 0 in weights:
        problems.append(Problem("data.mix", weights, f"source {weights.index(0)} has weight 0: it would be read and "
                                "tokenized, and never drawn into a batch", "leave that source out of data.mix, or give "
                                "it a weight above 0"))
    elif all(math.isfinite(w) for w in weights) and not math.isfinite(sum(weights)):
        problems.append(Problem("data.mix", weights, "the weights' sum overflows (each source's share is its weight "
                                "over the sum)", "weights such as 0.7 and 0.3 (relative: they need not sum to 1)"))
    for i, sub in enumerate(sources_of(cfg)):
        found = source.check(sub) if source.check else []
        bad = bad.merge(_bad_read(found))
        for p in found:
            p = p if isinstance(p, Problem) else Problem(*p)
            key = p.key.replace("data.", f"data.mix[{i}].", 1) if p.key in ("data.paths", "data.text_field") else p.key
            problems.append(Problem(key, p.value, p.rule, p.fix.replace(p.key, key)))
    return problems, bad


def _chat_problems(d) -> list[Problem]:
    """The chat template records are rendered with (data.format=chat needs one; prompt/completion records only when
    they are lists of messages, which the first records' check finds): data.chat_template's file exists, the
    folder's named template exists, it compiles, and where only the assistant's tokens are learned its renderings of
    a conversation's prefixes extend each other (or it has generation tags), else nothing could be told apart."""
    try:
        template = tokenizers.chat_template(d)
    except KeyError:
        folder = tokenizers.hf_folder(d.tokenizer)
        names = sorted(templates_of(folder)) if folder else []
        return [Problem("data.chat_template_name", d.chat_template_name, f"the tokenizer folder {folder} has no chat "
                        f"template of this name (it has: {', '.join(names) or 'none'})",
                        f"data.chat_template_name= one of {', '.join(names)}" if names else
                        "data.chat_template_name='' and data.chat_template= a Jinja template")]
    except OSError as e:
        given = Path(d.chat_template).expanduser()
        near = difflib.get_close_matches(given.name, _names_in(given.parent), n=3, cutoff=0.6)
        return [Problem("data.chat_template", d.chat_template, "a value without Jinja markup ({{ or {%) is a template "
                        f"file's path, and this one cannot be read ({e.strerror})",
                        (f"did you mean {', '.join(str(given.parent / n) for n in near)}? " if near else "")
                        + "data.chat_template= an existing Jinja file, or the template's text")]
    except ValueError as e:  # a file not UTF-8, a tokenizer_config.json not JSON
        return [Problem("data.chat_template" if d.chat_template else "data.tokenizer",
                        d.chat_template or d.tokenizer, f"the chat template cannot be read: {e}",
                        "repair the JSON (tokenizer.save_pretrained writes it whole)" if "not JSON" in str(e) else
                        "save the file as UTF-8, e.g. iconv -f latin1 -t utf-8 FILE > FILE.utf8")]
    if not template:
        if not format_of(d).always_rendered:
            return []
        folder = tokenizers.hf_folder(d.tokenizer)
        named = sorted(templates_of(folder)) if folder and folder.is_dir() else []
        if named:
            return [Problem("data.chat_template_name", d.chat_template_name, f"the tokenizer folder {folder} has no "
                            f"default chat template, only named ones: {', '.join(named)}",
                            f"data.chat_template_name= one of {', '.join(named)}")]
        where = f"the tokenizer folder {folder} has no chat template" if folder else \
            f"data.tokenizer={d.tokenizer} carries no chat template"
        return [Problem("data.chat_template", d.chat_template, f"chat records are rendered with a chat template; "
                        f"{where}", "data.chat_template= a Jinja template (its text or a file), or "
                        "data.tokenizer=hf:<a folder whose chat_template.jinja or tokenizer_config.json has one>")]
    try:
        compiled(template)
    except Exception as e:  # jinja2's TemplateSyntaxError (and what a sandboxed compile may raise)
        return [Problem("data.chat_template", d.chat_template or tokenizers.hf_folder(d.tokenizer),
                        f"the chat template cannot be read as Jinja: {type(e).__name__}: {e}",
                        "data.chat_template= a template that compiles (transformers' apply_chat_template would "
                        "refuse this one too)")]
    if format_of(d).probes_turns and d.loss_on == "completion" and not has_generation_tags(template):
        try:
            examples(template, PROBE_CHAT, d.chat_turns, **tokenizers.template_variables(d))
        except NotExtending as e:
            return [Problem("data.chat_template", d.chat_template or tokenizers.hf_folder(d.tokenizer),
                            f"only the assistant's tokens are learned (data.loss_on=completion), and on a one-turn "
                            f"conversation {e}", ("data.chat_turns=each (an example per assistant turn, as at "
                                                  "inference), " if d.chat_turns == "all" else "")
                            + "{% generation %} ... {% endgeneration %} around the assistant's turns in a copy of the "
                            "template, or data.loss_on=all")]
        except Exception:  # a template that cannot render this conversation: the first records' check says so
            pass
    return []


PROBE_CHAT = [{"role": "user", "content": "Hello?"}, {"role": "assistant", "content": "Hello."}]


def _names_in(folder: Path) -> list[str]:
    try:
        return [p.name for p in folder.iterdir()]
    except OSError:
        return []
