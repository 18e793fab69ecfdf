"""pipeline.py's report card: the held-out table of SFT, best-of-n, PPO, DPO and GRPO and the reward-hacking
sentences."""

import math
import os

import pytest

import pipeline
from plumbing import report

MONITORS = {"rm_score": 0.5, "rm_score_se": 0.1, "judge": 0.6, "judge_se": 0.02, "kl": 0.0, "kl_se": 0.0,
            "distinct_2": 0.9, "longest_run": 2.0, "eos_share": 0.25, "length": 30.0}
SETTINGS = {"prompts": ["a", "b"], "samples_per_prompt": 4, "temperature": 1.0, "max_new_tokens": 40}


def best_of(n, rm_score):
    return {**MONITORS, "rm_score": rm_score, "best_of_n": n, "kl_bound": math.log(n) - (n - 1) / n}


def test_held_out_section_has_a_row_per_model_and_each_flag():
    ppo = {**MONITORS, "rm_score": 2.0, "kl": 2.5, "kl_se": 0.3, "eos_share": 0.5}
    dpo = {**MONITORS, "rm_score": 1.5, "kl": 4.0, "kl_se": 0.5, "judge": 0.7}
    grpo = {**MONITORS, "rm_score": 3.0, "kl": 1.0, "kl_se": 0.1}
    metrics = {"ppo": {"held_out": {"sft": MONITORS, "ppo": ppo}, "kl_limit": 3.0, "held_out_settings": SETTINGS,
                       "reward_hacking": ""},
               "dpo": {"held_out": {"sft": MONITORS, "dpo": dpo}, "kl_limit": 3.0,
                       "reward_hacking": "reward hacking suspected: KL to the SFT model is 4.00 nats/response."},
               "grpo": {"held_out": {"sft": {**MONITORS, "rm_score": 0.7}, "grpo": grpo}, "kl_limit": 3.0,
                        "reward_hacking": ""}}
    times = {"ppo": 100.4, "dpo": 60.0, "grpo": 80.0, "best_of_n": 30.2}
    lines = report.held_out_section(metrics, {"4": best_of(4, 1.0), "16": best_of(16, 1.8)}, times)
    text = "\n".join(lines)
    rows = [line for line in lines if line.startswith("| ") and not line.startswith("| model")]
    assert [r.split(" | ")[0] for r in rows] == ["| SFT", "| best-of-4 (SFT + RM)", "| best-of-16 (SFT + RM)",
                                                  "| PPO", "| DPO", "| GRPO"]
    assert "| SFT | 0.500 ± 0.100 | 0.600 ± 0.020 | 0.00 | 0.900 | 2.0 | 25% | 30.0 | — |" in text
    assert "| best-of-4 (SFT + RM) | 1.000 ± 0.100 | 0.600 ± 0.020 | ≤ 0.64 |" in text
    assert "| best-of-16 (SFT + RM) | 1.800 ± 0.100 | 0.600 ± 0.020 | ≤ 1.84 |" in text
    assert "30 s (one run of 16)" in text
    assert "| PPO | 2.000 ± 0.100 | 0.600 ± 0.020 | 2.50 ± 0.30 | 0.900 | 2.0 | 50% | 30.0 | 100 s |" in text
    assert "| DPO | 1.500 ± 0.100 | 0.700 ± 0.020 | 4.00 ± 0.50 |" in text and "| 60 s |" in text
    assert "- DPO: **reward hacking suspected: KL to the SFT model is 4.00 nats/response.**" in text
    assert "- PPO: no sign of reward hacking" in text and "KL past 3.0 nats" in text
    assert text.count("Its SFT measurement differs") == 1  # GRPO's SFT row is not the table's
    assert "2 prompts × 4 samples" in text


def test_held_out_section_with_one_stage_and_no_best_of_n():
    metrics = {"ppo": {"held_out": {"sft": MONITORS, "ppo": MONITORS}, "kl_limit": 3.0, "reward_hacking": ""},
               "dpo": {}}
    text = "\n".join(report.held_out_section(metrics))
    assert "| best-of" not in text and text.count("| PPO |") == 1 and "| DPO |" not in text
    assert "no sign of reward hacking" in text
    assert report.held_out_section({"ppo": {}}) == []  # checkpoints from before the monitors


def task_monitors(pass1, pass1_se, greedy=0.1, kl=0.0, families=("instruction",), **more):
    """Monitors as tasks.task_monitors writes them, the same figures for "all" and for each of ``families``."""
    out = {}
    for scope in ("all", *families):
        out.update({f"{scope}_greedy": greedy, f"{scope}_greedy_se": 0.01, f"{scope}_pass1": pass1,
                    f"{scope}_pass1_se": pass1_se, f"{scope}_kl": kl, f"{scope}_kl_se": 0.1,
                    f"{scope}_length": 25.0, f"{scope}_eos_share": 0.95, f"{scope}_problems": 500.0})
    return {**out, "kl": kl, "kl_se": 0.1, "length": 25.0, "eos_share": 0.95, **more}


def test_skill_section_rows_and_what_each_gain_means():
    """Rows SFT, best-of-4, best-of-16 (pass@k of the SFT samples), GRPO and PPO with the verifier; a gain of 12
    points over standard errors 1.0 and 1.2 is hypot(1.0, 1.2) = 1.56 points of error, 7.7 of them; PPO's +1 point
    over the same errors is 0.6 of them: nothing learnt, and said so."""
    judged = {k: MONITORS[k] for k in ("rm_score", "rm_score_se", "judge", "judge_se")}
    sft = task_monitors(0.50, 0.010, greedy=0.12, instruction_pass4=0.8, instruction_pass4_se=0.01,
                        instruction_pass16=0.95, instruction_pass16_se=0.005, praise_problems=250.0, **judged)
    settings = {"samples_per_prompt": 8, "sft_samples_per_prompt": 16, "temperature": 1.0, "max_new_tokens": 64,
                "rm_samples": 4}
    grpo = task_monitors(0.62, 0.012, greedy=0.8, kl=1.76, **{**judged, "rm_score": 0.4})
    metrics = {"grpo-tasks": {"held_out": {"sft": sft, "grpo": grpo},
                              "held_out_settings": {**settings, "rm_weight": 0.1}, "reward_hacking": ""},
               "ppo-tasks": {"held_out": {"sft": sft, "ppo": task_monitors(0.51, 0.012, kl=0.2)},
                             "held_out_settings": settings, "reward_hacking": ""}}
    lines = report.skill_section(metrics, {"grpo-tasks": 200.2})
    text = "\n".join(lines)
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| model")]
    assert [r.split(" | ")[0] for r in rows] == ["| SFT", "| best-of-4 (SFT + verifier)",
                                                  "| best-of-16 (SFT + verifier)", "| GRPO (verifier)",
                                                  "| PPO (verifier)"]
    assert "| SFT | 12.0% ± 1.0% | 50.0% ± 1.0% | 0 | 25.0 | 95% | 0.500 ± 0.100 | 0.600 ± 0.020 | — |" in text
    assert "| best-of-4 (SFT + verifier) | — | 80.0% ± 1.0% | ≤ 0.64 |" in text
    assert "| best-of-16 (SFT + verifier) | — | 95.0% ± 0.5% | ≤ 1.84 |" in text
    assert "| GRPO (verifier) | 80.0% ± 1.0% | 62.0% ± 1.2% | 1.76 ± 0.10 | 25.0 | 95% | 0.400 ± 0.100 |" in text
    assert "| 200 s |" in text and "| PPO (verifier) | 10.0% ± 1.0% | 51.0% ± 1.2% | 0.20 ± 0.10 |" in text
    assert "50.0% → 62.0%, **+12.0 points, 7.7 standard errors**" in text
    assert "+1.0 points (0.6 standard errors): RL gained nothing" in text
    # GRPO's reward counted the RM (--rm_weight), PPO's did not: only GRPO's RM score is said to be no check
    lines = text.splitlines()
    said = [i for i, line in enumerate(lines) if "its advantage added at weight 0.1 to the verifier's" in line]
    assert len(said) == 1 and lines[said[0] - 1].startswith("- GRPO")
    assert "500 held-out problems such as" in text and "the first 4 sampled answers of each of the 250 problems" in text
    # aligned models that drew 2 answers a problem were judged on those 2: the card says so, not "the first 4"
    fewer = {stage: {**m, "held_out_settings": {**m["held_out_settings"], "samples_per_prompt": 2}}
             for stage, m in metrics.items()}
    assert "the first 4 (2 for the aligned models) sampled answers" in "\n".join(report.skill_section(fewer))
    assert "| PPO (verifier) | 10.0% ± 1.0% | 51.0% ± 1.2% | 0.20 ± 0.10 | 25.0 | 95% | — | — | — |" in text
    assert "### The sentiment" not in text  # a family the measurement does not hold gets no table
    assert report.skill_section({"grpo": {"held_out": {}}}) == []  # no verifiable stage ran
    flat = {"grpo-tasks": {"held_out": {"sft": task_monitors(0.0, 0.0), "grpo": task_monitors(0.0, 0.0)},
                           "held_out_settings": settings, "reward_hacking": "worse reviews: the judge on 好评 fell"}}
    flat_text = "\n".join(report.skill_section(flat))  # the tiny preset: every SE 0, and its flag still shown
    assert "no spread across problems to tell a gain from chance. **worse reviews: the judge" in flat_text


def lengths(chars, rho, rho_se, bands=(45.0, 42.0, 41.0, 44.0, 43.0)):
    """The length-by-limit monitors of ``tasks.length_by_limit``: mean ``chars`` (SE 0.5), the five bands, and the
    rank correlation over 25 limits."""
    names = [f"instruction_chars_{lo}_{hi}" for lo, hi in report.LIMIT_BANDS]
    return {"instruction_chars": chars, "instruction_chars_se": 0.5, **dict(zip(names, bands)),
            "instruction_length_rho": rho, "instruction_length_rho_se": rho_se, "instruction_limits": 25.0}


def test_the_card_says_what_a_gain_on_the_limits_is():
    """A gain on "at most N" read from the lengths: GRPO shorter by 10 characters (20 SE of the difference
    hypot(0.5, 0.5)) with a flat rank correlation keeps limits by writing shorter; PPO, whose length rises with N
    (0.80 > 2 x 0.12), reads the limit; a gain with neither is said to be explained by neither."""
    settings = {"samples_per_prompt": 8, "sft_samples_per_prompt": 16, "temperature": 1.0, "max_new_tokens": 64}
    sft = task_monitors(0.50, 0.010, **lengths(43.0, 0.10, 0.20))
    grpo = task_monitors(0.65, 0.012, kl=1.5, **lengths(33.0, 0.05, 0.21, bands=(30.0, 34.0, 33.0, 32.0, 35.0)))
    ppo = task_monitors(0.60, 0.012, kl=0.5, **lengths(40.0, 0.80, 0.12, bands=(15.0, 25.0, 40.0, 47.0, 55.0)))
    metrics = {"grpo-tasks": {"held_out": {"sft": sft, "grpo": grpo}, "held_out_settings": settings,
                              "reward_hacking": ""},
               "ppo-tasks": {"held_out": {"sft": sft, "ppo": ppo}, "held_out_settings": settings,
                             "reward_hacking": ""}}
    text = "\n".join(report.skill_section(metrics))
    assert ("it keeps more limits by writing shorter (43.0 → 33.0 characters), not by reading the limit: its length "
            "does not follow N (rank correlation of N with the length +0.05 ± 0.21)") in text
    assert "it reads the limit: its answers grow with N (rank correlation of N with the length +0.80 ± 0.12)" in text
    assert "the mean length over the 25 held-out limits" in text
    assert "| model | N 10-19 | N 20-29 | N 30-39 | N 40-49 | N 50-60 | all | rank correlation with N |" in text
    assert "| SFT | 45.0 | 42.0 | 41.0 | 44.0 | 43.0 | 43.0 ± 0.5 | +0.10 ± 0.20 |" in text
    assert "| GRPO (verifier) | 30.0 | 34.0 | 33.0 | 32.0 | 35.0 | 33.0 ± 0.5 | +0.05 ± 0.21 |" in text
    assert "learnt to keep limits it never trained on" not in text
    same = {"grpo-tasks": {**metrics["grpo-tasks"],
                           "held_out": {"sft": sft, "grpo": {**grpo, **lengths(42.5, 0.1, 0.2)}}}}
    assert "its length neither follows N (rank correlation of N with the length +0.10 ± 0.20) nor fell beyond " \
           "noise (43.0 → 42.5 characters)" in "\n".join(report.skill_section(same))
    old = {"grpo-tasks": {**metrics["grpo-tasks"], "held_out": {"sft": task_monitors(0.5, 0.01), "grpo": grpo}}}
    assert "rank correlation with N" not in "\n".join(report.skill_section(old))  # measured before lengths were


def test_skill_section_gives_each_family_its_own_table_and_figures():
    """Two families: a table each, from the family's own keys (its KL, length and [SEP] share, not the overall
    ones); the RM score and the judge only beside the instructions, whose 好评 problems they can rank."""
    judged = {k: MONITORS[k] for k in ("rm_score", "rm_score_se", "judge", "judge_se")}
    both = ("instruction", "sentiment")
    sft = {**task_monitors(0.50, 0.010, families=both, **judged), "sentiment_pass1": 0.48, "sentiment_length": 2.4,
           "sentiment_eos_share": 0.9}
    grpo = {**task_monitors(0.55, 0.012, kl=1.5, families=both, **judged), "sentiment_pass1": 0.60,
            "sentiment_kl": 0.4, "sentiment_length": 2.0, "sentiment_eos_share": 1.0}
    settings = {"samples_per_prompt": 4, "sft_samples_per_prompt": 16, "temperature": 1.0, "max_new_tokens": 64}
    text = "\n".join(report.skill_section({"grpo-tasks": {"held_out": {"sft": sft, "grpo": grpo},
                                                          "held_out_settings": settings, "reward_hacking": ""}}))
    instructions, sentiment = text.split("### Review instructions")[1].split("### The sentiment")
    assert "| GRPO (verifier) | 10.0% ± 1.0% | 55.0% ± 1.2% | 1.50 ± 0.10 | 25.0 | 95% | 0.500 ± 0.100 |" \
        in instructions
    assert "| SFT | 10.0% ± 1.0% | 48.0% ± 1.0% | 0 | 2.4 | 90% | — | — | — |" in sentiment
    assert "| GRPO (verifier) | 10.0% ± 1.0% | 60.0% ± 1.2% | 0.40 ± 0.10 | 2.0 | 100% | — | — | — |" in sentiment
    assert "48.0% → 60.0%, **+12.0 points, 7.7 standard errors**: it learnt to tell the sentiment" in sentiment
    assert "A blind guess scores 50%." in sentiment and "blind guess" not in instructions
    # a gain that only reaches the guess (SFT answers out of form, RL fixes the form) is said to be no more
    grpo.update(sentiment_pass1=0.52)  # 52% ± 1.2%: within 3 standard errors of 50%
    text = "\n".join(report.skill_section({"grpo-tasks": {"held_out": {"sft": {**sft, "sentiment_pass1": 0.25},
                                                                    "grpo": grpo},
                                                          "held_out_settings": settings, "reward_hacking": ""}}))
    assert "25.0% → 52.0%, **+27.0 points" in text and "no better than a blind guess (50%)" in text



def test_skill_section_takes_each_family_from_the_stages_that_trained_on_it():
    """The pipeline's layout: GRPO and PPO on the instructions, GRPO alone on the sentiment in a stage of its own.
    Each family's table has its SFT row from its own stage's measurement and one row per stage that measured it;
    the aligner that did not run on a family is said so; the stage table's cell names no "all" for one family."""
    settings = {"samples_per_prompt": 4, "sft_samples_per_prompt": 16, "temperature": 1.0, "max_new_tokens": 64}
    instruction = {"held_out": {"sft": task_monitors(0.50, 0.010), "grpo": task_monitors(0.62, 0.012, kl=1.8)},
                   "held_out_settings": {**settings, "families": ["instruction"]}, "reward_hacking": "", "kl": 1.8}
    ppo = {"held_out": {"sft": task_monitors(0.50, 0.010), "ppo": task_monitors(0.60, 0.012, kl=1.2)},
           "held_out_settings": {**settings, "families": ["instruction"]}, "reward_hacking": ""}
    sentiment = {"held_out": {"sft": task_monitors(0.47, 0.007, greedy=0.54, families=("sentiment",)),
                           "grpo": task_monitors(0.60, 0.015, greedy=0.61, kl=0.3, families=("sentiment",))},
                 "held_out_settings": {**settings, "samples_per_prompt": 8, "max_new_tokens": 8,
                                       "families": ["sentiment"]},
                 "reward_hacking": "", "kl": 0.3}
    metrics = {"grpo-tasks": instruction, "ppo-tasks": ppo, "grpo-sentiment": sentiment}
    text = "\n".join(report.skill_section(metrics, {"grpo-tasks": 200.0, "grpo-sentiment": 150.0}))
    instructions, polarity = text.split("### Review instructions")[1].split("### The sentiment")
    assert "| PPO (verifier) | 10.0% ± 1.0% | 60.0% ± 1.2% |" in instructions and "not run" not in instructions
    assert "| SFT | 54.0% ± 1.0% | 47.0% ± 0.7% | 0 |" in polarity
    assert "| GRPO (verifier) | 61.0% ± 1.0% | 60.0% ± 1.5% | 0.30 ± 0.10 | 25.0 | 95% | — | — | 150 s |" in polarity
    assert "| PPO (verifier)" not in polarity and "- PPO with the verifier: not run on this family" in polarity
    assert "47.0% → 60.0%, **+13.0 points, 7.9 standard errors**: it learnt to tell" in polarity
    assert "Sampled: 8 answers per problem (16 for SFT) at temperature 1, up to 8 tokens." in polarity
    assert report.task_summary("grpo-sentiment", sentiment) == (
        "held-out problems: sampled pass@1 (SFT → GRPO) sentiment 47.0% → 60.0%; greedy 54.0% → 61.0%, KL 0.30 "
        "nats/response")

def test_export_section_names_the_best_unflagged_aligner_and_the_rm():
    demo = {"model": {"norm": "layernorm", "position_embedding": "rope"}}
    records = {stage: {"config": demo, "metrics": {"held_out": {stage: {**MONITORS, "judge": judge}},
                                                   "reward_hacking": flag}}
               for stage, judge, flag in (("ppo", 0.62, ""), ("dpo", 0.66, "reward hacking suspected"),
                                          ("grpo", 0.55, ""))}
    records["rm"] = {"config": demo, "metrics": {}}
    checkpoints = {stage: f"checkpoints/{stage}" for stage in records}
    text = "\n".join(report.export_section(records, checkpoints))
    # DPO scores highest but is flagged: PPO is the best aligned model
    assert "- PPO, the aligned model with the highest judge score (0.620): `python load_weight.py --checkpoint " \
           "checkpoints/ppo --to_hf hf/ppo` writes a `GPTNeoXForCausalLM`" in text
    assert "`python load_weight.py --checkpoint checkpoints/rm --to_hf hf/rm` writes a " \
           "`GPTNeoXForSequenceClassification`" in text
    assert "For llama.cpp and ollama: `python load_weight.py --checkpoint checkpoints/ppo --to_gguf gguf/ppo.gguf " \
           "--gguf_type q8_0` writes one GGUF file (llama.cpp's `gptneox`" in text
    assert text.count("--to_gguf") == 1  # the reward model does not go to llama.cpp
    records["ppo"]["config"] = {"model": {"norm": "rmsnorm", "position_embedding": "rope"}}
    text = "\n".join(report.export_section(records, checkpoints))
    assert "`ArceeForCausalLM`" in text
    assert "It cannot go to llama.cpp: --to_gguf: llama.cpp has no architecture" in text
    records["ppo"]["config"] = demo
    for stage in ("ppo", "grpo"):
        records[stage]["metrics"]["reward_hacking"] = "flagged"
    text = "\n".join(report.export_section(records, checkpoints))
    assert "- DPO, the aligned model with the highest judge score (0.660), although every aligner is flagged" in text
    records["dpo"]["config"] = {"model": {"norm": "rmsnorm", "position_embedding": "learned"}}
    assert "cannot be exported: cannot export norm='rmsnorm'" in "\n".join(report.export_section(records, checkpoints))
    assert report.export_section({"rm": records["rm"]}, checkpoints) == []


def test_aligned_summary_names_the_stage_and_dpo_pairs():
    def fmt(value, spec=".3f"):
        return "—" if value is None else format(value, spec)

    metrics = {"held_out": {"sft": MONITORS, "dpo": {**MONITORS, "rm_score": 1.25, "judge": 0.75}}, "kl": 2.0,
               "val_accuracy": 0.8}
    cell = report.aligned_summary("dpo", metrics, fmt)
    assert cell == ("val implicit-reward accuracy 0.800; held-out RM score 0.500 (SFT) → 1.250, judge 0.600 → "
                    "0.750, KL 2.00 nats/response")
    assert report.aligned_summary("dpo", metrics, fmt, {"step": 0, "val_accuracy": 0.5}).startswith(
        "val implicit-reward accuracy 0.500 → 0.800; held-out")  # from step 0 (chance) to the end
    assert report.aligned_summary("grpo", {}, fmt).startswith("held-out RM score — (SFT) → —")


def test_in_process_gives_the_exit_code_a_subprocess_would(capsys, tmp_path, monkeypatch):
    """pipeline.in_process runs a script's main in ROOT and turns a UserError into its one line and exit code 2,
    argparse's exit into its code; the caller's working directory is back afterwards."""
    from plumbing.cli import ArgumentParser, UserError

    monkeypatch.chdir(tmp_path)
    seen = []

    def ok(argv):
        seen.append((os.getcwd(), argv))

    def refuses(argv):
        raise UserError("--x is wrong; fix it")

    def bad_flag(argv):
        ArgumentParser().parse_args(argv)

    assert pipeline.in_process(ok, ["--a"]) == 0 and seen == [(pipeline.ROOT, ["--a"])]
    assert pipeline.in_process(refuses, []) == 2 and capsys.readouterr().err == "error: --x is wrong; fix it\n"
    assert pipeline.in_process(bad_flag, ["--nope"]) == 2
    assert os.getcwd() == str(tmp_path)


def test_in_process_stages_each_start_their_own_accelerate_state():
    """The pipeline runs the stages in its own process. Accelerate keeps its state process-wide and refuses a
    second Accelerator with another mixed precision; in_process clears it, so each stage starts as in a new
    process."""
    from accelerate import Accelerator

    made = []

    def stage(precision):
        return lambda argv: made.append(Accelerator(cpu=True, mixed_precision=precision).mixed_precision)

    with pytest.raises(ValueError):  # what a stage would meet without in_process
        Accelerator(cpu=True, mixed_precision="bf16")
        Accelerator(cpu=True, mixed_precision="no")
    assert pipeline.in_process(stage("bf16"), []) == 0
    assert pipeline.in_process(stage("no"), []) == 0
    assert made == ["bf16", "no"]
    pipeline.in_process(lambda argv: None, [])  # leave no state behind for the tests that follow


@pytest.mark.parametrize("argv, says", [
    (["--launch", ""], "--launch is empty"),
    (["--launch", "no-such-launcher-here --x"], "--launch no-such-launcher-here"),
    (["--report_dir", "{file}"], "is a file"),
])
def test_bad_arguments_stop_before_anything_runs(tmp_path, monkeypatch, argv, says):
    """Each is refused before data/prepare.py or any stage starts (step would be the first thing to run them)."""
    (tmp_path / "file").write_text("not a folder", encoding="utf-8")
    started = []
    monkeypatch.setattr(pipeline, "step", lambda *a, **k: started.append(a))
    with pytest.raises(pipeline.UserError, match=says):
        pipeline.main([a.format(file=tmp_path / "file") for a in argv] + ["--overwrite"])
    assert started == []


def test_best_of_n_rows_start_from_best_of_1_and_are_flagged_like_the_stages():
    """best-of-1 (the first of the same samples) gets its own row and is what best-of-4/16 are judged against; a
    best-of-16 whose answers stop ending is flagged as the aligners would be."""
    metrics = {"ppo": {"held_out": {"sft": MONITORS, "ppo": MONITORS}, "kl_limit": 3.0, "reward_hacking": ""}}
    first = {**best_of(1, 0.4), "eos_share": 0.6}
    best = {"1": first, "4": {**best_of(4, 1.0), "eos_share": 0.55},
            "16": {**best_of(16, 1.8), "eos_share": 0.2}}  # 60% -> 20% ending: more than the 15-point allowance
    lines = report.held_out_section(metrics, best, {"best_of_n": 30.0})
    names = [line.split(" | ")[0] for line in lines if line.startswith("| ") and not line.startswith("| model")]
    assert names == ["| SFT", "| best-of-1 (SFT, its first sample)", "| best-of-4 (SFT + RM)",
                     "| best-of-16 (SFT + RM)", "| PPO"]
    text = "\n".join(lines)
    assert "- best-of-4: no sign of reward hacking" in text and "against best-of-1." in text
    assert "- best-of-16: **reward hacking suspected: fewer answers end: 60% -> 20% end with [SEP].**" in text
    # SFT's row ends 25%: judged against it instead, best-of-16's 20% would pass, so the pairing is what is tested
    assert "- best-of-16: no sign" in "\n".join(report.held_out_section(metrics, {k: v for k, v in best.items()
                                                                                    if k != "1"}))


def fake_checkpoint(root, stage, preset="demo", parent_weights=None, state=False, weights=None, reward_weights=None,
                    more_flags=""):
    """A folder that looks like ``stage``'s checkpoint to ``plan_stages``: config.json with the stage's command and
    its parent's (and reward model's) sha256, a model.safetensors of its own bytes, and state/ if asked."""
    import json

    from plumbing.checkpoint import file_sha256

    folder = root / pipeline.CHECKPOINTS[stage]
    folder.mkdir(parents=True, exist_ok=True)
    script = dict(pipeline.STAGES)[stage]
    (folder / "model.safetensors").write_bytes(weights or stage.encode())
    parent = file_sha256(str(parent_weights)) if parent_weights else None
    config = {"stage": stage, "parent_sha256": parent,
              "command": " ".join(["python", *pipeline.stage_command(stage, script, preset), "--overwrite"])
              + more_flags}
    if reward_weights:
        config.update(reward="rm", reward_sha256=file_sha256(str(reward_weights)))
    (folder / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if state:
        (folder / "state").mkdir()
    return folder / "model.safetensors"


def planned(argv):
    args = pipeline.parse_args(argv)
    return {stage: command and command[1 + len(pipeline.stage_command(stage, script, args.preset)):]
            for stage, script, command in pipeline.plan_stages(args, ["python"])}


def test_resume_keeps_the_finished_stages_and_continues_the_stopped_one(tmp_path, monkeypatch):
    """After a Ctrl-C in the RM stage: pretrain and SFT (trained from that pretrain) are kept, the RM goes on from its
    state, and the aligners, finished by an older run, run again. A stage is run again when its parent changed
    since it was trained, when it came from another preset, and everything runs without --resume."""
    monkeypatch.setattr(pipeline, "ROOT", str(tmp_path))
    pretrain = fake_checkpoint(tmp_path, "pretrain")
    sft = fake_checkpoint(tmp_path, "sft", parent_weights=pretrain)
    fake_checkpoint(tmp_path, "rm", parent_weights=sft, state=True)
    old_sft = tmp_path / "old.safetensors"
    old_sft.write_bytes(b"an older SFT model")
    for stage in report.ALIGNED:
        fake_checkpoint(tmp_path, stage, parent_weights=old_sft)
    assert planned(["--resume"]) == {"pretrain": None, "sft": None, "rm": ["--resume"], "ppo": ["--overwrite"],
                                     "dpo": ["--overwrite"], "grpo": ["--overwrite"], "grpo-tasks": ["--overwrite"],
                                     "ppo-tasks": ["--overwrite"], "grpo-sentiment": ["--overwrite"]}
    assert planned(["--resume", "--preset", "tiny"]) == {s: ["--overwrite"] for s, _ in pipeline.STAGES}
    assert planned(["--overwrite"]) == {s: ["--overwrite"] for s, _ in pipeline.STAGES}
    assert planned([]) == {s: [] for s, _ in pipeline.STAGES}
    # where the curves go is passed on, and a stage logged elsewhere is still the pipeline's
    assert planned(["--report_to", "none"]) == {s: ["--report_to", "none"] for s, _ in pipeline.STAGES}
    fake_checkpoint(tmp_path, "sft", parent_weights=pretrain, more_flags=" --report_to none")
    assert planned(["--resume"])["sft"] is None

    (tmp_path / pipeline.CHECKPOINTS["pretrain"] / "model.safetensors").write_bytes(b"pretrained again")
    assert planned(["--resume"]) == {"pretrain": None, **{s: ["--overwrite"] for s, _ in pipeline.STAGES[1:]}}


def test_a_stopped_stage_tells_how_to_continue_the_pipeline(monkeypatch):
    """A stage that saved its state on Ctrl-C returns 130; the pipeline stops with the same signal and a hint that
    continues the pipeline (not the stage alone)."""
    import signal

    from plumbing import cli

    monkeypatch.setattr(cli, "interrupt_hint", None)
    monkeypatch.setattr(pipeline.sys, "argv", ["pipeline.py", "--preset", "tiny"])
    with pytest.raises(KeyboardInterrupt) as stopped:
        pipeline.step(2, 9, "0-PRETRAIN.py", ["python", "0-PRETRAIN.py"], 0.0, main=lambda argv: 130)
    assert stopped.value.args == (signal.SIGINT,)
    assert cli.interrupt_hint.startswith("continue the pipeline with: ")
    assert cli.interrupt_hint.endswith("pipeline.py --preset tiny --resume")


def test_resume_runs_again_a_stage_run_by_hand_or_trained_against_another_rm(tmp_path, monkeypatch):
    """An SFT run by hand with other flags is not the pipeline's stage; a PPO whose recorded reward model is not the
    one in checkpoints/rm is stale though its SFT parent matches; GRPO after it runs again in any case."""
    monkeypatch.setattr(pipeline, "ROOT", str(tmp_path))
    pretrain = fake_checkpoint(tmp_path, "pretrain")
    sft = fake_checkpoint(tmp_path, "sft", parent_weights=pretrain)
    rm = fake_checkpoint(tmp_path, "rm", parent_weights=sft)
    other_rm = tmp_path / "other-rm.safetensors"
    other_rm.write_bytes(b"another reward model")
    fake_checkpoint(tmp_path, "ppo", parent_weights=sft, reward_weights=other_rm)
    fake_checkpoint(tmp_path, "dpo", parent_weights=sft)
    fake_checkpoint(tmp_path, "grpo", parent_weights=sft, reward_weights=rm)
    for stage in report.TASK_ALIGNED:  # the verifier's stages: an SFT parent, no reward model
        fake_checkpoint(tmp_path, stage, parent_weights=sft)
    assert planned(["--resume"]) == {"pretrain": None, "sft": None, "rm": None, "ppo": ["--overwrite"],
                                     "dpo": ["--overwrite"], "grpo": ["--overwrite"], "grpo-tasks": ["--overwrite"],
                                     "ppo-tasks": ["--overwrite"], "grpo-sentiment": ["--overwrite"]}
    fake_checkpoint(tmp_path, "ppo", parent_weights=sft, reward_weights=rm)
    assert planned(["--resume"]) == {s: None for s, _ in pipeline.STAGES}
    fake_checkpoint(tmp_path, "sft", parent_weights=pretrain, more_flags=" --max_steps 10")
    assert planned(["--resume"])["sft"] == ["--overwrite"]
