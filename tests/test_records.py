"""Records read by their type (issue 49): text fields are strings or UTF-8 binary, never a value's Python spelling;
prompt/completion records whose prompt and completion are lists of messages are TRL's conversational form; a
tokenizer folder's named chat templates; a file named twice is read once."""
from __future__ import annotations

import json

import pytest

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
    assert check(twice) == []
    assert documents(tokenized(twice)) == once
    from plugins.data.corpus import plan_lines

    assert "data: data.paths names 6 file(s) more than once (overlapping globs, a folder and a file in it, links): " \
        "each is read once" in plan_lines(twice, 1, 1)


@pytest.mark.parametrize("record,words", [
    ({"prompt": [{"role": "user", "content": "Q"}], "completion": "A"},
     "data.prompt_field ('prompt') is a list of messages and data.completion_field ('completion') is a string"),
    ({"prompt": [{"role": "user", "content": "Q"}], "completion": [{"role": "assistant", "content": 7}]},
     "data.completion_field ('completion')'s message 1 has a 'content' that is a number, not text: 7"),
    ({"prompt": {"text": "Q"}, "completion": "A"},
     "the field 'prompt' (data.prompt_field) holds an object, not text: {\"text\": \"Q\"}"),
], ids=["list-and-text", "content-number", "object"])
def test_a_record_of_the_wrong_types_is_refused_before_launch_naming_its_line(tmp_path, hf_tokenizer, record, words):
    _, folder = hf_tokenizer
    good = {"prompt": "Q: 1+1?", "completion": " 2."}
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [good] * 6 + [record] + [good] * 6))
    problems = check(make_cfg(*BASE, f"data.paths=[{tmp_path}/r.jsonl]", "data.format=prompt_completion",
                              f"data.tokenizer=hf:{folder}"))
    assert [p.key for p in problems] == ["data.paths"], problems
    assert f"{tmp_path}/r.jsonl: line 7: " in problems[0].rule and words in problems[0].rule, problems[0].rule


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
