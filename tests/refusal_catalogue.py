"""The catalogue of bad inputs (tests/test_bad_inputs.py checks each is refused with the key, the value, the rule and
a fix) and the files its cases read: `write_corpus` makes them in a folder that `{tmp}` names in the cases."""
from __future__ import annotations

import json
import os
import tarfile
from pathlib import Path

import numpy as np

from plugins.data.indexed_dataset import write_index
from tests.user_task_files import user_tasks

# (overrides, the key named, words of the rule or fix); {tmp} is a folder holding the files made by `corpus` below
CATALOGUE = [
    # types, names and options (Hydra's composition errors, in config terms)
    (["parallel.dp=abc"], "parallel.dp", "must be an integer"),
    (["dry_run=maybe"], "dry_run", "true or false"),
    (["model=nonexistent"], "model", "not an option of the config group 'model'"),
    (["precision=fp8"], "precision", "not an option of the config group 'precision'"),
    (["model=model_schema"], "model", "the schema of the model options, not an option"),
    (["+parallel.foo=1"], "parallel.foo", "has no key 'foo'"),
    (["+foo=1"], "foo", "has no key 'foo'"),
    (["+model.n_head=2"], "model.n_head", "did you mean model.n_heads?"),
    (["precision.name=fp8"], "precision.name", "one of auto, fp32, bf16, fp16"),
    (["sweep.objective=speed"], "sweep.objective", "one of eval_loss, loss, tokens_per_s, peak_memory, "
     "eval_reward_accuracy, eval_reward_margin, or <task>/"),
    (["sweep.objective=eval_reward_accuracy"], "sweep.objective", "objective=sft has none"),
    (["optimizer.name=lion"], "optimizer.name", "the optimizers there are: adamw, sgd"),
    (["trian.steps=4"], "trian.steps", "did you mean train?"),
    (["cluster.partition=gpu"], "cluster.partition", "is a key of cluster=slurm"),
    (["train.steps=4,8"], "train.steps", "-m train.steps=4,8"),
    # values that cannot be read, and config groups given something else than one option
    (["train.steps=${nope.key}"], "train.steps", "not a key of the config"),
    (["train.steps=${train.steps}"], "train.steps", "refers to itself"),
    (["data.max_bytes=${oc.env:ORCHESTRATOR_UNSET_VARIABLE}"], "data.max_bytes", "which is not set"),
    (["train.seq_len=${nope:1}"], "train.seq_len", "a resolver that does not exist"),
    (["~model"], "model", "a config group every experiment needs"),
    (["model=[gpt_tiny,llama_tiny]"], "model", "a list merges its options"),
    (["cluster=slurm", "cluster.setup=[[1]]"], "cluster.setup", "single values, not lists"),
    # overrides Hydra's grammar cannot read
    (["train.steps=４"], "train.steps", "type it in ASCII: train.steps=4"),
    (["optimizer.betas=[0.9,0.95"], "optimizer.betas", "close the list: optimizer.betas=[0.9,0.95]"),
    (["train.init_from=/runs/my run (1)/step_0000100"], "train.init_from",
     "quote the value (Hydra reads spaces, parentheses"),
    (["optimizer.betas=0.9"], "optimizer.betas", "optimizer.betas=[0.9,0.95]"),
    # ranges and choices
    (["train.steps=0"], "train.steps", "without it they would be a random initialisation"),
    (["model.dropout=1.5"], "model.dropout", "between 0.0 and 0.95"),
    (["memory.level=4"], "memory.level", "one of 0, 1, 2, 3"),
    (["engine.opset=18"], "engine.opset", "between 14 and 17"),
    (["parallel.dp_mode=foo"], "parallel.dp_mode", "one of replicate, shard"),
    (["parallel.pp_schedule=foo"], "parallel.pp_schedule", "one of gpipe"),
    (["precision=fp16", "precision.init_scale=0.5"], "precision.init_scale", "between 1.0 and 4294967296"),
    (["precision=fp16", "precision.init_scale=1e300"], "precision.init_scale", "between 1.0 and 4294967296"),
    (["precision=fp16", "precision.growth_interval=0"], "precision.growth_interval", ">= 1"),
    (["cache_verify=maybe"], "cache_verify", "one of hash, full, size"),
    (["aggregate.shard_size_mb=0"], "aggregate.shard_size_mb", ">= 0.001"),
    (["aggregate.onnx_external_data_mb=4096"], "aggregate.onnx_external_data_mb", "between 0.0 and 2000"),
    (["aggregate.onnx=maybe"], "aggregate.onnx", "aggregate.onnx"),
    (["train.nonfinite=ignore"], "train.nonfinite", "one of stop, skip"),
    (["cluster.heartbeat_timeout_s=1"], "cluster.heartbeat_timeout_s", "between 5 and"),
    (["cluster.start_method=spawn"], "cluster.start_method", "one of forkserver, exec"),
    (["optimizer.weight_decay=-1"], "optimizer.weight_decay", ">= 0.0"),
    (["parallel.hp=0"], "parallel.hp", "between 1 and 65536"),
    (["parallel.microbatches=0"], "parallel.microbatches", "between 1 and"),
    (["model.n_heads=0"], "model.n_heads", "between 1 and"),
    (["cluster=slurm", "cluster.nodes=0"], "cluster.nodes", ">= 1"),
    (["tune=layout", "tune.pp_schedules=[1f1b,zb]"], "tune.pp_schedules", "must be a list of gpipe, 1f1b"),
    (["tune=layout", "tune.microbatches_per_stage=[2,0]"], "tune.microbatches_per_stage", "tune.microbatches_per_stage=[2]"),
    (["tune=layout", "tune.world_size=0"], "tune.world_size", ">= 1"),
    (["tune=layout", "tune.objective=speed"], "tune.objective", "one of tokens_per_s, memory"),
    (["plan.calibrate_steps=2"], "plan.calibrate_steps", "first 3 steps of a run are warm-up"),
    (["cluster=slurm", "plan.calibrate_steps=8"], "plan.calibrate_steps", "the cluster's nodes"),
    (["train.steps=99999999999999999999"], "train.steps", "between 0 and 1000000000"),
    (["train.seed=-1"], "train.seed", "between 0 and 4294967295"),
    # numbers that are not numbers
    (["optimizer.lr=nan"], "optimizer.lr", "finite number"),
    (["optimizer.lr=inf"], "optimizer.lr", "finite number"),
    (["train.grad_clip=-inf"], "train.grad_clip", "finite number"),
    (["optimizer.betas=[0.9,nan]"], "optimizer.betas", "finite number"),
    (["optimizer.betas=[0.9,1.5]"], "optimizer.betas", "in [0, 1)"),
    # the layout
    (["parallel.hp=3"], "parallel.hp", "not divisible by parallel.hp=3"),
    (["model.n_heads=5"], "model.n_heads", "divisible"),
    (["model.vocab_size=259", "parallel=megatron_hp2"], "parallel.hp", "pad the vocabulary"),
    (["model=llama_tiny", "model.n_kv_heads=3"], "model.n_kv_heads", "must be divisible by it"),
    (["model=llama_tiny", "model.rope_scaling=llama3", "model.rope_high_freq_factor=1"],
     "model.rope_high_freq_factor", "must exceed model.rope_low_freq_factor=1.0"),
    (["model=llama_tiny", "model.rope_factor=32"], "model.rope_factor", "model.rope_scaling=llama3 for it to apply"),
    (["model=llama_tiny", "model.n_kv_heads=1", "parallel=megatron_hp2"], "parallel.hp",
     "model.n_kv_heads=1 not divisible by parallel.hp=2"),
    (["cluster.nprocs=3"], "cluster.nprocs", "one process per rank"),
    (["cluster.device=h100", "dry_run=true"], "cluster.device", "a device the plan knows (h100_80gb"),
    (["cluster.device=h100_80gb"], "cluster.device", "a declared device is for the plan of a run elsewhere"),
    (["parallel=pipeline_pp4_interleaved", "model.n_layers=12"], "parallel.pp_chunks", "pipeline stages"),
    (["parallel=pipeline_pp2", "parallel.microbatches=1"], "parallel.microbatches", "at least 2 microbatches"),
    (["parallel.pp=2", "parallel.microbatches=2", "parallel.pp_schedule=interleaved_1f1b"], "parallel.pp_chunks",
     "pp_chunks >= 2"),
    (["parallel.pp=4", "parallel.pp_chunks=2", "parallel.microbatches=2", "parallel.pp_schedule=zbv"],
     "parallel.microbatches", "at least 4 microbatches"),
    (["parallel.pp_chunks=2"], "parallel.pp_chunks", "need a pipeline"),
    (["parallel.pp=2", "parallel.pp_chunks=1", "parallel.microbatches=2", "parallel.pp_schedule=zbv"],
     "parallel.pp_chunks", "pp_chunks == 2"),
    (["parallel.pp=2", "parallel.pp_chunks=2", "parallel.microbatches=2", "parallel.pp_schedule=1f1b"],
     "parallel.pp_chunks", "pp_chunks == 1"),
    (["parallel=pipeline_pp4_interleaved", "parallel.microbatches=9", "train.batch_size=18"],
     "parallel.microbatches", "not a multiple of its 2 rounds"),
    (["parallel.microbatches=3"], "train.batch_size", "divisible by 3"),
    (["parallel=ddp2", "train.batch_size=15"], "train.batch_size", "divisible by 2"),
    (["parallel.sequence_parallel=true"], "parallel.sequence_parallel", "parallel.hp > 1"),
    (["parallel=megatron_hp2", "parallel.sequence_parallel=true", "train.seq_len=63"], "train.seq_len", "split"),
    (["parallel.loss_parallel=true"], "parallel.loss_parallel", "parallel.hp > 1"),
    (["cluster=debug", "parallel=ddp2"], "cluster", "inside this process"),
    (["cluster=slurm", "+cluster.time_min.eval=5"], "cluster.time_min.eval", "per stage"),
    # sizes bounded by what they act on
    (["model.n_layers=2147483648"], "model.n_layers", "between 1 and 4096"),
    (["export.sample_batch=100000000000"], "export.sample_batch", "example sequences"),
    (["data=synthetic", "data.synthetic_tokens=1000000000000000"], "data.synthetic_tokens", "drawn in memory"),
    # keys that would do nothing in this config (refused: docs/reliability.md)
    (["parallel.pp_schedule=gpipe"], "parallel.pp_schedule", "there is no pipeline"),
    (["data.text_field=body"], "data.text_field", "has no fields"),
    (["triton.mode=max-autotune"], "triton.mode", "read only when triton.enabled=true"),
    (["precision=bf16", "precision.init_scale=1024"], "precision.init_scale", "read only when precision.name=fp16"),
    (["data.synthetic_tokens=5000"], "data.synthetic_tokens", "data=synthetic for it to apply"),
    (["cluster.threads_per_rank=1000000000000000"], "cluster.threads_per_rank", "between 1 and 4096"),
    # a stage's preconditions, checked with the plan
    (["transform.passes=[layernorm_stat_outputs]"], "transform.passes", "did you mean layernorm_stats_outputs?"),
    (["export.verify_atol=0"], "export.verify_atol", "agree to the last bit"),
    (["model=llama_tiny", "model.d_model=60", "model.n_heads=4"], "model.n_heads", "must be even"),
    (["train.init_from=hf:{tmp}/gpt_vocab259"], "train.init_from", "holds no *.safetensors weights"),
    (["train.init_from=hf:{tmp}/gpt_inverse_idx"], "train.init_from", "scale_attn_by_inverse_layer_idx=true"),
    # model and training
    (["train.seq_len=256"], "train.seq_len", "model.max_seq_len=128"),
    (["model.vocab_size=200"], "model.vocab_size", "token ids up to 257"),
    (["export.sample_seq=1000"], "export.sample_seq", "model.max_seq_len=128"),
    (["model.d_model=65536", "model.n_layers=64"], "parallel", "exceeds the"),
    (["train.init_from=/nonexistent"], "train.init_from", "complete checkpoint folder"),
    (["train.profile=[5,3]"], "train.profile", "1 <= first <= last"),
    (["train.init_from=hf:/nonexistent"], "train.init_from", "is not a folder"),
    # the evaluate stage's tasks (lm-evaluation-harness)
    (["evaluate.tasks=[arith_mcq]"], "evaluate.tasks", "no such task"),
    (["sweep.objective=arith_mc/acc"], "sweep.objective", "arith_mc is not scored"),
    (["evaluate.tasks=[arith_mc]", "sweep.objective=arith_mc/f1"], "sweep.objective",
     "the task arith_mc produces acc, acc_norm"),
    (["evaluate.tasks=[arith_mc]", "evaluate.include_path={tmp}/a_file"], "evaluate.include_path", "not a folder"),
    (["evaluate.tasks=[arith_mc]", "evaluate.include_path={tmp}/broken_tasks"], "evaluate.include_path",
     "does not parse as YAML"),
    (["evaluate.tasks=[arith_chat]", "evaluate.apply_chat_template=true"], "evaluate.apply_chat_template",
     "has no chat template"),
    (["evaluate.tasks=[arith_mc]", "evaluate.onnx=true", "aggregate.onnx=false"], "evaluate.onnx",
     "writes no ONNX model"),
    (["evaluate.tasks=[val_perplexity]", "data.name=synthetic"], "evaluate.tasks", "lm-eval scores text"),
    # the user's task files, loaded by lm-eval's own task loading before launch
    (["evaluate.tasks=[my_metric]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.tasks",
     "metric 'acuracy' is not one of lm-eval's"),
    (["evaluate.tasks=[my_otype]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.tasks",
     "invalid output_type 'multiple_chose'"),
    (["evaluate.tasks=[my_jinja]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.tasks", "TemplateSyntaxError"),
    (["evaluate.tasks=[my_nodata]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.tasks", "Unable to find"),
    (["evaluate.tasks=[my_split]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.tasks", "KeyError"),
    (["evaluate.tasks=[my_helper]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.tasks",
     "Cannot import module 'missing_utils'"),
    (["evaluate.tasks=[my_hub]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.tasks",
     "the Hub cannot be reached"),
    (["evaluate.tasks=[my_nofiles]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.tasks",
     "names no files"),
    (["evaluate.tasks=[arith_mc]", "evaluate.num_fewshot=32"], "evaluate.num_fewshot",
     "lm-eval would cut 305 tokens from the left of such prompts"),
    (["evaluate.tasks=[arith_mc]", "evaluate.include_path={tmp}/user_tasks"], "evaluate.include_path",
     "is defined twice"),
    # evaluate keys that would do nothing
    (["evaluate.num_fewshot=3"], "evaluate.num_fewshot", "read only when evaluate.tasks is given"),
    (["evaluate.include_path={tmp}/user_tasks"], "evaluate.include_path", "read only when evaluate.tasks is given"),
    (["evaluate.tasks=[arith_mc]", "evaluate.prompts=[Hello]", "evaluate.generations=2"], "evaluate.generations",
     "read only when evaluate.prompts is empty"),
    (["evaluate.tasks=[val_perplexity]", "evaluate.num_fewshot=2"], "evaluate.num_fewshot",
     "takes few-shot examples"),
    (["evaluate.tasks=[arith_gen]", "evaluate.onnx=true"], "evaluate.onnx", "scores loglikelihood tasks only"),
    (["train.init_from=hf:{tmp}/no_text"], "train.init_from", "holds no config.json"),
    (["train.init_from=hf:{tmp}/sparse_tokenizer", "data.tokenizer=bytes"], "data.tokenizer",
     "ships its own tokenizer (4 tokens), and data.tokenizer=bytes (258 tokens) gives"),
    # LoRA (peft=lora)
    (["peft=lora"], "train.init_from", "the base must be named"),
    (["peft=lora", "peft.targets=[wz]"], "peft.targets", "has no Linear of that name"),
    (["peft=lora", "peft.rank=100"], "peft.rank", "no longer low-rank"),
    (["peft=lora", "peft.alpha=0"], "peft.alpha", "the run would train nothing"),
    (["peft=lora", "peft.trainable=[lm_hed.weight]"], "peft.trainable", "has no parameter of that name"),
    (["train.init_from=hf:{tmp}/gpt_vocab259", "model.vocab_size=259", "parallel=megatron_hp2"], "parallel.hp",
     "model.pad_vocab_to=128"),
    # engine and precision
    (["engine.name=onnx"], "engine.name", "no engine of that name is registered"),
    (["engine=ort", "triton=on"], "triton.enabled", "need a CUDA GPU"),
    (["triton.attention=flex"], "triton.attention", "no backward on a CPU"),
    (["engine=ort", "parallel=megatron_hp2", "parallel.sequence_parallel=true"], "parallel.sequence_parallel",
     "runs each unit"),
    (["engine=ort", "precision=bf16"], "precision.name", "fp32 ONNX graph"),
    (["engine=ort", "precision=fp16"], "precision.name", "no mixed precision"),
    (["engine=ort", "data.packing_strategy=bfd"], "data.packing_strategy", "document mask"),
    (["engine=ort", "memory=level3"], "memory.level", "never show it"),
    (["engine=ort", "plan.trace=true"], "plan.trace", "graphs do not take"),
    # data
    (["data=text"], "data.paths", "needs files"),
    (["data=text", "data.paths=[/nonexistent/corpus.txt]"], "data.paths", "does not exist"),
    (["data=text", "data.paths=[{tmp}/random.bin]"], "data.paths", "binary"),
    (["data=megatron"], "data.paths", "reads the prefixes of Megatron indexed datasets"),
    (["data=synthetic", "data.max_bytes=1000"], "data.max_bytes", "read only when data.name=text or stdlib"),
    (["data=text", "data.paths=[{tmp}/web_text_document]"], "data.paths", "names a Megatron indexed dataset"),
    (["data=megatron", "data.paths=[{tmp}/random]"], "data.paths", "random.idx does not exist"),
    (["data=megatron", "data.paths=[{tmp}/meg_prefixes]", "data.tokenizer=hf:{tmp}/meg_tok"], "data.paths",
     "it holds 2: a_text_document, b_text_document"),
    (["data=megatron", "data.paths=[{tmp}/negative_text_document]", "data.tokenizer=hf:{tmp}/meg_tok"], "data.paths",
     "holds token id -1 (the first below 0 in document 2 of 3"),
    (["data=megatron", "data.paths=[{tmp}/web_text_document]", "data.tokenizer=hf:{tmp}/meg_tok"], "data.tokenizer",
     "holds token id 89, and data.tokenizer="),
    (["data=megatron", "data.mix=[{paths:[{tmp}/small_text_document],weight:1},{paths:[{tmp}/short_val_text_document],"
      "weight:1}]", "data.tokenizer=hf:{tmp}/meg_tok", "train.seq_len=16"], "data.mix[1].paths",
     "the held-out split of short_val_text_document holds 5 tokens"),
    (["data=megatron", "data.paths=[{tmp}/empty_tail_text_document]", "data.tokenizer=hf:{tmp}/meg_tok",
      "data.packing=false"], "data.paths", "holds 0 documents with tokens"),
    (["data=megatron", "data.paths=[{tmp}/small_text_document]", "data.tokenizer=hf:{tmp}/meg_tok",
      "data.packing_strategy=bfd", "data.long_documents=refuse", "train.seq_len=16"], "data.long_documents",
     "a document of 30 tokens is longer than a row"),
    (["data=text", "data.paths=[{tmp}/latin1.txt]"], "data.paths", "not UTF-8"),
    (["data=text", "data.paths=[{tmp}/empty.txt]"], "data.paths", "empty"),
    (["data=text", "data.paths=[{tmp}/no_text]"], "data.paths", "holds no"),
    (["data=text", "data.paths=[{tmp}/short.txt]"], "data.paths", "needs train.seq_len+1"),
    (["data.paths=[{tmp}/one.txt]"], "data.paths", "read only when data.name=text or megatron"),
    (["data.max_bytes=10"], "data.max_bytes", "left out by data.max_bytes"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.text_field=body"], "data.text_field", "has no field 'body'"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=prompt_completion"], "data.prompt_field",
     "has no field 'prompt'"),
    (["data=text", "data.paths=[{tmp}/one.txt]", "data.format=prompt_completion"], "data.paths", "text, not records"),
    (["data.format=prompt_completion"], "data.format", "data=stdlib has none"),
    (["data=text", "data.paths=[{tmp}/typed.jsonl]", "data.format=prompt_completion", "data.prompt_field=completion"],
     "data.prompt_field", "would both be read from the field 'completion'"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=chat"], "data.chat_template",
     "carries no chat template"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=chat", "data.chat_template={tmp}/one.txt"],
     "data.chat_template", "holds nothing of message 2's answer (the assistant's)"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=chat", "data.chat_template={tmp}/chatml.jnja"],
     "data.chat_template", "did you mean"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=chat", "data.chat_template={tmp}/odd.jinja",
      "data.chat_turns=all"], "data.chat_template", "what the assistant said cannot be told apart"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=chat", "data.chat_template={tmp}/chatml.jinja"],
     "data.messages_field", "has no field 'messages'"),
    (["data=text", "data.paths=[{tmp}/one.txt]", "data.text_field=body"], "data.text_field",
     "and data.paths holds none (1 text file(s), each read whole as one document)"),
    (["data=text", "data.paths=[{tmp}/one.txt]", "data.split=test"], "data.split", "and data.paths names none"),
    (["data=text", "data.paths=[{tmp}/array.json]"], "data.paths", "is a JSON array, not JSON Lines"),
    (["data=text", "data.paths=[{tmp}/typed.jsonl]", "data.format=prompt_completion"], "data.paths",
     "line 3: the field 'completion' (data.completion_field) holds a number, not text: 42"),
    (["data=text", "data.paths=[{tmp}/mixed.jsonl]", "data.format=prompt_completion",
      "data.chat_template={tmp}/chatml.jinja"], "data.paths", "line 2: data.completion_field ('completion') is a list "
     "of messages and data.prompt_field ('prompt') is a string"),
    (["data=text", "data.paths=[{tmp}/tool_calls.jsonl]", "data.format=chat", "data.chat_template={tmp}/chatml.jinja"],
     "data.paths", "message 2 has tool_calls, and the chat template never reads tool_calls"),
    (["data=text", "data.paths=[{tmp}/tools_named.jsonl]", "data.format=chat",
      "data.chat_template={tmp}/chatml.jinja"], "data.paths", "line 1: the record's tools (data.tools_field) are a string, not a list of JSON schemas"),
    (["data=text", "data.paths=[{tmp}/tools.jsonl]", "data.format=chat", "data.chat_template={tmp}/chatml.jinja"],
     "data.paths", "line 1: the record has tools (data.tools_field), and the chat template never reads tools"),
    # values that would do nothing on these records (plugins/data/no_effect.py) or at train.steps=0
    (["data=text", "data.paths=[{tmp}/tools.jsonl]", "data.format=chat", "data.chat_template={tmp}/chatml_tools.jinja",
      "data.tools_field=functions"], "data.tools_field", "and 32 of them hold 'tools'"),
    (["data=text", "data.paths=[{tmp}/chats.jsonl]", "data.format=chat", "data.chat_template={tmp}/chatml.jinja",
      "data.learn_reasoning=false"], "data.learn_reasoning", "none of the 32 record(s) read before launch"),
    (["train.steps=0", "peft=lora"], "peft.name", "the adapters keep their initial values"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs.jsonl]", "train.steps=0"], "objective.name",
     "the policy is its own reference"),
    (["data=text", "data.paths=[{tmp}/reasoning.jsonl]", "data.format=chat", "data.chat_template={tmp}/chatml.jinja"],
     "data.paths", "message 2 has reasoning (reasoning_content), and the chat template reads none"),
    (["data=text", "data.paths=[{tmp}/reasoning_typed.jsonl]", "data.format=chat",
      "data.chat_template={tmp}/chatml.jinja"], "data.paths", "message 2 has a 'reasoning_content' that is a number"),
    (["data=text", "data.paths=[{tmp}/empty_answers.jsonl]", "data.format=chat",
      "data.chat_template={tmp}/chatml.jinja"], "data.loss_on",
     "has a token to learn (no assistant message with text)"),
    (["data.packing_strategy=bfd", "data.long_documents=refuse"], "data.long_documents",
     "longer than a row (train.seq_len+1=129 tokens) whatever their text"),
    (["data=text", "data.paths=[{tmp}/chats.jsonl]", "data.format=chat", "data.chat_template={tmp}/chatml.jinja",
      "data.long_documents=refuse", "train.seq_len=16"], "data.long_documents", "line 1: a record of"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=chat", "data.chat_template={tmp}/broken.jinja"],
     "data.chat_template", "cannot be read as Jinja"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=chat", "data.chat_template={tmp}/latin1.jinja"],
     "data.chat_template", "is not UTF-8 text (byte 0xe9"),
    (["data=text", "data.paths=[{tmp}/records.jsonl]", "data.format=chat", "data.tokenizer=hf:{tmp}/truncated_config"],
     "data.tokenizer", "tokenizer_config.json is not JSON"),
    (["data=text", "data.paths=[{tmp}/*.nothing]"], "data.paths", "matches no file"),
    (["data=text", "data.paths=[{tmp}/packed]"], "data.paths", "holds 1 compressed file(s) (notes.txt.gz)"),
    (["data=text", "data.paths=[{tmp}/packed/notes.txt.gz]"], "data.paths", "reads for JSON Lines only"),
    (["data=text", "data.paths=[{tmp}/packed/gz.jsonl]"], "data.paths", "its name does not say so"),
    (["data=text", "data.paths=[{tmp}/packed/cut.jsonl.gz]"], "data.paths", "cannot be decompressed"),
    (["data=text", "data.paths=[{tmp}/archives/plain.jsonl.gz]"], "data.paths",
     "is not gzip-compressed, though its name says .gz: it holds plain text; rename it"),
    (["data=text", "data.paths=[{tmp}/archives/corpus.tar.gz]"], "data.paths", "unpack it: tar -xzf corpus.tar.gz"),
    (["data=text", "data.paths=[{tmp}/pack*]"], "data.paths", "matches 1 folder(s)"),
    (["data=text", "data.mix=[{paths: [{tmp}/one.txt]}, {paths: [/nonexistent/web]}]"], "data.mix[1].paths",
     "does not exist"),
    (["data=text", "data.mix=[{paths: [{tmp}/one.txt], weight: 0}]"], "data.mix", "weight above 0"),
    (["data=text", "data.mix=[{paths: [{tmp}/one.txt]}, {paths: [{tmp}/one.txt]}]", "train.epochs=1"],
     "train.epochs", "no epochs of one split's examples"),
    (["train.epochs=2", "train.steps=50"], "train.steps", "read only when train.epochs=0"),
    (["data=text", "data.mix=[{paths: [{tmp}/one.txt]}, {paths: [{tmp}/one.txt], weight: 0}]"], "data.mix",
     "never drawn into a batch"),
    (["data=text", "data.mix=[{paths: [{tmp}/one.txt], weight: -0.3}, {paths: [{tmp}/one.txt]}]"],
     "data.mix[0].weight", ">= 0.0"),
    (["data=text", "data.mix=[{paths: [{tmp}/one.txt], weight: nan}]"], "data.mix[0].weight", "a finite number"),
    (["data=text", "data.format=chat", "data.mix=[{paths: [{tmp}/records.jsonl], text_field: body}]"],
     "data.mix[0].text_field", "read only when data.format=text"),
    # combinations that do nothing or contradict
    (["data=text", "data=chat"], "data", "set 2 times on the command line"),
    (["cluster=debug", "data.tasks=4"], "data.tasks", "read only when cluster.name=local or slurm"),
    (["data=text", "data.paths=[{tmp}/one.txt]", "data.long_documents=refuse"], "data.long_documents",
     "read only when data.packing_strategy=bfd"),
    (["cluster=debug", "sweep.parallelism=2"], "sweep.parallelism", "points cannot run side by side"),
    (["cluster=slurm", "cluster.mem_per_task_gb=0"], "cluster.mem_per_task_gb", "all the memory of each node"),
    (["cluster=slurm", "cluster.signal_delay_s=100000"], "cluster.signal_delay_s", "before its time limit"),
    (["cluster=slurm", "cluster.threads_per_rank=8", "cluster.cpus_per_task=2"], "cluster.threads_per_rank",
     "share cores"),
    (["cluster=slurm", "+cluster.sbatch.nodes=3"], "cluster.sbatch.nodes", "set by cluster.nodes"),
    (["cluster=slurm", "cluster.mem_per_task_gb=0.5", "data.tokenizer=bpe", "data.vocab_size=300"], "data.tasks",
     "the tokenize stage needs about"),
    (["data=text", "data.paths=[{tmp}/one.txt]", "data.mix=[{paths: [{tmp}/one.txt]}]"], "data.paths",
     "every source names its own paths"),
    (["data=text", "data.paths=[{tmp}/pipe.txt]"], "data.paths", "is a named pipe (FIFO), not a regular file"),
    (["data=text", "data.paths=[{tmp}/loop_a]"], "data.paths", "is a symbolic link loop"),
    (["data=text", "data.paths=[{tmp}/bad_line.jsonl]"], "data.paths", "bad_line.jsonl: line 301 is not JSON"),
    (["data.tokenizer=hf:{tmp}/broken_tokenizer"], "data.tokenizer", "tokenizer.json cannot be parsed as a tokenizer"),
    (["data.tokenizer=sentencepiece"], "data.tokenizer", "bytes, bpe or hf:<folder>"),
    (["data.tokenizer=hf:{tmp}/no_text"], "data.tokenizer", "holds no tokenizer.json"),
    (["data.tokenizer=bpe", "data.vocab_size=4096"], "model.vocab_size", "data.vocab_size=320"),
    (["data.tokenizer=hf:{tmp}/sparse_tokenizer"], "model.vocab_size", "produces token ids up to 5000"),
    (["data.tokenizer=bpe", "data.vocab_size=100"], "data.vocab_size", "between 259 and"),
    # where outputs go
    (["runs_dir="], "runs_dir", "is empty"),
    (["triton=on", "triton.cache_dir=/proc/orchestrator-inductor"], "triton.cache_dir", "no folder can be made"),
    (["tracking.artifact_root=/proc/orchestrator-artifacts"], "tracking.artifact_root", "no folder can be made"),
    (["tracking.experiment=''"], "tracking.experiment", "needs a name"),
    (["cache_dir={tmp}/a_file/cache"], "cache_dir", "is a file, not a folder"),
    (["cache_dir=/"], "cache_dir", "it is the filesystem's root"),
    (["cache_dir={tmp}"], "cache_dir", "holds other things than cache entries"),
    (["runs_dir=/proc/orchestrator-runs"], "runs_dir", "no folder can be made"),
    (["tracking.uri=sqlite:////proc/x/mlflow.db"], "tracking.uri", "cannot be created"),
    (["tracking.uri=sqlite:///{tmp}/random.bin"], "tracking.uri", "cannot be read as an MLflow store"),
    (["tracking.uri=http://127.0.0.1:9"], "tracking.uri", "no MLflow server answers"),
    (["tracking.uri=postgresql://u:p@127.0.0.1:1/db"], "tracking.uri", "needs its Python driver psycopg"),
    (["tracking.uri=ftp://example.org/mlflow"], "tracking.uri", "the scheme ftp:// is not an MLflow store"),
    (["tracking.uri={tmp}/mlruns"], "tracking.uri", "MLflow's filesystem backend"),
    # preference pairs and the objective that learns from them
    (["data=preference", "data.paths=[{tmp}/pairs.jsonl]"], "data.format", "objective=dpo (or kto, orpo, simpo), or"),
    (["objective=dpo"], "objective.name", "data.format=text has no pairs"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs.jsonl]", "data.packing=true"], "data.packing",
     "never packed with others"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs.jsonl]", "parallel=ddp2", "train.batch_size=6"],
     "train.batch_size", "whole pairs (two rows each): it must be divisible by 4"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs.jsonl]", "engine=ort"], "engine.name",
     "on the torch engine only"),
    (["objective=dpo", "objective.beta=0"], "objective.beta", "between 1e-06 and"),
    (["objective.beta=0.5"], "objective.beta", "is a key of objective=dpo (or kto, orpo, simpo)"),
    (["objective.name=dpo", "data=preference", "data.paths=[{tmp}/pairs.jsonl]"], "objective.name",
     "objective=dpo (the option"),
    (["objective=dpo", "objective.loss_type=ipo", "objective.label_smoothing=0.1"], "objective.label_smoothing",
     "read only when objective.loss_type=sigmoid"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs.jsonl]", "train.label_sparsity=false"],
     "train.label_sparsity", "read only when objective.name=sft"),
    (["data.chosen_field=better"], "data.chosen_field", "read only when data.format=preference"),
    # unpaired records and kto
    (["data=unpaired", "data.paths=[{tmp}/feedback.jsonl]"], "data.format", "objective=kto, or"),
    (["objective=kto"], "objective.name", "data.format=text has no labelled completions"),
    (["objective=kto", "data=unpaired", "data.paths=[{tmp}/feedback.jsonl]", "objective.reference=cached"],
     "objective.reference", "a cached pass cannot know them"),
    (["objective=kto", "data=unpaired", "data.paths=[{tmp}/feedback.jsonl]", "train.batch_size=1"],
     "train.batch_size", "one record has no other"),
    (["objective=kto", "data=unpaired", "data.paths=[{tmp}/feedback.jsonl]", "evaluate.tasks=[val_perplexity]"],
     "evaluate.tasks", "an undesirable one is not"),
    (["objective=kto", "data=unpaired", "data.mix=[{paths: [{tmp}/feedback.jsonl]}, {paths: [{tmp}/feedback2.jsonl]}]"],
     "data.mix", "from one corpus; a data.mix draws each row's source by weight"),
    (["objective=kto", "data=unpaired", "data.paths=[{tmp}/feedback.jsonl]", "objective.undesirable_weight=-1"],
     "objective.undesirable_weight", "must be between 0.0 and"),
    (["objective=kto", "data=unpaired", "data.paths=[{tmp}/feedback.jsonl]", "objective.desirable_weight=0",
      "objective.undesirable_weight=0"], "objective.desirable_weight", "no step learns anything"),
    (["objective=kto", "data=unpaired", "data.paths=[{tmp}/feedback_label.jsonl]"], "data.paths",
     "line 2: the record's label (data.label_field='label') is \"yes\", not true or false"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs_same.jsonl]"], "data.paths",
     "line 2: the pair's chosen and rejected completions are the same"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs_empty.jsonl]"], "data.paths",
     "line 1: the pair's rejected completion (data.rejected_field='rejected') is empty"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs_mixed.jsonl]"], "data.paths",
     "line 1: the pair mixes texts and lists of messages"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs_unrepeated.jsonl]"], "data.paths",
     "as in TRL (maybe_extract_prompt), the prompt is then the beginning they share"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs_no_prompt.jsonl]"], "data.paths",
     "has no field data.prompt_field='prompt' and its chosen and rejected completions share no beginning"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs_chat.jsonl]"], "data.chat_template",
     "the pair is made of conversations, which are rendered with a chat template, and there is none"),
    (["objective=dpo", "data=preference", "data.paths=[{tmp}/pairs_bad.jsonl]"], "data.paths",
     "3 bad record(s) among the 50 read before launch"),
    (["data=text", "data.paths=[{tmp}/chats.jsonl]", "data.bad_records=skip"], "data.bad_records",
     "read only when data.format="),
    # an experiment's phases (orchestrator/phases.py): each checked before any runs, its problems under its keys
    (["++phases.a.train.steps=5", "++phases.b.train.init_from=phase:c"], "phases.b.train.init_from",
     "starts from the model of an earlier phase"),
    (["++phases.a.optimizer.lrr=0.1"], "phases.a.optimizer.lrr", "did you mean optimizer.lr?"),
    (["++phases.a.train.steps=5", "train.steps=7"], "train.steps", "phase a sets train.steps itself"),
    (["++phases.a.optimizer.lr=-1"], "phases.a.optimizer.lr", "in phase a: optimizer.lr must be >= 0.0"),
    (["++phases.A.train.steps=5"], "phases.A", "lower case letters"),
    (["++phases.a.choices.modle=x"], "phases.a.choices", "pick an option of a config group"),
    (["++phases.a.choices.model=nope"], "phases.a.choices.model", "not an option of the config group 'model'"),
    (["tune=layout", "++phases.a.train.steps=5"], "tune.name", "tunes the layout of one run"),
    (["train.init_from=phase:sft"], "train.init_from", "this run has no phases"),
    (["++phases.a.train.steps=5", "++phases.b.train.init_from=phase:a", "++phases.b.model.n_layers=3"],
     "phases.b.model", "its model differs"),
    (["++phases.a.dry_run=true"], "phases.a.dry_run", "dry_run is the experiment's: every phase runs with it"),
]


def write_corpus(tmp: Path) -> Path:
    """The files the catalogue's cases name under {tmp}: broken, compressed, looping, odd ones."""
    (tmp / "random.bin").write_bytes(bytes(range(256)) * 64)
    (tmp / "web_text_document.bin").write_bytes(np.arange(1, 90, dtype=np.uint16).tobytes())  # Megatron's
    write_index(str(tmp / "web_text_document"), np.uint16, [30, 30, 29])
    megatron_corpora(tmp)
    (tmp / "latin1.txt").write_bytes("café crème ".encode("latin-1") * 500)
    (tmp / "empty.txt").write_text("")
    (tmp / "no_text").mkdir()
    (tmp / "short.txt").write_text("too short\n")
    (tmp / "one.txt").write_text("a line of text\n" * 2000)
    (tmp / "a_file").write_text("not a folder")
    (tmp / "records.jsonl").write_text('{"text": "a record of text"}\n' * 50)
    chat = {"messages": [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5."}]}
    (tmp / "chats.jsonl").write_text((json.dumps(chat) + "\n") * 50)
    (tmp / "tools_named.jsonl").write_text((json.dumps({**chat, "tools": "add"}) + "\n") * 50)
    (tmp / "tools.jsonl").write_text((json.dumps({**chat, "tools": [{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {}}}}]}) + "\n") * 50)
    (tmp / "chatml.jinja").write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                                      "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    (tmp / "chatml_tools.jinja").write_text("{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n"
                                            "{% endif %}" + (tmp / "chatml.jinja").read_text())
    (tmp / "odd.jinja").write_text("{% for m in messages %}{% if loop.last and m.role == 'assistant' %}<final>"
                                   "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    (tmp / "typed.jsonl").write_text('{"prompt": "Q", "completion": "A"}\n' * 2 + '{"prompt": "Q", "completion": 42}\n')
    (tmp / "array.json").write_text(json.dumps([{"text": "a record"}] * 20, indent=1))
    (tmp / "mixed.jsonl").write_text('{"prompt": "Q", "completion": "A"}\n'
                                     '{"prompt": "Q", "completion": [{"role": "assistant", "content": "A"}]}\n')
    call = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "add", "arguments": {"a": 2, "b": 3}}}]}
    (tmp / "tool_calls.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "2+3?"}, call]}) + "\n")
    (tmp / "empty_answers.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "hello"}, {"role": "assistant", "content": " "}]}) + "\n")
    said = {"role": "assistant", "content": "5.", "reasoning_content": "2+3 is 5."}
    (tmp / "reasoning.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "2+3?"}, said]}) + "\n")
    (tmp / "reasoning_typed.jsonl").write_text(json.dumps({"messages": [
        {"role": "user", "content": "2+3?"}, {**said, "reasoning_content": 5}]}) + "\n")
    pair = {"prompt": "2+3=", "chosen": "5", "rejected": "6"}
    (tmp / "pairs.jsonl").write_text((json.dumps(pair) + "\n") * 50)
    feedback = [{"prompt": "2+3=", "completion": str(n), "label": n == 5} for n in (5, 6)]
    (tmp / "feedback.jsonl").write_text("".join(json.dumps(f) + "\n" for f in feedback) * 25)
    (tmp / "feedback2.jsonl").write_text((tmp / "feedback.jsonl").read_text())
    (tmp / "feedback_label.jsonl").write_text(json.dumps(feedback[0]) + "\n" + json.dumps({**feedback[1],
                                                                                           "label": "yes"}) + "\n")
    (tmp / "pairs_same.jsonl").write_text(json.dumps(pair) + "\n" + json.dumps({**pair, "rejected": "5"}) + "\n")
    (tmp / "pairs_empty.jsonl").write_text(json.dumps({**pair, "rejected": ""}) + "\n")
    (tmp / "pairs_mixed.jsonl").write_text(json.dumps({**pair, "chosen": [{"role": "assistant", "content": "5"}]})
                                           + "\n")
    (tmp / "pairs_unrepeated.jsonl").write_text(json.dumps({  # UltraFeedback's form, the prompt not repeated
        **pair, "chosen": [{"role": "assistant", "content": "5"}], "rejected": [{"role": "assistant", "content": "6"}]})
        + "\n")
    (tmp / "pairs_no_prompt.jsonl").write_text(json.dumps({"chosen": "5", "rejected": "6"}) + "\n")
    bad = [{"chosen": "2+3=5", "rejected": "2+3=5"}, {**pair, "chosen": 5}, {"prompt": "2+3=", "chosen": "5"}]
    (tmp / "pairs_bad.jsonl").write_text("".join(json.dumps(bad[i // 10 - 1] if i in (10, 20, 30) else pair) + "\n"
                                                 for i in range(50)))  # several bad records: all listed at once
    (tmp / "pairs_chat.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "2+3?"}],
                                                      "chosen": [{"role": "assistant", "content": "5"}],
                                                      "rejected": [{"role": "assistant", "content": "6"}]}) + "\n")
    (tmp / "broken.jinja").write_text("{% for m in messages %}{% generation %}{{ m.content }}")  # never closed
    (tmp / "bad_line.jsonl").write_text('{"text": "a record of text"}\n' * 300 + '{"text": "a tab\tinside"}\n')
    os.mkfifo(tmp / "pipe.txt")  # reading it would wait for a writer for ever
    os.symlink(tmp / "loop_b", tmp / "loop_a")
    os.symlink(tmp / "loop_a", tmp / "loop_b")
    (tmp / "gpt_inverse_idx").mkdir()  # GPT-2's config with an attention this model does not compute
    (tmp / "gpt_inverse_idx" / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "vocab_size": 320, "n_layer": 8, "n_head": 4, "n_embd": 64,
        "n_positions": 128, "scale_attn_by_inverse_layer_idx": True}))
    (tmp / "sparse_tokenizer").mkdir()  # 4 tokens, one of them id 5000: its size is not its largest id
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel(vocab={"a": 0, "b": 5000, "<unk>": 1, "<|endoftext|>": 2}, unk_token="<unk>")).save(
        str(tmp / "sparse_tokenizer" / "tokenizer.json"))
    (tmp / "latin1.jinja").write_bytes("{% for m in messages %}é{{ m.content }}{% endfor %}".encode("latin-1"))
    (tmp / "truncated_config").mkdir()  # a tokenizer whose tokenizer_config.json was cut short by a full disk
    Tokenizer(models.WordLevel(vocab={"a": 0, "<unk>": 1, "<|endoftext|>": 2}, unk_token="<unk>")).save(
        str(tmp / "truncated_config" / "tokenizer.json"))
    (tmp / "truncated_config" / "tokenizer_config.json").write_text('{"eos_token": "<|endoftext|>", "chat_tem')
    (tmp / "broken_tasks").mkdir()  # an lm-eval task file cut short
    (tmp / "broken_tasks" / "mine.yaml").write_text("task: mine\ndataset_kwargs: {data_files: {test: [a.jsonl")
    user_tasks(tmp / "user_tasks")
    import gzip

    (tmp / "packed").mkdir()  # JSON Lines, compressed JSON Lines (read) and compressed text (not read)
    (tmp / "packed" / "a.jsonl").write_text('{"text": "a record of text"}\n' * 50)
    (tmp / "packed" / "b.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a record of text"}\n' * 50))
    (tmp / "packed" / "notes.txt.gz").write_bytes(gzip.compress(b"some text\n" * 50))
    (tmp / "packed" / "gz.jsonl").write_bytes(gzip.compress(b'{"text": "a record of text"}\n' * 50))
    (tmp / "packed" / "cut.jsonl.gz").write_bytes(gzip.compress(b'{"text": "a record of text"}\n' * 50)[:-9])
    (tmp / "archives").mkdir()  # a plain file named as compressed, and a compressed tar of text
    (tmp / "archives" / "plain.jsonl.gz").write_text('{"text": "a record of text"}\n' * 50)
    with tarfile.open(tmp / "archives" / "corpus.tar.gz", "w:gz") as archive:
        archive.add(tmp / "one.txt", arcname="one.txt")
    (tmp / "broken_tokenizer").mkdir()
    (tmp / "broken_tokenizer" / "tokenizer.json").write_text('{"version": "1.0", "truncation": ')
    (tmp / "gpt_vocab259").mkdir()  # an imported GPT-2's config (gpt_tiny's sizes, a vocabulary hp=2 cannot split)
    (tmp / "gpt_vocab259" / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "vocab_size": 259, "n_layer": 8, "n_head": 4, "n_embd": 64,
        "n_inner": 256, "n_positions": 128, "activation_function": "gelu"}))
    return tmp


def megatron_corpora(tmp: Path) -> None:
    """Small Megatron corpora (ids below 64, meg_tok's vocabulary): one with an id of -1, one whose last document is
    empty, one whose held-out document is shorter than a row, and a folder of two prefixes (documents of a row,
    so that the fix listing both is accepted)."""
    from tokenizers import Tokenizer, models

    (tmp / "meg_tok").mkdir()
    Tokenizer(models.WordLevel(vocab={**{f"<{i}>": i for i in range(63)}, "<|endoftext|>": 63}, unk_token="<0>")).save(
        str(tmp / "meg_tok" / "tokenizer.json"))
    (tmp / "meg_prefixes").mkdir()
    for name, lengths in (("small", [30, 30, 30]), ("negative", [20, 20, 20]), ("short_val", [40, 40, 5]),
                          ("empty_tail", [30, 30, 0]), ("meg_prefixes/a", [130, 130]), ("meg_prefixes/b", [130, 130])):
        ids = np.arange(sum(lengths), dtype=np.int32) % 63
        ids[25] = -1 if name == "negative" else ids[25]
        (tmp / f"{name}_text_document.bin").write_bytes(ids.astype(np.int32 if name == "negative" else np.uint16)
                                                        .tobytes())
        write_index(str(tmp / f"{name}_text_document"), np.int32 if name == "negative" else np.uint16, lengths)
