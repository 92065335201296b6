"""`tfm export`: a trained model as one portable ONNX file, and running that file with onnxruntime.

The graph takes `ids` (batch, length) int64, each row [CLS] followed by the text's truncated
subword ids and [PAD] after them, and `mask` (batch, length) bool, True at real tokens; both axes
are dynamic (length up to the model's max_length). It returns `logits` (batch, num_labels) float32,
already divided by the model's calibration temperature: their softmax is `tfm predict`'s
probabilities. It is traced from the model's reference attention (plain matmuls and a masked
softmax), not from the fused kernel, and checked against the loaded model before it is written.

What a caller needs to build the inputs travels with the file: the tokenizer is written beside it
as NAME.tokenizer.json, and the ONNX model's metadata_props hold (all strings) `tfm.labels` (a
JSON list), `tfm.max_length`, `tfm.truncation`, `tfm.head_fraction`, `tfm.tokenizer` (the
tokenizer file's name), `tfm.cls_id`, `tfm.pad_id`, `tfm.temperature` (already in the graph) and
`tfm.version`. See docs/serving.md.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import warnings
from pathlib import Path

import numpy as np
import torch

from transformer_cli import __version__
from transformer_cli.calibration import softmax
from transformer_cli.checkpoint import read_tokenizer
from transformer_cli.data import CLS_ID, HEAD_SHARE, PAD_ID, Encoded, collate, encode_texts, length_batches, windows
from transformer_cli.errors import TfmError, UsageError
from transformer_cli.evaluate import load_model_dir
from transformer_cli.fileio import atomic_write_together, check_output_path
from transformer_cli.model import CTransformer, SelfAttention

INPUTS, OUTPUT = ("ids", "mask"), "logits"
CHECK_ATOL = 1e-4  # largest logit difference between the file (onnxruntime) and the loaded model accepted
EXTRA = "{what} needs 'pip install transformer-cli[{extra}]' ({e})"


def export_onnx(model_dir: str | Path, output: str | Path) -> dict:
    """Write `output` (.onnx) and its tokenizer beside it; returns what was written and the check's
    largest logit difference."""
    output = Path(output)
    if output.suffix.lower() != ".onnx":
        raise UsageError(f"--output '{output}' must name a .onnx file")
    tokenizer_file = output.with_name(output.stem + ".tokenizer.json")
    check_output_path(output, "--output", hint="pass a file name ending in .onnx")
    check_output_path(tokenizer_file, "tokenizer file", hint="choose another --output")  # written beside it
    _require("tfm export", "onnx", "onnxscript", "onnxruntime")
    import onnx

    model, cfg, tokenizer, labels, temperature = load_model_dir(model_dir)
    model = Calibrated(model, temperature)
    proto = onnx.load_from_string(_trace(Calibrated(reference_model(model.model), temperature), cfg.data.max_length))
    d = cfg.data
    meta = {"labels": json.dumps(labels), "max_length": d.max_length, "truncation": d.truncation,
            "long_text": d.long_text, "head_fraction": HEAD_SHARE, "tokenizer": tokenizer_file.name,
            "cls_id": CLS_ID, "pad_id": PAD_ID, "temperature": temperature, "version": __version__}
    onnx.helper.set_model_props(proto, {f"tfm.{k}": str(v) for k, v in meta.items()})
    data = proto.SerializeToString()
    diff = _check(data, model, d.max_length)
    atomic_write_together({tokenizer_file: tokenizer.to_str().encode("utf-8"), output: data})
    return {"onnx": str(output), "tokenizer": str(tokenizer_file), "bytes": len(data), "max_abs_logit_diff": diff}


def reference_model(model: CTransformer) -> CTransformer:
    """A copy of `model` (same weights, eval mode) whose attention takes the reference path."""
    emb = model.encoder.tok_emb
    ref = CTransformer(model.cfg, emb.num_embeddings, model.encoder.max_length, model.head.out_features)
    ref.load_state_dict(model.state_dict())
    for m in ref.modules():
        if isinstance(m, SelfAttention):
            m.fused = False
    return ref.eval()


class Calibrated(torch.nn.Module):
    """The classifier's logits divided by its calibration temperature (calibration.py)."""

    def __init__(self, model: CTransformer, temperature: float):
        super().__init__()
        self.model, self.temperature = model, temperature

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(ids, mask) / self.temperature


def _trace(model: Calibrated, max_length: int) -> bytes:
    """The serialized ONNX graph of model(ids, mask) -> logits, batch and length dynamic."""
    from torch.export import Dim

    length = min(max_length, 16)
    ids = torch.randint(CLS_ID + 1, model.model.encoder.tok_emb.num_embeddings, (2, length))
    mask = torch.ones(2, length, dtype=torch.bool)
    mask[1, length // 2 :] = False
    axes = {0: Dim("batch"), 1: Dim("length", max=max_length)}
    with torch.no_grad(), _quiet():
        program = torch.onnx.export(model, (ids, mask), dynamo=True, input_names=list(INPUTS),
                                    output_names=[OUTPUT], dynamic_shapes={"ids": axes, "mask": axes},
                                    verbose=False)
    return program.model_proto.SerializeToString()


@contextlib.contextmanager
def _quiet():
    """The exporter's progress lines, warnings and log records (e.g. "torchvision is not installed") held back."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def _check(data: bytes, model: Calibrated, max_length: int) -> float:
    """Largest |logit difference| between the graph in onnxruntime and `model` on rows of mixed lengths
    (the longest one max_length); raises TfmError above CHECK_ATOL."""
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, max_length, max(1, max_length // 3), min(max_length, 5)])
    vocab = model.model.encoder.tok_emb.num_embeddings
    ids = torch.randint(CLS_ID + 1, vocab, (len(lengths), max_length), generator=gen)
    mask = torch.arange(max_length)[None, :] < lengths[:, None]  # (B, T)
    ids = ids.masked_fill(~mask, PAD_ID)
    ids[:, 0] = CLS_ID
    with torch.inference_mode():
        expected = model(ids, mask).float().numpy()
    got = _ort_runner(data).run([OUTPUT], {"ids": ids.numpy(), "mask": mask.numpy()})[0]
    diff = float(np.abs(got - expected).max())
    if not diff <= CHECK_ATOL:
        raise TfmError(f"the exported graph's logits differ from the model's by {diff:.2g} (over {CHECK_ATOL}); "
                       "nothing was written")
    return diff


def _ort_runner(model: bytes | str | Path, threads: int | None = None):
    import onnxruntime as ort

    options = ort.SessionOptions()
    if threads:
        options.intra_op_num_threads = threads
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def _require(what: str, *modules: str) -> None:
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise TfmError(EXTRA.format(what=what, extra="export", e=e)) from None


class OnnxClassifier:
    """An exported .onnx file and the tokenizer beside it, run with onnxruntime: the probabilities
    `tfm predict` gives, without torch's model code."""

    def __init__(self, path: str | Path, threads: int | None = None):
        _require("running an exported model", "onnxruntime")
        path = Path(path)
        if not path.is_file():
            raise TfmError(f"ONNX file '{path}' does not exist; create it with `tfm export`")
        try:
            self.runner = _ort_runner(path, threads)
            meta = self.runner.get_modelmeta().custom_metadata_map
            self.labels = json.loads(meta["tfm.labels"])
            self.max_length, self.truncation = int(meta["tfm.max_length"]), meta["tfm.truncation"]
            self.windowed = meta.get("tfm.long_text") == "windows"  # reviews read whole, in windows
            tokenizer_path = path.with_name(meta["tfm.tokenizer"])
        except (KeyError, ValueError) as e:
            raise TfmError(f"'{path}' is not a `tfm export` file (its metadata lacks {e})") from None
        except Exception as e:  # noqa: BLE001 (onnxruntime's errors for a damaged file derive from Exception only)
            raise TfmError(f"'{path}' is unreadable as ONNX ({type(e).__name__}: {e})") from None
        self.tokenizer = read_tokenizer(tokenizer_path)

    def encode(self, texts: list[str]) -> Encoded:
        length = None if self.windowed else self.max_length
        ids, offsets = encode_texts(self.tokenizer, texts, length, self.truncation)
        return Encoded(ids, offsets, np.zeros(len(texts), dtype=np.int64))

    def logits(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """(B, num_labels) float32 logits of one padded batch."""
        return self.runner.run([OUTPUT], {"ids": ids.astype(np.int64), "mask": mask.astype(bool)})[0]

    def proba(self, texts: list[str], batch_size: int = 64) -> np.ndarray:
        """(N, num_labels) probabilities in the order of `texts`, batched by length as predict batches; with
        windows, of the mean logits of each review's windows. The graph has divided them by the temperature."""
        enc, owner = self.encode(texts), np.arange(len(texts))
        if self.windowed:
            enc, owner = windows(enc, self.max_length)
        logits = np.zeros((len(enc), len(self.labels)), dtype=np.float64)
        for idx in length_batches(enc.lengths, batch_size):
            ids, mask, _ = collate(enc, idx)
            logits[idx] = self.logits(ids, mask)
        mean = np.zeros((len(texts), len(self.labels)))
        np.add.at(mean, owner, logits)
        return softmax(mean / np.bincount(owner, minlength=len(texts))[:, None])
