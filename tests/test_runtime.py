"""The runtime context: device and precision choices, refusals, and mixed precision against fp32."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file

from transformer_cli import checkpoint as ckpt
from transformer_cli import runtime
from transformer_cli.errors import UsageError
from transformer_cli.runtime import Runtime, hardware, make_runtime, resolve_device, resolve_precision

CPU = torch.device("cpu")


def test_devices_this_machine_has_and_has_not(monkeypatch):
    assert resolve_device("cpu") == CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert resolve_device("auto") == CPU
    for name in ("cuda", "cuda:0"):
        with pytest.raises(UsageError, match="CUDA is not available"):
            resolve_device(name)
    with pytest.raises(UsageError, match="MPS is not available"):
        resolve_device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", local_rank=1) == torch.device("cuda", 1)  # each torchrun process its own GPU
    assert resolve_device("cuda", local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(UsageError, match="has 2 CUDA device"):
        resolve_device("cuda:2")


def test_precision_choices_on_the_cpu(monkeypatch):
    assert resolve_precision("fp32", CPU) is None
    with pytest.raises(UsageError, match="fp16 is not supported on CPU"):
        resolve_precision("fp16", CPU)
    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: False)
    assert resolve_precision("auto", CPU) is None  # emulated bf16 would be slower than fp32
    with pytest.raises(UsageError, match="no native bf16"):
        resolve_precision("bf16", CPU)
    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: True)
    assert resolve_precision("bf16", CPU) is torch.bfloat16
    assert resolve_precision("auto", CPU) is torch.bfloat16  # native bf16: faster


@pytest.mark.parametrize(("x86", "avx512_bf16", "amx", "mkldnn_bf16", "native"), [
    (True, True, False, True, True),  # AVX-512 BF16 (this project's machines)
    (True, False, True, True, True),  # AMX
    (True, False, False, True, False),  # AVX-512 without BF16: oneDNN only emulates bf16
    (True, False, False, False, False),  # AVX2
    (False, False, False, True, True),  # Arm with BF16
    (False, False, False, False, False),
])
def test_native_bf16_means_bf16_instructions(monkeypatch, x86, avx512_bf16, amx, mkldnn_bf16, native):
    monkeypatch.setattr(torch.cpu, "_is_avx2_supported", lambda: x86)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn_bf16)
    assert runtime.cpu_has_fast_bf16() is native


@pytest.mark.parametrize(("capability", "dtype"), [
    ((9, 0), torch.bfloat16), ((8, 0), torch.bfloat16),  # H100, A100: bf16 tensor cores
    ((7, 5), torch.float16), ((7, 0), torch.float16),  # T4, V100: bf16 only emulated, fp16 with a scaler
])
def test_precision_auto_on_cuda_prefers_bf16_where_the_gpu_computes_it(monkeypatch, capability, dtype):
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)  # as on a T4
    gpu = torch.device("cuda", 1)
    assert resolve_precision("auto", gpu) is dtype
    assert asked == [gpu]  # the run's GPU, not the current one


def test_torchrun_processes_each_take_their_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(UsageError, match="--device cuda:1 would put every process on one GPU"):
        make_runtime("cuda:1", "fp32")
    monkeypatch.setenv("LOCAL_RANK", "3")
    for device in ("cuda", "auto"):
        with pytest.raises(UsageError, match="LOCAL_RANK=3 has no GPU: this machine has 2"):
            make_runtime(device, "fp32")


def test_grad_scaler_only_for_fp16():
    assert [Runtime(CPU, dtype).grad_scaler().is_enabled() for dtype in (None, torch.bfloat16, torch.float16)] == [
        False, False, True]
    precisions = [Runtime(CPU, dtype).precision for dtype in (None, torch.bfloat16, torch.float16)]
    assert precisions == ["fp32", "bf16", "fp16"]


def test_single_process_runtime(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    rt = make_runtime("cpu", "fp32")
    assert (rt.device, rt.amp_dtype, rt.rank, rt.world_size, rt.is_main, rt.distributed) == (
        CPU, None, 0, 1, True, False)
    assert rt.all_sum([1.5, 2.0]) == [1.5, 2.0]
    (ids,) = rt.tensors(np.arange(6, dtype=np.int32).reshape(2, 3))
    assert ids.dtype == torch.int32 and ids.device == CPU and ids.tolist() == [[0, 1, 2], [3, 4, 5]]


# --------------------------------------------------------------------------- bf16 autocast against fp32


def test_bf16_autocast_logits_are_close_to_fp32():
    from transformer_cli.config import ModelConfig
    from transformer_cli.model import CTransformer

    torch.manual_seed(0)
    model = CTransformer(ModelConfig(d_model=32, n_heads=2, n_layers=2), 100, 24).eval()
    ids = torch.randint(1, 100, (6, 24))
    mask = torch.arange(24) < torch.tensor([24, 20, 9, 1, 24, 13])[:, None]  # (B, T) with padding
    with torch.no_grad():
        want = model(ids, mask)
        with Runtime(CPU, torch.bfloat16).autocast():
            got = model(ids, mask)
        with Runtime(CPU, None).autocast():
            assert torch.equal(model(ids, mask), want)  # fp32: autocast is off
    assert not torch.equal(got.float(), want)  # the matmuls ran in bf16 ...
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)  # ... within bf16's precision


def test_a_bf16_training_run_follows_the_fp32_run(synthetic_data_dir, tmp_path, monkeypatch):
    """train.precision=bf16 (on CPUs with native bf16; here allowed by hand, emulated): the same
    steps, losses within bf16's precision, and the saved weights stay fp32."""
    from transformer_cli.training.classify import train

    monkeypatch.setattr(runtime, "cpu_has_fast_bf16", lambda: True)
    runs, weights = {}, {}
    for precision in ("fp32", "bf16"):
        out = tmp_path / precision
        cfg = tiny_config(synthetic_data_dir, out, train__precision=precision, train__max_steps=12,
                          train__log_every=1, model__dropout=0.0)
        runs[precision] = train(cfg, progress=False)
        weights[precision] = saved = load_file(str(out / ckpt.MODEL_FILE))
        assert {t.dtype for t in saved.values()} == {torch.float32}
        assert json.loads((out / ckpt.CONFIG_FILE).read_text())["train"]["precision"] == precision
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert fp32["steps"] == bf16["steps"] == 12
    assert not torch.equal(weights["fp32"]["head.weight"], weights["bf16"]["head.weight"])  # bf16 did the arithmetic
    for name, w in weights["fp32"].items():
        torch.testing.assert_close(weights["bf16"][name], w, atol=0.05, rtol=0.05, msg=name)
    assert bf16["val"]["loss"] == pytest.approx(fp32["val"]["loss"], rel=0.05)
    assert abs(bf16["val"]["accuracy"] - fp32["val"]["accuracy"]) <= 0.1


def test_the_hardware_line_says_what_the_cpu_has():
    line = hardware()
    flags = next((x.split(":", 1)[1].split() for x in Path("/proc/cpuinfo").read_text().splitlines()
                  if x.startswith("flags")), [])
    for flag in ("avx2", "avx512_bf16", "amx_bf16"):
        assert f"{flag} {'yes' if flag in flags else 'no'}" in line
    assert f"torch {torch.__version__}, {torch.get_num_threads()} threads" in line and "GPU: " in line
