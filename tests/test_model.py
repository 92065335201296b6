import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from transformer_cli.config import ModelConfig
from transformer_cli.errors import UsageError
from transformer_cli.model import (
    GEGLU,
    CTransformer,
    SelfAttention,
    compact,
    drop_tokens,
    fused_attention,
    geglu_hidden,
    pool,
    rotary,
    rotate,
    sinusoidal_table,
)
from transformer_cli.tokens import PAD_ID

D_MODEL, N_HEADS, VOCAB, MAX_LEN = 32, 4, 50, 24
LENGTHS = [7, 3, 1, 5]  # real tokens per row; every row keeps at least its [CLS]


def model_cfg(**kw) -> ModelConfig:
    base = {"d_model": D_MODEL, "n_heads": N_HEADS, "n_layers": 2, "ff_mult": 2, "dropout": 0.0, "token_dropout": 0.0}
    return ModelConfig(**{**base, **kw})


def set_fused(model: nn.Module, fused: bool) -> nn.Module:
    """Every attention layer of `model` on the fused (SDPA) path, or on the explicit reference path."""
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.fused = fused
    return model


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
    explicit = SelfAttention(model_cfg())
    for p in explicit.parameters():
        nn.init.normal_(p, std=0.3)
    explicit.fused = False
    fused = SelfAttention(model_cfg())
    fused.load_state_dict(explicit.state_dict())
    assert fused.fused  # the default
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
def test_attention_equals_the_written_out_formula_and_torch_multihead_attention(attn_input, which):
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
    assert torch.allclose(got, reference_attention(module, x, mask), atol=1e-5)
    # Compare real positions only: MHA's inference fast path may zero the padded query rows.
    assert torch.allclose(got[mask], expected[mask], atol=1e-5)


VARIANTS = [(*v, "gelu") for v in itertools.product(["max", "mean", "first"], ["pre", "post"],
                                                     ["learned", "sinusoidal", "rope"])]
VARIANTS += [("mean", "pre", "rope", "geglu"), ("max", "post", "learned", "geglu")]


@pytest.mark.parametrize(("pooling", "norm", "pos_emb", "ff"), VARIANTS)
def test_fused_and_explicit_models_agree_and_extra_padding_does_not_change_the_logits(pooling, norm, pos_emb, ff):
    torch.manual_seed(0)
    model = CTransformer(model_cfg(pooling=pooling, norm=norm, pos_emb=pos_emb, ff=ff), VOCAB, MAX_LEN).eval()
    for p in model.parameters():  # at the init's scale the rows' logits barely differ: a mix-up would pass
        nn.init.normal_(p, std=0.3)
    ids, mask = random_batch(LENGTHS)
    extra = 9
    ids_padded = torch.cat([ids, torch.full((len(LENGTHS), extra), PAD_ID)], dim=1)
    mask_padded = torch.cat([mask, torch.zeros(len(LENGTHS), extra, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        logits = set_fused(model, False)(ids, mask)  # the reference path
        assert (logits[1:] - logits[:-1]).abs().max() > 0.01  # the rows' logits differ: each is its own
        for fused in (False, True):
            set_fused(model, fused)
            singles = torch.cat([model(ids[i : i + 1, :n], mask[i : i + 1, :n]) for i, n in enumerate(LENGTHS)])
            torch.testing.assert_close(model(ids, mask), logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(model(ids_padded, mask_padded), logits, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(singles, logits, atol=1e-5, rtol=1e-5)  # each row on its own, unpadded


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


@pytest.mark.parametrize(("ff", "out"), [("gelu", "ff.2"), ("geglu", "ff.down")])
def test_init_is_normal_002_with_depth_scaled_residual_projections_and_zero_biases(ff, out):
    torch.manual_seed(0)
    model = CTransformer(model_cfg(d_model=64, ff=ff, n_layers=8), VOCAB, MAX_LEN)
    # every matrix of 1,000 entries or more (the head's 128 are too few to tell a std from): embeddings, q/k/v,
    # the feed-forward layers; the rel tolerance is over 4 standard errors of the estimate, 1 / sqrt(2 n)
    std = {name: p.std().item() for name, p in model.named_parameters() if p.dim() >= 2 and p.numel() >= 1000}
    scaled = {f"encoder.blocks.{i}.{layer}.weight" for i in range(8) for layer in ("attn.proj", out)}
    assert scaled <= std.keys() and "encoder.tok_emb.weight" in std
    for name, s in std.items():
        assert s == pytest.approx(0.02 / math.sqrt(16) if name in scaled else 0.02, rel=0.1), name
    for name, p in model.named_parameters():
        if name.endswith(".bias"):
            assert p.abs().sum() == 0, name


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
    model = CTransformer(model_cfg(n_layers=2), VOCAB, MAX_LEN)
    groups = model.param_groups(0.1, layer_lr_decay=0.5)
    scale = {id(p): (g["lr_scale"], g["weight_decay"]) for g in groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert len(scale) == sum(len(g["params"]) for g in groups) == len(named)  # each parameter once
    expected = {"encoder.tok_emb.weight": 0.125, "encoder.pos_emb.weight": 0.125,  # 0.5 ** (n_layers + 1)
                "encoder.blocks.0.attn.qkv.weight": 0.25, "encoder.blocks.1.ff.0.bias": 0.5,
                "encoder.norm.weight": 1.0, "head.weight": 1.0}
    for name, lr_scale in expected.items():
        assert scale[id(named[name])][0] == lr_scale, name
    for name, p in named.items():
        assert scale[id(p)][1] == (0.1 if p.dim() >= 2 else 0.0), name
    plain = model.param_groups(0.1, layer_lr_decay=1.0)  # one rate: the two groups of decay_groups
    assert len(plain) == 2 and all("lr_scale" not in g for g in plain)


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


def rope_heads(positions: torch.Tensor, T: int = 5, seed: int = 0):
    """An attention layer's q, k, v of random states, without and with rope at `positions`."""
    torch.manual_seed(seed)
    attn = SelfAttention(model_cfg(d_model=24, n_heads=3))  # Dh = 8
    x = torch.randn(2, T, 24)
    with torch.no_grad():
        return attn.heads(x), attn.heads(x, rotary(positions, 8))


def test_rope_turns_each_pair_of_a_heads_dimensions_by_position_times_frequency():
    """The reference: each pair (i, i + Dh/2) of q and k as one complex number, times e^(i pos theta_i)."""
    B, T, Dh = 2, 5, 8
    positions = torch.tensor([[0, 1, 2, 3, 4], [7, 3, 9, 0, 2]])  # (B, T): compacted rows keep their places
    plain, turned = rope_heads(positions, T)
    theta = 10000.0 ** (-torch.arange(0, Dh, 2) / Dh)  # (Dh/2,)
    turn = torch.polar(torch.ones(B, 1, T, Dh // 2), positions[:, None, :, None] * theta)  # (B, 1, T, Dh/2)
    for x, got in zip(plain[:2], turned[:2]):  # q, then k: (B, H, T, Dh)
        expected = torch.complex(x[..., : Dh // 2], x[..., Dh // 2 :]) * turn  # (B, H, T, Dh/2)
        torch.testing.assert_close(got, torch.cat((expected.real, expected.imag), dim=-1), atol=1e-5, rtol=1e-5)
    assert torch.equal(turned[2], plain[2])  # v is not turned


def test_rope_keeps_norms_and_makes_q_dot_k_depend_on_distance_only():
    T = 6
    (q0, k0, _), (q, k, _) = rope_heads(torch.arange(T), T)
    _, (q_far, k_far, _) = rope_heads(torch.arange(T) + 37, T)  # every token 37 places further on
    torch.testing.assert_close(q.norm(dim=-1), q0.norm(dim=-1))  # a rotation: lengths kept
    torch.testing.assert_close(k.norm(dim=-1), k0.norm(dim=-1))
    scores = q @ k.transpose(-2, -1)  # (B, H, T, T)
    torch.testing.assert_close(q_far @ k_far.transpose(-2, -1), scores, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(scores, q0 @ k0.transpose(-2, -1), atol=1e-3)  # the places do change the scores


def test_rotate_in_bf16_stays_within_bf16_rounding_of_the_fp32_rotation():
    """bf16 projections are turned in bf16, not cast to fp32 and back."""
    B, H, T, Dh = 2, 2, 300, 16
    x = torch.randn(B, H, T, Dh).to(torch.bfloat16)
    rope = rotary(torch.arange(T), Dh)  # places up to 299: large angles
    out = rotate(x, rope)
    assert out.dtype == torch.bfloat16
    reference = rotate(x.float(), rope)  # (B, H, T, Dh) in fp32
    assert not torch.equal(out.float(), reference)  # it did round
    torch.testing.assert_close(out.float(), reference, atol=0.04, rtol=2**-6)  # a few bf16 steps (2^-8) of |x|


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


def test_token_dropout_hides_tokens_in_training_only():
    ids, mask = random_batch([24, 20, 17, 9])
    torch.manual_seed(0)
    model = CTransformer(model_cfg(token_dropout=0.5), VOCAB, MAX_LEN)
    plain = CTransformer(model_cfg(), VOCAB, MAX_LEN)
    plain.load_state_dict(model.state_dict())
    model.eval(), plain.eval()
    torch.testing.assert_close(model(ids, mask), plain(ids, mask))  # evaluation sees every token
    model.train(), plain.train()
    assert not torch.allclose(model(ids, mask), plain(ids, mask))

    kept = drop_tokens(mask, 0.5)
    assert kept[:, 0].all() and not (kept & ~mask).any()  # [CLS] stays; padding stays padding
    torch.manual_seed(0)
    full = torch.ones(64, 512, dtype=torch.bool)
    hidden = 1 - drop_tokens(full, 0.15)[:, 1:].float().mean().item()
    assert abs(hidden - 0.15) < 0.01  # the rate asked for (33,000 draws: 0.01 is over 6 sigma)


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


@pytest.mark.parametrize(("pooling", "norm", "pos_emb", "fused"), [
    ("mean", "pre", "learned", True),
    ("max", "post", "sinusoidal", False),
    ("first", "pre", "learned", False),
    ("mean", "pre", "rope", True),  # the kept tokens rotated by their places in the text, not their columns
])
def test_training_on_compacted_tokens_equals_computing_hidden_ones_as_padding(pooling, norm, pos_emb, fused):
    cfg = model_cfg(pooling=pooling, norm=norm, pos_emb=pos_emb, token_dropout=0.7)
    torch.manual_seed(0)
    fast = set_fused(CTransformer(cfg, VOCAB, 96).train(), fused)
    reference = set_fused(CTransformer(cfg, VOCAB, 96).train(), fused)
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
