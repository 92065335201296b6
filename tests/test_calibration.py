import json
import math
import shutil
import warnings

import numpy as np
import pytest
import torch
from conftest import edit_config

from transformer_cli.calibration import (
    calibrate,
    expected_calibration_error,
    fit_temperature,
    reliability,
    saved_temperature,
    softmax,
    temperature_of,
)
from transformer_cli.data import encode_texts
from transformer_cli.errors import TfmError
from transformer_cli.evaluate import evaluate_checkpoint, load_model_dir, predict_texts


def sampled(n: int, k: int, true_t: float, seed: int = 0) -> tuple[torch.Tensor, np.ndarray]:
    """Logits whose labels are drawn from softmax(logits / true_t): temperature true_t calibrates them."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, k, generator=g, dtype=torch.float64) * 3
    labels = torch.multinomial(z.softmax(-1), 1, generator=g)[:, 0].numpy()
    return (z * true_t).float(), labels


@pytest.mark.parametrize("temperature", [1.0, 0.25, 3.0])
def test_softmax_matches_torch(temperature):
    g = torch.Generator().manual_seed(0)
    logits = torch.cat([torch.randn(50, 3, generator=g) * 5, torch.tensor([[800.0, -800.0, 0.0], [-1e4, -1e4, -1e4]])])
    want = (logits.double() / temperature).softmax(-1).numpy()  # the reference; 800 and -1e4 overflow exp unshifted
    for given in (logits, logits.numpy()):
        got = softmax(given, temperature)
        assert got.dtype == np.float64 and got.shape == (52, 3)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    np.testing.assert_allclose(softmax(logits, temperature).sum(-1), 1.0, rtol=0, atol=1e-12)


@pytest.mark.parametrize(("k", "true_t"), [(2, 2.5), (3, 0.5), (5, 1.7)])
def test_fit_temperature_recovers_a_known_temperature(k, true_t):
    logits, labels = sampled(20000, k, true_t)
    t = fit_temperature(logits, labels)
    assert t == pytest.approx(true_t, rel=0.05)
    assert fit_temperature(logits, labels) == t  # deterministic
    # it is the minimum of the NLL: a step either way costs
    nll = [torch.nn.functional.cross_entropy(logits.double() / s, torch.as_tensor(labels)).item()
           for s in (t * 0.97, t, t * 1.03)]
    assert nll[1] < nll[0] and nll[1] < nll[2]


def test_fit_temperature_degenerate_inputs():
    assert fit_temperature(torch.zeros(0, 2), np.zeros(0, dtype=np.int64)) == 1.0
    # all right: the NLL falls all the way as T -> 0; no T fits, and the model is left as it is
    logits = torch.tensor([[2.0, -2.0], [-3.0, 3.0]] * 10)
    assert fit_temperature(logits, np.array([0, 1] * 10)) == 1.0
    # one wrong beside them: the NLL has its minimum at a finite T
    labels = np.array([0, 1] * 10)
    labels[0] = 1
    t = fit_temperature(logits, labels)
    nll = [torch.nn.functional.cross_entropy(logits.double() / s, torch.as_tensor(labels)).item()
           for s in (t * 0.97, t, t * 1.03)]
    assert 0.01 < t < 100.0 and nll[1] < nll[0] and nll[1] < nll[2]
    # all wrong: the NLL falls as T grows, within its bound
    assert 2.0 < fit_temperature(logits, np.array([1, 0] * 10)) <= 100.0
    assert fit_temperature(torch.zeros(6, 3), np.array([0, 1, 2, 0, 1, 2])) == 1.0  # no gradient at all


def test_ece_of_a_hand_worked_example():
    probs = np.array([[0.9, 0.1], [0.12, 0.88], [0.8, 0.2], [0.3, 0.7], [0.45, 0.55]])
    labels = np.array([0, 1, 1, 1, 0])
    # bins of width 1/15: 0.9 and 0.88 share (13/15, 14/15]: accuracy 1, confidence 0.89, gap 0.11;
    # 0.8 (wrong) gap 0.8; 0.7 (right) gap 0.3; 0.55 (wrong) gap 0.55
    assert expected_calibration_error(probs, labels) == pytest.approx((2 * 0.11 + 0.8 + 0.3 + 0.55) / 5)
    r = reliability(probs, labels)
    assert r["count"].sum() == 5 and r["count"][13] == 2
    assert r["confidence"][13] == pytest.approx(0.89) and r["accuracy"][13] == 1.0
    # three classes, the top probability decides; one bin of the 2 bins used here
    probs3 = np.array([[0.6, 0.3, 0.1], [0.2, 0.7, 0.1], [0.1, 0.2, 0.7], [0.1, 0.8, 0.1]])
    assert expected_calibration_error(probs3, np.array([0, 1, 0, 1]), bins=2) == pytest.approx(
        abs(2 / 3 - (0.6 + 0.7 + 0.7) / 3) * 3 / 4 + abs(1 - 0.8) / 4)
    assert expected_calibration_error(np.zeros((0, 2)), np.zeros(0)) == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no garbage bin from casting NaN to an integer
        assert math.isnan(expected_calibration_error(np.array([[np.nan, np.nan], [0.9, 0.1]]), np.array([0, 0])))


def test_calibration_lowers_the_ece_of_overconfident_logits():
    logits, labels = sampled(5000, 4, 3.0, seed=1)  # over-confident by 3x
    cal = calibrate(logits, labels)
    assert cal["temperature"] == cal["fitted_temperature"] == pytest.approx(3.0, rel=0.1)
    assert cal["ece_after"] < cal["ece_before"] / 3 and cal["nll_after"] < cal["nll_before"]
    assert cal["ece_after"] == pytest.approx(expected_calibration_error(softmax(logits, cal["temperature"]), labels))


def test_a_fitted_temperature_that_would_raise_the_ece_is_not_kept():
    """The NLL's minimum need not lower the binned ECE: 30 reviews at 0.99 (3 wrong) pull T up, which moves 70
    right ones at 0.6 further from their accuracy of 1. Then the model stays as it is (T = 1)."""
    logits = torch.tensor([[2.3, -2.3]] * 30 + [[0.2, -0.2]] * 70)
    labels = np.zeros(100, dtype=np.int64)
    labels[:3] = 1
    cal = calibrate(logits, labels)
    assert cal["fitted_temperature"] > 1.05
    assert expected_calibration_error(softmax(logits, cal["fitted_temperature"]), labels) > cal["ece_before"]
    assert cal["temperature"] == 1.0
    assert (cal["ece_after"], cal["nll_after"]) == (cal["ece_before"], cal["nll_before"])


def test_temperature_of_a_config():
    assert temperature_of({"labels": ["neg", "pos"]}) == 1.0  # saved before calibration existed
    assert temperature_of({"calibration": {"temperature": 2}}) == 2.0
    assert temperature_of({"calibration": {"temperature": 0.01}}) == 0.01  # the fit's bounds
    assert temperature_of({"calibration": {"temperature": 100}}) == 100.0
    for bad in (0, -1.0, float("nan"), "2", True, None, 1e-40, 0.0099, 100.5, float("inf")):
        with pytest.raises(TfmError, match="invalid calibration temperature"):
            temperature_of({"calibration": {"temperature": bad}})


# --------------------------------------------------------------------------- trained runs


def model_logits(model_dir, texts: list[str]) -> torch.Tensor:
    """The saved model's raw logits of each text alone: the reference for predict's probabilities."""
    model, cfg, tokenizer, _, _ = load_model_dir(model_dir)
    d = cfg.data
    ids, offsets = encode_texts(tokenizer, texts, d.max_length, d.truncation)
    rows = []
    with torch.no_grad():
        for i in range(len(texts)):
            x = torch.from_numpy(ids[offsets[i] : offsets[i + 1]].astype(np.int64))[None]
            rows.append(model(x, torch.ones_like(x, dtype=torch.bool))[0])
    return torch.stack(rows).double()


def predicted_probs(model_dir, texts: list[str]) -> np.ndarray:
    results = predict_texts(model_dir, texts, device="cpu", precision="fp32")
    return np.array([list(r["probabilities"].values()) for r in results])


def test_a_trained_run_stores_its_temperature_and_predict_uses_it(trained_run, test_rows, model_dir):
    out, metrics = trained_run
    cal = json.loads((out / "config.json").read_text())["calibration"]
    assert cal == metrics["calibration"]
    assert cal["temperature"] > 0 and cal["num_examples"] == metrics["val"]["num_examples"]
    # the fixture's model may get its validation split all right (T = 1): predict with another T too
    texts = [r["text"] for r in test_rows[:40]]
    edit_config(model_dir, calibration={**cal, "temperature": 0.5})  # model_dir: a copy of the same run
    for run, t in [(out, cal["temperature"]), (model_dir, 0.5)]:
        np.testing.assert_allclose(predicted_probs(run, texts), softmax(model_logits(out, texts), t), atol=1e-5)


def test_evaluate_reports_the_ece_of_the_calibrated_probabilities(trained_dir, test_rows):
    m = evaluate_checkpoint(trained_dir, device="cpu", precision="fp32")
    probs = predicted_probs(trained_dir, [r["text"] for r in test_rows])
    labels = np.array([r["label"] for r in test_rows])
    assert m["temperature"] == saved_temperature(trained_dir)
    assert m["ece"] == pytest.approx(expected_calibration_error(probs, labels), abs=1e-6)
    assert m["loss"] == pytest.approx(-np.log(probs[np.arange(len(labels)), labels]).mean(), rel=1e-4)


@pytest.mark.parametrize("calibrate", [None, False], ids=["before-calibration", "calibrate-false"])
def test_a_model_saved_without_a_temperature_loads_with_temperature_one(trained_dir, tmp_path, test_rows, calibrate):
    """Saved before calibration existed, or by a version with train.calibrate = false (a field it no longer has)."""
    old = tmp_path / "old"
    shutil.copytree(trained_dir, old, ignore=shutil.ignore_patterns("checkpoints", "events.*"))
    meta = json.loads((old / "config.json").read_text())
    del meta["calibration"]
    if calibrate is not None:
        meta["train"]["calibrate"] = calibrate
    (old / "config.json").write_text(json.dumps(meta))
    texts = [r["text"] for r in test_rows[:20]]
    assert load_model_dir(old)[4] == 1.0
    np.testing.assert_allclose(predicted_probs(old, texts), softmax(model_logits(old, texts)), atol=1e-5)
    assert evaluate_checkpoint(old, device="cpu")["temperature"] == 1.0
