"""The runtime context: device and precision choices, refusals, and mixed precision against fp32."""

import json
import platform
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import tiny_config
from safetensors.torch import load_file

from transformer_cli import checkpoint as ckpt
from transformer_cli import runtime
from transformer_cli.errors import UsageError
from transformer_cli.runtime import Runtime, make_runtime, resolve_device, resolve_precision

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
    model = CTransformer(ModelConfig(d_model=32, n_heads=2, n_layers=2, ngram_buckets=64), 100, 24).eval()
    with torch.no_grad():
        model.ngrams.table.weight.normal_(std=0.1)  # the n-gram path speaks too
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
    from transformer_cli.train import train

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


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "1000"), ({"GOMP_SPINCOUNT": "5"}, "5"), ({"OMP_WAIT_POLICY": "ACTIVE"}, None),
    ({"OMP_WAIT_POLICY": "PASSIVE"}, None)])
def test_openmp_threads_yield_soon_unless_the_user_says_otherwise(env, expected):
    """Set on import, before torch loads libgomp (scripts/bench/bench_threads.py measures why)."""
    import os
    import subprocess
    import sys

    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os, transformer_cli; print(os.environ.get('GOMP_SPINCOUNT'))"
    done = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == str(expected)


REUSE_PROBE = """
import ctypes, resource, sys
from transformer_cli.runtime import keep_freed_memory
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]

def second_round_faults(size, count):  # blocks written and freed twice: the page faults of the second time
    for _ in range(2):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [libc.malloc(size) for _ in range(count)]
        for b in blocks:
            ctypes.memset(b, 1, size)
        for b in reversed(blocks):
            libc.free(b)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

applied = keep_freed_memory() if sys.argv[1] == "keep" else None
print(applied, second_round_faults(100_000, 640), second_round_faults(8 << 20, 8))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_freed_memory_is_kept_for_the_next_pass():
    """64 MB of small blocks freed at the heap's top, and blocks of 8 MB: glibc's defaults hand both back
    to the kernel, so writing them again faults every page in; kept, the second round finds them mapped."""
    def run(mode):
        out = subprocess.run([sys.executable, "-c", REUSE_PROBE, mode], capture_output=True, text=True, check=True)
        applied, small, large = out.stdout.split()
        return applied, int(small), int(large)

    default, kept = run("default"), run("keep")
    assert default[1] > 10_000 and default[2] > 10_000  # 16,000 pages each
    assert kept[0] == "True" and kept[1] < 100 and kept[2] < 100
