"""Device, precision and distribution, threaded through training as one small context."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from transformer_cli.errors import UsageError


@dataclass
class Runtime:
    device: torch.device
    amp_dtype: torch.dtype | None  # None = fp32
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def precision(self) -> str:
        return {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[self.amp_dtype]

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.amp_dtype)

    def grad_scaler(self) -> torch.amp.GradScaler:
        """Loss scaling for fp16 only; a disabled scaler is a no-op for bf16/fp32."""
        return torch.amp.GradScaler(self.device.type, enabled=self.amp_dtype is torch.float16)

    def tensors(self, *arrays: np.ndarray) -> tuple[torch.Tensor, ...]:
        """numpy -> device tensors; pinned memory and non-blocking copies on CUDA."""
        out = []
        for a in arrays:
            t = torch.from_numpy(a)
            if self.device.type == "cuda":
                t = t.pin_memory().to(self.device, non_blocking=True)
            else:
                t = t.to(self.device)
            out.append(t)
        return tuple(out)

    def barrier(self) -> None:
        if self.distributed:
            torch.distributed.barrier()

    def all_sum(self, values: list[float]) -> list[float]:
        """Sum numbers over all ranks (in float64 on CPU for gloo, on the device for NCCL)."""
        if not self.distributed:
            return values
        dev = self.device if torch.distributed.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor(values, dtype=torch.float64, device=dev)
        torch.distributed.all_reduce(t)
        return t.tolist()


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    """The torch device a valid device name (config.DEVICE_NAME) means here; refuses one this machine lacks."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank)
        if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine; use --device cpu or auto")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                         "numbered from 0")
    if name == "mps" and not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        raise UsageError("--device mps: MPS is not available on this machine; use --device cpu or auto")
    if name == "cuda":
        return torch.device("cuda", local_rank)
    return torch.device(name)


def hardware() -> str:
    """The CPU model and the flags that decide its bf16 speed, cores, torch and its threads, the GPU."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in lines)  # every CPU's are alike
            if k.strip() in ("model name", "flags")}
    flags = set(info.get("flags", "").split())
    marks = ", ".join(f"{f} {'yes' if f in flags else 'no'}" for f in ("avx2", "avx512_bf16", "amx_bf16"))
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return (f"CPU: {info.get('model name', 'unknown')} ({marks}); {os.cpu_count()} logical cores; "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads; GPU: {gpu}")


def cpu_has_fast_bf16() -> bool:
    """Native bf16 dot products: AVX-512 BF16 or AMX on x86, BF16 on Arm, where oneDNN's bf16 matmul
    is much faster than its fp32 one; AVX-512 without BF16 only emulates it."""
    cpu = torch.cpu
    try:
        if cpu._is_avx2_supported():  # x86
            return bool(cpu._is_avx512_bf16_supported() or cpu._is_amx_tile_supported())
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype (None: fp32) a valid precision name (config.Precision) means on `device`;
    refuses one the device cannot run."""
    if precision == "auto":
        if device.type == "cuda":
            # bf16 tensor cores from compute capability 8 (Ampere) on; older GPUs (T4, V100) only emulate it
            return torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
        if device.type == "cpu" and cpu_has_fast_bf16():
            return torch.bfloat16  # faster steps, the same validation accuracy
        return None  # MPS, and CPUs that would only emulate bf16
    if precision == "fp16" and device.type == "cpu":
        raise UsageError("--precision fp16 is not supported on CPU; use bf16 or fp32")
    if precision == "bf16" and device.type == "cpu" and not cpu_has_fast_bf16():
        raise UsageError("--precision bf16: this CPU has no native bf16 support; use fp32")
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def make_runtime(device: str = "auto", precision: str = "auto") -> Runtime:
    """Build the context; under torchrun (WORLD_SIZE > 1) also join the process group."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size > 1 and device.startswith("cuda:"):
        raise UsageError(f"--device {device} would put every process on one GPU; under torchrun pass --device cuda "
                         "or auto (each process takes the GPU of its LOCAL_RANK)")
    dev = resolve_device(device, local_rank)
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UsageError(f"process LOCAL_RANK={local_rank} has no GPU: this machine has {torch.cuda.device_count()}; "
                         "start at most that many processes a machine (torchrun --nproc-per-node)")
    if world_size > 1 and not torch.distributed.is_initialized():
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        backend = "nccl" if dev.type == "cuda" else "gloo"
        torch.distributed.init_process_group(backend=backend, device_id=dev if dev.type == "cuda" else None)
    return Runtime(dev, resolve_precision(precision, dev), rank, world_size, local_rank)


def shutdown(rt: Runtime) -> None:
    if rt.distributed and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
