import platform
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from transformer_cli import kernels
from transformer_cli.config import ModelConfig
from transformer_cli.model import CTransformer, explicit_attention

CAN_RUN = sys.platform.startswith("linux") and platform.machine() == "x86_64" and torch.cpu._is_avx512_bf16_supported()
needs_avx512_bf16 = pytest.mark.skipif(not CAN_RUN, reason="the kernel needs x86-64 Linux with AVX-512 BF16")


def forget_the_library(monkeypatch) -> None:
    """The kernel module as if nothing was loaded or failed yet, until monkeypatch restores it."""
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_reason", None)


@pytest.fixture
def fresh_kernels(tmp_path, monkeypatch):
    """The kernel module with nothing loaded and its cache in tmp_path; as it was again after."""
    monkeypatch.setenv("TFM_CACHE", str(tmp_path))
    forget_the_library(monkeypatch)
    return tmp_path / "kernels"


def qkv_and_mask(B: int, T: int, H: int, D: int, lengths: list[int], seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, 3 * H * D, generator=g) * 1.5).bfloat16()
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    return qkv, mask


def reference(qkv: torch.Tensor, mask: torch.Tensor, H: int) -> torch.Tensor:
    """explicit_attention in fp32 on the same bf16 inputs, heads merged: (B, T, C)."""
    B, T, C3 = qkv.shape
    q, k, v = (x.view(B, T, H, C3 // 3 // H).transpose(1, 2) for x in qkv.float().split(C3 // 3, dim=2))
    return explicit_attention(q, k, v, mask[:, None, None, :]).transpose(1, 2).reshape(B, T, C3 // 3)


@needs_avx512_bf16
@pytest.mark.parametrize(
    ("T", "H", "D", "lengths"),
    [
        (256, 8, 16, [256, 190, 1, 77]),  # seed.toml's heads; a row of [CLS] alone
        (37, 2, 32, [37, 36, 17, 2]),  # the default's heads; T not a multiple of 16
        (64, 1, 64, [64, 33]),
        (1, 4, 16, [1]),
    ],
)
def test_attention_kernel_equals_the_reference(T, H, D, lengths):
    qkv, mask = qkv_and_mask(len(lengths), T, H, D, lengths)
    mask[0, min(3, T - 1)] = T == 1  # a hidden key inside the first row (not in a one-token row)
    with torch.inference_mode():
        out = kernels.attention_bf16(qkv, mask, H)
        ref = reference(qkv, mask, H)
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == ref.shape
    rows = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # up to each row's last real token
    # bf16 output (as the projection reads it) and bf16 probabilities: within 2% of the scale of v
    assert torch.allclose(out.float()[rows], ref[rows], atol=0.03 * 1.5, rtol=0.02)
    assert (out.float() - ref)[rows].abs().mean() < 3e-3
    assert (out[~rows] == 0).all()  # rows after the last real token: zero, never read


def packed_qkv(qkv: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A padded batch's rows end to end: (N, 3C) projections and (B + 1,) offsets."""
    offsets = torch.zeros(len(mask) + 1, dtype=torch.int64)
    offsets[1:] = mask.sum(1).cumsum(0)
    return qkv[mask], offsets


@needs_avx512_bf16
@pytest.mark.parametrize(
    ("T", "H", "D", "lengths"),
    [
        (256, 8, 16, [256, 190, 1, 77]),
        (37, 2, 32, [2, 37, 17, 36]),  # the default's heads; texts out of length order
        (64, 1, 64, [64, 33]),
        (1, 4, 16, [1]),
    ],
)
def test_packed_attention_kernel_equals_the_reference_on_each_text(T, H, D, lengths):
    qkv, mask = qkv_and_mask(len(lengths), T, H, D, lengths)
    rows, offsets = packed_qkv(qkv, mask)
    with torch.inference_mode():
        out = kernels.attention_bf16_packed(rows, offsets, T, H)
        padded = kernels.attention_bf16(qkv, mask, H)
    ref = reference(qkv, mask, H)[mask]  # (N, C): each text attending to itself only
    assert out is not None and out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert torch.allclose(out.float(), ref, atol=0.03 * 1.5, rtol=0.02)
    assert (out.float() - ref).abs().mean() < 3e-3
    assert torch.equal(out, padded[mask])  # the same arithmetic as the padded layout's


@needs_avx512_bf16
def test_packed_attention_kernel_declines_what_it_does_not_cover():
    qkv, mask = qkv_and_mask(2, 16, 4, 16, [16, 5])
    rows, offsets = packed_qkv(qkv, mask)
    with torch.inference_mode():
        assert kernels.attention_bf16_packed(rows, offsets, 16, 4) is not None
        assert kernels.attention_bf16_packed(rows.float(), offsets, 16, 4) is None
        assert kernels.attention_bf16_packed(rows, offsets.int(), 16, 4) is None  # offsets must be int64
        assert kernels.attention_bf16_packed(rows, offsets, 16, 8) is None  # head size 8
    assert kernels.attention_bf16_packed(rows, offsets, 16, 4) is None  # autograd on


@needs_avx512_bf16
def test_attention_kernel_gives_the_same_bits_on_any_number_of_threads(monkeypatch):
    qkv, mask = qkv_and_mask(5, 48, 4, 16, [48, 40, 9, 48, 1], seed=1)
    outs = []
    rows, offsets = packed_qkv(qkv, mask)
    for threads in (1, 3, 64):
        monkeypatch.setattr(torch, "get_num_threads", lambda n=threads: n)
        with torch.inference_mode():
            outs.append((kernels.attention_bf16(qkv, mask, 4), kernels.attention_bf16_packed(rows, offsets, 48, 4)))
    for padded, packed in outs[1:]:
        assert torch.equal(padded, outs[0][0]) and torch.equal(packed, outs[0][1])


@needs_avx512_bf16
def test_attention_kernel_declines_what_it_does_not_cover(monkeypatch):
    qkv, mask = qkv_and_mask(2, 16, 4, 16, [16, 5])
    with torch.inference_mode():
        assert kernels.attention_bf16(qkv, mask, 4) is not None
        assert kernels.attention_bf16(qkv.float(), mask, 4) is None  # fp32: SDPA's
        assert kernels.attention_bf16(qkv, mask, 8) is None  # head size 8
        assert kernels.attention_bf16(qkv, mask.long(), 4) is None  # a mask that is not bool
    assert kernels.attention_bf16(qkv, mask, 4) is None  # autograd on: training needs SDPA's backward
    monkeypatch.setattr(kernels, "enabled", False)  # TFM_CPU_KERNELS=0
    with torch.inference_mode():
        assert kernels.attention_bf16(qkv, mask, 4) is None


def eval_logits(cfg: ModelConfig, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Logits of the same weights with attention "auto" and "sdpa" under bf16 autocast, and how many
    times the kernel ran."""
    torch.manual_seed(0)
    auto = CTransformer(cfg, 100, 64).eval()
    for name, p in auto.named_parameters():  # at the init's scale (0.02) attention barely shows in the logits:
        if ".attn." in name:  # a kernel returning zeros would pass
            nn.init.normal_(p, std=0.3)
    sdpa = CTransformer(ModelConfig(**{**cfg.__dict__, "attention": "sdpa"}), 100, 64).eval()
    sdpa.load_state_dict(auto.state_dict())
    calls = []
    attention = kernels.attention_bf16

    def counted(*args):
        out = attention(*args)
        calls.append(out is not None)
        return out

    kernels.attention_bf16 = counted
    try:
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return auto(ids, mask).float(), sdpa(ids, mask).float(), sum(calls)
    finally:
        kernels.attention_bf16 = attention


@needs_avx512_bf16
@pytest.mark.parametrize(
    "kw",
    [
        {"d_model": 128, "n_heads": 8, "n_layers": 3, "pooling": "max", "norm": "post"},  # seed.toml's
        {"d_model": 64, "n_heads": 2, "n_layers": 2, "pooling": "mean", "norm": "pre"},  # the default's
        {"d_model": 64, "n_heads": 2, "n_layers": 2, "pooling": "mean", "pos_emb": "rope"},  # q, k turned first
    ],
)
def test_model_inference_with_the_kernel_matches_sdpa(kw):
    cfg = ModelConfig(**kw, dropout=0.0, ngram_buckets=0)
    g = torch.Generator().manual_seed(2)
    mask = torch.arange(64)[None, :] < torch.tensor([64, 50, 20, 1, 33])[:, None]
    ids = torch.randint(5, 100, mask.shape, generator=g).masked_fill(~mask, 0)
    with_kernel, with_sdpa, calls = eval_logits(cfg, ids, mask)
    assert calls == cfg.n_layers  # every layer took the kernel
    scale = with_sdpa.abs().max()
    assert (with_kernel - with_sdpa).abs().max() <= 0.05 * scale
    assert torch.equal(with_kernel.argmax(1), with_sdpa.argmax(1))


@needs_avx512_bf16
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_packed_model_inference_with_the_kernel_matches_the_padded_batch(monkeypatch, pos_emb):
    from transformer_cli.model import Packed

    torch.manual_seed(0)
    model = CTransformer(ModelConfig(d_model=64, n_heads=2, n_layers=2, pooling="max", pos_emb=pos_emb, dropout=0.0,
                                     ngram_buckets=0), 100, 64).eval()
    for name, p in model.named_parameters():
        if ".attn." in name:
            nn.init.normal_(p, std=0.3)
    lengths = torch.tensor([64, 50, 20, 1, 33])
    mask = torch.arange(64)[None, :] < lengths[:, None]
    ids = torch.randint(5, 100, mask.shape, generator=torch.Generator().manual_seed(2)).masked_fill(~mask, 0)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    calls = []
    monkeypatch.setattr(kernels, "attention_bf16_packed",
                        lambda *a, f=kernels.attention_bf16_packed: calls.append(1) or f(*a))
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.packed_logits(ids[mask], Packed(offsets, 64)).float()
        expected = model(ids, mask).float()
    assert len(calls) == 2  # every layer took the packed kernel
    assert torch.allclose(got, expected, atol=0.02 * expected.abs().max())
    assert torch.equal(got.argmax(1), expected.argmax(1))


@needs_avx512_bf16
def test_the_library_is_compiled_once_into_the_cache(fresh_kernels, monkeypatch):
    import subprocess

    outputs, run = [], subprocess.run

    def recording(cmd, *args, **kwargs):
        outputs.append(Path(cmd[cmd.index("-o") + 1]))
        return run(cmd, *args, **kwargs)

    monkeypatch.setattr(kernels.subprocess, "run", recording)
    assert kernels.available() and kernels.unavailable_reason() is None
    built = list(fresh_kernels.glob("attention_bf16-*.so"))
    assert len(built) == 1 and not list(fresh_kernels.glob("*.tmp"))
    assert outputs and outputs[0].parent == built[0].parent and outputs[0] != built[0]  # renamed into place whole
    stamp = built[0].stat().st_mtime_ns
    forget_the_library(monkeypatch)
    assert kernels.available()
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


@needs_avx512_bf16
def test_a_failed_build_falls_back_to_sdpa(fresh_kernels, monkeypatch, tmp_path):
    # a compiler that writes part of its output (-o FILE) and fails, as a killed or broken one does
    cc = tmp_path / "half-cc"
    cc.write_text('#!/bin/sh\nprev=\nfor a; do [ "$prev" = -o ] && printf junk > "$a"; prev=$a; done\n'
                  'echo "internal compiler error" >&2\nexit 1\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    assert not kernels.available()
    assert kernels.unavailable_reason() == f"{cc} failed: internal compiler error"
    assert not list(fresh_kernels.iterdir())  # no half-written library for a later run to load
    qkv, mask = qkv_and_mask(2, 16, 4, 16, [16, 5])
    with torch.inference_mode():
        assert kernels.attention_bf16(qkv, mask, 4) is None
    cfg = ModelConfig(d_model=64, n_heads=2, n_layers=1, dropout=0.0, ngram_buckets=0)
    with_kernel, with_sdpa, calls = eval_logits(cfg, torch.ones(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=bool))
    assert calls == 0 and torch.equal(with_kernel, with_sdpa)


def test_without_avx512_bf16_nothing_is_compiled(fresh_kernels, monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert not kernels.available()
    assert "AVX-512 BF16" in kernels.unavailable_reason() or "x86-64 Linux" in kernels.unavailable_reason()
    assert not fresh_kernels.exists()


def test_the_exp_polynomial_is_within_its_stated_error():
    """exp_ps's 2^f polynomial (degree 5 on [-0.5, 0.5]), read from the C source: relative error < 1.5e-7."""
    source = kernels.SOURCE.read_text()
    body = source[source.index("static inline __m512 exp_ps") :].split("\n}\n")[0]
    coefficients = [float(c) for c in re.findall(r"(?:p = |p, f, )_mm512_set1_ps\(([-0-9.e]+)f\)", body)]
    assert len(coefficients) == 6  # highest degree first, as Horner's rule reads them
    f = torch.linspace(-0.5, 0.5, 10001, dtype=torch.float64)
    poly = torch.zeros_like(f)
    for c in coefficients:
        poly = poly * f + c
    assert ((poly - 2.0**f).abs() / 2.0**f).max() < 1.5e-7
