"""A hand-written CPU kernel for inference: attention with AVX-512 BF16 dot products (csrc/attention_bf16.c).

torch's CPU attention kernels are slow at small head sizes, whose matmuls have an inner dimension
of only 16 or 32. This kernel computes q k^T and p v with the vdpbf16ps instruction and the softmax
in fp32, which is much faster there than torch's fp32 flash kernel. Under bf16 autocast q, k and v
come out of the projection in bf16 and the output projection reads its input in bf16, so next to
the fp32 path it rounds only the attention probabilities to bf16. It takes the texts padded
(`attention_bf16`) or end to end without padding (`attention_bf16_packed`, for `model.Packed`).

The C source is compiled on first use with the system's C compiler (`$CC`, else cc, gcc or clang)
into a shared library in the `kernels` folder of `$TFM_CACHE` (default
~/.cache/transformer_cli), named by a hash of the source, compiler and flags, and loaded with
ctypes, which releases the GIL during the call. Without x86-64 Linux, AVX-512 BF16 or a compiler,
or with TFM_CPU_KERNELS=0, `attention_bf16` returns None and the model uses
F.scaled_dot_product_attention; `unavailable_reason()` says why.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import torch

from transformer_cli.fileio import cache_dir

SOURCE = Path(__file__).with_name("csrc") / "attention_bf16.c"
FLAGS = ["-O3", "-fno-strict-aliasing", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma",
         "-shared", "-fPIC", "-pthread"]  # no strict aliasing: bf16 pairs are read as 32-bit words
HEAD_SIZES = (16, 32, 64)

enabled = os.environ.get("TFM_CPU_KERNELS", "1") != "0"  # False: attention_bf16 always returns None
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernel is unavailable; None: not tried yet, or loaded


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def _build() -> ctypes.CDLL:
    """The compiled library, built into the cache unless it is there; raises OSError saying why not."""
    if not sys.platform.startswith("linux") or platform.machine().lower() not in ("x86_64", "amd64"):
        raise OSError(f"built for x86-64 Linux only, not {sys.platform} {platform.machine()}")
    if not getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        raise OSError("this CPU has no AVX-512 BF16 instructions")
    cc = _compiler()
    if cc is None:
        raise OSError("no C compiler found (set CC, or install gcc or clang)")
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"attention_bf16-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")  # renamed into place once whole
        try:
            cmd = [cc, *FLAGS, str(SOURCE), "-o", str(tmp)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
            if proc.returncode != 0:
                lines = (proc.stderr or proc.stdout).strip().splitlines()
                raise OSError(f"{cc} failed: {lines[0] if lines else f'exit code {proc.returncode}'}")
            os.replace(tmp, path)
        except subprocess.TimeoutExpired as e:
            raise OSError(f"{cc} took over {e.timeout:.0f} s") from e
        finally:
            tmp.unlink(missing_ok=True)
    lib = ctypes.CDLL(str(path))
    for fn in (lib.tfm_attention_bf16, lib.tfm_attention_bf16_packed):
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int] * 5
    return lib


def _load() -> ctypes.CDLL | None:
    global _lib, _reason
    if _lib is None and _reason is None:
        with _lock:
            if _lib is None and _reason is None:
                try:
                    _lib = _build()
                except OSError as e:
                    _reason = str(e)
    return _lib


def available() -> bool:
    return enabled and _load() is not None


def unavailable_reason() -> str | None:
    if not enabled:
        return "turned off (TFM_CPU_KERNELS=0)"
    _load()
    return _reason


def attention_bf16(qkv: torch.Tensor, mask: torch.Tensor, n_heads: int) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(Dh)) v with padding keys masked, for inference: (B, T, 3C) bf16 fused
    projections and a (B, T) bool mask -> (B, T, C) bf16 with the heads merged; rows after a
    sequence's last real token are zero. None when the kernel cannot take these inputs (use SDPA)."""
    B, T, C3 = qkv.shape
    lib = _library_for(qkv, n_heads)
    if lib is None or mask.dtype != torch.bool:
        return None
    mask = mask.contiguous().view(torch.uint8)  # (B, T)
    return _call(lib.tfm_attention_bf16, qkv, mask, (B, T, C3 // 3), B, T, n_heads)


def attention_bf16_packed(qkv: torch.Tensor, offsets: torch.Tensor, longest: int, n_heads: int
                          ) -> torch.Tensor | None:
    """attention_bf16 for texts laid end to end without padding: (N, 3C) bf16 fused projections, text b
    being rows offsets[b]:offsets[b + 1] ((B + 1,) int64), the longest of `longest` rows -> (N, C) bf16,
    each text attending to itself. None when the kernel cannot take these inputs."""
    N, C3 = qkv.shape
    lib = _library_for(qkv, n_heads)
    if lib is None or offsets.dtype != torch.int64 or offsets.device.type != "cpu":
        return None
    return _call(lib.tfm_attention_bf16_packed, qkv, offsets.contiguous(), (N, C3 // 3), len(offsets) - 1, longest,
                 n_heads)


def _library_for(qkv: torch.Tensor, n_heads: int) -> ctypes.CDLL | None:
    """The loaded library if the kernel can take these projections (bf16 on the CPU, inference, a head
    size it has), else None."""
    C = qkv.size(-1) // 3
    if (
        not enabled
        or qkv.device.type != "cpu"
        or qkv.dtype != torch.bfloat16
        or torch.is_grad_enabled()
        or C % n_heads
        or C // n_heads not in HEAD_SIZES
        or torch.compiler.is_compiling()
    ):
        return None
    return _load()


def _call(fn, qkv: torch.Tensor, where: torch.Tensor, out_shape: tuple[int, ...], B: int, T: int, n_heads: int
          ) -> torch.Tensor | None:
    qkv = qkv.contiguous()
    out = torch.empty(out_shape, dtype=torch.bfloat16)
    C = out_shape[-1]
    with torch.profiler.record_function("tfm::attention_bf16"):  # named in torch.profiler's tables
        status = fn(qkv.data_ptr(), where.data_ptr(), out.data_ptr(), B, T, n_heads, C // n_heads,
                    torch.get_num_threads())
    return out if status == 0 else None
