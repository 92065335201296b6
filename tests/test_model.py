import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_cli.config import ModelConfig
from transformer_cli.data import PAD_ID
from transformer_cli.errors import UsageError
from transformer_cli.model import (
    GEGLU,
    CTransformer,
    NgramBag,
    Packed,
    SelfAttention,
    adversarial_step,
    compact,
    drop_tokens,
    dropout,
    fused_attention,
    geglu_hidden,
    kl_from,
    pool,
    rotary,
    rotate_qk,
    sinusoidal_table,
    virtual_adversarial_step,
)

D_MODEL, N_HEADS, VOCAB, MAX_LEN = 32, 4, 50, 24
LENGTHS = [7, 3, 1, 5]  # real tokens per row; every row keeps at least its [CLS]


def model_cfg(**kw) -> ModelConfig:
    base = {"d_model": D_MODEL, "n_heads": N_HEADS, "n_layers": 2, "ff_mult": 2, "dropout": 0.0, "token_dropout": 0.0,
            "ngram_buckets": 0}
    return ModelConfig(**{**base, **kw})


def length_mask(lengths: list[int], width: int | None = None) -> torch.Tensor:
    width = width or max(lengths)
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def random_batch(lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (PAD after each row's length) and the matching mask."""
    g = torch.Generator().manual_seed(seed)
    mask = length_mask(lengths)
    ids = torch.randint(1, VOCAB, mask.shape, generator=g).masked_fill(~mask, PAD_ID)
    return ids, mask


@pytest.fixture
def attn_input() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(len(LENGTHS), max(LENGTHS), D_MODEL, generator=g), length_mask(LENGTHS)


def attention_pair() -> tuple[SelfAttention, SelfAttention]:
    """An explicit and a fused attention module with the same (random) weights, in eval mode."""
    torch.manual_seed(0)
    explicit = SelfAttention(model_cfg(attention="explicit"))
    for p in explicit.parameters():
        nn.init.normal_(p, std=0.3)
    fused = SelfAttention(model_cfg(attention="sdpa"))
    fused.load_state_dict(explicit.state_dict())
    assert not explicit.fused and fused.fused
    return explicit.eval(), fused.eval()


def reference_attention(attn: SelfAttention, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Multi-head self-attention written out head by head, in float64, from the module's weights."""
    x = x.double()
    w_qkv, b_qkv = attn.qkv.weight.double(), attn.qkv.bias.double()
    B, T, C = x.shape
    dh = C // N_HEADS
    out = torch.zeros(B, T, C, dtype=torch.float64)
    for b in range(B):
        heads = []
        for h in range(N_HEADS):
            rows = [slice(part * C + h * dh, part * C + (h + 1) * dh) for part in range(3)]
            q, k, v = (x[b] @ w_qkv[r].T + b_qkv[r] for r in rows)  # (T, dh) each
            scores = q @ k.T / math.sqrt(dh)  # (T, T)
            scores[:, ~mask[b]] = float("-inf")
            heads.append(torch.softmax(scores, dim=-1) @ v)
        out[b] = torch.cat(heads, dim=-1) @ attn.proj.weight.double().T + attn.proj.bias.double()
    return out.float()


def test_fused_and_explicit_attention_agree_on_outputs_and_gradients(attn_input):
    x, mask = attn_input
    explicit, fused = attention_pair()
    weights = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    results = []
    for module in (explicit, fused):
        xi = x.clone().requires_grad_(True)
        y = module(xi, mask)
        (y * weights * mask[..., None]).sum().backward()
        results.append((y.detach(), xi.grad, {n: p.grad for n, p in module.named_parameters()}))
    (y_e, gx_e, gp_e), (y_f, gx_f, gp_f) = results
    assert torch.allclose(y_e, y_f, atol=1e-5)
    assert torch.allclose(gx_e, gx_f, atol=1e-5)
    assert gp_e.keys() == gp_f.keys()
    for name in gp_e:
        assert torch.allclose(gp_e[name], gp_f[name], atol=1e-5), name


def test_fused_attention_runs_in_fp32_under_cpu_bf16_autocast():
    """Autocast would run SDPA in bf16, whose CPU kernel was the slower one; the fused path upcasts."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, N_HEADS, 7, 8, generator=g).bfloat16().requires_grad_(True) for _ in range(3))
    key_mask = length_mask([7, 4])[:, None, None, :]  # (B, 1, 1, T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fused_attention(q, k, v, key_mask)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=key_mask)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, want, atol=1e-6, rtol=1e-6)
    y.sum().backward()
    assert q.grad.dtype == torch.bfloat16 and q.grad.abs().sum() > 0  # gradients reach the bf16 projections
    with torch.no_grad():  # outside autocast the inputs' dtype is kept
        assert fused_attention(q, k, v, key_mask).dtype == torch.bfloat16


@pytest.mark.parametrize("which", ["explicit", "fused"])
def test_attention_equals_the_written_out_formula(attn_input, which):
    x, mask = attn_input
    module = dict(zip(["explicit", "fused"], attention_pair()))[which]
    with torch.no_grad():
        assert torch.allclose(module(x, mask), reference_attention(module, x, mask), atol=1e-5)


@pytest.mark.parametrize("which", ["explicit", "fused"])
def test_attention_equals_torch_multihead_attention(attn_input, which):
    x, mask = attn_input
    module = dict(zip(["explicit", "fused"], attention_pair()))[which]
    mha = nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(module.qkv.weight)
        mha.in_proj_bias.copy_(module.qkv.bias)
        mha.out_proj.weight.copy_(module.proj.weight)
        mha.out_proj.bias.copy_(module.proj.bias)
        expected, _ = mha(x, x, x, key_padding_mask=~mask, need_weights=False)
        got = module(x, mask)
    # Compare real positions only: MHA's inference fast path may zero the padded query rows.
    assert torch.allclose(got[mask], expected[mask], atol=1e-5)


VARIANTS = [(*v, "gelu") for v in itertools.product(["max", "mean", "first"], ["pre", "post"],
                                                     ["learned", "sinusoidal", "rope"], ["sdpa", "explicit"])]
VARIANTS += [("mean", "pre", "rope", "sdpa", "geglu"), ("max", "post", "learned", "explicit", "geglu")]


@pytest.mark.parametrize(("pooling", "norm", "pos_emb", "attention", "ff"), VARIANTS)
def test_extra_padding_does_not_change_the_logits(pooling, norm, pos_emb, attention, ff):
    torch.manual_seed(0)
    cfg = model_cfg(pooling=pooling, norm=norm, pos_emb=pos_emb, attention=attention, ff=ff)
    model = CTransformer(cfg, VOCAB, MAX_LEN).eval()
    ids, mask = random_batch(LENGTHS)
    extra = 9
    ids_padded = torch.cat([ids, torch.full((len(LENGTHS), extra), PAD_ID)], dim=1)
    mask_padded = torch.cat([mask, torch.zeros(len(LENGTHS), extra, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        logits = model(ids, mask)
        logits_padded = model(ids_padded, mask_padded)
        singles = torch.cat([model(ids[i : i + 1, :n], mask[i : i + 1, :n]) for i, n in enumerate(LENGTHS)])
    assert torch.allclose(logits, logits_padded, atol=1e-5)
    assert torch.allclose(logits, singles, atol=1e-5)  # and equal to each row on its own, unpadded


def test_geglu_equals_its_formula_and_keeps_about_the_plain_layers_parameters():
    torch.manual_seed(0)
    cfg = model_cfg(d_model=96, ff_mult=4, ff="geglu")
    assert geglu_hidden(cfg) == 256  # 2/3 of 384, rounded up to a multiple of 64
    layer = GEGLU(96, geglu_hidden(cfg))
    x = torch.randn(3, 5, 96)
    W, V, b, c = layer.gate.weight, layer.value.weight, layer.gate.bias, layer.value.bias
    assert W.shape == V.shape == (256, 96)
    expected = (F.gelu(x @ W.T + b) * (x @ V.T + c)) @ layer.down.weight.T + layer.down.bias
    assert torch.allclose(layer(x), expected, atol=1e-5)
    plain = CTransformer(model_cfg(d_model=96, ff_mult=4), VOCAB, MAX_LEN)
    gated = CTransformer(cfg, VOCAB, MAX_LEN)
    assert isinstance(gated.encoder.blocks[0].ff, GEGLU)
    assert 1.0 < gated.num_params() / plain.num_params() < 1.05


def test_geglu_output_projection_gets_the_depth_scaled_init():
    torch.manual_seed(0)
    model = CTransformer(model_cfg(d_model=64, ff="geglu", n_layers=8), VOCAB, MAX_LEN)
    ff = model.encoder.blocks[0].ff
    assert ff.gate.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert ff.value.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert ff.down.weight.std().item() == pytest.approx(0.02 / math.sqrt(16), rel=0.05)


@pytest.fixture
def states_with_loud_padding() -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, C) states whose padded positions hold huge values that any leak would show."""
    mask = length_mask(LENGTHS)
    h = torch.randn(len(LENGTHS), max(LENGTHS), 6, generator=torch.Generator().manual_seed(3))
    return h.masked_fill(~mask[..., None], 1e6), mask


@pytest.mark.parametrize(("how", "reduce"), [
    ("max", lambda rows: rows.max(dim=0).values),
    ("mean", lambda rows: rows.mean(dim=0)),
    ("first", lambda rows: rows[0]),
])
def test_pool_ignores_padding(states_with_loud_padding, how, reduce):
    h, mask = states_with_loud_padding
    expected = torch.stack([reduce(h[b, :n]) for b, n in enumerate(LENGTHS)])
    assert torch.allclose(pool(h, mask, how), expected)


@pytest.mark.parametrize("num_labels", [2, 3])
def test_output_shapes(num_labels):
    model = CTransformer(model_cfg(), VOCAB, MAX_LEN, num_labels).eval()
    ids, mask = random_batch(LENGTHS)
    with torch.no_grad():
        assert model.encoder(ids, mask).shape == (len(LENGTHS), max(LENGTHS), D_MODEL)
        assert model(ids, mask).shape == (len(LENGTHS), num_labels)


def test_param_groups_decay_exactly_the_matrices():
    model = CTransformer(model_cfg(), VOCAB, MAX_LEN)
    decay, no_decay = model.param_groups(0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    decay_ids, no_decay_ids = [{id(p) for p in g["params"]} for g in (decay, no_decay)]
    assert len(decay_ids) == len(decay["params"]) and len(no_decay_ids) == len(no_decay["params"])
    named = dict(model.named_parameters())
    assert not decay_ids & no_decay_ids
    assert decay_ids | no_decay_ids == {id(p) for p in named.values()}
    assert decay_ids == {id(p) for p in named.values() if p.dim() >= 2}
    for name, p in named.items():
        if name.endswith(".bias") or "norm" in name:
            assert id(p) in no_decay_ids, name
    assert id(named["encoder.tok_emb.weight"]) in decay_ids
    assert id(named["encoder.blocks.0.attn.qkv.weight"]) in decay_ids


def test_layer_lr_decay_scales_each_depth_and_keeps_weight_decay_on_matrices():
    model = CTransformer(model_cfg(n_layers=2, ngram_buckets=64), VOCAB, MAX_LEN)
    groups = model.param_groups(0.1, layer_lr_decay=0.5)
    scale = {id(p): (g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(scale) == sum(len(g["params"]) for g in groups) == len(named)  # each parameter once
    expected = {"encoder.tok_emb.weight": 0.125, "encoder.pos_emb.weight": 0.125,  # 0.5 ** (n_layers + 1)
                "encoder.blocks.0.attn.qkv.weight": 0.25, "encoder.blocks.1.ff.0.bias": 0.5,
                "encoder.norm.weight": 1.0, "head.weight": 1.0,
                "ngrams.table.weight": model.cfg.ngram_lr_scale}  # the n-gram path keeps its own rate
    for name, lr_scale in expected.items():
        assert scale[id(named[name])][0] == lr_scale, name
    for name, p in named.items():
        assert scale[id(p)][1] == (0.1 if p.dim() >= 2 else 0.0), name
    plain = model.param_groups(0.1, layer_lr_decay=1.0)  # one rate: the two groups of decay_groups
    assert len(plain) == 3 and all("lr_scale" not in g for g in plain[:2])


def reference_ngram_scores(bag: NgramBag, ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each row's unigrams and hashed n-grams (each distinct one once if `bag.binary`) counted one by one, in float64."""
    table = bag.table.weight.double()
    rows = []
    for b, n in enumerate(lengths):
        toks = ids[b, :n].tolist()
        grams = list(toks)
        for order in range(2, bag.order + 1):
            for i in range(n - order + 1):
                h = toks[i]
                for t in toks[i + 1 : i + order]:
                    h = (h * 1_000_003 + t) % bag.buckets
                grams.append(h + bag.vocab_size)
        if bag.binary:
            grams = list(set(grams))
        rows.append(sum(table[g] for g in grams) / math.sqrt(len(grams)))
    return torch.stack(rows)


@pytest.mark.parametrize(("order", "binary"), [(3, True), (3, False), (2, True), (1, True)])
def test_ngram_bag_counts_each_rows_ngrams(order, binary):
    torch.manual_seed(0)
    bag = NgramBag(VOCAB, buckets=64, num_labels=3, order=order, binary=binary)
    nn.init.normal_(bag.table.weight)
    ids, mask = random_batch(LENGTHS)
    ids[:, 1:] = ids[:, 1:] % 5  # a small alphabet: rows repeat unigrams and bigrams
    assert torch.allclose(bag(ids, mask).double(), reference_ngram_scores(bag, ids, LENGTHS), atol=1e-5)
    # A bigram straddling a row's end and its padding never counts: poison every padded position.
    poisoned = ids.masked_fill(~mask, VOCAB - 1)
    assert torch.allclose(bag(poisoned, mask), bag(ids, mask), atol=1e-6)


@pytest.mark.parametrize("attention", ["sdpa", "explicit"])
def test_ngram_path_adds_to_the_transformer_logits_and_ignores_padding(attention):
    torch.manual_seed(0)
    plain = CTransformer(model_cfg(attention=attention), VOCAB, MAX_LEN).eval()
    torch.manual_seed(0)
    wide = CTransformer(model_cfg(attention=attention, ngram_buckets=64), VOCAB, MAX_LEN).eval()
    ids, mask = random_batch(LENGTHS)
    with torch.no_grad():
        assert wide.ngrams.table.weight.abs().sum() == 0  # starts silent: the same logits as without it
        assert torch.allclose(wide(ids, mask), plain(ids, mask))
        nn.init.normal_(wide.ngrams.table.weight)
        expected = plain(ids, mask) + reference_ngram_scores(wide.ngrams, ids, LENGTHS).float()
        assert torch.allclose(wide(ids, mask), expected, atol=1e-5)
        ids_padded = torch.cat([ids, torch.full((len(LENGTHS), 5), PAD_ID)], dim=1)
        mask_padded = torch.cat([mask, torch.zeros(len(LENGTHS), 5, dtype=torch.bool)], dim=1)
        assert torch.allclose(wide(ids_padded, mask_padded), wide(ids, mask), atol=1e-5)


def test_ngram_table_has_its_own_param_group_with_a_scaled_lr():
    model = CTransformer(model_cfg(ngram_buckets=64, ngram_lr_scale=7.0), VOCAB, MAX_LEN)
    decay, no_decay, wide = model.param_groups(0.1)
    assert wide["params"] == [model.ngrams.table.weight]
    assert (wide["weight_decay"], wide["lr_scale"]) == (0.1, 7.0)
    assert "lr_scale" not in decay and "lr_scale" not in no_decay
    grouped = [id(p) for g in (decay, no_decay, wide) for p in g["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters())  # each parameter exactly once


def ngram_grads(model: CTransformer, ids, mask, labels) -> tuple[torch.Tensor, torch.Tensor]:
    """The n-gram table's and the classifier head's gradients of the training loss `model` returns."""
    model.zero_grad()
    model(ids, mask, labels)[1].backward()
    return model.ngrams.table.weight.grad.clone(), model.head.weight.grad.clone()


@pytest.mark.parametrize("own_loss", [True, False])
def test_the_ngram_path_learns_from_its_own_loss_and_the_transformer_from_the_sum(own_loss):
    torch.manual_seed(0)
    model = CTransformer(model_cfg(ngram_buckets=64, ngram_own_loss=own_loss), VOCAB, MAX_LEN).eval()
    nn.init.normal_(model.ngrams.table.weight)
    ids, mask = random_batch(LENGTHS)
    labels = torch.tensor([0, 1, 1, 0])
    table_grad, head_grad = ngram_grads(model, ids, mask, labels)

    def grads_of(loss: torch.Tensor) -> list[torch.Tensor]:
        return torch.autograd.grad(loss, [model.ngrams.table.weight, model.head.weight], allow_unused=True,
                                   retain_graph=True)

    logits, wide = model(ids, mask), model.ngrams(ids, mask)
    deep = logits - wide
    if own_loss:  # the table: its own loss alone; the head: the loss of the sum, the table held fixed
        expected_table = grads_of(F.cross_entropy(wide, labels))[0]
        expected_head = grads_of(F.cross_entropy(deep + wide.detach(), labels))[1]
    else:  # one loss on the sum for both
        expected_table, expected_head = grads_of(F.cross_entropy(logits, labels))
    torch.testing.assert_close(table_grad, expected_table)
    torch.testing.assert_close(head_grad, expected_head)
    assert model(ids, mask, labels)[0].equal(logits)  # the logits are the sum either way


# --------------------------------------------------------------------------- adversarial training


def adversarial_setup(seed: int = 0):
    torch.manual_seed(seed)
    model = CTransformer(model_cfg(), VOCAB, MAX_LEN).train()  # no dropout: every forward is the same
    ids, mask = random_batch(LENGTHS, seed)
    labels = torch.tensor([0, 1, 1, 0])
    return model, ids, mask, labels, model.encoder.embed(ids)  # x: (B, T, C)


def test_adversarial_step_has_the_set_norm_and_raises_the_loss_more_than_random_directions():
    model, _, mask, labels, x = adversarial_setup()
    eps = 0.01

    def losses(x):  # (B,) each text's loss
        return F.cross_entropy(model.deep_logits(x, mask), labels, reduction="none")

    r = adversarial_step(losses(x).sum(), x, mask, eps)
    assert not r.requires_grad and r.shape == x.shape
    assert r[~mask].abs().max() == 0  # padding is not moved
    x_norm = (x.detach() * mask[..., None]).flatten(1).norm(dim=1)
    torch.testing.assert_close(r.flatten(1).norm(dim=1), eps * x_norm)  # each text by eps of its own norm

    with torch.no_grad():
        base, adversarial = losses(x), losses(x + r)
        g = torch.Generator().manual_seed(3)
        for _ in range(20):  # random directions of the same norms
            noise = torch.randn(x.shape, generator=g) * mask[..., None]
            noise *= (r.flatten(1).norm(dim=1) / noise.flatten(1).norm(dim=1))[:, None, None]
            assert (adversarial - base > (losses(x + noise) - base).abs()).all()


def test_adversarial_loss_adds_the_loss_at_the_moved_embeddings_in_training_only():
    model, ids, mask, labels, x = adversarial_setup()
    eps = 0.02
    clean = F.cross_entropy(model.deep_logits(x, mask), labels)
    expected = clean + F.cross_entropy(model.deep_logits(x + adversarial_step(clean, x, mask, eps), mask), labels)
    _, objective = model(ids, mask, labels, adversarial_eps=eps)
    torch.testing.assert_close(objective, expected)
    assert model(ids, mask, labels)[1].equal(clean)  # eps 0: the plain loss

    weights = model.encoder.tok_emb.weight
    (grad,) = torch.autograd.grad(objective, weights)
    (plain_grad,) = torch.autograd.grad(model(ids, mask, labels)[1], weights)
    assert grad.isfinite().all() and not torch.allclose(grad, plain_grad)  # the adversarial loss trains too

    model.eval()
    _, objective = model(ids, mask, labels, adversarial_eps=eps)
    torch.testing.assert_close(objective, clean)  # evaluation measures the plain loss


def test_adversarial_training_with_the_ngram_path_moves_the_transformers_input_only():
    torch.manual_seed(0)
    model = CTransformer(model_cfg(ngram_buckets=64), VOCAB, MAX_LEN).train()
    with torch.no_grad():  # the path starts silent: give it scores, so that what it adds shows
        model.ngrams.table.weight.normal_()
    ids, mask = random_batch(LENGTHS, 0)
    labels, eps = torch.tensor([0, 1, 1, 0]), 0.02
    x, wide = model.encoder.embed(ids), model.ngrams(ids, mask).detach()

    def loss(logits):
        return F.cross_entropy(logits, labels)

    deep = model.deep_logits(x, mask)
    r = adversarial_step(loss(deep + wide), x, mask, eps)  # the path's scores held fixed
    expected = loss(deep + wide) + loss(model.ngrams(ids, mask)) + loss(model.deep_logits(x + r, mask) + wide)
    _, objective = model(ids, mask, labels, adversarial_eps=eps)
    torch.testing.assert_close(objective, expected)

    table = model.ngrams.table.weight  # the path learns from its own loss alone, with or without
    (grad,) = torch.autograd.grad(objective, table)
    (own,) = torch.autograd.grad(loss(model.ngrams(ids, mask)), table)
    torch.testing.assert_close(grad, own)


def test_virtual_adversarial_step_has_the_set_norm_and_moves_the_predictions_more_than_random_directions():
    model, _, mask, _, x = adversarial_setup()
    eps = 0.01

    def logits_at(x):
        return model.deep_logits(x, mask)

    target = logits_at(x).detach()
    torch.manual_seed(1)
    r = virtual_adversarial_step(logits_at, x, mask, target, eps)
    assert not r.requires_grad and r.shape == x.shape
    assert r[~mask].abs().max() == 0  # padding is not moved
    x_norm = (x.detach() * mask[..., None]).flatten(1).norm(dim=1)
    torch.testing.assert_close(r.flatten(1).norm(dim=1), eps * x_norm)

    with torch.no_grad():
        moved = kl_from(target, logits_at(x + r))  # (B,)
        assert (moved > 0).all()
        g = torch.Generator().manual_seed(3)
        for _ in range(20):  # random directions of the same norms move them less, text by text
            noise = torch.randn(x.shape, generator=g) * mask[..., None]
            noise *= (r.flatten(1).norm(dim=1) / noise.flatten(1).norm(dim=1))[:, None, None]
            assert (moved > kl_from(target, logits_at(x + noise))).all()


def test_virtual_adversarial_loss_adds_the_divergence_at_the_moved_embeddings_without_labels():
    model, ids, mask, labels, x = adversarial_setup()
    eps = 0.02
    clean_logits = model.deep_logits(x, mask)
    clean = F.cross_entropy(clean_logits, labels)
    torch.manual_seed(5)
    r = virtual_adversarial_step(lambda e: model.deep_logits(e, mask), x, mask, clean_logits.detach(), eps)
    expected = clean + kl_from(clean_logits.detach(), model.deep_logits(x + r, mask)).mean()
    torch.manual_seed(5)  # the same random start of the power iteration
    _, objective = model(ids, mask, labels, virtual_adversarial_eps=eps)
    torch.testing.assert_close(objective, expected)
    assert objective > clean

    # The added term does not depend on the labels: flipped labels change the clean loss alone.
    torch.manual_seed(5)
    _, flipped = model(ids, mask, 1 - labels, virtual_adversarial_eps=eps)
    torch.testing.assert_close(flipped - F.cross_entropy(clean_logits, 1 - labels), objective - clean)

    model.eval()
    _, objective = model(ids, mask, labels, virtual_adversarial_eps=eps)
    torch.testing.assert_close(objective, clean)  # evaluation measures the plain loss


def test_word_dropout_hides_tokens_from_the_transformer_only():
    torch.manual_seed(0)
    model = CTransformer(model_cfg(ngram_buckets=64, token_dropout=0.5), VOCAB, MAX_LEN).train()
    nn.init.normal_(model.ngrams.table.weight)
    ids, mask = random_batch(LENGTHS)
    labels = torch.tensor([0, 1, 1, 0])
    table_grad, _ = ngram_grads(model, ids, mask, labels)
    expected = torch.autograd.grad(F.cross_entropy(model.ngrams(ids, mask), labels), model.ngrams.table.weight)[0]
    torch.testing.assert_close(table_grad, expected)  # every token's n-grams, none dropped


def packed(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Packed]:
    """The rows of a padded batch end to end: (N,) ids and their Packed."""
    lengths = mask.sum(1)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    return ids[mask], Packed(offsets, int(lengths.max()))


@pytest.mark.parametrize(("pooling", "norm", "pos_emb", "attention", "ff"), VARIANTS)
def test_packed_texts_get_the_logits_of_the_padded_batch(pooling, norm, pos_emb, attention, ff):
    torch.manual_seed(0)
    model = CTransformer(model_cfg(pooling=pooling, norm=norm, pos_emb=pos_emb, attention=attention, ff=ff),
                         VOCAB, MAX_LEN, num_labels=3).eval()
    for p in model.parameters():  # at the init's scale the texts' logits barely differ: mixing them up would pass
        nn.init.normal_(p, std=0.3)
    ids, mask = random_batch([MAX_LEN, *LENGTHS])  # packed, 40 tokens: more than max_length
    with torch.no_grad():
        expected = model(ids, mask)
        got = model.packed_logits(*packed(ids, mask))
    assert got.shape == expected.shape
    assert torch.allclose(got, expected, atol=1e-5)
    assert (expected[1:] - expected[:-1]).abs().max() > 0.01  # the texts' logits differ: each is its own


def test_packed_texts_with_the_ngram_path_get_the_logits_of_the_padded_batch():
    torch.manual_seed(0)
    model = CTransformer(model_cfg(ngram_buckets=97), VOCAB, MAX_LEN).eval()
    nn.init.normal_(model.ngrams.table.weight)  # it starts at zero
    ids, mask = random_batch(LENGTHS)
    with torch.no_grad():
        assert torch.allclose(model.packed_logits(*packed(ids, mask)), model(ids, mask), atol=1e-5)


def test_packed_pad_gives_the_padded_layout():
    ids, mask = random_batch(LENGTHS)
    padded, real = packed(ids, mask)[1].pad(ids[mask], fill=PAD_ID)
    assert torch.equal(padded, ids) and torch.equal(real, mask)
    assert packed(ids, mask)[1].positions().tolist() == [[i for n in LENGTHS for i in range(n)]]


def test_sequences_longer_than_max_length_raise():
    model = CTransformer(model_cfg(), VOCAB, max_length=8)
    ids, mask = random_batch([9, 2])
    with pytest.raises(ValueError, match="max_length"):
        model(ids, mask)


def test_sinusoidal_table_follows_the_formula():
    table = sinusoidal_table(10, 8)
    for pos, i in itertools.product(range(10), range(4)):
        angle = pos / 10000 ** (2 * i / 8)
        assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
        assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)


def test_rotate_qk_turns_each_pair_of_a_heads_dimensions_by_position_times_frequency():
    """The reference: each pair (i, i + Dh/2) of q and k as one complex number, times e^(i pos theta_i)."""
    B, T, H, Dh = 2, 5, 3, 8
    qkv = torch.randn(B, T, 3 * H * Dh)
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 9, 0, 2]])  # (B, T): compacted rows keep their places
    out = rotate_qk(qkv, H, rotary(positions, Dh))  # (B, T, 3C)
    theta = 10000.0 ** (-torch.arange(0, Dh, 2) / Dh)  # (Dh/2,)
    turn = torch.polar(torch.ones(B, T, 1, Dh // 2), positions[:, :, None, None] * theta)  # (B, T, 1, Dh/2)
    for part in range(2):  # q, then k
        x = qkv[..., part * H * Dh:(part + 1) * H * Dh].view(B, T, H, Dh)  # (B, T, H, Dh)
        turned = torch.complex(x[..., : Dh // 2], x[..., Dh // 2:]) * turn  # (B, T, H, Dh/2)
        expected = torch.cat((turned.real, turned.imag), dim=-1).view(B, T, H * Dh)  # (B, T, C)
        torch.testing.assert_close(out[..., part * H * Dh:(part + 1) * H * Dh], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[..., 2 * H * Dh:], qkv[..., 2 * H * Dh:])  # v is not turned


def test_rotate_qk_in_bf16_stays_within_bf16_rounding_of_the_fp32_rotation():
    """The fast path: bf16 projections are turned in bf16, not cast to fp32 and back."""
    B, T, H, Dh = 2, 300, 2, 16
    qkv = torch.randn(B, T, 3 * H * Dh).to(torch.bfloat16)
    rope = rotary(torch.arange(T), Dh)  # places up to 299: large angles
    out = rotate_qk(qkv, H, rope)
    assert out.dtype == torch.bfloat16
    reference = rotate_qk(qkv.float(), H, rope)  # (B, T, 3C) in fp32
    assert not torch.equal(out.float(), reference)  # it did round
    torch.testing.assert_close(out.float(), reference, atol=0.04, rtol=2**-6)  # a few bf16 steps (2^-8) of |x|


def test_rotate_qk_backward_is_the_gradient_of_its_forward():
    """The fast path: under autograd the backward turns the gradient back by the angle (_RotateQK), where
    autograd would differentiate the forward's ops; gradcheck compares it with finite differences, and
    the gradient equals autograd's through the same rotation written with plain ops."""
    B, T, H, Dh = 2, 6, 3, 8
    positions = torch.tensor([[0, 1, 2, 3, 4, 5], [40, 3, 9, 0, 2, 77]])  # (B, T)
    rope = tuple(t.double() for t in rotary(positions, Dh))
    qkv = torch.randn(B, T, 3 * H * Dh, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: rotate_qk(x, H, rope), (qkv,))
    grad = torch.randn(B, T, 3 * H * Dh, dtype=torch.float64)
    (fast,) = torch.autograd.grad(rotate_qk(qkv, H, rope), qkv, grad)
    cos, sin = rope
    q_k, v = qkv.split((2 * H * Dh, H * Dh), dim=2)
    x1, x2 = q_k.reshape(B, T, 2 * H, Dh).chunk(2, dim=-1)  # (B, T, 2H, Dh/2) each
    plain = torch.cat((torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(2), v), dim=2)
    (reference,) = torch.autograd.grad(plain, qkv, grad)
    torch.testing.assert_close(fast, reference)
    torch.testing.assert_close(rotate_qk(qkv, H, rope), plain)


def test_with_rope_the_encoder_sees_distances_not_places():
    torch.manual_seed(0)
    model = CTransformer(model_cfg(pos_emb="rope"), VOCAB, MAX_LEN).eval()
    assert model.encoder.pos_emb is None  # no position table: nothing added to the embeddings
    ids, mask = random_batch([9, 6])
    states = model.encoder(ids, mask)  # (B, T, C)
    shifted = model.encoder(ids, mask, torch.arange(9).expand(2, 9) + 11)  # every token 11 places further on
    torch.testing.assert_close(shifted[mask], states[mask], atol=1e-5, rtol=1e-4)
    swapped = ids.clone()
    swapped[:, [1, 2]] = ids[:, [2, 1]]  # the same tokens in another order
    # without positions [CLS]'s state would not change (attention is blind to order) but for float noise
    assert not torch.allclose(model.encoder(swapped, mask)[:, 0], states[:, 0], atol=1e-4)  # order is seen


def test_rope_needs_an_even_head_size():
    with pytest.raises(UsageError, match="head size .* must be even"):
        model_cfg(d_model=30, n_heads=2, pos_emb="rope")


def test_token_dropout_hides_tokens_like_padding_in_training_only():
    ids, mask = random_batch([24, 20, 17, 9])
    torch.manual_seed(0)
    model = CTransformer(model_cfg(token_dropout=0.5), VOCAB, MAX_LEN)
    plain = CTransformer(model_cfg(), VOCAB, MAX_LEN)
    plain.load_state_dict(model.state_dict())

    model.eval(), plain.eval()
    torch.testing.assert_close(model(ids, mask), plain(ids, mask))  # evaluation sees every token

    model.train(), plain.train()
    torch.manual_seed(7)
    dropped = model(ids, mask)
    torch.manual_seed(7)
    kept = drop_tokens(mask, 0.5)
    assert kept[:, 0].all() and not (kept & ~mask).any()  # [CLS] stays; padding stays padding
    assert 0.3 < 1 - kept.sum() / mask.sum() < 0.7
    torch.testing.assert_close(dropped, plain(ids, kept))
    assert not torch.allclose(dropped, plain(ids, mask))


def test_compact_moves_each_rows_kept_tokens_to_its_front_in_order():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (3, 70), generator=g)
    mask = torch.rand(3, 70, generator=g) < 0.3
    mask[:, 0] = True
    mask[2, 40:] = False  # a row with padding at its end
    out_ids, kept, positions = compact(ids, mask)
    counts = mask.sum(dim=1)
    assert kept.shape == out_ids.shape == positions.shape == (3, 32)  # most kept (< 32), rounded up to 32
    assert kept.sum(dim=1).equal(counts) and kept[:, 0].all()
    for row in range(3):
        n = int(counts[row])
        assert positions[row, :n].equal(mask[row].nonzero().squeeze(1))  # the kept columns, in order
        assert out_ids[row, :n].equal(ids[row, mask[row]])
        assert not kept[row, n:].any() and (out_ids[row, n:] == PAD_ID).all()
    full = torch.ones(2, 40, dtype=torch.bool)
    assert compact(ids[:2, :40], full)[1].shape == (2, 40)  # never wider than the input: 64 is cut to 40


@pytest.mark.parametrize(("pooling", "norm", "pos_emb", "attention"), [
    ("mean", "pre", "learned", "sdpa"),
    ("max", "post", "sinusoidal", "explicit"),
    ("first", "pre", "learned", "explicit"),
    ("mean", "pre", "rope", "sdpa"),  # the kept tokens rotated by their places in the text, not their columns
])
def test_training_on_compacted_tokens_equals_computing_hidden_ones_as_padding(pooling, norm, pos_emb, attention):
    cfg = model_cfg(pooling=pooling, norm=norm, pos_emb=pos_emb, attention=attention, token_dropout=0.7)
    torch.manual_seed(0)
    fast = CTransformer(cfg, VOCAB, 96).train()
    reference = CTransformer(cfg, VOCAB, 96).train()
    reference.load_state_dict(fast.state_dict())

    def hidden_tokens_as_padding(ids, mask, labels):  # the reference: every column, word-dropped ones masked
        dropped = drop_tokens(mask, cfg.token_dropout)
        logits = reference.head(pool(reference.encoder(ids, dropped), dropped, cfg.pooling))
        return logits, F.cross_entropy(logits, labels)

    widths = []
    fast.encoder.blocks[0].register_forward_pre_hook(lambda _, args: widths.append(args[0].size(1)))
    ids, mask = random_batch([96, 80, 50, 9], seed=4)
    labels = torch.tensor([0, 1, 1, 0])
    results = []
    for model, forward in ((fast, fast), (reference, hidden_tokens_as_padding)):
        torch.manual_seed(7)  # the same word dropout
        logits, loss = forward(ids, mask, labels)
        loss.backward()
        results.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    assert widths == [32]  # about 30% of 96 columns kept, rounded up to 32: the fast path did run
    (logits, grads), (ref_logits, ref_grads) = results
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-4)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert grads["encoder.pos_emb.weight" if pos_emb == "learned" else "head.weight"].abs().sum() > 0


def test_with_lazy_embeddings_only_the_rows_of_kept_tokens_get_a_gradient():
    model = CTransformer(model_cfg(token_dropout=0.7, lazy_embeddings=True), VOCAB, 96).train()
    ids, mask = random_batch([96, 80, 50, 9], seed=4)
    torch.manual_seed(7)
    model(ids, mask, torch.tensor([0, 1, 1, 0]))[1].backward()
    torch.manual_seed(7)  # the same word dropout
    kept = drop_tokens(mask, 0.7)
    rows = model.encoder.tok_emb.weight.grad.coalesce().indices()[0]
    # a hidden token's row is left for LazyAdamW to skip; [PAD]'s fills the shorter rows, as in any padded batch
    assert rows.tolist() == sorted(set(ids[kept].tolist()) | {PAD_ID})
    assert len(set(ids[mask].tolist()) | {PAD_ID}) > len(rows)


@pytest.mark.parametrize("binary", [True, False])
def test_sparse_ngram_gradients_name_only_the_rows_of_real_ngrams(binary):
    """With sparse gradients every row looked up counts as used (LazyAdamW moves it): n-grams that run
    into the padding must look up [PAD]'s row, not the bucket their hash gives."""
    vocab, buckets, order = 50, 1000, 3
    bag = NgramBag(vocab, buckets, 2, order=order, binary=binary, sparse=True)
    ids = torch.tensor([[2, 11, 12, 13, 0, 0, 0, 0], [2, 21, 22, 23, 24, 25, 26, 27]])
    bag(ids, ids != PAD_ID).sum().backward()
    real = set()
    for row in ids.tolist():
        tokens = [t for t in row if t != PAD_ID]
        for n in range(1, order + 1):
            for i in range(len(tokens) - n + 1):
                h = tokens[i]
                for t in tokens[i + 1 : i + n]:
                    h = (h * 1_000_003 + t) % buckets
                real.add(h if n == 1 else vocab + h)
    rows = set(bag.table.weight.grad.coalesce().indices()[0].tolist())
    assert rows - {PAD_ID} == real


def test_token_dropout_rate():
    torch.manual_seed(0)
    mask = torch.ones(64, 512, dtype=torch.bool)
    hidden = 1 - drop_tokens(mask, 0.15)[:, 1:].float().mean().item()
    assert abs(hidden - 0.15) < 0.01


def test_cpu_dropout_of_bf16_keeps_the_dtype_and_scale():
    x = torch.randn(64, 512).abs_().add_(0.5).to(torch.bfloat16)  # no zeros: a zero output means dropped
    torch.manual_seed(0)
    y = dropout(x, 0.1, training=True)
    kept = y != 0
    assert y.dtype == torch.bfloat16 and 0.08 < (~kept).float().mean().item() < 0.12
    torch.testing.assert_close(y[kept].float(), x[kept].float() / 0.9, rtol=8e-3, atol=0)  # bf16 has 8 bits


@pytest.mark.parametrize("shape", [(5, 7, 3), (1,), (2, 3)])
def test_cpu_dropout_masks_any_shape_with_every_element_drawn(shape):
    """numel need not be a multiple of 4 (the int16s are drawn 4 to an int64)."""
    torch.manual_seed(0)
    x = torch.ones(shape)
    rates = torch.stack([dropout(x, 0.5, training=True) == 0 for _ in range(400)]).float().mean(0)
    assert ((rates - 0.5).abs() < 0.15).all()  # every position dropped about half the time (6 sigma)


def test_cpu_dropout_near_1_rounds_to_the_largest_p_below_1():
    torch.manual_seed(0)
    y = dropout(torch.ones(2**22), 0.99999, training=True)  # p = 65535 / 65536: 64 survivors expected
    kept = y[y != 0]
    assert 20 < len(kept) < 130 and (kept == 65536).all()


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_cpu_dropout_behaves_as_f_dropout(p):
    x = torch.randn(256, 1024).abs_().add_(0.5).requires_grad_()  # no zeros: a zero output means dropped
    assert dropout(x, p, training=False) is x and dropout(x, 0.0, training=True) is x
    torch.manual_seed(0)
    y = dropout(x, p, training=True)
    kept = y != 0
    p16 = round(p * 65536) / 65536  # the mask's p, a multiple of 2^-16
    assert abs(p16 - p) <= 2**-17
    torch.testing.assert_close(y[kept], x[kept] / (1 - p16))  # survivors scaled by 1 / (1 - p), as F.dropout does
    n = x.numel()
    assert abs((~kept).float().mean().item() - p) < 4 * math.sqrt(p * (1 - p) / n)
    y.sum().backward()  # the gradient passes the same mask and scale
    torch.testing.assert_close(x.grad, kept.float() / (1 - p16))
    torch.manual_seed(1)
    assert not torch.equal(dropout(x, p, training=True) != 0, kept)  # a fresh mask per call
