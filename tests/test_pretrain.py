"""Stage 0 and the training plumbing it shares with later stages: schedule, data order, optimizer groups, packing,
and the script end to end (loss falls, exact resume, no silent overwrite, two processes)."""

import json
import math
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_script
from gpt_model import GPTModel, get_preset
from plumbing.batching import BatchSchedule
from plumbing.cli import UserError
from plumbing.documents import load_text_documents
from plumbing.flops import training_flops_per_token
from plumbing.optimizers import lr_at, make_optimizer
from plumbing.token_cache import PackedBlocks


def test_lr_schedule_by_hand():
    """Linear warm-up reaches the peak at the end of warm-up; cosine ends at 10% of the peak; halfway is 55%."""
    assert lr_at(0, 1.0, 4, 104) == pytest.approx(0.25)
    assert lr_at(3, 1.0, 4, 104) == pytest.approx(1.0)
    assert lr_at(54, 1.0, 4, 104) == pytest.approx(0.1 + 0.9 * 0.5)  # cos(pi/2) = 0
    assert lr_at(104, 1.0, 4, 104) == pytest.approx(0.1)
    assert lr_at(500, 1.0, 4, 104) == pytest.approx(0.1)


def test_batch_schedule_covers_each_epoch_once_and_splits_across_processes():
    """Every epoch is a permutation; two processes with batch b see exactly one process's batch 2b."""
    one = BatchSchedule(10, 4, 1, 1, seed=7)
    two = BatchSchedule(10, 2, 1, 2, seed=7)
    for step in range(5):
        together = one.indices(step, 0, 0)
        assert two.indices(step, 0, 0) + two.indices(step, 0, 1) == together
    first_epoch = [one._example(k) for k in range(10)]
    assert sorted(first_epoch) == list(range(10))
    assert [one._example(k) for k in range(10, 20)] != first_epoch  # a new order each epoch


def test_optimizer_decays_only_linear_weights():
    """Weight decay applies to Linear weight matrices; never to biases, norms or (tied) embeddings."""
    model = GPTModel(get_preset("tiny").replace(vocab_size=50))
    decay, no_decay = make_optimizer(model, 1e-3, 0.1).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(n.endswith(".weight") and "norm" not in n and "emb" not in n for n in decayed)
    assert "trf_blocks.0.att.W_query.weight" in decayed
    assert {"tok_emb.weight", "pos_emb.weight", "final_norm.scale"} <= {names[id(p)] for p in no_decay["params"]}
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_packing_joins_documents_with_sep_and_shifts_by_one(tokenizer, tmp_path):
    """Blocks are the concatenated document tokens with [SEP] after each; labels are inputs moved left by one."""
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "你好"}\n{"text": "世界和平"}\n', encoding="utf-8")
    blocks = PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=3)
    expected = tokenizer.convert_tokens_to_ids(list("你好")) + [102] + \
        tokenizer.convert_tokens_to_ids(list("世界和平")) + [102]
    assert blocks.tokens.tolist() == expected
    assert len(blocks) == (len(expected) - 1) // 3
    x, y = blocks[1]
    assert x.tolist() == expected[3:6] and y.tolist() == expected[4:7]


def test_a_batch_holds_the_blocks_it_names_in_order(tokenizer, tmp_path):
    """collate reads many blocks at once; each row must be the expected slice of the token list, as blocks[i] is."""
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(f'{{"text": "第{i}篇文章，写一些字。"}}\n' for i in range(20)), encoding="utf-8")
    blocks = PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=5)
    tokens, order = blocks.tokens.tolist(), [len(blocks) - 1, 0, 7, 7, 3]
    batch = blocks.collate(order)
    assert batch["input_ids"].tolist() == [tokens[5 * i:5 * i + 5] for i in order]
    assert batch["labels"].tolist() == [tokens[5 * i + 1:5 * i + 6] for i in order]
    assert batch["input_ids"].dtype == torch.int64 and batch["labels"].is_contiguous()


def test_packing_starts_each_document_with_the_models_bos(tokenizer, tmp_path):
    """For weights trained on "[CLS] text [SEP]" (uer's: cfg.bos_id 101) every document starts with [CLS] too;
    before, --init_from_hf packed them as our own pretraining does, with no [CLS]."""
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "你好"}\n{"text": "世界和平"}\n', encoding="utf-8")
    blocks = PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=3, bos_id=101)
    expected = [101] + tokenizer.convert_tokens_to_ids(list("你好")) + [102, 101] + \
        tokenizer.convert_tokens_to_ids(list("世界和平")) + [102]
    assert blocks.tokens.tolist() == expected


def test_txt_documents_are_split_on_blank_lines(tmp_path):
    (tmp_path / "a.txt").write_text("第一段\n第二行\n\n\n第二篇\r\n", encoding="utf-8")
    docs = list(load_text_documents([str(tmp_path / "a.txt")], "test"))
    assert docs == ["第一段\n第二行", "第二篇"]


def test_tokens_are_cached_on_disk_and_read_lazily(tokenizer, tmp_path, monkeypatch):
    """The first PackedBlocks tokenizes into a uint16 file in the datasets cache; the next one for the same files
    memory-maps it without tokenizing; an edited file is read and tokenized again, and its old token file goes."""
    import datasets
    import numpy as np

    from plumbing import token_cache

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "你好"}\n{"text": "世界和平"}\n', encoding="utf-8")
    first = PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=3)
    assert isinstance(first.tokens, np.memmap) and first.tokens.dtype == np.uint16  # 21128 ids fit in 16 bits
    assert str(tmp_path / "cache") in first.tokens.filename

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again although the cache holds these tokens")

    with monkeypatch.context() as m:
        m.setattr(token_cache, "tokenize_to_file", no_tokenizing)
        again = PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=3)
        assert again.tokens.tolist() == first.tokens.tolist()
        with path.open("a", encoding="utf-8") as f:
            f.write('{"text": "再见"}\n')
        with pytest.raises(AssertionError, match="tokenized again"):
            PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=3)
    edited = PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=3)
    assert edited.tokens.tolist() == first.tokens.tolist() + tokenizer.convert_tokens_to_ids(list("再见")) + [102]
    # the token file of the file before the edit is gone (it can never be used again); another corpus's stays
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "别的"}\n', encoding="utf-8")
    PackedBlocks(load_text_documents([str(other)], "test"), tokenizer, block_len=1)
    left = sorted(p.name for p in (tmp_path / "cache" / "gpt2-zh-tokens").iterdir())
    assert len(left) == 4 and os.path.basename(edited.path) in left and os.path.basename(first.path) not in left


def test_a_special_tokens_name_in_a_document_is_plain_text(tokenizer, tmp_path, monkeypatch):
    """Pretraining documents become ids by the one rule of chinese_tokenizer.encode: a document that contains the
    strings "[CLS]" or "[SEP]" gets their characters, not an end-of-text id in its middle."""
    import datasets

    from chinese_tokenizer import CLS_ID, SEP_ID, encode

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "[CLS]你好吗[SEP]再见"}\n', encoding="utf-8")
    blocks = PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=2)
    expected = encode("[CLS]你好吗[SEP]再见", tokenizer) + [SEP_ID]
    assert blocks.tokens.tolist() == expected
    assert CLS_ID not in expected and expected.count(SEP_ID) == 1  # only the separator the packing adds


def test_the_token_cache_key_covers_the_tokenizers_normaliser(tokenizer, tmp_path, monkeypatch):
    """A tokenizer with the same 21128-id vocabulary but lower-casing off gets its own token file, with its own ids
    ("GPT" is [UNK] to it), not the lower-cased tokenizer's file."""
    import datasets

    from chinese_tokenizer import encode, load_tokenizer

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    cased_dir = tmp_path / "cased"
    tokenizer.save_pretrained(str(cased_dir))
    config = json.loads((cased_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config["normalizer"]["lowercase"] = False
    (cased_dir / "tokenizer.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    settings = json.loads((cased_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    settings["do_lower_case"] = False  # BertTokenizerFast rebuilds its normaliser from this flag
    (cased_dir / "tokenizer_config.json").write_text(json.dumps(settings, ensure_ascii=False), encoding="utf-8")
    cased = load_tokenizer(str(cased_dir))
    assert len(cased) == len(tokenizer) and encode("GPT你好", cased) != encode("GPT你好", tokenizer)
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "GPT你好"}\n', encoding="utf-8")
    lower = PackedBlocks(load_text_documents([str(path)], "test"), tokenizer, block_len=2)
    upper = PackedBlocks(load_text_documents([str(path)], "test"), cased, block_len=2)
    assert lower.path != upper.path
    assert upper.tokens.tolist() == encode("GPT你好", cased) + [102]
    assert lower.tokens.tolist() == encode("GPT你好", tokenizer) + [102]


def test_parquet_jsonl_fields_and_datasets_give_the_same_tokens(tokenizer, tmp_path, monkeypatch):
    """The same three documents as .jsonl with another field, as .parquet, as a folder saved by datasets, and as
    a dataset folder laid out as on the Hub (split files under data/, rows chosen by slicing), all tokenize to what the
    {"text"} .jsonl gives; a missing field or column is a one-line error that names it and --text_field."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plumbing.cli import UserError

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    texts = ["你好", "世界和平", "再见"]
    (tmp_path / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    (tmp_path / "content.jsonl").write_text("".join(json.dumps({"content": t, "id": i}) + "\n"
                                                   for i, t in enumerate(texts)), encoding="utf-8")
    pq.write_table(pa.table({"id": [0, 1, 2], "content": texts}), tmp_path / "docs.parquet")
    datasets.Dataset.from_dict({"content": texts}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    pq.write_table(pa.table({"content": texts}), tmp_path / "hub" / "data" / "validation-00000-of-00001.parquet")
    pq.write_table(pa.table({"content": ["别的", "另外"]}), tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")

    def tokens(pattern, field="content"):
        return PackedBlocks(load_text_documents([str(pattern)], "--train_files", field), tokenizer, 3).tokens.tolist()

    expected = []
    for text in texts:
        expected += tokenizer.convert_tokens_to_ids(list(text)) + [102]
    assert tokens(tmp_path / "text.jsonl", "text") == expected
    assert tokens(tmp_path / "content.jsonl") == expected
    assert tokens(tmp_path / "docs.parquet") == expected
    assert tokens(tmp_path / "saved") == expected
    assert tokens(f"{tmp_path / 'hub'}:validation") == expected
    assert list(load_text_documents([str(tmp_path / "hub")], "x", "content")) == ["别的", "另外"]  # split: train
    assert list(load_text_documents([f"{tmp_path / 'hub'}:train[50%:]"], "x", "content")) == ["另外"]  # rows
    for pattern, field, needle in ((tmp_path / "text.jsonl", "content", "line 1: field 'content' is missing (its "
                                                                         "fields: text); pass --text_field"),
                                   (tmp_path / "docs.parquet", "body", "no column 'body' (its columns: id, content)"),
                                   (tmp_path / "saved", "body", "no column 'body' (its columns: content)")):
        with pytest.raises(UserError) as info:
            tokens(pattern, field)
        message = str(info.value)
        assert needle in message and str(pattern) in message and "\n" not in message, message
    with pytest.raises(UserError, match="--text_field"):
        tokens(tmp_path / "docs.parquet", "text")


def test_a_hub_name_that_cannot_be_loaded_is_one_line_and_a_mistyped_path_stays_a_path(tmp_path, monkeypatch):
    """Offline, an unknown Hub name fails at once with one line naming the argument and the accepted forms; a
    mistyped local path (its folder exists) is not sent to the Hub."""
    import datasets
    import huggingface_hub

    from plumbing.cli import UserError

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(UserError) as info:
        load_text_documents(["nobody-here/no-such-corpus:train"], "--train_files")
    message = str(info.value)
    assert message.startswith("--train_files: nobody-here/no-such-corpus:train") and "NAME:CONFIG:SPLIT" in message
    assert "\n" not in message
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match="no file matches data/pretrian"):
        load_text_documents(["data/pretrian"], "--train_files")


def test_saved_datasets_take_splits_and_row_slices_and_hub_folders_keep_their_metadata(tmp_path, monkeypatch):
    """A save_to_disk Dataset is split "train" (slices apply, another split is refused rather than ignored, so val
    cannot silently equal train); a DatasetDict takes SPLIT[slice]; a glob over dataset folders loads each; a Hub
    repository folder with a top-level dataset_infos.json is a dataset, not a folder of JSON files."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from plumbing.cli import UserError

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    datasets.Dataset.from_dict({"text": [str(i) for i in range(10)]}).save_to_disk(str(tmp_path / "ds_one"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["甲", "乙", "丙", "丁"]}),
                          "test": datasets.Dataset.from_dict({"text": ["戊"]})}).save_to_disk(str(tmp_path / "ds_dict"))
    (tmp_path / "hub" / "data").mkdir(parents=True)
    pq.write_table(pa.table({"text": ["己"]}), tmp_path / "hub" / "data" / "train-00000-of-00001.parquet")
    (tmp_path / "hub" / "dataset_infos.json").write_text('{"default": {}}', encoding="utf-8")

    def docs(pattern):
        return list(load_text_documents([str(pattern)], "--train_files"))

    head, tail = (load_text_documents([f"{tmp_path / 'ds_one'}:train[{s}]"], "x") for s in (":70%", "70%:"))
    assert list(head) == [str(i) for i in range(7)] and list(tail) == ["7", "8", "9"] and head.key != tail.key
    assert docs(f"{tmp_path / 'ds_dict'}:train[:50%]") == ["甲", "乙"]
    assert docs(f"{tmp_path / 'ds_dict'}:test") == ["戊"]
    assert docs(tmp_path / "ds_*") == ["甲", "乙", "丙", "丁"] + [str(i) for i in range(10)]
    assert docs(tmp_path / "hub") == ["己"]
    with pytest.raises(UserError, match="has no split 'test' \\(a single dataset, whose only split is train"):
        docs(f"{tmp_path / 'ds_one'}:test")


def test_a_late_bad_byte_is_named_by_its_offset_in_the_file(tmp_path):
    path = tmp_path / "late.txt"
    path.write_bytes("好".encode() * 50000 + "\n中文".encode("gbk"))
    with pytest.raises(UserError, match="bad byte at offset 150001"):
        list(load_text_documents([str(path)], "--train_files"))


@pytest.mark.slow
def test_a_killed_runs_half_written_token_file_is_removed_and_sigterm_cleans_up(tokenizer, tmp_path):
    """A .tmp left by a process that no longer exists goes before the next tokenizing (one of a live process
    stays); SIGTERM while tokenizing ends 0-PRETRAIN with one line and exit 143, leaving no partial file."""
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO_ROOT
    from plumbing import token_cache

    path = str(tmp_path / "t" / "abc.bin")
    os.makedirs(os.path.dirname(path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale, live = f"{path}.{int(dead.stdout)}.tmp", f"{path}.{os.getppid()}.tmp"  # a gone and a live process
    for leftover in (stale, stale + ".json", live):
        open(leftover, "w").close()
    docs = tmp_path / "d.jsonl"
    docs.write_text('{"text": "你好"}\n', encoding="utf-8")
    token_cache.tokenize_to_file(load_text_documents([str(docs)], "x"), tokenizer, path, None, "x")
    assert sorted(os.listdir(tmp_path / "t")) == ["abc.bin", os.path.basename(live), "abc.json"]

    big = tmp_path / "big.jsonl"  # about 6 MB: a few seconds of tokenizing
    poem = "春眠不觉晓，处处闻啼鸟。" * 160
    big.write_text("".join(json.dumps({"text": f"第{i}篇：" + poem}, ensure_ascii=False) + "\n"
                           for i in range(1000)), encoding="utf-8")
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "0-PRETRAIN.py", "--preset", "tiny", "--train_files", str(big),
                             "--val_files", str(docs), "--output_dir", str(tmp_path / "out")], cwd=REPO_ROOT, env=env,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not [p for p in (tmp_path / "cache").rglob("*.tmp") if "gpt2-zh-tokens" in str(p)]:
        assert proc.poll() is None and time.monotonic() < deadline, "0-PRETRAIN never started tokenizing"
        time.sleep(0.005)  # the half-written token file exists: the run is tokenizing now
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert rest.strip().splitlines()[-1] == "stopped by SIGTERM" and "Traceback" not in rest
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "gpt2-zh-tokens" in str(p)]


def test_a_bad_record_leaves_no_token_file_behind(tokenizer, tmp_path, monkeypatch):
    """Tokenizing stops at the first bad line with its number, and the cache holds nothing afterwards (no partial
    token file that a later run could take for a whole one)."""
    import datasets

    from plumbing.cli import UserError

    cache = tmp_path / "cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "你好"}\n{"text": "世界"}\n{"txt": "坏"}\n', encoding="utf-8")
    with pytest.raises(UserError, match="docs.jsonl line 3: field 'text' is missing"):
        PackedBlocks(load_text_documents([str(path)], "--train_files"), tokenizer, 2)
    assert not any(p.is_file() for p in cache.rglob("*"))


def pretrain(out, corpus, *extra):
    return run_script("0-PRETRAIN.py", "--preset", "tiny", "--train_files", corpus / "train.txt",
                      "--val_files", corpus / "val.txt", "--output_dir", out, *extra)


@pytest.mark.slow
def test_pretrain_loss_falls_and_checkpoint_is_complete(tiny_pretrain_checkpoint):
    """The fixture's 20-step run: val loss starts near ln(V) and falls; the checkpoint has every design.md file."""
    ckpt = tiny_pretrain_checkpoint
    rows = [json.loads(line) for line in open(ckpt / "metrics.jsonl", encoding="utf-8")]
    assert rows[0]["train_loss"] == pytest.approx(math.log(21128), abs=0.3)
    assert rows[-1]["val_loss"] < rows[0]["train_loss"] - 2.0
    for name in ("model.safetensors", "config.json", "tokenizer/tokenizer.json", "metrics.jsonl", "loss_curve.png"):
        assert (ckpt / name).exists(), name
    assert not (ckpt / "state").exists()  # a finished run keeps no resumable state
    config = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    assert config["stage"] == "pretrain" and config["step"] == 20 and config["model"]["n_layers"] == 2


@pytest.mark.slow
def test_resume_is_bit_identical_to_a_straight_run(tmp_path, tiny_corpus):
    """3 steps, stop, --resume to 6 gives the same weights as 6 steps straight (optimizer, schedule, RNG, data)."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    args = ("--max_steps", "6", "--eval_every", "2", "--preset", "tiny")
    assert pretrain(straight, tiny_corpus, *args).returncode == 0
    first = pretrain(resumed, tiny_corpus, *args, "--stop_after", "3")
    assert first.returncode == 0, first.stderr[-1500:]
    assert (resumed / "state" / "optimizer.safetensors").exists()
    assert "--stop_after 3 --resume" in first.stdout  # the hint is the whole command that continues the run
    # a resume with other settings would be another run than the one saved: refused, the state kept
    other = pretrain(resumed, tiny_corpus, "--max_steps", "8", "--eval_every", "2", "--preset", "tiny",
                     "--learning_rate", "0.01", "--resume")
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1
    assert "--learning_rate" in other.stderr and "--max_steps 6" in other.stderr and "--overwrite" in other.stderr
    assert (resumed / "state" / "optimizer.safetensors").exists()
    second = pretrain(resumed, tiny_corpus, *args, "--resume")
    assert second.returncode == 0, second.stderr[-1500:]
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rows_a = (straight / "metrics.jsonl").read_text().splitlines()
    rows_b = (resumed / "metrics.jsonl").read_text().splitlines()
    def strip(rows):
        return [{k: v for k, v in json.loads(r).items() if k not in ("time_s", "flop_s")} for r in rows]  # no clocks

    assert strip(rows_a) == strip(rows_b)
    times = [json.loads(r)["time_s"] for r in rows_b]  # the clock goes on across the resume, as tokens_seen does
    assert times == sorted(times)
    # the FLOPs go on across the resume too, none counted twice: training is 6N + 12·L·E·T per token read (every
    # position of a packed block is predicted), evaluation and the samples are counted apart
    config_a, config_b = (json.loads((d / "config.json").read_text(encoding="utf-8")) for d in (straight, resumed))
    assert config_a["flops"] == config_b["flops"] and config_a["flops"]["forward"] > 0
    cfg = get_preset("tiny")
    assert config_a["flops"]["train"] == config_a["tokens_seen"] * training_flops_per_token(cfg, cfg.context_length)
    assert config_a["flop_s"] > 0 and config_a["matmul_flop_s"] > 0


@pytest.mark.slow
def test_existing_checkpoint_is_never_replaced_without_overwrite(tmp_path, tiny_pretrain_checkpoint, tiny_corpus):
    """A second run into the same directory exits 2 with a one-line hint and leaves every byte as it was."""
    out = tmp_path / "pretrain"
    shutil.copytree(tiny_pretrain_checkpoint, out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    result = pretrain(out, tiny_corpus, "--max_steps", "2")
    assert result.returncode == 2
    assert "--overwrite" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


@pytest.mark.slow
def test_two_processes_follow_the_one_process_loss_curve(tmp_path, tiny_corpus):
    """``accelerate launch --multi_gpu --num_processes 2`` on a machine without a GPU (two gloo processes on the
    CPU) with batch 2 each gives the same losses as one process with batch 4 (the same global batches; dropout is 0
    in the tiny preset); only one copy of the files is written."""
    one, two = tmp_path / "one", tmp_path / "two"
    args = ("--max_steps", "4", "--eval_every", "2")
    assert pretrain(one, tiny_corpus, *args, "--batch_size", "4").returncode == 0
    result = run_script("-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                        "--num_machines", "1",
                        "--mixed_precision", "no", "--dynamo_backend", "no", "0-PRETRAIN.py", "--preset", "tiny",
                        "--train_files", tiny_corpus / "train.txt", "--val_files", tiny_corpus / "val.txt",
                        "--output_dir", two, *args, "--batch_size", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("saved ") == 1  # one process is the main process
    def rows(d):
        return [json.loads(line) for line in (d / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]

    def losses(d):
        return [(r["train_loss"], r.get("val_loss")) for r in rows(d)]

    for (a, va), (b, vb) in zip(losses(one), losses(two)):
        assert a == pytest.approx(b, abs=1e-4)
        assert (va is None) == (vb is None) and (va is None or va == pytest.approx(vb, abs=1e-4))
    # the global batch really spans both processes, and so do the training FLOPs: each counts its half
    assert [r["tokens_seen"] for r in rows(one)] == [r["tokens_seen"] for r in rows(two)]
    flops = [json.loads((d / "config.json").read_text(encoding="utf-8"))["flops"]["train"] for d in (one, two)]
    assert flops[0] == flops[1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directories left


@pytest.mark.slow
def test_accelerate_launch_without_cpu_flag_gets_a_thread_note(tmp_path, tiny_corpus):
    """Plain `accelerate launch` on a machine with no GPU runs the stage on one CPU thread (it sets
    OMP_NUM_THREADS=1); the stage says so and how to use every core. With --cpu it gets them all and says nothing."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip(f"needs 2 or more CPU cores to have something to say (this machine has {os.cpu_count()})")
    if torch.cuda.is_available():
        pytest.skip("with a GPU the stage trains there and the CPU threads do not matter")
    common = ("0-PRETRAIN.py", "--preset", "tiny", "--train_files", tiny_corpus / "train.txt", "--val_files",
              tiny_corpus / "val.txt", "--max_steps", "1", "--overwrite", "--output_dir", tmp_path / "out")
    launch = ("-m", "accelerate.commands.launch", "--num_processes", "1", "--num_machines", "1", "--mixed_precision",
              "no", "--dynamo_backend", "no")
    no_omp = {"OMP_NUM_THREADS": None}  # as on a user's machine: accelerate decides
    plain = run_script(*launch, *common, env=no_omp)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert f"computes on 1 of {os.cpu_count()} CPU cores" in plain.stdout and "--cpu" in plain.stdout
    with_cpu = run_script(*launch, "--cpu", *common, env=no_omp)
    assert with_cpu.returncode == 0, with_cpu.stderr[-2000:]
    assert "CPU cores" not in with_cpu.stdout


def test_missing_train_file_is_a_one_line_error(tmp_path):
    result = run_script("0-PRETRAIN.py", "--preset", "tiny", "--train_files", tmp_path / "nope.txt",
                        "--output_dir", tmp_path / "out")
    assert result.returncode == 2
    assert "nope.txt" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
