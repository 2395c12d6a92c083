"""Records read by their type (issue 49): text fields are strings or UTF-8 binary, never a value's Python spelling;
prompt/completion records whose prompt and completion are lists of messages are TRL's conversational form; a
tokenizer folder's named chat templates; a file named twice is read once."""
from __future__ import annotations

import json

import pytest

from common.problem import InputFault
from plugins.data.corpus import tokenized
from plugins.data.rules import check
from tests.conftest import make_cfg
from tests.test_chat import CHATML, hf_tokenizer  # noqa: F401 (a fixture: a tokenizer folder with a ChatML template)

BASE = ["data=text", "data.packing=false", "train.seq_len=64", "train.batch_size=2", "data.val_fraction=0.2"]


def documents(corpus) -> list[tuple[list[int], list[int]]]:
    masks = (corpus.train_mask or [None] * len(corpus.train)) + (corpus.val_mask or [None] * len(corpus.val))
    return sorted((ids.tolist(), None if m is None else m.astype(int).tolist())
                  for ids, m in zip(corpus.train + corpus.val, masks))


def test_conversational_prompt_completion_gives_trls_ids_and_completion_mask(tmp_path, hf_tokenizer):
    """TRL's SFT on {prompt: [messages], completion: [messages]}: the prompt rendered with the generation prompt,
    the prompt and completion rendered together, the tokens after the prompt's learned. The ChatML template ends the
    assistant's turn with the tokenizer's eos (<|im_end|>): nothing is appended."""
    hf, folder = hf_tokenizer
    rows = [{"prompt": [{"role": "user", "content": f"Add {a} and {a + 1}."}],
             "completion": [{"role": "assistant", "content": f"{2 * a + 1}."}]} for a in range(40)]
    rows[3]["prompt"].insert(0, {"role": "system", "content": "You answer briefly."})
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = []
    for r in rows:  # trl.SFTTrainer's tokenize for conversational prompt-completion records
        prompt_ids = hf.apply_chat_template(r["prompt"], tokenize=True, add_generation_prompt=True,
                                            return_dict=True)["input_ids"]
        ids = list(hf.apply_chat_template(r["prompt"] + r["completion"], tokenize=True, return_dict=True)["input_ids"])
        assert ids[:len(prompt_ids)] == list(prompt_ids)
        expected.append((ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))))
    cfg = make_cfg(*BASE, f"data.paths=[{tmp_path}/pc.jsonl]", "data.format=prompt_completion",
                   f"data.tokenizer=hf:{folder}", runs_dir=tmp_path)
    assert check(cfg) == []
    assert documents(tokenized(cfg)) == sorted(expected)


def test_a_binary_column_is_read_as_its_utf8_text_and_other_types_are_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"record {i}: naïve café " * 3 for i in range(30)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "strings.parquet")
    pq.write_table(pa.table({"text": pa.array([t.encode() for t in texts], pa.binary())}), tmp_path / "binary.parquet")
    pq.write_table(pa.table({"text": pa.array([t.encode() for t in texts[:5]] + [b"\xff\xfe bad"], pa.binary())}),
                   tmp_path / "latin.parquet")
    pq.write_table(pa.table({"text": [[1, 2]] * 3}), tmp_path / "lists.parquet")

    def cfg(name):
        return make_cfg(*BASE, f"data.paths=[{tmp_path}/{name}.parquet]", runs_dir=tmp_path)

    assert documents(tokenized(cfg("binary"))) == documents(tokenized(cfg("strings")))
    for name, words in (("latin", "row 5: the field 'text' (data.text_field) is binary and not UTF-8 text (byte 0: "
                                  "0xff)"),
                        ("lists", "row 0: the field 'text' (data.text_field) holds a list, not text: [1, 2]")):
        problems = [p for p in check(cfg(name)) if p.key != "train.eval_batches"]  # 3 rows: a small held-out split
        assert [p.key for p in problems] == ["data.paths"] and words in problems[0].rule, problems


def test_a_folders_named_chat_templates_are_read_as_transformers_reads_them(tmp_path, hf_tokenizer):
    """chat_template.jinja (what transformers writes now) is the default; additional_chat_templates/NAME.jinja are
    picked by data.chat_template_name; a name the folder lacks is refused listing the names it has."""
    import shutil

    from plugins.data.tokenizer import chat_template

    _, saved = hf_tokenizer
    folder = tmp_path / "tok"
    shutil.copytree(saved, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(CHATML)
    (folder / "additional_chat_templates").mkdir()
    (folder / "additional_chat_templates" / "plain.jinja").write_text(
        "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    args = ["data=text", "data.format=chat", f"data.tokenizer=hf:{folder}"]
    assert chat_template(make_cfg(*args).data) == CHATML
    assert chat_template(make_cfg(*args, "data.chat_template_name=plain").data).startswith("{% for m in messages %}")
    (tmp_path / "chats.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"},
                                                                   {"role": "assistant", "content": "Hello"}]}) + "\n")
    problems = check(make_cfg(*args, f"data.paths=[{tmp_path}/chats.jsonl]", "data.chat_template_name=tools"))
    problems = [p for p in problems if p.key.startswith("data.")]  # a corpus of one record is too small, too
    assert [p.key for p in problems] == ["data.chat_template_name"]
    assert "has no chat template of this name (it has: default, plain)" in problems[0].rule
    (folder / "chat_template.jinja").unlink()  # named templates only: the refusal names them
    problems = [p for p in check(make_cfg(*args, f"data.paths=[{tmp_path}/chats.jsonl]")) if p.key.startswith("data.")]
    assert [p.key for p in problems] == ["data.chat_template_name"] and "only named ones: plain" in problems[0].rule


def test_a_file_named_twice_is_read_once(tmp_path):
    """Overlapping globs, a folder and a file inside it, a link to a file: each file is read once."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"part{i}.txt").write_text(f"document {i} " * 400 + "\n")
    (tmp_path / "link.txt").symlink_to(corpus / "part0.txt")
    once = documents(tokenized(make_cfg(*BASE, f"data.paths=[{corpus}]", runs_dir=tmp_path)))
    twice = make_cfg(*BASE, f"data.paths=[{corpus}/*.txt,{corpus}/*0.txt,{corpus},{tmp_path}/link.txt]",
                     runs_dir=tmp_path)
    checked = check(twice)
    assert checked == []
    assert documents(tokenized(twice)) == once
    from plugins.data.tokenize_cost import plan_lines

    assert "data: data.paths names 6 file(s) more than once (overlapping globs, a folder and a file in it, links): " \
        "each is read once" in plan_lines(twice, checked.facts, 1, 1)


@pytest.mark.parametrize("record,words", [
    ({"prompt": [{"role": "user", "content": "Q"}], "completion": "A"},
     "data.prompt_field ('prompt') is a list of messages and data.completion_field ('completion') is a string"),
    ({"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": 7}]},
     "data.completion_field ('completion')'s message 1 has a 'content' that is a number, not text: 7"),
    ({"prompt": {"text": "Q"}, "completion": "A"},
     "the field 'prompt' (data.prompt_field) holds an object, not text: {\"text\": \"Q\"}"),
    ({"prompt": [{"role": "human", "content": "Q"}], "completion": [{"role": "assistant", "content": "A"}]},
     "a message's role 'human' is neither one of"),  # the template's rendering: a bad record as the others are
], ids=["list-and-text", "content-number", "object", "role"])
def test_a_record_of_the_wrong_types_is_refused_before_launch_naming_its_line(tmp_path, hf_tokenizer, record, words):
    _, folder = hf_tokenizer
    good = {"prompt": "Q: 1+1?", "completion": " 2."}
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [good] * 6 + [record] + [good] * 6))
    problems = check(make_cfg(*BASE, f"data.paths=[{tmp_path}/r.jsonl]", "data.format=prompt_completion",
                              f"data.tokenizer=hf:{folder}"))
    assert [p.key for p in problems] == ["data.paths"], problems
    assert f"{tmp_path}/r.jsonl: line 7: " in problems[0].rule and words in problems[0].rule, problems[0].rule


PAIR = {"prompt": "2+3=", "chosen": "5", "rejected": "6"}
BAD_PAIRS = [  # (a bad record, the words its own line must say)
    ({**PAIR, "rejected": "5"}, "the pair's chosen and rejected completions are the same"),
    ({"chosen": "The answer is 5", "rejected": "The answer is 5"}, "the pair's chosen and rejected completions are "
     "the same"),  # an implicit prompt: once said as "the chosen completion is empty"
    ({"chosen": "5", "rejected": "5 or 6"}, "the pair's chosen completion (data.chosen_field='chosen') is the "
     "beginning of its rejected one"),
    ({**PAIR, "chosen": 5}, "the field 'chosen' (data.chosen_field) holds a number, not text: 5"),
    ({"prompt": "2+3=", "chosen": "5"}, "has no field 'rejected' (its fields: prompt, chosen)"),
    ("{not json", "is not JSON"),
    ({**PAIR, "rejected": ""}, "the pair's rejected completion (data.rejected_field='rejected') is empty"),
]


def _pairs_file(path, bad_every: int = 3, n: int = 90):
    """n lines, one in `bad_every` bad (BAD_PAIRS in turn): returns {line: the words it must be listed with}."""
    lines, said = [], {}
    for i in range(1, n + 1):
        record, words = BAD_PAIRS[(i // bad_every) % len(BAD_PAIRS)] if i % bad_every == 0 else (PAIR, None)
        lines.append(record if isinstance(record, str) else json.dumps(record))
        if words:
            said[i] = words
    path.write_text("\n".join(lines) + "\n")
    return said


def test_bad_records_are_listed_all_at_once_or_skipped_with_their_count(tmp_path, monkeypatch):
    """data.bad_records=refuse (the default): one refusal lists every bad record read before launch, up to 20, with
    their count, each with its own fault; skip (the refusal's fix) passes, and the plan, the tokenize stage's index
    and its log line name them; past the records read before launch, the stage refuses the first, offering skip."""
    from orchestrator.dag import stage_key
    from plugins.data.bad_records import BadRecords, stage_line
    from plugins.data.corpus import tokenize_into
    from plugins.data.tokenize_cost import plan_lines
    from stages.tokenize import STAGE

    said = _pairs_file(tmp_path / "pairs.jsonl")
    base = [*BASE, f"data.paths=[{tmp_path}/pairs.jsonl]", "data.format=preference", "train.seq_len=256"]
    (refusal,) = check(make_cfg(*base))
    assert refusal.key == "data.paths" and refusal.rule.startswith(f"{len(said)} bad record(s) among the 90 read")
    listed = refusal.rule.split("\n")[1:]
    assert len(listed) == 21 and listed[-1].strip() == f"... and {len(said) - 20} more", listed
    for line, (number, words) in zip(listed[:20], said.items()):
        assert f"pairs.jsonl: line {number}" in line and words in line, (number, line)
    assert "is empty" not in " ".join(listed[:3])  # each its own fault: the implicit prompt's took none
    assert refusal.fix.endswith("or data.bad_records=skip (each left out and counted, the first 20 listed in the "
                                "plan and in the tokenize stage's log)")

    skip = make_cfg(*base, "data.bad_records=skip", runs_dir=tmp_path)
    checked = check(skip)  # the plan's line names what the check read: the records are not read again
    assert checked == []
    (line,) = [x for x in plan_lines(skip, checked.facts, 1, 1) if "bad_records" in x]
    assert line.startswith(f"warning: data.bad_records=skip: {len(said)} bad record(s) among the 90 read") and \
        "pairs.jsonl: line 3: the pair's chosen and rejected completions are the same" in line
    index = tokenize_into(skip, tmp_path / "skipped")
    assert index["train"]["documents"] + index["val"]["documents"] == 2 * (90 - len(said))
    left = BadRecords.of(index)
    assert left.count == len(said) and len(left.first) == 20 and "line 3:" in left.first[0]
    assert stage_line(left).startswith(f"warning: data.bad_records=skip: {len(said)} bad record(s) left out:")
    assert stage_key(skip, STAGE, {})[0] != stage_key(make_cfg(*base, runs_dir=tmp_path), STAGE, {})[0]

    monkeypatch.setattr("plugins.data.first_records.SCANNED_RECORDS", 2)  # the bad ones past what is read before launch
    refuse = make_cfg(*base, runs_dir=tmp_path)
    assert check(refuse) == []
    with pytest.raises(InputFault, match=r"pairs\.jsonl: line 3: .* or data\.bad_records=skip \(each bad record"):
        tokenize_into(refuse, tmp_path / "refused")


def test_a_set_whose_every_record_read_is_bad_is_not_offered_the_skip(tmp_path):
    (tmp_path / "pairs.jsonl").write_text((json.dumps({**PAIR, "rejected": "5"}) + "\n") * 3)
    for skip in ([], ["data.bad_records=skip"]):
        (refusal,) = check(make_cfg(*BASE, f"data.paths=[{tmp_path}/pairs.jsonl]", "data.format=preference", *skip))
        assert refusal.rule.startswith("every one of the 3 record(s) read before launch (the first of each file) is "
                                       "bad, so data.bad_records=skip would leave none") and "skip" not in refusal.fix


# -- datasets folders, compared with what `datasets` itself reads ----------------------------------------------

@pytest.fixture(scope="module")
def llama_like(tmp_path_factory):
    """A tokenizer folder whose post-processor puts <s> before every text, as Llama's do (eos </s>)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = ["Answer: the water is wet.", "Q: what colour is the sky? A: blue, mostly."] * 30
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    folder = tmp_path_factory.mktemp("llama_like")
    hf.save_pretrained(folder)
    return hf, folder


PAIRS = [("Answer: ", "the water"), ("Q: what colour is the sky? A:", " blue, mostly.</s>"), ("Q: 2+2?", " 4.")]


@pytest.mark.parametrize("encoding", ["separate", "joint"])
def test_prompt_completion_ids_are_as_at_inference_with_one_eos(tmp_path, llama_like, encoding):
    """<bos> as the tokenizer's post-processor adds it; a completion that ends with the eos text gets no second one.
    joint: TRL's ids and completion_mask (its add_eos, then tokenizer(prompt) and tokenizer(prompt + completion));
    separate: the prompt and completion encoded apart ('Answer: ' + 'the' is ' ' 't' 'he', not ' the')."""
    hf, folder = llama_like
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in PAIRS * 4))
    expected = []
    for prompt, completion in PAIRS * 4:
        if encoding == "joint":
            completion = completion if completion.endswith(hf.eos_token) else completion + hf.eos_token
            prompt_ids, ids = hf(prompt)["input_ids"], hf(prompt + completion)["input_ids"]
        else:
            prompt_ids = [hf.bos_token_id] + hf(prompt, add_special_tokens=False)["input_ids"]
            ids = prompt_ids + hf(completion.removesuffix("</s>"), add_special_tokens=False)["input_ids"] + [
                hf.eos_token_id]
        expected.append((ids, [0] * len(prompt_ids) + [1] * (len(ids) - len(prompt_ids))))
        assert ids[0] == hf.bos_token_id and ids.count(hf.eos_token_id) == 1
    cfg = make_cfg(*BASE, f"data.paths=[{tmp_path}/pc.jsonl]", "data.format=prompt_completion",
                   f"data.tokenizer=hf:{folder}", f"data.prompt_encoding={encoding}", runs_dir=tmp_path)
    assert documents(tokenized(cfg)) == sorted(expected)
    assert ("Ġthe" in hf.convert_ids_to_tokens(expected[0][0])) == (encoding == "joint")  # the boundary's token


def test_text_documents_start_with_bos_once(tmp_path, llama_like):
    """Records and text files: <bos> before each document's start (not before a file's later pieces), one <eos>."""
    hf, folder = llama_like
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in
                                                 ["the water is wet.", "blue, mostly.</s>"] * 5))
    cfg = make_cfg(*BASE, f"data.paths=[{tmp_path}/docs.jsonl]", f"data.tokenizer=hf:{folder}", runs_dir=tmp_path)
    for ids, _ in documents(tokenized(cfg)):
        assert ids == hf((hf.decode(ids[1:-1]) + "</s>"))["input_ids"] and ids.count(hf.eos_token_id) == 1


# -- what trains, shown before it trains ---------------------------------------------------------------------

def test_the_plan_shows_a_chats_learned_part_and_data_preview_stops_before_anything_runs(tmp_path):
    """Qwen 2.5's template as it ships (no generation tags), the bytes tokenizer: the first record shown with the
    assistant's turn between the marks (a pipe, not a terminal), its counts; data.preview=2 shows two and starts
    nothing (no stage folder, no cache entry)."""
    from tests.conftest import run_cli
    from tests.test_chat import TEMPLATES

    chats = [[{"role": "user", "content": f"What is {a} + 1?"}, {"role": "assistant", "content": f"{a + 1}."}]
             for a in range(60)]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    args = ["data=chat", f"data.paths=[{tmp_path}/chats.jsonl]", f"data.chat_template={TEMPLATES}/qwen2.5.jinja",
            "train.seq_len=128", "train.eval_batches=1", "tracking=none"]
    done = run_cli(args + ["data.preview=2"], cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    assert f"data: {tmp_path}/chats.jsonl: line 1 as the model sees it, 14 of 176 tokens learned (between ⟦ and ⟧):" \
        in out, out
    assert "<|im_start|>assistant\n    ⟦1.<|im_end|>\n    <eos>⟧" in out and "line 2 as the model sees it" in out
    assert "line 3 as the model sees it" not in out and "data.preview=2: nothing was started" in out
    assert not (tmp_path / "runs" / "cache").exists() or not any((tmp_path / "runs" / "cache").glob("tokenize*"))
    assert "\x1b[" not in out and "measured now" not in out  # no terminal codes in a pipe; nothing measured


def test_a_one_line_text_file_holds_out_its_tail_by_position(tmp_path):
    """One document of 60,000 words on one line: no line start to cut at, so the held-out part is its last
    data.val_fraction by position (at a character's start), not an empty split that fails in the train stage."""
    words = " ".join(("alpha", "beta", "délta", "ε")[i % 4] for i in range(60_000))
    (tmp_path / "one.txt").write_text(words)
    cfg = make_cfg("data=text", f"data.paths=[{tmp_path}/one.txt]", "data.max_bytes=0", runs_dir=tmp_path)
    assert check(cfg) == []
    corpus = tokenized(cfg)
    train, val = (b"".join(bytes(d[d < 256].tolist()) for d in docs) for docs in (corpus.train, corpus.val))
    assert train + val == words.encode() and abs(len(val) / len(words.encode()) - 0.05) < 1e-3
    val.decode("utf-8")  # cut at a character's first byte


def test_the_preview_marks_a_completion_and_shows_text_whole_in_plain_text(tmp_path):
    """prompt/completion: the completion and its <eos> between the marks, or styled (no marks) for a terminal; text:
    every token learned, no marks; a long document cut to its two ends."""
    from plugins.data.preview import preview

    (tmp_path / "pc.jsonl").write_text("".join(json.dumps({"prompt": f"Q: {i}+1?\nA:", "completion": f" {i + 1}."})
                                               + "\n" for i in range(20)))
    cfg = make_cfg(*BASE, f"data.paths=[{tmp_path}/pc.jsonl]", "data.format=prompt_completion", runs_dir=tmp_path)
    head, body = preview(cfg, 1, styled=False)
    assert head.plain == f"data: {tmp_path}/pc.jsonl: line 1 as the model sees it, 4 of 14 tokens learned (between ⟦ " \
                         "and ⟧):"
    assert body.plain == "    Q: 0+1?\n    A:⟦ 1.<eos>⟧"
    _, styled = preview(cfg, 1, styled=True)
    assert styled.plain == "    Q: 0+1?\n    A: 1.<eos>"
    assert styled.spans and styled.spans[0].start == len("    Q: 0+1?\n    A:")
    (tmp_path / "long.txt").write_text("word " * 2000)
    head, body = preview(make_cfg(*BASE, f"data.paths=[{tmp_path}/long.txt]", runs_dir=tmp_path), 1, styled=False,
                         chars=40)
    assert "all " in head.plain and "⟦" not in body.plain and " … (" in body.plain and len(body.plain) < 200
