"""The report card of ``pipeline.py`` (reports/report.md), one function per section.

* ``stage_table`` and ``notes_section``: each stage's wall time, tokens/s and final metrics beside the counting
  baseline it must beat, and what the baselines are;
* ``held_out_section``: the four ways to align the SFT model side by side on the held-out prompts, with the
  reward-hacking flags;
* ``skill_section``: the verifiable path, GRPO and PPO rewarded by a checker, on held-out review instructions;
* ``export_section``: the command that takes the best aligned model (and the RM) to ``transformers``;
* ``curves_section`` and ``answers_section``: the curves, and the same prompts answered by every model;
* ``write_report``: all of them, in that order.

It reads the checkpoints' ``config.json`` and ``metrics.jsonl``; it runs nothing.
"""

from __future__ import annotations

import json
import math
import os
import shutil

from chinese_tokenizer import encode, load_tokenizer
from gpt_model import GPTConfig
from plumbing.cli import UserError, default_path
from plumbing.flops import format_speed
from plumbing.gguf_export import llama_cpp_architecture
from plumbing.hf_weights import CLASSES, architecture_for
from plumbing.judge import best_of_n_kl, distinct_n, longest_repeat, reward_hacking_flag
from plumbing.markdown import markdown_table
from plumbing.tasks import LIMIT_BANDS

ALIGNED = ("ppo", "dpo", "grpo")  # the three alignment stages, each from the SFT model, measured alike
# the verifiable path: GRPO and PPO from the same SFT model, rewarded by the strict checker on the review
# instructions, and GRPO on the sentiment of reviews in a run of its own (its answers are two characters long)
TASK_ALIGNED = ("grpo-tasks", "ppo-tasks", "grpo-sentiment")
ANSWERING = ("pretrain", "sft") + ALIGNED + ("grpo-tasks",)  # the models that answer the report's prompts
# prompts answered by every model in the report: two review-writing tasks, a held-out length instruction (its limit
# is in no training instruction), a 歇后语, a definition, free text
REPORT_PROMPTS = ["写一条好评：", "写一条以“房间”开头的好评。", "写一条不超过二十个字的好评。", "歇后语：外甥打灯笼",
                  "请解释一下“明月”这个词。", "今天天气很好，"]
BEST_OF = (4, 16)  # best-of-n from the SFT model, from one run of 16 samples: the no-training baselines
# How the report's answers are decoded. Greedy decoding makes any small model loop ("国国国…"), so the answers are
# sampled: temperature 0.7 with nucleus (top-p 0.9, Holtzman et al. 2020) and CTRL's repetition penalty (Keskar et
# al. 2019) at a mild 1.1, one sample per prompt with generate.py's fixed --seed, so a rerun gives the same answers.
REPORT_DECODING = {"temperature": 0.7, "top_k": 0, "top_p": 0.9, "repetition_penalty": 1.1}


def fmt(value, spec: str = ".3f") -> str:
    """A number for a table, or "—" when there is none."""
    return "—" if value is None else format(value, spec)


def read_json(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def read_rows(path):
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def tokens_per_second(rows) -> float | None:
    """Training tokens per second from the last metrics row that records both counters."""
    for row in reversed(rows):
        if row.get("tokens_seen") and row.get("time_s"):
            return row["tokens_seen"] / row["time_s"]
    return None


def held_out_settings(metrics: dict) -> dict:
    """How the aligners sampled their held-out answers (prompts, samples per prompt, temperature, longest answer):
    the first alignment stage's record in ``metrics`` ({stage: its config's metrics}); {} when none has one. Every
    aligner records the same settings (``alignment.HeldOut``), so best-of-n repeats them to be compared with all."""
    return next((metrics[s]["held_out_settings"] for s in ALIGNED if metrics.get(s, {}).get("held_out_settings")), {})


def held_out_section(metrics: dict, best_of_n: dict | None = None, times: dict | None = None) -> list[str]:
    """Markdown lines: SFT, best-of-n, PPO, DPO and GRPO on the held-out prompts (each alignment stage's final
    monitors in ``metrics[stage]``, best-of-n from ``generate.py --monitors``), each stage's wall time from
    ``times``, then the reward-hacking flags. Nothing if no stage recorded held-out monitors."""
    aligned = [stage for stage in ALIGNED if metrics.get(stage, {}).get("held_out")]
    if not aligned:
        return []
    times = times or {}
    settings = held_out_settings(metrics)
    sft = metrics[aligned[0]]["held_out"]["sft"]
    rows = [("SFT", sft, f"{sft['kl']:.2f}", "—")]
    best_of_n = best_of_n or {}
    first = best_of_n.get("1")  # best-of-n's own starting point: the first of the same samples, no RM
    for n in [1] * (first is not None) + list(BEST_OF if best_of_n else ()):
        m = best_of_n[str(n)]
        rows.append((f"best-of-{n} (SFT + RM)" if n > 1 else "best-of-1 (SFT, its first sample)", m,
                     f"≤ {m['kl_bound']:.2f}",
                     f"{times['best_of_n']:.0f} s (one run of {max(BEST_OF)})" if "best_of_n" in times else "—"))
    for stage in aligned:
        m = metrics[stage]["held_out"][stage]
        rows.append((stage.upper(), m, f"{m['kl']:.2f} ± {m['kl_se']:.2f}",
                     f"{times[stage]:.0f} s" if stage in times else "—"))
    lines = ["## Four ways to align the SFT model (best-of-n, PPO, DPO, GRPO), on held-out prompts", "",
             f"{len(settings.get('prompts', []))} prompts × {settings.get('samples_per_prompt', '?')} samples at "
             f"temperature {settings.get('temperature', '?')}, up to {settings.get('max_new_tokens', '?')} tokens; "
             f"SFT, PPO, DPO and GRPO on the same draws of randomness. Best-of-n trains nothing: the RM keeps the "
             f"best of n answers that generate.py samples from the SFT model, one kept per prompt (so its standard "
             f"errors are wider); its best-of-1 row is the first of the same samples, what best-of-n starts from. "
             f"The RM is the one PPO and GRPO maximise; DPO learnt from the RM's training pairs "
             f"instead. Judge: snownlp's sentiment naive Bayes, P(positive), mean ± standard error, a model none "
             f"of them saw (see notes/judge.md for what it cannot tell). KL to SFT in nats per response, estimated "
             f"from the samples (the sum of log π/π_SFT over each answer's tokens, so a policy close to SFT can show "
             f"a little below 0); best-of-n's is the bound log n - (n - 1)/n. Wall time is the whole stage; when "
             f"the stages run in the pipeline's own process (the default --launch), the first of them also loads "
             f"the judge and measures the SFT policy (about 10 s on the demo), which the ones after it reuse.", "",
             "| model | RM score | judge | KL | distinct-2 | longest run | ends with [SEP] | mean length | wall time |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m, kl, wall in rows:
        lines.append(f"| {name} | {m['rm_score']:.3f} ± {m['rm_score_se']:.3f} | {m['judge']:.3f} ± "
                     f"{m['judge_se']:.3f} | {kl} | {m['distinct_2']:.3f} | {m['longest_run']:.1f} | "
                     f"{m['eos_share']:.0%} | {m['length']:.1f} | {wall} |")
    lines.append("")
    kl_limit = metrics[aligned[0]].get("kl_limit", "?")
    no_sign = ("no sign of reward hacking: none of the RM up with the judge down, repetition collapsing, fewer "
               "answers ending, KL past {} nats")
    for n in BEST_OF if best_of_n else ():
        m = best_of_n[str(n)]  # judged against its own first samples where there are, else against the SFT row
        flag = reward_hacking_flag(first or sft, {**m, "kl": m["kl_bound"]},
                                   kl_limit if isinstance(kl_limit, (int, float)) else math.inf)
        lines.append(f"- best-of-{n}: " + (f"**{flag}**" if flag else no_sign.format(kl_limit) +
                                           (", against best-of-1." if first is not None else ".")))
    for stage in aligned:
        differs = abs(metrics[stage]["held_out"]["sft"]["rm_score"] - sft["rm_score"]) > 1e-3
        flag = metrics[stage].get("reward_hacking")
        lines.append(f"- {stage.upper()}: " + (f"**{flag}**" if flag else
                     no_sign.format(metrics[stage].get('kl_limit', '?')) + ".") +
                     (" (Its SFT measurement differs from the table's: the stages' held-out settings differ.)"
                      if differs else ""))
    return lines + [""]


# Per family of the verifiable path (tasks.task_monitors keys the figures by family): the card's heading, an example
# problem, its held-out split and what keeps it apart from training, what the strict checker wants, what a gain
# means, and the pass rate of a blind guess where there is one
SKILL_FAMILIES = {
    "instruction": dict(heading="Review instructions on held-out limits", example="“写一条不超过二十个字的好评。”",
                        held_out="`data/instructions/test.jsonl`, whose limits no training instruction holds",
                        right="it ended with [SEP], keeps the limit, reads as a review (8-120 characters, other "
                              "Chinese characters than a repeated phrase) and does not copy the instruction (half of "
                              "its characters in order)",
                        learnt="it keeps more limits it never trained on", guess=None),
    "sentiment": dict(heading="The sentiment of held-out reviews",
                      example="“这条评论是正面的还是负面的？“只能说是一般般了””",
                      held_out="`data/sentiment/test.jsonl`, whose reviews are taken from the RM's test reviews, "
                               "which no stage trains on (not the RM's pairs, SFT or any prompt), half 正面 (positive) "
                               "and half 负面",
                      right="it ended with [SEP] and is the review's label, 正面 or 负面, and nothing else",
                      learnt="it learnt to tell the sentiment of reviews it never saw labelled", guess=0.5),
}


def skill_section(metrics: dict, times: dict | None = None) -> list[str]:
    """Markdown lines: "A skill checked exactly", the verifiable path on held-out problems, one part per family of
    ``SKILL_FAMILIES`` that a stage of ``TASK_ALIGNED`` measured (``family_part``). Nothing if no such stage ran."""
    measured = {stage: metrics[stage] for stage in TASK_ALIGNED if metrics.get(stage, {}).get("held_out")}
    if not measured:
        return []
    lines = ["## A skill checked exactly", "",
             "GRPO and PPO rewarded by a program instead of the RM (`--verifier exact`, `plumbing/verifiers.py`), "
             "each measured on the held-out problems of the families it trained on, a table per family below. An "
             "answer is right when the strict checker accepts it. Greedy: one answer per problem; sampled pass@1: "
             "several answers per problem at temperature 1 (more for SFT); ± one standard error over problems. "
             "Best-of-k trains nothing: it is pass@k of the SFT model's samples, the verifier picking a right one "
             "when there is one, and its KL is the bound log k - (k - 1)/k at most. KL, mean length (tokens) and "
             "[SEP] share are the family's own; the wall time is the whole stage's.", ""]
    for family in SKILL_FAMILIES:
        stages = {stage: m for stage, m in measured.items() if f"{family}_pass1" in m["held_out"]["sft"]}
        if stages:
            lines += family_part(family, stages, times or {})
    return lines


def family_part(family: str, stages: dict, times: dict) -> list[str]:
    """Markdown lines for one family: its heading, what its problems are and how they were sampled, then a table
    with the rows SFT, best-of-4 and best-of-16 by the verifier (pass@4 and pass@16 of the SFT model's samples per
    problem, as the first of ``stages`` measured them), then each of ``stages`` ({stage: its final metrics}, each
    ``metrics["held_out"]`` from ``tasks.task_monitors``) with greedy and sampled accuracy, KL, length, the [SEP] share,
    and for the instructions the RM score and judge of the answers to the problems that ask for a 好评; under the
    table one sentence per aligner on what its gain means (or that the pipeline did not run it on this family)."""
    about, f = SKILL_FAMILIES[family], family + "_"  # f: the prefix of the family's figures
    first = next(iter(stages.values()))
    settings, sft = first["held_out_settings"], first["held_out"]["sft"]

    def pct(m, key):
        return f"{m[key]:.1%} ± {m[key + '_se']:.1%}" if key in m else "—"

    def judged(m):
        return (f"{m['rm_score']:.3f} ± {m['rm_score_se']:.3f}", f"{m['judge']:.3f} ± {m['judge_se']:.3f}") \
            if "rm_score" in m and family == "instruction" else ("—", "—")

    rows = [("SFT", pct(sft, f + "greedy"), pct(sft, f + "pass1"), "0", f"{sft[f + 'length']:.1f}",
             f"{sft[f + 'eos_share']:.0%}", *judged(sft), "—")]
    for k in (4, 16):
        rows.append((f"best-of-{k} (SFT + verifier)", "—", pct(sft, f"{f}pass{k}"), f"≤ {best_of_n_kl(k):.2f}",
                     "—", "—", "—", "—", "—"))
    sentences, aligned = [], {}  # aligned: {name: its task monitors}, for the length table
    for stage, metrics in stages.items():
        name = stage.split("-")[0]
        m = aligned[name] = metrics["held_out"][name]
        rows.append((f"{name.upper()} (verifier)", pct(m, f + "greedy"), pct(m, f + "pass1"),
                     f"{m[f + 'kl']:.2f} ± {m[f + 'kl_se']:.2f}", f"{m[f + 'length']:.1f}",
                     f"{m[f + 'eos_share']:.0%}", *judged(m), f"{times[stage]:.0f} s" if stage in times else "—"))
        sentences.append(gain_sentence(name, sft, m, f, dict(about, learnt=what_was_learnt(family, sft, m, about)),
                                       metrics.get("reward_hacking")))
        weight = metrics["held_out_settings"].get("rm_weight", 0.0)
        if family == "instruction" and weight and "rm_score" in m:
            sentences.append(f"  Its reward counted the RM's score of the reviews too (negated on a 差评, its "
                             f"advantage added at weight {weight:g} to the verifier's: `--rm_weight`), so its RM score "
                             f"is not an independent check: the judge is.")
    sentences += [f"- {name.upper()} with the verifier: not run on this family by the pipeline (its time budget)."
                  for name in ("grpo", "ppo") if name not in aligned]
    count = f"{int(sft[f + 'problems'])} " if f + "problems" in sft else ""
    judge_note = (f" RM score and judge, as in the table above: the first {judged_answers(settings)} sampled "
                  f"answers of each of the {int(sft.get('praise_problems', 0))} problems that ask for a 好评 (both "
                  f"score how positive a review is, so on a 差评 the higher score would be the worse answer): keeping "
                  f"a limit must not be bought with worse reviews." if family == "instruction" and "rm_score" in sft
                  else "")
    return [f"### {about['heading']}", "",
            f"{count}held-out problems such as {about['example']}: {about['held_out']}. Right: {about['right']}."
            + (f" A blind guess scores {about['guess']:.0%}." if about["guess"] is not None else "")
            + f" Sampled: {settings['samples_per_prompt']} answers per problem "
              f"({settings['sft_samples_per_prompt']} for SFT) at "
              f"temperature {settings['temperature']:g}, up to {settings['max_new_tokens']} tokens." + judge_note, "",
            markdown_table(("model", "greedy", "sampled pass@1", "KL", "mean length", "ends with [SEP]", "RM score",
                            "judge", "wall time"), rows).rstrip("\n"), ""] + sentences + [""] \
        + (length_part(sft, aligned) if family == "instruction" else [])


def length_part(sft: dict, aligned: dict) -> list[str]:
    """Markdown lines: the mean answer length in characters by band of the limit N (``tasks.LIMIT_BANDS``) for SFT
    and each aligned model ({name: its task monitors}), with the rank correlation of N with the length over the
    held-out limits: the evidence for what a gain on "at most N" is (``what_was_learnt``). Nothing when SFT's
    measurement has no lengths (a run from before they were measured)."""
    if "instruction_length_rho" not in sft:
        return []
    bands = [(lo, hi) for lo, hi in LIMIT_BANDS if f"instruction_chars_{lo}_{hi}" in sft]
    rows = []
    for name, m in (("SFT", sft), *((n.upper() + " (verifier)", m) for n, m in aligned.items())):
        rows.append((name, *(fmt(m.get(f"instruction_chars_{lo}_{hi}"), ".1f") for lo, hi in bands),
                     f"{m['instruction_chars']:.1f} ± {m['instruction_chars_se']:.1f}",
                     f"{m['instruction_length_rho']:+.2f} ± {m['instruction_length_rho_se']:.2f}"
                     if "instruction_length_rho" in m else "—"))
    return ["Does the answer's length follow the limit? Mean length in characters of the sampled answers, by the "
            "limit N asked for, and the rank correlation of N with the mean length over the "
            f"{int(sft['instruction_limits'])} held-out limits (± one standard error; a model that reads N writes "
            "longer when N is larger, one that writes short keeps more limits at every N alike):", "",
            markdown_table(("model", *(f"N {lo}-{hi}" for lo, hi in bands), "all", "rank correlation with N"),
                           rows).rstrip("\n"), ""]


def what_was_learnt(family: str, sft: dict, m: dict, about: dict) -> str:
    """What a gain on the family means, from the evidence: for the instructions, "it reads the limit" only when its
    answers' length rises with N (rank correlation above two standard errors), "it keeps more limits by writing
    shorter" when its length does not follow N and fell by more than two standard errors, else that the length
    explains neither; for another family, or without lengths, ``about["learnt"]``."""
    if family != "instruction" or "instruction_length_rho" not in m or "instruction_chars" not in sft:
        return about["learnt"]
    rho, se = m["instruction_length_rho"], m["instruction_length_rho_se"]
    follows = f"rank correlation of N with the length {rho:+.2f} ± {se:.2f}"
    if rho > 2 * se:
        return f"it reads the limit: its answers grow with N ({follows})"
    before, after = sft["instruction_chars"], m["instruction_chars"]
    spread = math.hypot(sft["instruction_chars_se"], m["instruction_chars_se"])
    if before - after > 2 * spread:
        return (f"it keeps more limits by writing shorter ({before:.1f} → {after:.1f} characters), not by reading "
                f"the limit: its length does not follow N ({follows})")
    return (f"it keeps more limits, though its length neither follows N ({follows}) nor fell beyond noise "
            f"({before:.1f} → {after:.1f} characters)")


def judged_answers(settings: dict) -> str:
    """How many of each 好评 problem's sampled answers the RM and the judge scored (``held_out.READ_SAMPLES`` at
    most, and no more than were drawn): "4", or "4 (2 for the aligned models)" when the aligned models drew fewer
    than the SFT."""
    if "rm_samples" not in settings:
        return "?"
    sft, aligned = (min(settings["rm_samples"], settings[k])
                    for k in ("sft_samples_per_prompt", "samples_per_prompt"))
    return f"{sft}" if sft == aligned else f"{sft} ({aligned} for the aligned models)"


def gain_sentence(name: str, sft: dict, m: dict, f: str, about: dict, flag: str | None) -> str:
    """One line on an aligner's gain on a family (figures prefixed ``f``): SFT's sampled pass@1 -> ``m``'s, what the
    gain means (learnt, only a blind guess's rate, or nothing told from chance), the KL, and the stage's reward-hacking
    ``flag`` if any."""
    gain, se = m[f + "pass1"] - sft[f + "pass1"], math.hypot(m[f + "pass1_se"], sft[f + "pass1_se"])
    head = f"- {name.upper()} with the verifier: sampled pass@1 {sft[f + 'pass1']:.1%} → {m[f + 'pass1']:.1%}"
    if se == 0:  # every problem scored alike (the tiny preset's smoke test): nothing to weigh the gain with
        return head + ", with no spread across problems to tell a gain from chance." + (f" **{flag}**" if flag else "")
    learnt, guess = about["learnt"], about["guess"]
    if guess is not None and m[f + "pass1"] - guess <= 3 * m[f + "pass1_se"]:  # no better than guessing
        learnt = f"the answers took the right form, but they are no better than a blind guess ({guess:.0%})"
    return (head + ", " + (f"**{gain * 100:+.1f} points, {gain / se:.1f} standard errors**: {learnt}" if gain > 3 * se
                           else f"{gain * 100:+.1f} points ({gain / se:.1f} standard errors): RL gained nothing that "
                                f"this measurement can tell from chance")
            + f", at KL {m[f + 'kl']:.2f} nats per response." + (f" **{flag}**" if flag else ""))


def aligned_summary(stage: str, metrics: dict, fmt, first_row: dict | None = None) -> str:
    """The stage table's cell for an alignment stage: held-out RM score and judge, SFT -> the stage, and KL (and
    DPO's implicit-reward accuracy on its val pairs, from the step-0 row ``first_row`` to the end)."""
    held = metrics.get("held_out", {})
    sft, aligned = held.get("sft", {}), held.get(stage, {})
    start = (first_row or {}).get("val_accuracy")
    pairs = (f"val implicit-reward accuracy {fmt(start) + ' → ' if start is not None else ''}"
             f"{fmt(metrics.get('val_accuracy'))}; ") if stage == "dpo" else ""
    return (f"{pairs}held-out RM score {fmt(sft.get('rm_score'))} (SFT) → {fmt(aligned.get('rm_score'))}, judge "
            f"{fmt(sft.get('judge'))} → {fmt(aligned.get('judge'))}, KL {fmt(metrics.get('kl'), '.2f')} nats/response")


def task_summary(stage: str, metrics: dict) -> str:
    """The stage table's cell for a stage of the verifiable path: held-out sampled pass@1 per family (and over all
    when it trained on more than one), SFT -> the stage, greedy over all, and KL."""
    tasks, name = metrics.get("held_out", {}), stage.split("-")[0]
    sft, aligned = tasks.get("sft", {}), tasks.get(name, {})

    def change(key):  # SFT's figure -> the stage's
        return f"{fmt(sft.get(key), '.1%')} → {fmt(aligned.get(key), '.1%')}"

    families = [family for family in SKILL_FAMILIES if family + "_pass1" in sft]
    passed = ", ".join(f"{family} {change(family + '_pass1')}" for family in families + ["all"] * (len(families) > 1))
    return (f"held-out problems: sampled pass@1 (SFT → {name.upper()}) {passed}; greedy {change('all_greedy')}, KL "
            f"{fmt(metrics.get('kl'), '.2f')} nats/response")


FLOP_KINDS = (("train", "training"), ("forward", "scoring and reference passes"), ("sample", "sampling"),
              ("held_out", "held-out measurement"))


def flops_table(records: dict, best_of_n: dict | None = None) -> list[str]:
    """Markdown lines: for each stage that recorded its FLOPs by kind (``flops.FlopCounter``), and best-of-n, their
    total and the share of each kind in it, so that a reader sees which part of a stage its arithmetic goes to."""
    rows = []
    recorded = [(stage, record["config"].get("flops")) for stage, record in records.items()]
    for stage, flops in recorded + [("best-of-n", (best_of_n or {}).get("speed", {}).get("flops"))]:
        flops = flops or {}
        total = sum(flops.values())
        if total:
            rows.append((stage, f"{total:.3g}", *(f"{flops.get(kind, 0) / total:.0%}" for kind, _ in FLOP_KINDS)))
    if not rows:
        return []
    return [markdown_table(("stage", "FLOPs", *(name for _, name in FLOP_KINDS)), rows).rstrip("\n"), ""]


def best_matmul(records: dict, best_of_n: dict | None = None) -> dict:
    """{(device, precision): the fastest ``matmul_flop_s`` any stage of the run measured on that device in that
    autocast precision}: the yardstick of every stage's matmul share. One measurement is a handful of products at a
    stage's end; on a shared machine it can fall in a slow second, and the share it gives would then be too high."""
    best = {}
    configs = [r["config"] for r in records.values()] + [(best_of_n or {}).get("speed", {})]
    for config in configs:
        if config.get("matmul_flop_s"):
            key = yardstick_key(config)
            best[key] = max(best.get(key, 0.0), config["matmul_flop_s"])
    return best


def yardstick_key(config: dict) -> tuple:
    """(device, autocast precision) of a stage's ``config.json`` or a ``speed_record`` (generate.py runs on the CPU
    without autocast unless its record says otherwise)."""
    return config.get("device", "cpu"), config.get("mixed_precision", "no")


def with_yardstick(config: dict, best: dict) -> dict:
    """``config`` with its ``matmul_flop_s`` replaced by the run's fastest on the same device and precision."""
    key = yardstick_key(config)
    return {**config, "matmul_flop_s": best[key]} if config.get("matmul_flop_s") and key in best else config


def stage_table(preset: str, launch: str, times: dict, records: dict, baselines: dict,
                best_of_n: dict | None = None) -> list[str]:
    """Markdown lines: one row per step of the pipeline (wall time, training tokens/s, FLOP/s and its share, final
    metrics beside the counting baseline each one bounds), then the precision and device line and ``flops_table``.
    ``records``: ``read_records``; ``best_of_n``: ``generate.py --monitors``' dict, with the ``speed`` of its run."""
    m, b = {stage: r["metrics"] for stage, r in records.items()}, baselines
    yardstick = best_matmul(records, best_of_n)

    def speed(stage):  # the tokens/s and FLOP/s cells
        record = records[stage]
        return fmt(tokens_per_second(record["rows"]), ",.0f"), format_speed(with_yardstick(record["config"], yardstick))

    rows = [("data/prepare.py", f"{times['data']:.0f} s", "—", "—",
             f"{'already built; ' if times['data'] < 1 else ''}see data/MANIFEST.json"),
            ("counting baselines", f"{times.get('baselines', 0):.0f} s", "—", "—",
             "token bigram, response bigram and naive Bayes (`baselines.py`), fitted on the train splits; each is "
             "shown beside the figure it bounds, and explained under the table"),
            ("0-PRETRAIN", f"{times['pretrain']:.0f} s", *speed("pretrain"),
             f"val loss {fmt(m['pretrain'].get('val_loss'))} (counting baseline: token bigram "
             f"{fmt(b.get('bigram_val_loss'))}), perplexity {fmt(m['pretrain'].get('val_perplexity'), '.1f')}"),
            ("1-SFT", f"{times['sft']:.0f} s", *speed("sft"),
             f"val response loss {fmt(m['sft'].get('val_loss'))} (pretrained model: "
             f"{fmt(m['sft'].get('val_loss_before_sft'))}; counting baseline: response bigram "
             f"{fmt(b.get('response_bigram_val_loss'))})"),
            ("2-RM", f"{times['rm']:.0f} s", *speed("rm"),
             f"test accuracy {fmt(m['rm'].get('test_accuracy'))} (counting baseline: naive Bayes "
             f"{fmt(b.get('naive_bayes_test_accuracy'))}), test margin {fmt(m['rm'].get('test_margin'))}"),
            *[(f"3-{stage.upper()}", f"{times[stage]:.0f} s", *speed(stage),
               aligned_summary(stage, m[stage], fmt, (records[stage]["rows"] or [{}])[0])) for stage in ALIGNED],
            *[(f"3-{stage.split('-')[0].upper()} --verifier exact "
               f"({', '.join(m[stage].get('held_out_settings', {}).get('families', []))})", f"{times[stage]:.0f} s",
               *speed(stage), task_summary(stage, m[stage])) for stage in TASK_ALIGNED if stage in m],
            ("generation", f"{times['generate']:.0f} s", "—", "—",
             f"{len(ANSWERING)} models × {len(REPORT_PROMPTS)} prompts"),
            ("best-of-n", f"{times.get('best_of_n', 0):.0f} s", "—",
             format_speed(with_yardstick((best_of_n or {}).get("speed", {}), yardstick)),
             f"{max(BEST_OF)} samples per held-out prompt from the SFT model, scored by the RM")]
    precisions = sorted({r["config"].get("mixed_precision", "no") for r in records.values()})
    devices = sorted({r["config"].get("device", "?") for r in records.values()})
    return [f"# Report card — preset `{preset}`", "", f"Data: `data/MANIFEST.json`. Launch: `{launch}`.", "",
            markdown_table(("stage", "wall time", "tokens/s", "FLOP/s", "final metrics"), rows).rstrip("\n"),
            "", f"Precision: {', '.join(precisions)} autocast (`--mixed_precision`; bf16 where the CPU or GPU "
            f"computes it natively). Device: {', '.join(devices)}. Tokens/s: the tokens a stage trained on over its "
            f"whole wall time. FLOP/s: every pass the stage ran on its models (training 6N + 12·L·H·Q·T per token, "
            f"a forward pass for scoring or sampling 2N + 4·L·E per token and key it attends to; "
            f"`plumbing/flops.py`) over its whole wall time; beside it the MFU, the share of the GPU's dense bf16 "
            f"peak, or on a CPU, which has no datasheet peak here, the share of what one 1024 × 1024 matrix "
            f"product reached in the same precision: measured at the end of every stage, the fastest of the run "
            f"(one taken while the machine's neighbours slowed it would flatter the stage it ended). Where each "
            f"stage's arithmetic goes:", "",
            *flops_table(records, best_of_n)]


BASELINES_EXPLAINED = (
    "Counting baselines, computed by the pipeline on the same splits: the *token bigram* is the cross-entropy of an "
    "interpolated Kneser–Ney bigram fitted on `data/pretrain/train.jsonl` (each token predicted from the one before "
    "it alone); a pretrained model that does not beat it has learnt no more than which token tends to follow which. "
    "The *response bigram* is the same kind of bigram fitted on the SFT training responses only and scored on the "
    "same val response tokens as SFT's loss; a fine-tuned model that does not beat it answers no better than a table "
    "of which token follows which in answers. The *naive Bayes* is a character uni+bigram classifier fitted on the "
    "RM's training pairs (chosen = good, rejected = bad); a reward model that does not beat it ranks answers no "
    "better than counting their characters.")
TINY_WARNING = (
    "**The `tiny` preset is a smoke test**: a 2-layer, 32-wide model trained for a few dozen steps, which the tests "
    "use to run every stage in seconds. Its figures are not meant to beat the baselines, and they do not; run the "
    "`demo` preset (`make pipeline`) for a report card whose numbers mean something.")


def notes_section(preset: str, kept) -> list[str]:
    """Markdown lines under the stage table: which stages ``--resume`` kept, what the baselines are, and the tiny
    preset's warning."""
    lines = [f"Kept from the earlier run by `--resume`: {', '.join(kept)}; their wall times are their training "
             f"loops' in that run.", ""] if kept else []
    lines += [BASELINES_EXPLAINED, ""]
    return lines + ([TINY_WARNING, ""] if preset == "tiny" else [])


def export_section(records: dict, checkpoints: dict) -> list[str]:
    """Markdown lines: the ``load_weight.py --to_hf`` commands for the aligned model with the highest held-out judge
    score among those without a reward-hacking flag (all of them if every one is flagged) and for the RM, with the
    ``transformers`` class each becomes, and the ``--to_gguf`` command that takes the aligned model to llama.cpp
    and ollama (or why it cannot go). Nothing if no alignment stage measured its held-out answers."""
    judged = [(r["metrics"]["held_out"][stage]["judge"], stage) for stage, r in records.items()
              if stage in ALIGNED and r["metrics"].get("held_out", {}).get(stage)]
    if not judged:
        return []
    clean = [(j, stage) for j, stage in judged if not records[stage]["metrics"].get("reward_hacking")]
    judge, best = max(clean or judged)
    lines = ["## Take the models elsewhere", ""]
    for stage, why in ((best, f"the aligned model with the highest judge score ({judge:.3f})"
                              f"{'' if clean else ', although every aligner is flagged'}"), ("rm", "the reward model")):
        if stage not in records:
            continue
        try:
            cfg = GPTConfig.from_dict(records[stage]["config"]["model"])
            name = CLASSES[architecture_for(cfg)][1 if stage == "rm" else 0]
        except (KeyError, TypeError, ValueError, UserError) as e:
            lines.append(f"- {stage.upper()}, {why}, cannot be exported: {e}")
            continue
        out, path = os.path.join("hf", stage), os.path.relpath(checkpoints[stage])
        path = checkpoints[stage] if path.startswith("..") else path  # short when under the working directory
        lines.append(f"- {stage.upper()}, {why}: `python load_weight.py --checkpoint {path} --to_hf "
                     f"{out}` writes a `{name}` that `transformers` loads with `from_pretrained(\"{out}\")`"
                     f"{', its tokenizer with the chat template' if stage != 'rm' else ''}.")
        if stage != "rm":
            try:
                gguf = f"llama.cpp's `{llama_cpp_architecture(cfg)}`"
            except UserError as e:
                lines.append(f"  It cannot go to llama.cpp: {e}.")
                continue
            lines.append(f"  For llama.cpp and ollama: `python load_weight.py --checkpoint {path} --to_gguf "
                         f"gguf/{stage}.gguf --gguf_type q8_0` writes one GGUF file ({gguf}, with the chat "
                         f"template) and `gguf/{stage}.Modelfile`; then `llama-cli -m gguf/{stage}.gguf --jinja -cnv` "
                         f"or `ollama create {stage} -f gguf/{stage}.Modelfile`.")
    return lines + [""]


def curves_section(checkpoints: dict, report_dir: str) -> list[str]:
    """Markdown lines: every stage's curves, each PNG copied next to the report as ``<stage>-<name>``."""
    lines = ["## Curves", ""]
    for stage, folder in checkpoints.items():
        for name in sorted(os.listdir(folder)):
            if name.endswith(".png"):
                shutil.copy2(os.path.join(folder, name), os.path.join(report_dir, f"{stage}-{name}"))
                lines.append(f"![{stage}]({stage}-{name})")
    return lines


MODEL_NAMES = {"pretrain": "pretrain", "sft": "SFT", "ppo": "PPO", "dpo": "DPO", "grpo": "GRPO",
               "grpo-tasks": "GRPO (verifier)", "ppo-tasks": "PPO (verifier)"}


def answers_section(answers: dict, tokenizer) -> list[str]:
    """Markdown lines: the report's prompts answered by every model of ``ANSWERING`` (``answers[stage]``: rows of
    ``generate.py --prompts_file``), each with its RM score, distinct-2 and longest repeated run."""
    d = REPORT_DECODING
    decoding = f"temperature {d['temperature']}, top-p {d['top_p']}, repetition penalty {d['repetition_penalty']}"
    rows = []
    for i, prompt in enumerate(REPORT_PROMPTS):
        for j, stage in enumerate(ANSWERING):
            row = answers[stage][i] if i < len(answers[stage]) else {}
            text = str(row.get("response", ""))
            ids = encode(text, tokenizer)
            rows.append((prompt if j == 0 else "", MODEL_NAMES[stage], text.replace("\n", " "),
                         fmt(row.get("score"), ".2f"), f"{distinct_n([ids]):.2f}", longest_repeat(ids)))
    return ["", f"## The same prompts, {len(ANSWERING)} models", "",
            f"One sample per prompt and model ({decoding}; seed 1234), up to 48 tokens. Beside each answer: its RM "
            f"score, its distinct-2 (d-2: different token pairs / token pairs; 1 = no pair repeated) and its "
            f"longest repeated run in tokens (one n-gram written again and again back to back; 0 = none). "
            f"Distinct-2 under 0.5 or a run over 8 is degenerate text, whatever its score.", "",
            markdown_table(("prompt", "model", "answer", "RM", "d-2", "run"), rows).rstrip("\n")]


def read_records(checkpoints: dict) -> dict:
    """``{stage: {"config", "metrics", "rows"}}`` of every checkpoint folder in ``checkpoints`` ({stage: folder}):
    its config.json, the final metrics in it and its metrics.jsonl rows."""
    records = {}
    for stage, folder in checkpoints.items():
        config = read_json(os.path.join(folder, "config.json"))
        records[stage] = {"config": config, "metrics": config.get("metrics", {}),
                          "rows": read_rows(os.path.join(folder, "metrics.jsonl"))}
    return records


def write_report(report_dir: str, checkpoints: dict, preset: str, launch: str, times: dict, answers: dict,
                 best_of_n=None, baselines=None, kept=()) -> str:
    """``report_dir/report.md``, section after section: the stage table, the notes under it, the held-out comparison
    of the aligners, the verifiable path, the export commands, the curves and the answers table (``kept``: the stages
    that ``--resume`` kept from the earlier run). Returns the Markdown."""
    records = read_records(checkpoints)
    metrics = {stage: r["metrics"] for stage, r in records.items()}
    lines = (stage_table(preset, launch, times, records, baselines or {}, best_of_n) + notes_section(preset, kept)
             + held_out_section(metrics, best_of_n, times) + skill_section(metrics, times)
             + export_section(records, checkpoints)
             + curves_section(checkpoints, report_dir)
             + answers_section(answers, load_tokenizer(default_path("data", "tokenizer"))))
    report = "\n".join(lines) + "\n"
    with open(os.path.join(report_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(report)
    return report
