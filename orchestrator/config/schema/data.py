"""What trains: the `data` section (sources, formats, tokenizer, mixtures, chats, packing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from omegaconf import MISSING

from orchestrator.config.schema.keys import (key, MAX_VOCAB, BPE, PROMPT_COMPLETION, CHAT, CHAT_OR_PROMPT,
                                             COMPLETION_ONLY, PREFERENCE, PROMPT_OR_PAIR, UNPAIRED,
                                             WITH_COMPLETION)


FILES = ("data.name", ("text", "stdlib"))  # the sources the tokenize stage reads in pieces of files


@dataclass
class MixSourceConfig:
    paths: List[str] = key([], "this source's files, folders or glob patterns (as data.paths)")
    weight: float = key(1.0, "its share of a batch's rows, relative to the other sources' weights (a row draws its "
                              "source by weight from the seed and step); changing it re-tokenizes nothing", min=0.0)
    text_field: Optional[str] = key(None, "the field or column of its records' text (default: data.text_field)",
                                    read_when=("data.format", ("text",)))


@dataclass
class DataConfig:
    name: str = key(MISSING, "data source: an entry of the data registry (plugins/data: synthetic, stdlib, text; "
                    "packages add theirs through the orchestrator.data entry points)")
    val_fraction: float = key(0.05, "share of documents held out for evaluation", min=0.0001, max=0.5)
    packing: bool = key(True, "concatenate documents (separated by <eos>) instead of padding each one")
    packing_strategy: str = key("auto", "data.packing=true: wrapped (a row is a window of the documents back to back, "
                                        "attending across them: pretraining's way) or bfd (a row holds whole "
                                        "documents, best-fit decreasing; attention stays within a document and "
                                        "positions restart at each, as if each ran alone: fine-tuning's way); auto: "
                                        "bfd for records of prompt_completion or chat, wrapped for text",
                                choices=("auto", "wrapped", "bfd"), read_when=("data.packing", (True,)))
    long_documents: str = key("split", "data.packing_strategy=bfd (auto: for chats and prompt/completion records): a "
                                       "document longer than train.seq_len+1 tokens is split into pieces that "
                                       "overlap by one token (each learned as a document of its own) or refused: "
                                       "before launch where its bytes make it longer whatever the tokenizer (a "
                                       "text file, the first records of a file), else by the tokenize stage, "
                                       "naming its file (and line) (train.seq_len then enters that stage's key)",
                              choices=("split", "refuse"),
                              read_when=[("data.packing", (True,)), ("data.packing_strategy", ("bfd",))])
    balance_ranks: bool = key(True, "data.packing=false: deal each batch's rows (documents padded to "
                                    "train.seq_len) so that every data-parallel rank gets about the same real "
                                    "tokens, and where the layout allows (no pipeline, engine=torch, no "
                                    "compilation) each rank packs its rows' tokens into fewer rows with a document "
                                    "mask, so that it computes about its real tokens; the loss does not change",
                              read_when=("data.packing", (False,)))
    paths: List[str] = key([], "text: files, folders (searched for *.txt, *.md, *.py, *.rst, *.jsonl, *.parquet) or "
                               "glob patterns of UTF-8 text; JSON Lines and Parquet files hold one document per "
                               "record. megatron: the prefixes of Megatron indexed datasets (prefix.bin, prefix.idx)",
                       read_when=("data.name", ("text", "megatron")))
    split: str = key("train", "a Hugging Face datasets folder in data.paths (DatasetDict.save_to_disk's, or a Hub "
                              "snapshot: a dataset card beside data/{split}-*.parquet): the split read, as "
                              "load_from_disk / load_dataset name them (the held-out part is still "
                              "data.val_fraction of it)", read_when=("data.name", ("text",)))
    format: str = key("text", "what a record is: text (one field, every token trained), prompt_completion (a "
                              "prompt and its completion), chat (a list of {role, content} messages, rendered "
                              "with the chat template) or preference (a prompt with a chosen and a rejected "
                              "completion, for an objective of pairs (dpo, simpo, orpo): texts, lists of "
                              "messages, or chosen and rejected alone, their common beginning the prompt: TRL's "
                              "three forms) or unpaired (a prompt, a completion and a label, true where the "
                              "completion is desirable: TRL's unpaired preference records, for kto); records from "
                              "JSON Lines or Parquet; what the model learns: data.loss_on",
                      choices=("text", "prompt_completion", "chat", "preference", "unpaired"))
    bad_records: str = key("refuse", "records (data.format=prompt_completion, chat, preference or unpaired): a "
                                     "record at fault "
                                     "itself (a line that is not JSON, a field missing or of the wrong type, "
                                     "messages that are not messages, a pair with nothing to compare, a "
                                     "conversation the template cannot render) is refused (the check before launch "
                                     "lists every one among the records it reads, the first 20 and their count) or "
                                     "skipped: left out and counted, the first listed in the plan (those read "
                                     "before launch) and in the tokenize stage's log and index",
                           choices=("refuse", "skip"), read_when=CHAT_OR_PROMPT)
    text_field: str = key("text", "text: the field (JSON Lines) or column (Parquet) that holds a record's text",
                          read_when=("data.format", ("text",)))
    prompt_field: str = key("prompt", "data.format=prompt_completion, preference or unpaired: the field that "
                                      "holds a record's prompt (preference: a record without it has an implicit "
                                      "prompt, the beginning its chosen and rejected share)", read_when=PROMPT_OR_PAIR)
    chosen_field: str = key("chosen", "data.format=preference: the field that holds a pair's preferred completion",
                            read_when=PREFERENCE)
    rejected_field: str = key("rejected", "data.format=preference: the field that holds its dispreferred completion",
                              read_when=PREFERENCE)
    completion_field: str = key("completion", "data.format=prompt_completion or unpaired: the field that holds its "
                                              "completion", read_when=WITH_COMPLETION)
    label_field: str = key("label", "data.format=unpaired: the field that holds a record's label: true where its "
                                    "completion is desirable, false where it is not (TRL's unpaired preference "
                                    "records, KTO's)", read_when=UNPAIRED)
    prompt_encoding: str = key("separate", "data.format=prompt_completion with text fields: separate (the prompt "
                                           "and the completion encoded apart, so the prompt's tokens are those "
                                           "inference reads and the completion starts at a token boundary) or "
                                           "joint (encoded as one text, its first len(prompt's ids) tokens not "
                                           "learned: TRL's exact ids and completion_mask; a token may then span the "
                                           "boundary, e.g. 'Answer: ' + 'the' gives ' the' where inference reads "
                                           "' ' and generates 'the')", choices=("separate", "joint"),
                               read_when=PROMPT_COMPLETION)
    messages_field: str = key("messages", "data.format=chat: the field that holds a record's messages",
                              read_when=CHAT)
    tools_field: str = key("tools", "data.format=chat: the field that holds a record's tools (a list of JSON "
                                    "schemas, TRL's `tools`), passed to the chat template as transformers' "
                                    "apply_chat_template(tools=...) passes them; a record without it has none",
                           read_when=CHAT)
    chat_turns: str = key("auto", "data.format=chat, data.loss_on=completion: the training examples a chat makes: all "
                                  "(one, every assistant turn learned), each (one per assistant turn: the "
                                  "conversation up to it as inference renders it, that turn learned), last (the "
                                  "last assistant turn's), or auto (all where the template's renderings of a "
                                  "conversation's beginnings are the start of the whole, else each: reasoning "
                                  "models' templates, Qwen3's and DeepSeek-R1's, drop earlier turns' reasoning)",
                          choices=("auto", "all", "each", "last"), read_when=[CHAT, COMPLETION_ONLY])
    learn_reasoning: bool = key(True, "data.format=chat, data.loss_on=completion: an assistant turn's reasoning "
                                      "(reasoning_content, or the <think> block opening its content) is learned "
                                      "with its answer; false: read, not learned (what follows it is)",
                                read_when=[CHAT, COMPLETION_ONLY])
    chat_template: str = key("", "records rendered as chats (data.format=chat, and prompt/completion records whose "
                                 "prompt and completion are lists of messages): the Jinja template, as transformers' "
                                 "apply_chat_template; a value with Jinja markup ({{ or {%) is the template's text, "
                                 "anything else a file's path. Default: the data.tokenizer=hf: folder's own "
                                 "(chat_template.jinja or tokenizer_config.json's chat_template)",
                             read_when=CHAT_OR_PROMPT)
    chat_template_name: str = key("", "the data.tokenizer=hf: folder's named chat template (tokenizer_config.json's "
                                      "list form, additional_chat_templates/NAME.jinja); default: its default one",
                                  read_when=CHAT_OR_PROMPT)
    loss_on: str = key("completion", "records: the tokens whose labels enter the loss: completion (a completion and "
                                     "the <eos> after it, or the assistant's turns: what {% generation %} tags mark, "
                                     "else what each assistant message adds to the template's rendering after the "
                                     "generation prompt; the others' labels are -100, TRL's completion_only_loss and "
                                     "assistant_only_loss) or all", choices=("completion", "all"),
                       read_when=("data.format", ("prompt_completion", "chat")))
    tokenizer: str = key("auto", "auto (train.init_from=hf:<folder>'s own tokenizer where it ships one, else bytes; "
                                 "the plan says which), bytes (one token per byte, lossless), bpe (a byte-level BPE "
                                 "of data.vocab_size trained on the corpus, saved with the tokens), or hf:<folder> (a "
                                 "Hugging Face tokenizer.json / save_pretrained folder)")
    vocab_size: int = key(2048, "data.tokenizer=bpe: the vocabulary it learns (bytes, <eos>, <pad> and merges); "
                                "model.vocab_size must be at least this", min=259, max=MAX_VOCAB, read_when=BPE)
    max_bytes: int = key(16_000_000, "read the corpus's first this many bytes, in file order, the last file cut at a "
                                     "line start (0: all of it); the plan says how much it leaves out", min=0,
                         read_when=FILES)  # token sources (synthetic, megatron) are read whole
    tasks: Optional[int] = key(None, "processes of the tokenize stage, each taking a contiguous part of the corpus "
                                     "(files, and big files by byte ranges at line starts); the result does not "
                                     "depend on it. Default: the usable cores (local; 1 on debug), one per node of "
                                     "cluster.nodes (slurm); at most one per MiB of corpus", content=False, min=1,
                               read_when=[("cluster.name", ("local", "slurm")), FILES])  # debug: in this process
    bpe_sample_bytes: int = key(1_000_000_000, "data.tokenizer=bpe: it learns from at most this many bytes of the "
                                               "training split, pieces spread evenly over the corpus (streamed)",
                                min=1, read_when=BPE)
    mix: List[MixSourceConfig] = key([], "data=text: several sources mixed by weight (Megatron's blend), e.g. "
                                         "'data.mix=[{paths: [/corpus/web], weight: 0.7}, {paths: [/corpus/code], "
                                         "weight: 0.3}]'; each is tokenized on its own (data.max_bytes each), with "
                                         "one tokenizer; data.paths stays empty. data=megatron: each source its "
                                         "prefixes (Megatron's [0.7, web, 0.3, code])")
    preview: int = key(0, "print the first this many records of each source as the model will see them (tokens "
                          "decoded, the part that enters the loss marked) after the plan, and stop: nothing runs "
                          "(0: the plan shows the first one and the run goes on)", content=False, min=0)
    synthetic_tokens: int = key(1_000_000, "synthetic: length of the random token stream", min=2,
                                read_when=("data.name", ("synthetic",)))
