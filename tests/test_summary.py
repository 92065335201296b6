"""`tfm inspect` and transformer_cli.summary: shapes, parameters and FLOPs of each layer."""

import json

import pytest
import torch
from conftest import CONFIGS
from test_cli import assert_fails_cleanly, tfm

from transformer_cli.config import load_config
from transformer_cli.model import SelfAttention
from transformer_cli.summary import SAMPLE_TEXT, model_from_config, sample_ids, summarize

pytest.importorskip("torchinfo")


def rows_by_name(out: dict) -> dict[str, dict]:
    return {r["name"]: r for r in out["layers"]}


def test_seed_recipe_has_the_reference_notebooks_shapes():
    """configs/seed.toml: embedding (B, T, 128), heads (B, 8, T, 16), T x T weights, 2 labels."""
    r = tfm("inspect", "--config", CONFIGS / "seed.toml", "--json")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    T = out["dims"]["T"]
    assert out["dims"] == {"B": 1, "T": T, "C": 128, "H": 8, "Dh": 16, "L": 2} and T > 10
    rows = rows_by_name(out)
    assert rows["encoder.tok_emb"]["output"] == [1, T, 128]
    assert rows["encoder.tok_emb"]["output_symbols"] == "(B, T, C)"
    for i in range(3):
        assert rows[f"encoder.blocks.{i}.attn.qkv"]["output"] == [1, T, 384]
        assert rows[f"encoder.blocks.{i}.attn.heads"]["output"] == [1, 8, T, 16]
        assert rows[f"encoder.blocks.{i}.attn.heads"]["output_symbols"] == "(B, H, T, Dh)"
        assert rows[f"encoder.blocks.{i}.attn.weights"]["output"] == [1, 8, T, T]
        assert rows[f"encoder.blocks.{i}.ff.0"]["output"] == [1, T, 512]
        assert rows[f"encoder.blocks.{i}"]["output"] == [1, T, 128]
    assert rows["head"]["input"] == [1, 128] and rows["head"]["output"] == [1, 2]
    assert rows[""]["output_symbols"] == "(B, L)" and rows[""]["input_symbols"] == "(B, T)"

    text = tfm("inspect", "--config", CONFIGS / "seed.toml")
    assert text.exit_code == 0, text.stderr
    assert f"(B, H, T, Dh) = (1, 8, {T}, 16)" in text.stdout
    assert f"(B, T, C) = (1, {T}, 128)" in text.stdout
    assert "total: 7,027,842 parameters" in text.stdout


def test_overrides_and_depth():
    r = tfm("inspect", "--config", CONFIGS / "seed.toml", "model.n_heads=4", "--depth", "2", "--json",
            "--text", "one two three")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["dims"]["H"] == 4 and out["dims"]["Dh"] == 32 and out["dims"]["T"] == 4  # [CLS] + 3 words
    assert max(row["depth"] for row in out["layers"]) == 2
    assert {"", "encoder", "encoder.tok_emb", "encoder.blocks", "head"} <= set(rows_by_name(out))


def test_total_matches_the_runs_num_params(trained_run):
    out_dir, metrics = trained_run
    r = tfm("inspect", "-c", out_dir, "--json", "--depth", "0")
    assert r.exit_code == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["total"]["params"] == metrics["num_params"]
    assert [row["name"] for row in out["layers"]] == [""]
    assert out["layers"][0]["params"] == metrics["num_params"]


def test_flops_equal_torchs_count_of_the_explicit_model():
    """Per-token FLOPs x tokens equal torch's FlopCounterMode on the explicit-attention model, whose
    attention matmuls are plain ops that it counts; with the fused kernel the shapes and count are the same."""
    from torch.utils.flop_counter import FlopCounterMode

    model = model_from_config(load_config(CONFIGS / "seed.toml"))
    ids = sample_ids(SAMPLE_TEXT, model)
    fused = summarize(model, ids)
    for m in model.modules():
        if isinstance(m, SelfAttention):
            m.fused = False
    explicit = summarize(model, ids)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(ids, torch.ones_like(ids, dtype=torch.bool))
    for s in (fused, explicit):
        assert s.flops_per_token * ids.numel() == pytest.approx(counter.get_total_flops(), rel=1e-9)
        heads = next(r for r in s.rows if r.name == "encoder.blocks.0.attn.heads")
        assert heads.output == [1, 8, ids.size(1), 16]


def test_long_text_is_truncated_to_max_length():
    cfg = load_config(CONFIGS / "seed.toml", {"data.max_length": 16})
    model = model_from_config(cfg)
    assert sample_ids(SAMPLE_TEXT, model).shape == (1, 16)


def test_an_untrained_model_counts_the_tokens_a_trained_tokenizer_leaves(trained_dir):
    """Without a tokenizer (--config) each word and punctuation mark is a token, after the normalization
    that a trained tokenizer applies: a `<br />` tag is no token in either; and a count of one is singular."""
    for text, tokens in (("<br />", "T = 1 token,"), ("Great film.<br /><br />Loved it", "T = 6 tokens,")):
        for model in (["-c", trained_dir], ["--config", CONFIGS / "tiny.toml", "model.n_heads=1"]):
            r = tfm("inspect", *model, "--depth", "0", "--text", text)
            assert r.exit_code == 0, r.stderr
            assert r.stdout.startswith(f"B = 1 review, {tokens} C = 32, H = ")
            assert ("H = 1 head," in r.stdout) == (model[0] == "--config")


def test_usage_errors():
    assert_fails_cleanly(tfm("inspect"), 2, "-c DIR", "--config FILE")
    assert_fails_cleanly(tfm("inspect", "-c", "x", "--config", CONFIGS / "seed.toml"), 2, "one of the two")
    assert_fails_cleanly(tfm("inspect", "--config", CONFIGS / "seed.toml", "--text", " "), 2, "--text is empty")
    assert_fails_cleanly(tfm("inspect", "-c", "no/such/dir"), 1, "does not exist")


@pytest.mark.parametrize("overrides", [{}, {"model.pos_emb": "sinusoidal"}, {"model.pos_emb": "rope"}])
def test_every_module_has_a_row_and_each_rows_parameters_are_its_childrens(overrides):
    """The learned position embedding is read as a table, never called: it still has a row; the encoder
    shows what goes in and comes out."""
    model = model_from_config(load_config(CONFIGS / "tiny.toml", overrides))
    s = summarize(model, sample_ids(SAMPLE_TEXT, model))
    rows = {r.name: r for r in s.rows}
    assert {name for name, _ in model.named_modules()} <= set(rows)
    for name, module in model.named_modules():
        children = [rows[f"{name}.{c}" if name else c] for c, _ in module.named_children()]
        if children:
            assert rows[name].params == sum(c.params for c in children), name
    assert [r.name for r in s.rows].index("encoder.tok_emb") < [r.name for r in s.rows].index("encoder.blocks")
    T = s.dims["T"]
    assert rows["encoder"].input == [1, T] and rows["encoder"].output == [1, T, 32]
    assert rows["encoder"].output_symbols == "(B, T, C)"
    assert rows["encoder.blocks"].input == rows["encoder.blocks"].output == [1, T, 32]
    if "model.pos_emb" not in overrides:
        assert rows["encoder.pos_emb"].params == 64 * 32 and rows["encoder.pos_emb"].depth == 2
