"""Tests of gpt_fast.py: each fast path against the lesson's definition in gpt_model.py.

Bit for bit where the arithmetic is the same (the batched sampler's greedy and sampled tokens, speed_up's
parameters), within float32 rounding where it is not (the split products, the chunked loss: a sum over the
vocabulary in another order, 1e-5). The helpers and oracles are tests/test_gpt_model.py's.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from test_gpt_model import (
    cacheless_greedy,
    hand_loss,
    hidden_weight_labels,
    one_thread,  # noqa: F401  (an autouse fixture: tiny tensors run on one thread)
    random_model,
    small_cfg,
    successor_model,
)

import gpt_fast as gf
import gpt_model as gm
from gpt_model import GPTConfig, GPTModel, RewardModel

# --------------------------------------------------------------------------------------------------------------
# speed_up: the same model, its classes swapped


def test_speed_up_swaps_classes_in_place_and_keeps_every_parameter():
    """Every plain nn.Linear becomes a SplitLinear and every GPTModel (a reward model's backbone too) a FastGPTModel:
    the same module objects, the same Parameter objects, the same state-dict names; a LoRA layer (a subclass) and
    None are passed over; the outputs are the lesson's."""
    from lora import LoRALinear, add_lora

    policy, reward = random_model(small_cfg(), seed=1), RewardModel(small_cfg())
    params, names = [p for p in policy.parameters()], list(policy.state_dict())
    ids = torch.randint(0, 61, (2, 7), generator=torch.Generator().manual_seed(2))
    before = policy(ids)["logits"]
    add_lora(reward.backbone, 2, 4.0, ["att.W_query"])
    assert gf.speed_up(policy, reward, None) == (policy, reward, None)
    assert type(policy) is gf.FastGPTModel and type(reward.backbone) is gf.FastGPTModel
    assert type(policy.out_head) is gf.SplitLinear and type(policy.trf_blocks[0].ff.layers[0]) is gf.SplitLinear
    assert type(reward.backbone.trf_blocks[0].att.W_query) is LoRALinear  # a subclass: left as it is
    assert type(reward.head.linear) is gf.SplitLinear
    assert all(a is b for a, b in zip(policy.parameters(), params)) and list(policy.state_dict()) == names
    assert torch.equal(policy(ids)["logits"], before)  # batches of 14 rows, with autograd on: F.linear
    assert not any(type(m) is nn.Linear for m in policy.modules())
    assert gf.speed_up(policy) is policy  # twice changes nothing


def test_a_training_step_with_the_fast_path_equals_one_without():
    """One AdamW step on the same batch from the same weights, by the lesson (logits, then next_token_loss) and by
    the sped-up copy (the chunked loss): the losses and every updated parameter agree within 1e-5."""
    import copy

    plain = random_model(small_cfg(), seed=3).train()
    fast = gf.speed_up(copy.deepcopy(plain))
    ids = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(4))
    labels = torch.cat((ids[:, 1:], torch.full((3, 1), -100)), dim=1)
    losses = []
    for model in (plain, fast):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss = model(ids, labels=labels)["loss"]
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    for (name, a), b in zip(plain.named_parameters(), fast.parameters()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)


def test_the_attention_upcast_equals_the_lesson_attention():
    """fused_attention is F.scaled_dot_product_attention bit for bit on fp32 inputs; on bf16 inputs (CPU autocast)
    it computes in fp32 and returns bf16, within bf16 rounding (2^-7 relative) of the lesson's bf16 kernel and
    closer than it to the fp32 result; a sped-up model under autocast gives the lesson's logits to bf16 precision."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 3, 7, 8, generator=g) for _ in range(3))
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    assert torch.equal(gf.fused_attention(q, k, v, attn_mask=mask), F.scaled_dot_product_attention(q, k, v, mask))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    up = gf.fused_attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True)
    plain = F.scaled_dot_product_attention(*(t.bfloat16() for t in (q, k, v)), is_causal=True)
    assert up.dtype == torch.bfloat16
    torch.testing.assert_close(up.float(), plain.float(), atol=3e-2, rtol=2 ** -7)
    assert (up.float() - exact).abs().max() <= (plain.float() - exact).abs().max()
    model = random_model(small_cfg(), seed=8)
    ids = torch.randint(0, 61, (2, 9), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lesson = model(ids)["logits"].float()
        fast = gf.speed_up(model)(ids)["logits"].float()
    assert type(model.trf_blocks[0].att) is gf.FastMultiHeadAttention
    torch.testing.assert_close(fast, lesson, atol=0.02 * lesson.abs().max().item(), rtol=0)  # measured: 0.5%


# --------------------------------------------------------------------------------------------------------------
# generate: the lesson's, for many rows at once


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_the_batched_sampler_gives_the_lesson_generate_tokens(position_embedding):
    """Left-padded prompts, a per-row end token and a window that slides past the context: the fast generate's
    greedy tokens are the lesson's, bit for bit; sampled (no end token, so no row is dropped) from the same seed
    too, the two drawing the same random numbers; both are the cache-less loop's when greedy."""
    model = random_model(small_cfg(position_embedding=position_embedding), seed=22)
    g = torch.Generator().manual_seed(13)
    rows = [torch.randint(1, 61, (n,), generator=g) for n in (6, 2, 4)]
    ids, mask = torch.zeros(3, 6, dtype=torch.long), torch.zeros(3, 6, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, 6 - len(r):], mask[b, 6 - len(r):] = r, 1
    for context_size in (16, 9):
        lesson = gm.generate(model, ids, 14, context_size, attention_mask=mask, eos_id=7)
        assert torch.equal(gf.generate(model, ids, 14, context_size, attention_mask=mask, eos_id=7), lesson)
        for seed in (0, 1):
            torch.manual_seed(seed)
            lesson = gm.generate(model, ids, 10, context_size, temperature=1.0, top_k=20, attention_mask=mask)
            torch.manual_seed(seed)
            fast = gf.generate(model, ids, 10, context_size, temperature=1.0, top_k=20, attention_mask=mask)
            assert torch.equal(fast, lesson)
    assert torch.equal(gm.generate(model, rows[0][None], 14, 9), cacheless_greedy(model, rows[0][None], 14, 9))


def test_repetition_penalty_hand_example():
    """Seen tokens: positive logits divided by the penalty, negative multiplied; unseen untouched."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    idx = torch.tensor([[0, 1, 1], [3, 3, 3]])
    got = gf.apply_repetition_penalty(logits, idx, 2.0)
    assert torch.equal(got, torch.tensor([[1.0, -2.0, 0.5, 3.0], [2.0, -1.0, 0.5, 1.5]]))


def test_generate_with_repetition_penalty_equals_hand_loop():
    """Greedy generation with a repetition penalty equals the cache-less loop applying CTRL's rule by hand."""
    model = random_model(small_cfg(), seed=17)
    prompt = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(9))
    got = gf.generate(model, prompt, 20, 16, repetition_penalty=1.8)
    assert torch.equal(got, cacheless_greedy(model, prompt, 20, 16, penalty=1.8))
    assert not torch.equal(got, gf.generate(model, prompt, 20, 16))  # the penalty did something


def test_a_repetition_penalty_of_zero_or_less_is_refused():
    model = random_model(small_cfg(), seed=0)
    with pytest.raises(ValueError, match="repetition_penalty"):
        gf.generate(model, torch.zeros(1, 2, dtype=torch.long), 2, 16, repetition_penalty=0.0)


# --------------------------------------------------------------------------------------------------------------
# the chunked loss


@pytest.mark.parametrize("chunk_rows", [1, 4, 5, 13, None, 1000])
def test_chunked_loss_and_gradients_equal_the_logits_loss(chunk_rows):
    """The loss from hidden states, whatever the chunking, equals next_token_loss on the full logits and the hand
    formula; its gradients for the hidden states and the head weight equal autograd's through the logits."""
    hidden, weight, labels = hidden_weight_labels()
    expected = gm.next_token_loss(hidden @ weight.t(), labels)
    got = gf.chunked_next_token_loss(hidden, weight, labels, chunk_rows)
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(hand_loss(hidden, weight, labels), rel=1e-5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(expected, (hidden, weight))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_chunked_loss_scales_with_the_upstream_gradient_and_skips_ignored_rows():
    """(3 * loss).backward() gives three times the gradients; ignored positions get a zero gradient; without
    grad mode the same value comes back."""
    hidden, weight, labels = hidden_weight_labels()
    (3 * gf.chunked_next_token_loss(hidden, weight, labels, 4)).backward()
    expected = torch.autograd.grad(3 * gm.next_token_loss(hidden @ weight.t(), labels), (hidden, weight))
    torch.testing.assert_close(hidden.grad, expected[0], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(weight.grad, expected[1], atol=1e-6, rtol=1e-5)
    assert hidden.grad[0, :3].abs().max() == 0 and hidden.grad[1, -2:].abs().max() == 0
    assert hidden.grad[0, 3:].abs().min() > 0
    with torch.no_grad():
        value = gf.chunked_next_token_loss(hidden, weight, labels, 4)
    assert value.item() == pytest.approx(hand_loss(hidden, weight, labels), rel=1e-5)



def test_chunked_loss_with_every_label_ignored_is_nan_like_cross_entropy():
    hidden, weight, labels = hidden_weight_labels()
    ignored = torch.full_like(labels, -100)
    assert math.isnan(gm.next_token_loss(hidden @ weight.t(), ignored).item())
    assert math.isnan(gf.chunked_next_token_loss(hidden, weight, ignored).item())


def test_chunked_loss_under_bf16_autocast_is_close_to_the_autocast_logits_loss():
    """Under CPU autocast the head runs in bfloat16 and the softmax in float32 on both paths: the losses agree
    closely, the gradients to bfloat16 precision."""
    hidden, weight, labels = hidden_weight_labels(n_rows=200, vocab=300, emb=32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = gm.next_token_loss(F.linear(hidden, weight), labels)
        got = gf.chunked_next_token_loss(hidden, weight, labels, 16)
    assert got.item() == pytest.approx(expected.item(), rel=1e-4)
    assert got.item() == pytest.approx(hand_loss(hidden, weight, labels), rel=2e-2)
    for a, b in zip(torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(expected, (hidden, weight))):
        assert a.dtype == b.dtype == torch.float32
        torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=0)



@pytest.mark.parametrize("tie", [True, False])
def test_the_fast_model_loss_equals_the_lesson_definition_with_the_same_gradients(tie):
    """A sped-up model(ids, labels=...) gives "loss" (no "logits"), equal in value and in every parameter's gradient
    to the lesson's next_token_loss on model(ids)["logits"], for a right-padded batch (float32 rounding of a sum
    over the vocabulary apart: 1e-5)."""
    model = gf.speed_up(random_model(small_cfg(tie_embeddings=tie), seed=5))
    assert type(model) is gf.FastGPTModel
    ids = torch.randint(1, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), dim=1).masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    assert "logits" not in out and out["last_hidden_state"].shape == (2, 10, 24)
    expected = gm.next_token_loss(model(ids, attention_mask=mask)["logits"], labels)
    torch.testing.assert_close(out["loss"], expected, atol=1e-5, rtol=1e-5)
    params = [p for p in model.parameters()]
    for name, a, b in zip([n for n, _ in model.named_parameters()], torch.autograd.grad(out["loss"], params),
                          torch.autograd.grad(expected, params)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)



def test_stream_receives_each_new_column():
    """The stream callback sees every new (B,) column, in order."""
    model = successor_model()
    seen = []
    out = gf.generate(model, torch.tensor([[1], [9]]), 4, 64, stream=lambda col: seen.append(col.tolist()))
    assert seen == [[2, 10], [3, 11], [4, 12], [5, 13]]
    assert torch.equal(torch.tensor(seen).T, out[:, 1:])


def test_stream_can_finish_rows():
    """A stream that returns a row mask ends those rows there: later tokens of theirs are eos_id, and the loop
    stops once every row is finished, even without an eos_id (a server's stop string or a reader who left)."""
    model = successor_model()
    calls = []

    def stop_first_row_then_all(col):
        calls.append(col.tolist())
        return [True, len(calls) >= 3]

    out = gf.generate(model, torch.tensor([[1], [9]]), 10, 64, eos_id=0, stream=stop_first_row_then_all)
    assert out.tolist() == [[1, 2, 0, 0], [9, 10, 11, 12]]
    assert len(calls) == 3
    out = gf.generate(model, torch.tensor([[1], [9]]), 10, 64, stream=lambda col: [True, True])
    assert out.tolist() == [[1, 2], [9, 10]]  # no eos_id: the loop still ends



@pytest.mark.parametrize("context_size", [64, 12])
def test_finished_rows_leave_the_batch_and_the_others_go_on_as_alone(context_size):
    """Rows that emit eos are dropped from the computed batch (and the KV cache) once a quarter have finished: the
    batch the model is called with shrinks, and every row's greedy tokens are still those it gets alone, padded
    or not, with the cache and (context 12) with the sliding window."""
    model = random_model(small_cfg(), seed=21)
    g = torch.Generator().manual_seed(12)
    rows = [torch.randint(1, 61, (n,), generator=g) for n in (5, 2, 4, 3, 5, 1, 2, 3)]
    ids, mask = torch.zeros(8, 5, dtype=torch.long), torch.zeros(8, 5, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, 5 - len(r):], mask[b, 5 - len(r):] = r, 1
    free = [gf.generate(model, r[None], 20, context_size)[0, len(r):] for r in rows]
    # the eos: a token several rows emit at different steps of their free greedy run
    firsts = {}
    for b, f in enumerate(free):
        for step, t in enumerate(f.tolist()):
            firsts.setdefault(t, {}).setdefault(b, step)
    eos = max(firsts, key=lambda t: (len(set(firsts[t].values())), len(firsts[t])))
    assert len(set(firsts[eos].values())) >= 2  # rows finish at two steps at least: a drop happens in between
    sizes = []
    hook = model.register_forward_pre_hook(lambda module, args: sizes.append(args[0].shape[0]))
    out = gf.generate(model, ids, 20, context_size, eos_id=eos, attention_mask=mask)
    hook.remove()
    assert sizes[0] == 8 and min(sizes) < 8 and sizes == sorted(sizes, reverse=True)
    for b, r in enumerate(rows):
        alone = gf.generate(model, r[None], 20, context_size, eos_id=eos)[0, len(r):]
        assert torch.equal(out[b, 5:5 + len(alone)], alone), b
        assert (out[b, 5 + len(alone):] == eos).all(), b



def test_num_samples_reads_each_prompt_once_and_continues_it_k_times():
    """generate(num_samples=k) gives what the prompts repeated k times give (greedy, and sampled from the same seed:
    the k copies draw the same random numbers), left padding included; logits_to_keep=1 is the last column."""
    torch.manual_seed(0)
    model = GPTModel(gm.get_preset("tiny").replace(vocab_size=50)).eval()
    idx = torch.tensor([[0, 0, 5, 6, 7], [1, 2, 3, 4, 9]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    full = model(idx, attention_mask=mask)["logits"]
    assert torch.allclose(model(idx, attention_mask=mask, logits_to_keep=1)["logits"][:, 0], full[:, -1], atol=1e-6)
    repeated_idx, repeated_mask = idx.repeat_interleave(3, 0), mask.repeat_interleave(3, 0)
    for temperature in (0.0, 1.0):
        torch.manual_seed(1)
        once = gf.generate(model, idx, 6, 64, temperature=temperature, attention_mask=mask, eos_id=49, num_samples=3)
        torch.manual_seed(1)
        rows = gf.generate(model, repeated_idx, 6, 64, temperature=temperature, attention_mask=repeated_mask, eos_id=49)
        assert once.shape == (6, idx.shape[1] + 6) and torch.equal(once, rows)
    assert gf.generate(model, idx, 0, 64, num_samples=3).shape == (6, idx.shape[1])  # nothing new, k copies
    with pytest.raises(ValueError, match="num_samples"):
        gf.generate(model, idx, 2, 64, num_samples=0)


def test_generate_caches_only_the_positions_it_fills():
    """The KV cache of a generation holds the prompt and every new token but the last (whose keys nothing reads),
    not the model's whole context: after the last step every position of it is filled."""
    model = random_model(small_cfg(), seed=3)
    caches = []
    hook = model.register_forward_hook(lambda module, args, kwargs, out: caches.append(out.get("past_key_values")),
                                       with_kwargs=True)
    gf.generate(model, torch.tensor([[1, 2, 3], [4, 5, 6]]), 6, 64, num_samples=2)
    hook.remove()
    cache = caches[-1]
    assert cache.keys.shape == cache.shape and cache.shape[1] == 4  # 2 prompts x 2 samples
    assert cache.shape[3] == cache.length == 3 + 6 - 1 < model.cfg.context_length


def test_repeat_rows_and_keep_rows_copy_the_filled_positions_of_their_rows():
    """repeat_rows makes row b rows b*k .. b*k+k-1 and keep_rows keeps the rows asked for, in their order: the
    filled positions are those rows' keys and values, the cache keeps its length and its room for more."""
    cfg = small_cfg()
    cache = gm.KVCache(cfg, 2, 10)
    L, _, H, _, d = cache.shape
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(L, 2, H, 4, d, generator=g), torch.randn(L, 2, H, 4, d, generator=g)
    for layer in range(L):
        cache.update(layer, keys[layer], values[layer])
    cache.length = 4
    gf.repeat_rows(cache, 3)
    assert cache.keys.shape == cache.shape == (L, 6, H, 10, d) and cache.length == 4
    assert torch.equal(cache.keys[:, :, :, :4], keys.repeat_interleave(3, dim=1))
    assert torch.equal(cache.values[:, :, :, :4], values.repeat_interleave(3, dim=1))
    gf.keep_rows(cache, torch.tensor([5, 0]))  # row 5 is the 3rd copy of row 1, row 0 the 1st of row 0
    assert cache.keys.shape == cache.shape == (L, 2, H, 10, d)
    assert torch.equal(cache.keys[:, :, :, :4], keys[:, [1, 0]])
    assert torch.equal(cache.values[:, :, :, :4], values[:, [1, 0]])
    k, v = cache.update(0, torch.ones(2, H, 1, d), torch.ones(2, H, 1, d))  # the room after them is still there
    assert k.shape == (2, H, 5, d) and torch.equal(k[:, :, :4], keys[0, [1, 0]]) and (v[:, :, 4] == 1).all()



# --------------------------------------------------------------------------------------------------------------
# FastGPTModel.decode_step: one new token after cached ones


def decode_steps(model, ids, mask, steps=4, general=False):
    """Prefill ``ids`` (B, T) with ``mask`` (or None), then feed ``steps`` random tokens one at a time, through
    ``model`` (its ``decode_step`` where it applies) or, with ``general``, through ``GPTModel.forward`` itself.
    Returns every step's logits and hidden states and the filled part of the cache."""
    B = ids.shape[0]
    cache, outs = gm.KVCache(model.cfg, B, ids.shape[1] + steps), []
    call = (lambda *a, **k: GPTModel.forward(model, *a, **k)) if general else model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        call(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for _ in range(steps):
            if mask is not None:
                mask = torch.cat((mask, torch.ones_like(mask[:, :1])), dim=1)  # (B, past + 1)
            out = call(torch.randint(0, model.cfg.vocab_size, (B, 1), generator=g), attention_mask=mask,
                       past_key_values=cache, use_cache=True)
            outs += [out["logits"], out["last_hidden_state"]]
    return outs + [cache.keys[:, :, :, :cache.length], cache.values[:, :, :, :cache.length]]


def prompts_and_mask(padded: bool):
    """Three prompts of 6 ids; with ``padded`` the second is left-padded by 3 and the third by 1."""
    ids = torch.randint(0, 61, (3, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 6, dtype=torch.long)
    if padded:
        mask[1, :3], mask[2, :1] = 0, 0
    return ids, mask if padded else None


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
@pytest.mark.parametrize("qkv_bias", [False, True])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("padded", [False, True])
def test_decode_step_equals_the_general_pass(position_embedding, qkv_bias, norm, padded, monkeypatch):
    """Each one-token step of a fast model goes through decode_step and gives the general pass's logits, hidden
    states and cached keys and values: the same operations on the same numbers (one product of the stacked
    projections for three; equal bit for bit here, float32 rounding allowed)."""
    model = gf.speed_up(random_model(small_cfg(position_embedding=position_embedding, qkv_bias=qkv_bias, norm=norm),
                                     seed=6)).eval()
    ids, mask = prompts_and_mask(padded)
    calls, step = [], gf.FastGPTModel.decode_step
    monkeypatch.setattr(gf.FastGPTModel, "decode_step", lambda *a: calls.append(1) or step(*a))
    fast = decode_steps(model, ids, mask)
    assert len(calls) == 4
    for got, want in zip(fast, decode_steps(model, ids, mask, general=True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_decode_step_with_lora_adapters_and_under_autocast_equals_the_general_pass():
    """With LoRA adapters on the query and value projections (their own term added) the three projections run
    as layers; under bf16 autocast too (a stacked copy would be cast again each step): both as the general pass."""
    from lora import add_lora

    model = gf.speed_up(random_model(small_cfg(position_embedding="rope"), seed=7)).eval()
    add_lora(model, rank=2, alpha=4.0, targets=("W_query", "W_value"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3)  # a non-zero update, so that leaving it out would show
    ids, mask = prompts_and_mask(padded=True)
    for got, want in zip(decode_steps(model, ids, mask), decode_steps(model, ids, mask, general=True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, general = decode_steps(model, ids, mask), decode_steps(model, ids, mask, general=True)
    for got, want in zip(fast, general, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_each_generation_stacks_the_projections_of_the_weights_it_decodes_with():
    """decode_step stacks [W_query; W_key; W_value] at a cache's first step and keeps it on that cache: a new
    generation after a fused AdamW step (which updates the weights in place without raising their ``_version``) or
    after a Parameter was replaced decodes with the new weights, as the general pass does."""
    model = gf.speed_up(random_model(small_cfg(qkv_bias=True), seed=8)).eval()
    ids, _ = prompts_and_mask(padded=False)
    decode_steps(model, ids, None)
    model(ids)["logits"].square().mean().backward()
    torch.optim.AdamW(model.parameters(), lr=0.1, fused=True).step()  # in place, as the stages' optimizers
    for got, want in zip(decode_steps(model, ids, None), decode_steps(model, ids, None, general=True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    att = model.trf_blocks[1].att
    att.W_query.weight = nn.Parameter(torch.randn_like(att.W_query.weight))  # a new tensor altogether
    for got, want in zip(decode_steps(model, ids, None), decode_steps(model, ids, None, general=True), strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_decode_step_is_left_to_the_general_pass_when_training_with_autograd_or_at_the_context_end(monkeypatch):
    """Dropout (training mode), autograd, the written-out attention (``attention="math"``) and a position past the
    context take the general pass: its dropout, its graph, its attention and its error for a position past
    ``context_length``."""
    monkeypatch.setattr(gf.FastGPTModel, "decode_step", lambda *a: pytest.fail("decode_step was taken"))
    math = gf.speed_up(random_model(small_cfg(attention="math"), seed=9)).eval()
    ids, mask = prompts_and_mask(padded=True)
    decode_steps(math, ids, mask)
    model = gf.speed_up(random_model(small_cfg(drop_rate=0.5), seed=9))
    cache = gm.KVCache(model.cfg, 1, 16)
    ids = torch.randint(0, 61, (1, 15), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model.eval()(ids, past_key_values=cache, use_cache=True)
        model.train()(ids[:, :1], past_key_values=cache, use_cache=True)  # dropout on: training mode
    cache.length = 15
    assert model.eval()(ids[:, :1], past_key_values=cache, use_cache=True)["logits"].requires_grad  # autograd on
    with torch.no_grad(), pytest.raises(ValueError, match="context_length"):
        cache.length = 16
        model(ids[:, :1], past_key_values=cache, use_cache=True)


# --------------------------------------------------------------------------------------------------------------
# SplitLinear: the split path for decoding on a CPU


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("out_features", [12, 7])
def test_linear_split_path_equals_f_linear(threads, rows, bias, out_features, monkeypatch):
    """The blocks of output features multiplied in one bmm give F.linear's product (float32 rounding apart), for one
    row (W x^T) and several (x W^T), with and without bias; a width the threads do not divide takes F.linear."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    calls, split = [], gf.split_linear
    monkeypatch.setattr(gf, "split_linear", lambda x, w, b, parts: calls.append(parts) or split(x, w, b, parts))
    torch.manual_seed(0)
    layer = gf.SplitLinear(10, out_features, bias=bias)
    x = torch.randn(rows, 1, 10)  # (B, T, in)
    with torch.no_grad():
        got = layer(x)
    assert got.shape == (rows, 1, out_features)
    assert torch.allclose(got, F.linear(x, layer.weight, layer.bias), atol=1e-6)
    assert calls == ([threads] if out_features % threads == 0 else [])


def test_linear_takes_f_linear_for_training_autocast_bf16_and_many_rows(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(gf, "split_linear", lambda *a: pytest.fail("the split path was taken"))
    layer = gf.SplitLinear(8, 8)
    layer(torch.randn(1, 8)).sum().backward()  # autograd on: training
    with torch.no_grad():
        layer(torch.randn(gf.SPLIT_ROWS + 1, 8))  # more rows than a decoding batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            layer(torch.randn(1, 8))
        layer.to(torch.bfloat16)(torch.randn(1, 8, dtype=torch.bfloat16))


def test_greedy_decoding_is_the_same_with_and_without_the_split_path(monkeypatch):
    """Whole generations: the split products change no greedy token of a small random model at batch 1 and 4."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=300, context_length=64, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0,
                               position_embedding="rope")).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    gf.speed_up(model)
    prompt = torch.randint(1, 300, (4, 6), generator=torch.Generator().manual_seed(1))
    split = [gf.generate(model, prompt[:b], 20, 64) for b in (1, 4)]
    monkeypatch.setattr(gf, "SPLIT_ROWS", 0)
    for ids, b in zip(split, (1, 4)):
        assert torch.equal(ids, gf.generate(model, prompt[:b], 20, 64))
