"""Calibration: how far a classifier's probabilities can be trusted, and temperature scaling to fix them.

Temperature scaling divides the logits by one scalar T > 0, fitted on the validation split to minimise
the negative log-likelihood; the predicted labels do not change. `tfm train` stores T in config.json under
"calibration" and `tfm predict` and `tfm evaluate` divide by it (T = 1 for a model saved without it).
The expected calibration error (ECE): the mean over examples of |accuracy - mean top probability| of
their bin, among `BINS` equal-width bins of the top probability.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from transformer_cli.errors import TfmError
from transformer_cli.fileio import read_json, write_json

BINS = 15  # equal-width bins of the top probability, as ECE is usually reported
CONFIG_KEY = "calibration"  # config.json's object: {"temperature", "ece_before", "ece_after", ...}
T_RANGE = (1e-2, 1e2)  # T beyond these is a degenerate fit (e.g. a split it gets almost all wrong)
LOG_T_RANGE = (math.log(T_RANGE[0]), math.log(T_RANGE[1]))


def fit_temperature(logits: torch.Tensor, labels: np.ndarray | torch.Tensor, max_iter: int = 100) -> float:
    """The T > 0 that minimises the mean NLL of softmax(logits / T) on (logits, labels): L-BFGS on log T,
    in float64, from T = 1; deterministic; clamped to T_RANGE. 1.0 for no examples, and where every label
    has the strictly largest logit: there the NLL falls all the way to T -> 0, and no T fits.
    """
    if len(logits) == 0:
        return 1.0
    z = torch.as_tensor(logits, dtype=torch.float64)
    y = torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    if (z.gather(1, y[:, None]) > z.scatter(1, y[:, None], -math.inf)).all():
        return 1.0
    log_t = torch.zeros((), dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([log_t], lr=1.0, max_iter=max_iter, tolerance_grad=1e-10, tolerance_change=1e-12,
                            line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(z / log_t.clamp(*LOG_T_RANGE).exp(), y)
        loss.backward()
        return loss

    with torch.enable_grad():  # callers may run under inference_mode
        opt.step(closure)
    value = float(log_t.detach().exp())
    return min(max(value, T_RANGE[0]), T_RANGE[1]) if math.isfinite(value) else 1.0


def reliability(probs: np.ndarray, labels: np.ndarray, bins: int = BINS) -> dict[str, np.ndarray]:
    """Per bin of the top probability (bin b holds (b/bins, (b+1)/bins], bin 0 also 0): "count",
    "confidence" (mean top probability) and "accuracy" (share predicted right), 0 where empty; and
    "edges" (bins + 1,)."""
    probs = np.asarray(probs, dtype=np.float64)
    conf, right = probs.max(axis=1), (probs.argmax(axis=1) == np.asarray(labels)).astype(np.float64)
    which = np.clip(np.ceil(conf * bins).astype(np.int64) - 1, 0, bins - 1)
    count = np.bincount(which, minlength=bins).astype(np.float64)
    safe = np.maximum(count, 1)
    return {
        "count": count,
        "confidence": np.bincount(which, weights=conf, minlength=bins) / safe,
        "accuracy": np.bincount(which, weights=right, minlength=bins) / safe,
        "edges": np.linspace(0.0, 1.0, bins + 1),
    }


def expected_calibration_error(probs: np.ndarray, labels: np.ndarray, bins: int = BINS) -> float:
    """sum over bins of |bin| / N * |accuracy - confidence|; 0.0 for no examples, NaN for probabilities
    that are not all finite (logits that overflowed)."""
    if not np.isfinite(np.asarray(probs, dtype=np.float64)).all():
        return float("nan")
    r = reliability(probs, labels, bins)
    n = r["count"].sum()
    return float((r["count"] * np.abs(r["accuracy"] - r["confidence"])).sum() / n) if n else 0.0


def softmax(logits: torch.Tensor | np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """(N, K) float64 probabilities of logits / temperature, in numpy: torch's softmax on a few rows would
    wake its thread pool, which then spins, CPU time lost after every small call."""
    z = np.asarray(logits, dtype=np.float64) / temperature
    e = np.exp(z - z.max(-1, keepdims=True))  # shifted by each row's largest: no overflow
    return e / e.sum(-1, keepdims=True)


def calibrate(logits: torch.Tensor, labels: np.ndarray) -> dict:
    """The temperature of (validation) logits, with the ECE and NLL before and after scaling: the one fitted (it
    minimises the NLL) where it also lowers the ECE, else 1 (no scaling), so that calibration never makes the
    reported ECE worse. "fitted_temperature" is the fitted one either way."""
    fitted = fit_temperature(logits, labels)
    z, y = torch.as_tensor(logits, dtype=torch.float64), torch.as_tensor(np.asarray(labels), dtype=torch.int64)
    before = expected_calibration_error(softmax(z), labels)
    after = expected_calibration_error(softmax(z, fitted), labels)
    t = fitted if after <= before else 1.0
    return {
        "temperature": t,
        "fitted_temperature": fitted,
        "ece_before": before,
        "ece_after": after if t == fitted else before,
        "nll_before": float(F.cross_entropy(z, y)) if len(y) else 0.0,
        "nll_after": float(F.cross_entropy(z / t, y)) if len(y) else 0.0,
        "bins": BINS,
        "num_examples": len(y),
    }


def temperature_of(meta: dict, where: str = "config.json") -> float:
    """The temperature stored in a model's config.json (its parsed dict); 1.0 when it has none."""
    cal = meta.get(CONFIG_KEY)
    if cal is None:
        return 1.0
    t = cal.get("temperature") if isinstance(cal, dict) else None
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not T_RANGE[0] <= t <= T_RANGE[1]:  # NaN too
        raise TfmError(f"'{where}' has an invalid calibration temperature {t!r} (expected a number in "
                       f"[{T_RANGE[0]:g}, {T_RANGE[1]:g}], as calibration fits it); delete its \"{CONFIG_KEY}\" "
                       "entry to use the model uncalibrated")
    return float(t)


def saved_temperature(model_dir: str | Path) -> float:
    """temperature_of the config.json in `model_dir`."""
    path = Path(model_dir) / "config.json"
    meta = read_json(path, "config")
    return temperature_of(meta, str(path)) if isinstance(meta, dict) else 1.0


def save_calibration(model_dir: str | Path, cal: dict) -> None:
    """Store `cal` (calibrate's dict) as config.json's "calibration" entry, atomically."""
    path = Path(model_dir) / "config.json"
    meta = read_json(path, "config")
    meta[CONFIG_KEY] = cal
    write_json(path, meta)
