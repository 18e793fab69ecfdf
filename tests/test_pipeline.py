"""pipeline.py's report card: the held-out table of SFT, best-of-n and PPO and its reward-hacking sentence."""

import pipeline

MONITORS = {"rm_score": 0.5, "rm_score_se": 0.1, "judge": 0.6, "judge_se": 0.02, "kl": 0.0, "kl_se": 0.0,
            "distinct_2": 0.9, "longest_run": 2.0, "eos_share": 0.25, "length": 30.0}


def test_held_out_section_has_a_row_per_model_and_the_flag():
    ppo = {**MONITORS, "rm_score": 2.0, "kl": 2.5, "kl_se": 0.3, "eos_share": 0.5}
    metrics = {"held_out": {"sft": MONITORS, "ppo": ppo}, "kl_limit": 3.0,
               "held_out_settings": {"prompts": ["a", "b"], "samples_per_prompt": 4, "temperature": 1.0,
                                     "max_new_tokens": 40},
               "reward_hacking": "reward hacking suspected: distinct-2 fell from 0.900 to 0.800."}
    best = {**MONITORS, "rm_score": 1.0, "best_of_n": 4, "kl_bound": 0.636}
    text = "\n".join(pipeline.held_out_section(metrics, best))
    assert "| SFT | 0.500 ± 0.100 | 0.600 ± 0.020 | 0.00 | 0.900 | 2.0 | 25% | 30.0 |" in text
    assert "| best-of-4 (SFT + RM) | 1.000 ± 0.100 | 0.600 ± 0.020 | ≤ 0.64 |" in text
    assert "| PPO | 2.000 ± 0.100 | 0.600 ± 0.020 | 2.50 ± 0.30 | 0.900 | 2.0 | 50% | 30.0 |" in text
    assert "**reward hacking suspected: distinct-2 fell from 0.900 to 0.800.**" in text
    assert "2 prompts × 4 samples" in text


def test_held_out_section_without_best_of_n_or_flag():
    metrics = {"held_out": {"sft": MONITORS, "ppo": MONITORS}, "kl_limit": 3.0, "reward_hacking": ""}
    text = "\n".join(pipeline.held_out_section(metrics))
    assert "| best-of" not in text and text.count("| PPO |") == 1
    assert "No sign of reward hacking" in text and "KL past 3.0 nats" in text
    assert pipeline.held_out_section({}) == []  # a PPO checkpoint from before the monitors
