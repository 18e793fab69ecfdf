"""The ``lm-eval`` tasks we ship (``data/lm_eval/``) on an exported checkpoint, against our own figures.

``lm-eval`` runs offline on a small chat model (fitted to a few poems, exported with ``save_hf_model``) over
problems and documents written here, through the task files as shipped (only their data paths point here). Its
multiple-choice accuracy must equal ``harness.multiple_choice_accuracy``'s problem by problem, and its perplexity
per byte ``harness.byte_perplexity``'s within 1e-4 relative, with a document longer than the context, so that the
rolling windows are exercised.
"""

import json
import math
from pathlib import Path

import pytest

from chinese_tokenizer import SEP_ID, encode
from conftest import POEMS
from plumbing import harness
from plumbing.hf_weights import save_hf_model

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is in requirements.txt; `make venv` installs it")

REPO_ROOT = Path(__file__).resolve().parent.parent
REVIEWS = [("房间很干净，服务也热情，下次还来。", "正面"), ("隔音太差，一晚上没睡好。", "负面"),
           ("早餐丰富，位置方便。", "正面"), ("前台态度恶劣，再也不来了。", "负面"), ("性价比很高，推荐！", "正面"),
           ("空调坏了也没人修。", "负面"), ("风景很美，床很舒服。", "正面"), ("卫生间有异味，很失望。", "负面")]
DOCUMENTS = [POEMS * 4, "红豆生南国，春来发几枝。愿君多采撷，此物最相思。", "今天天气很好。\n我们去公园散步吧！"]

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("quiet_single_thread")]


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tokenizer, fitted_models):
    """(exported model dir, task dir, problems): the data as .jsonl, the shipped task files pointing at it."""
    root = tmp_path_factory.mktemp("lm_eval")
    problems = [{"prompt": f"这条评论是正面的还是负面的？“{text}”", "answer": label, "family": "sentiment"}
                for text, label in REVIEWS]
    (root / "sentiment.jsonl").write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in problems),
                                          encoding="utf-8")
    (root / "val.jsonl").write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in DOCUMENTS),
                                    encoding="utf-8")
    tasks = root / "tasks"
    tasks.mkdir()
    for name, data in (("zh_sentiment_mc.yaml", "data/sentiment/test.jsonl"),
                       ("zh_val_perplexity.yaml", "data/pretrain/val.jsonl")):
        text = (REPO_ROOT / "data" / "lm_eval" / name).read_text(encoding="utf-8")
        assert data in text
        target = root / ("sentiment.jsonl" if "sentiment" in name else "val.jsonl")
        (tasks / name).write_text(text.replace(data, str(target)), encoding="utf-8")
    save_hf_model(fitted_models["rope"], str(root / "hf"), tokenizer, chat=True)
    return root / "hf", tasks, problems


@pytest.fixture(scope="module")
def results(setup):
    """One lm-eval run of both tasks (one model load instead of two): the chat template applied, as the README
    runs the sentiment task (lm-eval applies no template to a rolling likelihood, so the perplexity task is scored
    as the README runs it without the flag, which the equality with ours below shows), and [SEP] before each
    document."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    model_dir, tasks, _ = setup
    return simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32,prefix_token_id={SEP_ID}",
                           tasks=["zh_sentiment_mc", "zh_val_perplexity"],
                           task_manager=TaskManager(include_path=str(tasks)), apply_chat_template=True,
                           log_samples=True, batch_size=1, device="cpu")


def test_sentiment_accuracy_equals_ours_problem_by_problem(setup, results, tokenizer, fitted_models):
    _, _, problems = setup
    out = results
    accuracy, picked = harness.multiple_choice_accuracy(fitted_models["rope"], tokenizer, problems, ["正面", "负面"])
    samples = sorted(out["samples"]["zh_sentiment_mc"], key=lambda s: s["doc_id"])
    theirs = [max(range(2), key=lambda i: (s["filtered_resps"][i][0], -i)) for s in samples]
    assert theirs == picked
    assert out["results"]["zh_sentiment_mc"]["acc,none"] == accuracy
    # and each choice's log-likelihood, to float32 precision
    from chinese_tokenizer import chat_messages_ids

    context = chat_messages_ids([("user", problems[0]["prompt"])], tokenizer)
    ours = harness.continuation_log_likelihood(fitted_models["rope"], context, encode("负面", tokenizer))
    assert math.isclose(samples[0]["filtered_resps"][1][0], ours, rel_tol=1e-5, abs_tol=1e-4)


def test_perplexity_per_byte_equals_ours(results, tokenizer, fitted_models):
    assert len(encode(DOCUMENTS[0], tokenizer)) > 2 * 128  # three windows of the 128-position model
    out = results
    perplexity, bits = harness.byte_perplexity(fitted_models["rope"], tokenizer, DOCUMENTS)
    # document by document (the aggregate alone would hide a wrong first window: its error is spread over all bytes)
    samples = sorted(out["samples"]["zh_val_perplexity"], key=lambda s: s["doc_id"])
    for sample, text in zip(samples, DOCUMENTS, strict=True):
        ours = harness.rolling_log_likelihood(fitted_models["rope"], encode(text, tokenizer), SEP_ID)
        assert math.isclose(sample["filtered_resps"][0], ours, rel_tol=1e-5), text[:20]
    result = out["results"]["zh_val_perplexity"]
    assert math.isclose(result["byte_perplexity,none"], perplexity, rel_tol=1e-4)
    assert math.isclose(result["bits_per_byte,none"], bits, rel_tol=1e-4)
