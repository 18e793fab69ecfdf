"""Tests of gpt_model.py against independent oracles.

Every expected value here comes from somewhere other than the code under test: a hand calculation, a formula
written out in the test, a cache-less loop written in the test, the same model run on one row alone, or
``transformers.GPT2LMHeadModel`` holding the same weights.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import gpt_model as gm
from gpt_model import GPTConfig, GPTModel

# --------------------------------------------------------------------------------------------------------------
# helpers


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These tensors are tiny: a second intra-op thread only adds spin-waiting (20x slower on a busy 2-core box)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def small_cfg(**changes):
    """A model small enough to run in milliseconds, with dropout off."""
    base = dict(vocab_size=61, context_length=16, emb_dim=24, n_heads=3, n_layers=2, drop_rate=0.0)
    if changes.get("position_embedding") == "rope":
        base.update(emb_dim=24, n_heads=2)  # even head dim
    base.update(changes)
    return GPTConfig(**base)


def random_model(cfg, seed=0):
    """A model whose every parameter is random and large enough that logits are well spread.

    (The default init gives nearly flat logits, which would let many bugs through and make argmax ties likely.)
    """
    torch.manual_seed(seed)
    model = GPTModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("scale"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.3)
    return model.eval()


def cacheless_greedy(model, ids, max_new_tokens, context_size, penalty=1.0):
    """The seed walkthrough's generate_text_simple: recompute the last ``context_size`` tokens every step."""
    ids = ids.clone()
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(ids[:, -context_size:])["logits"][:, -1, :].clone()
            if penalty != 1.0:  # CTRL's penalty, written out element by element
                for b in range(ids.shape[0]):
                    for tok in set(ids[b].tolist()):
                        v = logits[b, tok].item()
                        logits[b, tok] = v / penalty if v > 0 else v * penalty
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


def successor_model(vocab=16, context_length=64):
    """A real GPTModel built by hand so that greedy decoding emits (last token + 1) mod V.

    Attention and feed-forward branches output zero, token embeddings are one-hot, and the head maps the
    normalised one-hot of token i onto logit i + 1.
    """
    cfg = GPTConfig(vocab_size=vocab, context_length=context_length, emb_dim=vocab, n_heads=2, n_layers=1,
                    drop_rate=0.0, tie_embeddings=False)
    model = GPTModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0 if name.endswith("scale") else 0.0)
        model.tok_emb.weight.copy_(torch.eye(vocab))
        head = torch.zeros(vocab, vocab)
        for i in range(vocab):
            head[(i + 1) % vocab, i] = 1.0
        model.out_head.weight.copy_(head)
    return model.eval()


def logits_of(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask)["logits"]


# --------------------------------------------------------------------------------------------------------------
# the Hugging Face oracle


def hf_twin(cfg, seed=0, attn_implementation="eager"):
    """A random ``GPT2LMHeadModel`` of the same shape as ``cfg`` and our ``GPTModel`` holding its weights.

    HF's Conv1D stores weights as (in, out), so they are transposed into nn.Linear's (out, in); ``c_attn`` holds
    query | key | value side by side along the output dimension.
    """
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_cfg = GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.context_length, n_embd=cfg.emb_dim, n_layer=cfg.n_layers,
        n_head=cfg.n_heads, activation_function="gelu_new", layer_norm_epsilon=cfg.layer_norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0, attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    hf = GPT2LMHeadModel(hf_cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if ".ln_" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
        if not cfg.qkv_bias:
            for block in hf.transformer.h:
                block.attn.c_attn.bias.zero_()
    assert (hf.lm_head.weight is hf.transformer.wte.weight) == cfg.tie_embeddings

    ours = GPTModel(cfg).eval()
    e = cfg.emb_dim
    t = hf.transformer
    with torch.no_grad():
        ours.tok_emb.weight.copy_(t.wte.weight)
        ours.pos_emb.weight.copy_(t.wpe.weight)
        for blk, h in zip(ours.trf_blocks, t.h):
            for i, lin in enumerate((blk.att.W_query, blk.att.W_key, blk.att.W_value)):
                lin.weight.copy_(h.attn.c_attn.weight[:, i * e:(i + 1) * e].T)
                if cfg.qkv_bias:
                    lin.bias.copy_(h.attn.c_attn.bias[i * e:(i + 1) * e])
                else:
                    assert lin.bias is None
            for lin, conv in ((blk.att.out_proj, h.attn.c_proj), (blk.ff.layers[0], h.mlp.c_fc),
                              (blk.ff.layers[2], h.mlp.c_proj)):
                lin.weight.copy_(conv.weight.T)
                lin.bias.copy_(conv.bias)
            for norm, ln in ((blk.norm1, h.ln_1), (blk.norm2, h.ln_2)):
                norm.scale.copy_(ln.weight)
                norm.shift.copy_(ln.bias)
        ours.final_norm.scale.copy_(t.ln_f.weight)
        ours.final_norm.shift.copy_(t.ln_f.bias)
        if cfg.tie_embeddings:
            assert ours.out_head.weight is ours.tok_emb.weight
        else:
            ours.out_head.weight.copy_(hf.lm_head.weight)
    return hf, ours


@pytest.mark.parametrize("attention", ["sdpa", "math"])
@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("qkv_bias", [True, False])
def test_logits_match_hf_gpt2(qkv_bias, tie, attention):
    """Same weights in transformers' GPT-2 and ours give the same logits (HF is the independent oracle)."""
    cfg = GPTConfig(vocab_size=97, context_length=24, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0,
                    qkv_bias=qkv_bias, tie_embeddings=tie, attention=attention)
    hf, ours = hf_twin(cfg, seed=1 + 2 * qkv_bias + tie)
    ids = torch.randint(0, cfg.vocab_size, (3, cfg.context_length), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(ids).logits
    got = logits_of(ours, ids)
    assert expected.abs().max() > 1.0  # the comparison is not between two near-zero tensors
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_left_padded_batch_matches_hf_with_explicit_positions():
    """A left-padded batch gives HF's logits when HF gets the mask and positions counted from the first real token."""
    cfg = GPTConfig(vocab_size=97, context_length=24, emb_dim=32, n_heads=4, n_layers=2, drop_rate=0.0,
                    qkv_bias=True)
    hf, ours = hf_twin(cfg, seed=7)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (3, 10), generator=g)
    lengths = [10, 6, 2]
    mask = torch.zeros(3, 10, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, 10 - n:] = 1
    position_ids = torch.zeros(3, 10, dtype=torch.long)
    for b, n in enumerate(lengths):
        position_ids[b, 10 - n:] = torch.arange(n)
    with torch.no_grad():
        expected = hf(ids, attention_mask=mask, position_ids=position_ids).logits
    got = logits_of(ours, ids, mask)
    for b, n in enumerate(lengths):
        torch.testing.assert_close(got[b, 10 - n:], expected[b, 10 - n:], atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------------------------------------------
# building blocks


def test_layernorm_forward_reference_and_hand_value():
    """LayerNorm on [1, 2, 3]: mean 2, biased variance 2/3, so the normalised vector is (-1, 0, 1)/sqrt(2/3 + eps)."""
    eps = 1e-5
    ln = gm.LayerNorm(3, eps=eps)
    with torch.no_grad():
        ln.scale.copy_(torch.tensor([1.0, 2.0, 0.5]))
        ln.shift.copy_(torch.tensor([0.1, 0.2, 0.3]))
    x = torch.tensor([[1.0, 2.0, 3.0]])
    r = 1.0 / math.sqrt(2.0 / 3.0 + eps)
    expected = torch.tensor([[1.0 * -r + 0.1, 2.0 * 0.0 + 0.2, 0.5 * r + 0.3]])
    torch.testing.assert_close(ln(x), expected)
    torch.testing.assert_close(ln.reference(x), expected)
    y = torch.randn(4, 5, 3)
    torch.testing.assert_close(ln(y), ln.reference(y))


def test_gelu_forward_reference_torch_and_hand_values():
    """GELU (tanh form) matches torch's approximate='tanh' and the formula evaluated with math.tanh."""
    xs = [-4.0, -1.5, -0.3, 0.0, 0.7, 2.0, 5.0]
    hand = [0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))) for x in xs]
    x = torch.tensor(xs, dtype=torch.float64)
    expected = torch.tensor(hand, dtype=torch.float64)
    torch.testing.assert_close(gm.GELU()(x), expected)
    torch.testing.assert_close(gm.GELU.reference(x), expected)
    torch.testing.assert_close(F.gelu(x, approximate="tanh"), expected)
    assert gm.GELU()(torch.tensor(0.0)).item() == 0.0


def test_rmsnorm_matches_torch():
    """Our RMSNorm equals torch.nn.RMSNorm with the same weight and eps."""
    torch.manual_seed(0)
    ours = gm.RMSNorm(8, eps=1e-5)
    ref = torch.nn.RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        w = torch.randn(8)
        ours.scale.copy_(w)
        ref.weight.copy_(w)
    x = torch.randn(3, 5, 8) * 3
    torch.testing.assert_close(ours(x), ref(x))


def test_feedforward_is_four_times_wider():
    """The FeedForward hidden layer has 4E units and maps E back to E."""
    cfg = small_cfg()
    ff = gm.FeedForward(cfg)
    assert ff.layers[0].out_features == 4 * cfg.emb_dim and ff.layers[2].in_features == 4 * cfg.emb_dim
    assert ff(torch.randn(2, 3, cfg.emb_dim)).shape == (2, 3, cfg.emb_dim)


# --------------------------------------------------------------------------------------------------------------
# attention_reference against a hand softmax


def hand_attention(q, k, v, allowed=None, bias=None):
    """softmax(q.k / sqrt(d) + bias) v with Python loops; a row with nothing allowed gives zeros."""
    bsz, heads, tq, d = q.shape
    tk = k.shape[2]
    out = torch.zeros(bsz, heads, tq, v.shape[-1], dtype=torch.float64)
    for b in range(bsz):
        for h in range(heads):
            for i in range(tq):
                scores = {}
                for j in range(tk):
                    if allowed is not None and not allowed(b, h, i, j):
                        continue
                    s = sum(q[b, h, i, c].item() * k[b, h, j, c].item() for c in range(d)) / math.sqrt(d)
                    if bias is not None:
                        s += bias[b, h, i, j].item()
                    if s != float("-inf"):
                        scores[j] = s
                if not scores:
                    continue
                top = max(scores.values())
                z = sum(math.exp(s - top) for s in scores.values())
                for j, s in scores.items():
                    out[b, h, i] += math.exp(s - top) / z * v[b, h, j].double()
    return out.float()


def qkv(tq=4, tk=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 2, tq, 5, generator=g), torch.randn(2, 2, tk, 5, generator=g),
            torch.randn(2, 2, tk, 5, generator=g))


def test_attention_reference_without_mask():
    """No mask: every key is visible."""
    q, k, v = qkv()
    torch.testing.assert_close(gm.attention_reference(q, k, v), hand_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_attention_reference_causal_bool_mask():
    """A lower-triangular bool mask lets query i see keys 0..i only."""
    q, k, v = qkv()
    mask = torch.tensor([[j <= i for j in range(4)] for i in range(4)])
    got = gm.attention_reference(q, k, v, mask)
    torch.testing.assert_close(got, hand_attention(q, k, v, lambda b, h, i, j: j <= i), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


def test_attention_reference_padding_mask():
    """A (B, 1, 1, Tk) key-padding mask hides padded keys of each row."""
    q, k, v = qkv(tq=3, tk=5)
    keep = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    got = gm.attention_reference(q, k, v, keep[:, None, None, :])
    expected = hand_attention(q, k, v, lambda b, h, i, j: bool(keep[b, j]))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_attention_reference_additive_bias():
    """A float mask is added to the scores (any bias, with -inf meaning hidden)."""
    q, k, v = qkv()
    bias = torch.randn(2, 2, 4, 4, generator=torch.Generator().manual_seed(3))
    bias[0, 1, 2, 1] = float("-inf")
    bias[1, 0, :, 3] = float("-inf")
    got = gm.attention_reference(q, k, v, bias)
    torch.testing.assert_close(got, hand_attention(q, k, v, bias=bias), atol=1e-5, rtol=1e-5)


def test_attention_reference_fully_masked_row_is_zero_not_nan():
    """A query with no visible key gets zeros (softmax of an all -inf row would be NaN); other rows are exact."""
    q, k, v = qkv()
    mask = torch.tensor([[j <= i for j in range(4)] for i in range(4)])
    mask = mask[None, None].repeat(2, 2, 1, 1)
    mask[1, 0, 2, :] = False
    got = gm.attention_reference(q, k, v, mask)
    assert not torch.isnan(got).any()
    assert torch.equal(got[1, 0, 2], torch.zeros(5))
    expected = hand_attention(q, k, v, lambda b, h, i, j: bool(mask[b, h, i, j]))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    additive = torch.zeros(2, 2, 4, 4).masked_fill(~mask, float("-inf"))
    got_add = gm.attention_reference(q, k, v, additive)
    assert not torch.isnan(got_add).any()
    torch.testing.assert_close(got_add, expected, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------------------------------
# RoPE


def rotate(vec, position):
    """RoPE applied to one (d,) vector at an integer position through the module's functions."""
    rotation = gm.rope_angles(vec.shape[-1], torch.tensor([[position]]))
    return gm.apply_rope(vec.view(1, 1, 1, -1), rotation).view(-1)


def test_rope_two_dimensions_is_a_rotation_by_the_position():
    """With d_h = 2 the only frequency is 1, so position m rotates (x, y) by m radians."""
    x, y, m = 0.3, -1.2, 5
    got = rotate(torch.tensor([x, y]), m)
    expected = torch.tensor([x * math.cos(m) - y * math.sin(m), x * math.sin(m) + y * math.cos(m)])
    torch.testing.assert_close(got, expected)


def test_rope_rotates_each_pair_by_its_own_frequency():
    """d_h = 8 at position m: pair j = (x_2j, x_2j+1) turns by m * 10000^(-2j/8) radians, written out with real cos
    and sin; a batch of positions and heads gets what each vector gets alone (to rounding: the vectorised complex
    multiply may round the last bit differently)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, 8, generator=g, dtype=torch.float64).float()  # (B, H, T, d_h)
    positions = torch.tensor([[0, 1, 2, 30, 255], [7, 7, 8, 100, 3]])
    got = gm.apply_rope(x, gm.rope_angles(8, positions))
    for b in range(2):
        for h in range(3):
            for t in range(5):
                m, expected = positions[b, t].item(), []
                for j in range(4):
                    angle = m * 10000 ** (-2 * j / 8)
                    a, c = x[b, h, t, 2 * j].item(), x[b, h, t, 2 * j + 1].item()
                    expected += [a * math.cos(angle) - c * math.sin(angle), a * math.sin(angle) + c * math.cos(angle)]
                torch.testing.assert_close(got[b, h, t], torch.tensor(expected), atol=2e-6, rtol=1e-5)
                torch.testing.assert_close(rotate(x[b, h, t], m), got[b, h, t])


def test_rope_score_depends_only_on_relative_position():
    """q_m . k_n is a function of m - n: shifting both positions leaves the score unchanged, and it does vary."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(16, generator=g), torch.randn(16, generator=g)
    for m, n in [(3, 1), (7, 7), (2, 9)]:
        base = torch.dot(rotate(q, m), rotate(k, n))
        for shift in (1, 5, 40):
            torch.testing.assert_close(torch.dot(rotate(q, m + shift), rotate(k, n + shift)), base,
                                       atol=1e-4, rtol=1e-4)
    scores = {torch.dot(rotate(q, m), rotate(k, 0)).item() for m in range(4)}
    assert len(scores) == 4
    torch.testing.assert_close(rotate(q, 11).norm(), q.norm())  # a rotation keeps the length


# --------------------------------------------------------------------------------------------------------------
# the seed's tests


def test_inputs_and_targets_shifted_by_one_give_the_hand_loss():
    """A packed stream cut into inputs = chunk[:-1], targets = chunk[1:]: next_token_loss equals the mean of
    -log p(target_t | inputs_0..t), each probability computed by running the model on that prefix alone."""
    cls_, sep = 1, 2
    stream = [cls_, 10, 11, 12, sep, cls_, 20, 21, sep, cls_, 30, 31, 32, 33, sep]
    chunk = torch.tensor(stream[:9])
    inputs, targets = chunk[:-1], chunk[1:]
    assert inputs.tolist() == [cls_, 10, 11, 12, sep, cls_, 20, 21]
    assert targets.tolist() == [10, 11, 12, sep, cls_, 20, 21, sep]
    model = random_model(small_cfg(), seed=3)
    logits = logits_of(model, inputs[None])
    terms = []
    for t in range(len(inputs)):
        last = logits_of(model, inputs[None, : t + 1])[0, -1]
        terms.append(-torch.log_softmax(last.double(), -1)[targets[t]].item())
    assert gm.next_token_loss(logits, targets[None]).item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    ignored = targets.clone()
    ignored[[0, 4]] = -100  # positions whose target is not to be learned
    kept = [terms[t] for t in range(len(terms)) if t not in (0, 4)]
    assert gm.next_token_loss(logits, ignored[None]).item() == pytest.approx(sum(kept) / len(kept), rel=1e-5)


def hidden_weight_labels(n_rows=18, vocab=50, emb=16, seed=0):
    """Random (2, n_rows / 2, emb) hidden states and (vocab, emb) head weight that need grads, and labels with
    some -100 (a prompt at the start of row 0, padding at the end of row 1)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, n_rows // 2, emb, generator=g).requires_grad_()
    weight = torch.randn(vocab, emb, generator=g).requires_grad_()
    labels = torch.randint(0, vocab, (2, n_rows // 2), generator=g)
    labels[0, :3] = -100
    labels[1, -2:] = -100
    return hidden, weight, labels


def hand_loss(hidden, weight, labels):
    """Mean over kept positions of log-sum-exp(z) - z_label, one position at a time in float64."""
    terms = []
    for h, y in zip(hidden.detach().double().reshape(-1, hidden.shape[-1]), labels.reshape(-1).tolist()):
        if y != -100:
            z = weight.detach().double() @ h
            terms.append((torch.logsumexp(z, 0) - z[y]).item())
    return sum(terms) / len(terms)


def test_the_model_loss_from_labels_is_the_cross_entropy_written_out():
    """model(ids, labels=...)["loss"] (the lesson's forward, no "logits" in its output) is, by hand in float64 from
    the same model's logits, the mean over the counted positions of log sum_v exp(z_v) - z_label, position by
    position; its gradients are autograd's through that very formula."""
    model = random_model(small_cfg(), seed=5)
    ids = torch.randint(1, 61, (2, 10), generator=torch.Generator().manual_seed(1))
    labels = torch.cat((ids[:, 1:], torch.full((2, 1), -100)), dim=1)
    labels[1, 6:] = -100  # padding: nothing to predict
    out = model(ids, labels=labels)
    assert "logits" not in out and out["last_hidden_state"].shape == (2, 10, 24)
    logits = model(ids)["logits"]
    terms = [torch.logsumexp(logits[b, t].double(), 0) - logits[b, t, labels[b, t]].double()
             for b in range(2) for t in range(10) if labels[b, t] != -100]
    by_hand = sum(terms) / len(terms)
    assert len(terms) == 9 + 6 and out["loss"].item() == pytest.approx(by_hand.item(), rel=1e-6)
    params = list(model.parameters())
    for a, b in zip(torch.autograd.grad(out["loss"], params), torch.autograd.grad(by_hand, params)):
        torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-4)


def test_labels_of_the_wrong_shape_are_refused():
    """Labels one position short (input_ids[:, 1:], a common slip) or of another batch size raise, naming both
    shapes, instead of giving a loss over misaligned rows."""
    model = random_model(small_cfg(), seed=6)
    ids = torch.randint(0, 61, (2, 10))
    for labels in (ids[:, 1:], ids[:1], ids.reshape(1, 20)):
        with pytest.raises(ValueError, match=r"labels have shape .* but the hidden states \(2, 10\)"):
            model(ids, labels=labels)


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_causal_mask_blocks_the_future(attention, position_embedding):
    """Changing the tokens after t leaves logits at positions <= t unchanged, and does change position t + 1."""
    model = random_model(small_cfg(attention=attention, position_embedding=position_embedding), seed=4)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    t = 6
    changed = ids.clone()
    changed[:, t + 1:] = (changed[:, t + 1:] + 7) % 61
    a, b = logits_of(model, ids), logits_of(model, changed)
    torch.testing.assert_close(a[:, : t + 1], b[:, : t + 1], atol=1e-5, rtol=1e-5)
    assert (a[:, t + 1] - b[:, t + 1]).abs().max() > 1e-3


@pytest.mark.parametrize("tie", [True, False])
def test_parameters_change_after_an_optimizer_step(tie):
    """One AdamW step moves every parameter tensor; all gradients are finite."""
    torch.manual_seed(0)
    model = GPTModel(small_cfg(tie_embeddings=tie, drop_rate=0.1)).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 61, (2, 16))
    loss = gm.next_token_loss(model(ids[:, :-1])["logits"], ids[:, 1:])
    loss.backward()
    for n, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), n
    opt.step()
    for n, p in model.named_parameters():
        assert not torch.equal(before[n], p.detach()), f"{n} did not change"


SENTENCES = ["床前明月光，疑是地上霜。", "举头望明月，低头思故乡。", "白日依山尽，黄河入海流。"]


@pytest.fixture(scope="module")
def memorised(tokenizer):
    """The tiny preset over-fitted on three Chinese sentences: (model, losses)."""
    import chinese_tokenizer as ct

    rows = [[ct.CLS_ID] + ct.encode(s, tokenizer) + [ct.SEP_ID] for s in SENTENCES]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), ct.PAD_ID)
    labels = torch.full((len(rows), width), -100)
    for b, row in enumerate(rows):
        ids[b, : len(row)] = torch.tensor(row)
        labels[b, : len(row) - 1] = torch.tensor(row[1:])
    torch.manual_seed(0)
    model = GPTModel(gm.get_preset("tiny")).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(120):
        loss = model(ids, attention_mask=(ids != ct.PAD_ID).long(), labels=labels)["loss"]
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.eval(), losses


def test_loss_falls_when_overfitting_chinese_sentences(memorised):
    """Training on three sentences drives the loss from about ln(V) to near zero."""
    _, losses = memorised
    assert losses[0] == pytest.approx(math.log(21128), abs=1.0)  # untrained: close to uniform
    assert losses[-1] < 0.1 * losses[0]
    assert losses[-1] < 0.5


def test_greedy_generation_reproduces_a_memorised_sentence(memorised, tokenizer):
    """From [CLS] and the first two characters, greedy decoding writes the rest of the memorised line and [SEP]."""
    import chinese_tokenizer as ct

    model, _ = memorised
    for s in SENTENCES:
        prompt = torch.tensor([[ct.CLS_ID] + ct.encode(s[:2], tokenizer)])
        out = gm.generate(model, prompt, max_new_tokens=30, context_size=64, eos_id=ct.SEP_ID)
        assert out[0, -1].item() == ct.SEP_ID
        assert ct.token_ids_to_text(out, tokenizer) == s


@pytest.mark.parametrize("tie", [True, False])
def test_save_and_load_safetensors_gives_equal_logits(tmp_path, tie):
    """safetensors save_model -> load_model into a fresh model restores the logits (and the tie)."""
    from safetensors.torch import load_model, save_model

    cfg = small_cfg(tie_embeddings=tie)
    model = random_model(cfg, seed=5)
    save_model(model, str(tmp_path / "model.safetensors"))
    fresh = GPTModel(cfg).eval()
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(logits_of(fresh, ids), logits_of(model, ids))
    load_model(fresh, str(tmp_path / "model.safetensors"))
    assert torch.equal(logits_of(fresh, ids), logits_of(model, ids))
    assert (fresh.out_head.weight is fresh.tok_emb.weight) == tie


# --------------------------------------------------------------------------------------------------------------
# KV cache, padding, SDPA vs math


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
@pytest.mark.parametrize("attention", ["sdpa", "math"])
def test_kv_cache_steps_give_the_full_pass_logits(attention, position_embedding):
    """A 5-token prefill, a 3-token chunk, then single tokens through the cache equal one full forward pass."""
    model = random_model(small_cfg(attention=attention, position_embedding=position_embedding), seed=6)
    ids = torch.randint(0, 61, (2, 14), generator=torch.Generator().manual_seed(1))
    full = logits_of(model, ids)
    with torch.no_grad():
        out = model(ids[:, :5], use_cache=True)
        pieces = [out["logits"]]
        cache = out["past_key_values"]
        out = model(ids[:, 5:8], past_key_values=cache, use_cache=True)
        pieces.append(out["logits"])
        for t in range(8, 14):
            out = model(ids[:, t: t + 1], past_key_values=out["past_key_values"], use_cache=True)
            pieces.append(out["logits"])
    assert out["past_key_values"].length == 14
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_kv_cache_with_left_padding(position_embedding):
    """Left-padded prefill then cached single steps (mask growing by one) match each row's full pass alone."""
    model = random_model(small_cfg(position_embedding=position_embedding), seed=7)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 61, (n,), generator=g) for n in (9, 4, 6)]
    width, extra = 9, 5
    ids = torch.zeros(3, width + extra, dtype=torch.long)
    mask = torch.zeros(3, width + extra, dtype=torch.long)
    followups = torch.randint(0, 61, (3, extra), generator=g)
    for b, r in enumerate(rows):
        ids[b, width - len(r): width] = r
        mask[b, width - len(r):] = 1
    ids[:, width:] = followups
    with torch.no_grad():
        out = model(ids[:, :width], attention_mask=mask[:, :width], use_cache=True)
        steps = [out["logits"][:, -1]]
        for t in range(width, width + extra):
            out = model(ids[:, t: t + 1], attention_mask=mask[:, : t + 1], past_key_values=out["past_key_values"],
                        use_cache=True)
            steps.append(out["logits"][:, -1])
    for b, r in enumerate(rows):
        alone = logits_of(model, torch.cat([r, followups[b]])[None])[0, len(r) - 1:]
        torch.testing.assert_close(torch.stack([s[b] for s in steps]), alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_batch_equals_each_row_alone(side, position_embedding):
    """With attention_mask, the real positions of a padded batch give the logits of each sequence run alone,
    whatever the (garbage) pad ids are."""
    model = random_model(small_cfg(position_embedding=position_embedding), seed=8)
    g = torch.Generator().manual_seed(3)
    lengths = [7, 3, 10, 1]
    ids = torch.randint(0, 61, (4, 10), generator=g)  # pads hold random ids on purpose
    mask = torch.zeros(4, 10, dtype=torch.long)
    spans = []
    for b, n in enumerate(lengths):
        span = slice(0, n) if side == "right" else slice(10 - n, 10)
        mask[b, span] = 1
        spans.append(span)
    got = logits_of(model, ids, mask)
    for b, span in enumerate(spans):
        torch.testing.assert_close(got[b, span], logits_of(model, ids[b:b + 1, span])[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_sdpa_equals_math_attention(position_embedding):
    """The fused kernel and the explicit-softmax reference give the same logits: causal, padded, and cached."""
    sdpa = random_model(small_cfg(position_embedding=position_embedding), seed=9)
    math_model = GPTModel(sdpa.cfg.replace(attention="math")).eval()
    math_model.load_state_dict(sdpa.state_dict())
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 61, (3, 12), generator=g)
    torch.testing.assert_close(logits_of(sdpa, ids), logits_of(math_model, ids), atol=1e-5, rtol=1e-5)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[0, :5] = 0
    mask[1, 9:] = 0
    torch.testing.assert_close(logits_of(sdpa, ids, mask), logits_of(math_model, ids, mask), atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        outs = []
        for m in (sdpa, math_model):
            o = m(ids[:, :6], use_cache=True)
            o = m(ids[:, 6:9], past_key_values=o["past_key_values"], use_cache=True)
            outs.append(o["logits"])
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_positions_past_the_context_raise():
    """More tokens than context_length is a ValueError, not an index error deep inside."""
    model = random_model(small_cfg(), seed=0)
    with pytest.raises(ValueError, match="context_length"):
        model(torch.zeros(1, 17, dtype=torch.long))


# --------------------------------------------------------------------------------------------------------------
# generate


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_generate_greedy_equals_cacheless_loop_past_the_context(position_embedding):
    """Greedy ids with the KV cache, running 19 tokens past a 16-token context, equal the seed's cache-less loop."""
    model = random_model(small_cfg(position_embedding=position_embedding), seed=10)
    prompt = torch.randint(0, 61, (1, 5), generator=torch.Generator().manual_seed(5))
    got = gm.generate(model, prompt, max_new_tokens=30, context_size=16)
    assert got.shape == (1, 35) and got.dtype == torch.long
    assert torch.equal(got, cacheless_greedy(model, prompt, 30, 16))


def test_long_prompt_keeps_its_last_tokens():
    """A prompt longer than context_size is returned whole, and continued from its last context_size tokens."""
    model = random_model(small_cfg(), seed=11)
    prompt = torch.randint(0, 61, (1, 25), generator=torch.Generator().manual_seed(6))
    got = gm.generate(model, prompt, max_new_tokens=6, context_size=16)
    assert torch.equal(got[:, :25], prompt)
    assert torch.equal(got, cacheless_greedy(model, prompt, 6, 16))
    # only the last 16 prompt tokens matter: changing the earlier ones changes nothing
    other = prompt.clone()
    other[:, :9] = (other[:, :9] + 1) % 61
    assert torch.equal(gm.generate(model, other, 6, 16)[:, 25:], got[:, 25:])


def test_context_size_smaller_than_the_model():
    """context_size below the model's context_length slides a window of that size."""
    model = random_model(small_cfg(), seed=12)
    prompt = torch.randint(0, 61, (2, 3), generator=torch.Generator().manual_seed(7))
    assert torch.equal(gm.generate(model, prompt, 12, 8), cacheless_greedy(model, prompt, 12, 8))


def test_context_size_larger_than_the_model_is_clamped():
    """context_size past the model's 16 positions used to stream tokens and then fail once the text passed 16; now
    it is clamped: the same ids as context_size 16, also for a prompt that already fills the context."""
    model = random_model(small_cfg(), seed=12)
    for length in (3, 16):
        prompt = torch.randint(0, 61, (2, length), generator=torch.Generator().manual_seed(7))
        assert torch.equal(gm.generate(model, prompt, 20, 64), cacheless_greedy(model, prompt, 20, 16))


def test_eos_id_outside_the_vocabulary_is_refused():
    """GPT-2's 50256 in a 61-token model could never be sampled, so generation would never stop: a ValueError
    naming the id and the vocabulary, before any token."""
    model = random_model(small_cfg(), seed=12)
    prompt = torch.zeros(1, 2, dtype=torch.long)
    for eos in (50256, 61, -1):
        with pytest.raises(ValueError, match=rf"eos_id {eos} is not a token of this model \(vocabulary 0..60\)"):
            gm.generate(model, prompt, 5, 16, eos_id=eos)
    with pytest.raises(ValueError, match="context_size must be >= 1"):
        gm.generate(model, prompt, 5, 0)
    assert gm.generate(model, prompt, 5, 16, eos_id=60).shape[1] <= 7  # the last id is a token


def test_temperature_zero_is_argmax():
    """One greedy step appends the argmax of the last position's logits."""
    model = random_model(small_cfg(), seed=13)
    prompt = torch.randint(0, 61, (3, 6), generator=torch.Generator().manual_seed(8))
    out = gm.generate(model, prompt, max_new_tokens=1, context_size=16, temperature=0.0)
    assert torch.equal(out[:, -1], logits_of(model, prompt)[:, -1].argmax(-1))


@pytest.mark.parametrize("kwargs", [dict(temperature=-0.5), dict(temperature=1.0, top_k=0),
                                    dict(temperature=1.0, top_p=0.0), dict(temperature=1.0, top_p=1.5)])
def test_bad_sampling_arguments_raise(kwargs):
    """Negative temperature, top_k < 1 and top_p outside (0, 1] are ValueErrors."""
    model = random_model(small_cfg(), seed=0)
    with pytest.raises(ValueError):
        gm.generate(model, torch.zeros(1, 2, dtype=torch.long), 2, 16, **kwargs)


def test_top_k_larger_than_vocab_is_clamped():
    """top_k > V keeps every logit, and sampling with it equals sampling without top_k."""
    logits = torch.randn(2, 61)
    assert torch.equal(gm.filter_logits(logits, top_k=10_000), logits)
    model = random_model(small_cfg(), seed=14)
    prompt = torch.zeros(2, 3, dtype=torch.long)
    torch.manual_seed(0)
    a = gm.generate(model, prompt, 8, 16, temperature=1.0, top_k=10_000)
    torch.manual_seed(0)
    b = gm.generate(model, prompt, 8, 16, temperature=1.0)
    assert torch.equal(a, b)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_top_k_one_and_tiny_top_p_are_greedy(seed):
    """Sampling that keeps only the most likely token is greedy decoding, whatever the temperature and seed."""
    model = random_model(small_cfg(), seed=15)
    prompt = torch.randint(0, 61, (2, 4), generator=torch.Generator().manual_seed(seed))
    greedy = gm.generate(model, prompt, 10, 16)
    torch.manual_seed(seed)
    assert torch.equal(gm.generate(model, prompt, 10, 16, temperature=1.3, top_k=1), greedy)
    torch.manual_seed(seed)
    assert torch.equal(gm.generate(model, prompt, 10, 16, temperature=0.8, top_p=1e-6), greedy)


def test_sampling_is_repeatable_and_varies_with_the_seed():
    """Sampling uses torch's global RNG: the same seed repeats, different seeds differ."""
    model = random_model(small_cfg(), seed=16)
    prompt = torch.zeros(1, 2, dtype=torch.long)
    runs = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        runs.append(gm.generate(model, prompt, 12, 16, temperature=2.0))
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])


def test_filter_logits_hand_example():
    """top_k keeps the k largest; top_p keeps the fewest tokens, by rank, whose probability reaches p."""
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    inf = float("-inf")
    assert torch.equal(gm.filter_logits(logits, top_k=2), torch.tensor([[inf, 3.0, 2.0, inf]]))
    assert torch.equal(gm.filter_logits(logits, top_k=1), torch.tensor([[inf, 3.0, inf, inf]]))
    probs = torch.log(torch.tensor([[0.15, 0.5, 0.3, 0.05]]))  # ranked: 0.5, 0.3, 0.15, 0.05
    def keep(out):
        return (out > inf).int().tolist()

    assert keep(gm.filter_logits(probs, top_p=0.45)) == [[0, 1, 0, 0]]
    assert keep(gm.filter_logits(probs, top_p=0.6)) == [[0, 1, 1, 0]]
    assert keep(gm.filter_logits(probs, top_p=0.9)) == [[1, 1, 1, 0]]
    assert keep(gm.filter_logits(probs, top_p=0.99)) == [[1, 1, 1, 1]]
    assert keep(gm.filter_logits(probs, top_k=2, top_p=0.99)) == [[0, 1, 1, 0]]
    both = torch.cat([probs, probs.flip(-1)])  # rows are filtered independently
    assert keep(gm.filter_logits(both, top_p=0.6)) == [[0, 1, 1, 0], [0, 1, 1, 0]]
    kept = gm.filter_logits(probs, top_p=0.6)
    assert torch.equal(kept[0, 1:3], probs[0, 1:3])  # kept logits are untouched
    # the boundary: a set whose probability exactly reaches top_p is enough (dyadic, so exact in float32)
    dyadic = torch.log(torch.tensor([[0.125, 0.5, 0.125, 0.25]]))
    assert torch.softmax(dyadic, -1).tolist() == [[0.125, 0.5, 0.125, 0.25]]
    assert keep(gm.filter_logits(dyadic, top_p=0.5)) == [[0, 1, 0, 0]]
    assert keep(gm.filter_logits(dyadic, top_p=0.75)) == [[0, 1, 0, 1]]


def test_top_p_one_keeps_everything_for_spread_logits():
    """top_p = 1 keeps every token when no probability is below float32 resolution."""
    logits = torch.randn(3, 61, generator=torch.Generator().manual_seed(0))
    assert torch.equal(gm.filter_logits(logits, top_p=1.0), logits)


def test_top_p_one_keeps_everything_for_peaked_logits():
    """top_p = 1 must be a no-op even when many tokens have tiny probabilities (a realistic 21128-way softmax)."""
    logits = torch.randn(1, 21128, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(gm.filter_logits(logits, top_p=1.0), logits)


def test_successor_model_counts_up():
    """The hand-built model used below really emits last + 1 (mod V)."""
    model = successor_model()
    out = gm.generate(model, torch.tensor([[14]]), 4, 64)
    assert out.tolist() == [[14, 15, 0, 1, 2]]


def test_eos_per_row_and_early_stop():
    """A row that emits eos is filled with eos while the others go on; the loop stops once all have finished."""
    model = successor_model()
    eos = 5
    out = gm.generate(model, torch.tensor([[3], [7]]), max_new_tokens=30, context_size=64, eos_id=eos)
    # row 0: 4, 5 (eos) then eos fill; row 1: 8 .. 15, 0 .. 5 = 14 steps, after which both are done
    assert out.shape == (2, 15)
    assert out[0].tolist() == [3, 4, 5] + [eos] * 12
    assert out[1].tolist() == [7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5]
    capped = gm.generate(model, torch.tensor([[3], [7]]), max_new_tokens=6, context_size=64, eos_id=eos)
    assert capped.shape == (2, 7)  # not everyone finished: max_new_tokens decides
    assert gm.generate(model, torch.tensor([[3], [7]]), max_new_tokens=6, context_size=64).tolist()[0] == \
        [3, 4, 5, 6, 7, 8, 9]  # without eos_id nothing stops


@pytest.mark.parametrize("position_embedding", ["learned", "rope"])
def test_batched_left_padded_generate_equals_each_row_alone(position_embedding):
    """Left-padded prompts of lengths 9, 3, 6 in one batch give each row's own greedy continuation, also while
    the window slides past the context."""
    model = random_model(small_cfg(position_embedding=position_embedding), seed=18)
    g = torch.Generator().manual_seed(10)
    rows = [torch.randint(1, 61, (n,), generator=g) for n in (9, 3, 6)]
    ids = torch.zeros(3, 9, dtype=torch.long)
    mask = torch.zeros(3, 9, dtype=torch.long)
    for b, r in enumerate(rows):
        ids[b, 9 - len(r):] = r
        mask[b, 9 - len(r):] = 1
    out = gm.generate(model, ids, max_new_tokens=12, context_size=16, attention_mask=mask)
    for b, r in enumerate(rows):
        alone = gm.generate(model, r[None], max_new_tokens=12, context_size=16)
        assert torch.equal(out[b, 9:], alone[0, len(r):]), b
        assert torch.equal(alone, cacheless_greedy(model, r[None], 12, 16))


def test_generate_turns_dropout_off_and_restores_the_mode():
    """A model in train mode with heavy dropout generates what it generates in eval mode, and stays in train mode."""
    model = random_model(small_cfg(drop_rate=0.5), seed=19)
    prompt = torch.randint(0, 61, (2, 5), generator=torch.Generator().manual_seed(11))
    expected = gm.generate(model.eval(), prompt, 10, 16)
    model.train()
    assert torch.equal(gm.generate(model, prompt, 10, 16), expected)
    assert model.training


def test_generated_ids_can_be_trained_on():
    """What generate returns is an ordinary tensor, not an inference-mode one: a training pass over it (as PPO
    does with its rollouts) can save it for backward."""
    model = random_model(small_cfg(), seed=20)
    sequences = gm.generate(model, torch.tensor([[3, 4, 5]]), 6, 16)
    assert not sequences.is_inference()
    model(sequences[:, :-1], labels=sequences[:, 1:])["loss"].backward()
    assert model.tok_emb.weight.grad is not None


def test_generate_under_autocast_casts_each_weight_once():
    """Under CPU bf16 autocast a cached decode step must reuse autocast's bf16 copy of each weight instead of
    casting it again: generate once ran in inference mode, where autocast keeps no such copies, and every step
    cast the whole (V, E) head again (bench/README.md). Counts the casts of the head weight over 1 full pass +
    3 cached steps with a dispatch mode; the dtypes come from autocast, not from the model."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountHeadCasts(TorchDispatchMode):
        def __init__(self, weight):
            super().__init__()
            self.shape, self.casts = tuple(weight.shape), 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if (func in (torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype) and
                    tuple(args[0].shape) == self.shape):
                self.casts += 1
            return func(*args, **kwargs)

    model = random_model(small_cfg(), seed=21)
    prompt = torch.tensor([[3, 4, 5], [6, 7, 8]])
    with torch.autocast("cpu", dtype=torch.bfloat16), CountHeadCasts(model.out_head.weight) as counter:
        out = gm.generate(model, prompt, 4, 16)
    assert out.shape == (2, 7)
    assert counter.casts == 1


# --------------------------------------------------------------------------------------------------------------
# reward model


@pytest.mark.parametrize("side", ["right", "left"])
def test_reward_reads_the_last_real_token(side):
    """The reward of a padded row is the head's value at its last real token, and equals the row scored alone."""
    torch.manual_seed(0)
    rm = gm.RewardModel(small_cfg()).eval()
    with torch.no_grad():
        for p in rm.parameters():
            p.normal_(0.0, 0.3)
    lengths = [6, 2, 4]
    ids = torch.randint(0, 61, (3, 6), generator=torch.Generator().manual_seed(12))
    mask = torch.zeros(3, 6, dtype=torch.long)
    last = []
    for b, n in enumerate(lengths):
        if side == "right":
            mask[b, :n] = 1
            last.append(n - 1)
        else:
            mask[b, 6 - n:] = 1
            last.append(5)
    with torch.no_grad():
        out = rm(ids, mask)
        assert out["values"].shape == (3, 6) and out["rewards"].shape == (3,)
        for b in range(len(lengths)):
            assert out["rewards"][b] == out["values"][b, last[b]]
            real = ids[b][mask[b].bool()][None]
            torch.testing.assert_close(out["rewards"][b], rm(real)["rewards"][0], atol=1e-5, rtol=1e-5)
    assert len(set(out["rewards"].tolist())) == 3


# --------------------------------------------------------------------------------------------------------------
# config and presets


@pytest.mark.parametrize("bad", [dict(emb_dim=30, n_heads=4), dict(vocab_size=0), dict(context_length=-1),
                                 dict(n_layers=0), dict(n_heads=0),
                                 dict(drop_rate=1.0), dict(drop_rate=-0.1),
                                 dict(norm="batchnorm"), dict(position_embedding="alibi"),
                                 dict(position_embedding="rope", emb_dim=6, n_heads=2), dict(attention="flash")])
def test_config_validation(bad):
    """Impossible or unknown settings are rejected when the config is made."""
    with pytest.raises(ValueError):
        GPTConfig(**{**dict(emb_dim=32, n_heads=4), **bad})


def test_config_dict_round_trip_and_unknown_keys():
    """to_dict/from_dict round-trip; unknown keys and unknown presets raise ValueError naming them."""
    cfg = small_cfg(qkv_bias=True)
    assert GPTConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="n_embd"):
        GPTConfig.from_dict({**cfg.to_dict(), "n_embd": 32})
    with pytest.raises(ValueError, match="demo"):
        gm.get_preset("huge")


def expected_parameter_count(cfg):
    """GPT-2's parameter count written out: embeddings + blocks + final norm + head (zero when tied)."""
    e, v = cfg.emb_dim, cfg.vocab_size
    embeddings = v * e + (cfg.context_length * e if cfg.position_embedding == "learned" else 0)
    norm = 2 * e if cfg.norm == "layernorm" else e
    attention = 3 * e * e + (3 * e if cfg.qkv_bias else 0) + e * e + e
    feed_forward = e * 4 * e + 4 * e + 4 * e * e + e
    block = attention + feed_forward + 2 * norm
    head = 0 if cfg.tie_embeddings else v * e
    return embeddings + cfg.n_layers * block + norm + head


@pytest.mark.parametrize("name", list(gm.PRESETS))
def test_presets_build_with_the_formula_parameter_count(name):
    """Every preset builds, and its parameter count (tied weights counted once) matches the formula."""
    cfg = gm.get_preset(name)
    with torch.device("meta"):
        model = GPTModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected_parameter_count(cfg)
    assert (model.out_head.weight is model.tok_emb.weight) == cfg.tie_embeddings


def test_preset_shapes_from_the_issue():
    """The preset shapes issue 2 asks for."""
    demo, small, uer = (gm.get_preset(n) for n in ("demo", "gpt2-zh-small", "uer-gpt2-chinese"))
    assert (demo.n_layers, demo.emb_dim, demo.n_heads, demo.context_length, demo.vocab_size) == (4, 256, 4, 256, 21128)
    assert (small.n_layers, small.emb_dim, small.n_heads, small.context_length) == (12, 768, 12, 256)
    assert (uer.n_layers, uer.emb_dim, uer.n_heads, uer.context_length, uer.qkv_bias) == (12, 768, 12, 1024, True)


@pytest.mark.parametrize("norm,position_embedding,tie", [("rmsnorm", "learned", True), ("layernorm", "rope", False),
                                                         ("rmsnorm", "rope", True)])
def test_option_parameter_counts(norm, position_embedding, tie):
    """RMSNorm drops the shift, RoPE drops the position table; the count follows the formula."""
    cfg = small_cfg(norm=norm, position_embedding=position_embedding, tie_embeddings=tie)
    model = GPTModel(cfg)
    assert sum(p.numel() for p in model.parameters()) == expected_parameter_count(cfg)


def test_uer_preset_has_hf_gpt2_parameter_count():
    """The uer preset has exactly as many parameters as transformers' GPT-2 of the same shape."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = gm.get_preset("uer-gpt2-chinese")
    hf_cfg = GPT2Config(vocab_size=cfg.vocab_size, n_positions=cfg.context_length, n_embd=cfg.emb_dim,
                        n_layer=cfg.n_layers, n_head=cfg.n_heads, bos_token_id=0, eos_token_id=0)
    with torch.device("meta"):
        hf = GPT2LMHeadModel(hf_cfg)
        ours = GPTModel(cfg)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in hf.parameters())


def test_generate_refuses_an_empty_prompt():
    """A (1, 0) prompt has nothing to continue from: a ValueError that says so, not an obscure RuntimeError."""
    model = gm.GPTModel(gm.get_preset("tiny").replace(vocab_size=40))
    with pytest.raises(ValueError, match="empty"):
        gm.generate(model, torch.zeros(1, 0, dtype=torch.long), 3, 16)


def test_sample_from_matches_the_probabilities():
    """200k draws from [0.1, 0.2, 0, 0.7] land with those frequencies (±0.005); the zero-probability token never."""
    torch.manual_seed(0)
    probs = torch.tensor([[0.1, 0.2, 0.0, 0.7]]).expand(200_000, 4)
    counts = torch.bincount(gm.sample_from(probs), minlength=4).float() / 200_000
    assert counts[2] == 0
    assert torch.allclose(counts, probs[0], atol=5e-3)
