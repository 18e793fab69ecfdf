"""The plumbing of the pipeline: everything two or more of the scripts at the root share, one module per idea.

The scripts at the root tell the story (the numbered stages, and the commands generate.py, serve.py, pipeline.py,
load_weight.py); gpt_model.py (the model), gpt_fast.py (its speed work) and chinese_tokenizer.py (the tokenizer and
the chat template) sit below everything. These modules import the model, the tokenizer and each other, never a stage
or a command (tests/test_layout.py reads the import graph and holds that rule).

Command line and files:   cli (user errors, shared flags), checkpoint (the hand-off between stages)
Data:                     records (reading and checking data files), documents (pretraining text streams),
                          token_cache (tokenized once to disk, packed into blocks), batching (padding, chat
                          examples, the data order)
Training:                 devices (precision, device, the RNG around sampling), flops (the FLOPs of every model
                          call, counted by kind; GPU peaks, MFU, a matrix product's speed), optimizers (AdamW, Muon,
                          the schedule), training (StageRun and the loop's pieces)
Alignment and judging:    rollouts (sampling answers, their log-probs), reward (scoring with an RM, the pair-accuracy
                          rule), alignment (the online aligners' rewards and set-up), held_out (the held-out
                          measurement of every aligner), judge (the independent judge and the monitors), baselines
                          (counting)
Verifiable tasks:         verifiers (the strict checkers), tasks (exact accuracy, pass@k, the verifiable path's flag)
Inference and export:     inference (loading a model to answer with), hf_weights (weights in and out of transformers),
                          gguf_export (a language model as a GGUF file for llama.cpp and ollama), harness (our
                          figures for the lm-eval tasks of data/lm_eval/)
Reporting:                report (the report card and the Markdown table helper)
"""
