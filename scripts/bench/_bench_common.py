"""Helpers shared by the bench_*.py scripts: hardware header, matmul peak, FLOP count, subprocess
timing, tables, target checks, JSON.

Not a benchmark itself. The scripts import it as `_bench_common` (scripts/bench is on
sys.path when a script is run as `python scripts/bench/bench_X.py`).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[2]
# In-process timings are of this checkout's transformer_cli, not of another copy that is installed
# (the subprocesses get the same through child_env's PYTHONPATH).
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
# The local IMDB copy beside the checkout, as an absolute path: the same files from any working folder.
DEFAULT_DATA = str(REPO.parent / "shared" / "data" / "imdb")
now = time.perf_counter


# --------------------------------------------------------------------------- hardware


def _cpuinfo(key: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def hardware_info() -> dict:
    """What the numbers were measured on, and how busy the machine was when the run started."""
    import torch

    from transformer_cli.runtime import cpu_has_fast_bf16

    flags = set(_cpuinfo("flags").split())
    simd = sorted(f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "avx_vnni"))
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "cpu": _cpuinfo("model name") or platform.processor() or "unknown",
        "logical_cpus": os.cpu_count(),
        "usable_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "simd": " ".join(simd) or "no avx2/avx512/amx",
        "native_bf16": cpu_has_fast_bf16(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def print_header(title: str, info: dict) -> None:
    load = info["loadavg_1_5_15"]
    print(f"== {title}\n"
          f"date     {info['date']}\n"
          f"cpu      {info['cpu']} ({info['usable_cpus']} usable of {info['logical_cpus']} logical CPUs); "
          f"{info['simd']}; native bf16: {'yes' if info['native_bf16'] else 'no'}\n"
          f"torch    {info['torch']}, {info['torch_threads']} threads; python {info['python']}\n"
          f"load     {load[0]} {load[1]} {load[2]} (1/5/15 min; above 0 before the run = other jobs share the CPUs, "
          "so compare only figures taken in the same run)\n")


def set_threads(n: int | None) -> None:
    if n:
        import torch

        torch.set_num_threads(n)


# --------------------------------------------------------------------------- compute


def synchronize(device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously), so that a clock read after it
    counts that work; nothing to wait for on a CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def dtype_name(dtype) -> str:
    """torch.float32 -> "fp32", torch.bfloat16 -> "bf16", as tfm names precisions."""
    return str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")


class MatmulPeak:
    """GFLOP/s of a square torch.mm (fp32, or `dtype`) with this process's threads, or on `device`:
    the ceiling a run's figures are compared with. Call `sample()` between the measured steps
    (interleaved, so that it sees the same contention from other jobs as they do); `gflops` is the
    median. n doubles from 256 up to `max_n`, but not to a size whose product would take over a
    second."""

    def __init__(self, max_n: int = 2048, dtype=None, device: str = "cpu"):
        import torch

        self.dtype, self.device = dtype or torch.float32, torch.device(device)
        n = 256
        while True:
            self.a, self.b = (torch.randn(n, n, device=self.device).to(self.dtype) for _ in range(2))
            self.out = torch.empty(n, n, dtype=self.dtype, device=self.device)
            torch.mm(self.a, self.b, out=self.out)  # warm-up: primitive creation, page faults
            t0 = self._now()
            torch.mm(self.a, self.b, out=self.out)
            if n >= max_n or 8 * (self._now() - t0) > 1.0:
                break
            n *= 2
        self.n, self.times = n, []

    def _now(self) -> float:
        synchronize(self.device)
        return now()

    def sample(self, repeats: int = 1) -> None:
        import torch

        for _ in range(repeats):
            t0 = self._now()
            torch.mm(self.a, self.b, out=self.out)
            self.times.append(self._now() - t0)

    @property
    def gflops(self) -> float:
        return 2 * self.n**3 / statistics.median(self.times) / 1e9

    def describe(self) -> str:
        where = "" if self.device.type == "cpu" else f" on {self.device}"
        return (f"{dtype_name(self.dtype)} torch.mm {self.n}x{self.n}x{self.n}{where}: {self.gflops:.1f} GFLOP/s "
                f"(median of {len(self.times)})")

    def as_dict(self) -> dict:
        return {"dtype": str(self.dtype), "n": self.n, "gflops": self.gflops, "samples": len(self.times),
                "sec_all": self.times}


# The op groups of a profile, by the first match in an op's name; "other" takes the rest.
OP_GROUPS = {
    # (b), _explicit: bmm, softmax; transformer_cli.kernels' bf16 attention, recorded by name
    "attention kernels": ("scaled_dot_product", "aten::bmm", "aten::_softmax", "tfm::attention_bf16"),
    "linear-layer matmuls": ("aten::mm", "aten::addmm"),
    "casts and copies": ("aten::copy_", "aten::_to_copy"),
    "optimizer": ("adam",),
}


def op_group(name: str) -> str:
    return next((g for g, keys in OP_GROUPS.items() if any(k in name.lower() for k in keys)), "other")


def profile_ops(run, title: str, per: int, unit: str, top: int = 8) -> dict:
    """Runs `run()` under torch.profiler and prints where its ops' self CPU time went: the share of
    each group (OP_GROUPS) and the `top` ops, in ms per `unit` (`per` units in the run). Self time
    of the ops in every thread; an op's own intra-op threads are not counted twice."""
    import torch

    try:  # without it, ops in threads other than this one (tfm evaluate's CPU workers) go unseen
        extra = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):  # a torch before the option: this thread's ops only
        extra = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], **extra) as prof:
        run()
    ops = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(t for _, t in ops)
    groups = {g: 0.0 for g in [*OP_GROUPS, "other"]}
    for name, t in ops:
        groups[op_group(name)] += 100 * t / total
    top_ops = [{"op": name, "group": op_group(name), "pct": 100 * t / total, f"ms_per_{unit}": t / 1e3 / per}
               for name, t in sorted(ops, key=lambda o: -o[1])[:top]]
    print(f"   {title}: share of self CPU time ({total / 1e3 / per:.1f} ms a {unit}): "
          + ", ".join(f"{g} {pct:.1f}%" for g, pct in groups.items()))
    print_table(top_ops, [("op", "op"), ("group", "group"), (f"ms_per_{unit}", f"ms/{unit}"), ("pct", "%")],
                digits={f"ms_per_{unit}": 2})
    return {f"self_cpu_ms_per_{unit}": total / 1e3 / per, "groups_pct": groups, "top": top_ops}


def forward_flops(d_model: int, n_layers: int, ff_mult: int, batch: int, seq: int, num_classes: int = 2) -> float:
    """FLOPs of one forward pass of the encoder classifier over a padded (batch, seq) batch.

    Per layer: 2 * (4 + 2 * ff_mult) * d^2 per token for the Q/K/V, output and feed-forward
    matmuls, and 4 * T^2 * d per sequence for Q K^T and (attention) V; plus the head. Embedding
    look-ups, norms, softmax and activations are left out (memory-bound, few FLOPs).
    """
    tokens = batch * seq
    per_layer = 2.0 * (4 + 2 * ff_mult) * d_model**2 * tokens + 4.0 * batch * seq**2 * d_model
    return n_layers * per_layer + 2.0 * batch * d_model * num_classes


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM) in MB. (getrusage's ru_maxrss is not used: on
    Linux a child started by a large parent inherits the parent's figure at exec.)"""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


# --------------------------------------------------------------------------- subprocesses


def child_env(extra: dict | None = None) -> dict:
    """This environment, offline (children must never reach for the Hub), with this checkout first on
    PYTHONPATH (a child imports the transformer_cli being benchmarked, not an installed copy), plus `extra`."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONPATH": path, **(extra or {})}


def run_timed(cmd: Sequence[str], env: dict | None = None,
              cwd: str | Path = REPO) -> tuple[float, subprocess.CompletedProcess]:
    """(wall seconds, completed process) of one subprocess run in `cwd` (default: the repository, so
    paths in `cmd` must be absolute), output captured. A failed one raises child_failed's error."""
    t0 = now()
    proc = subprocess.run(list(cmd), env=env or child_env(), cwd=cwd, capture_output=True, text=True, check=False)
    wall = now() - t0
    if proc.returncode != 0:
        raise child_failed(cmd, proc.returncode, proc.stderr)
    return wall, proc


def child_failed(cmd: Sequence[str], code: int, stderr: str) -> Exception:
    """The TfmError for a child process that exited with `code`: the last line it wrote on stderr
    (a tfm error says it there), and its exit code where that is tfm's (1 runtime, 2 usage)."""
    from transformer_cli.errors import TfmError

    last = (stderr.strip().splitlines() or ["no message"])[-1]
    error = TfmError(f"`{' '.join(cmd)}` exited with {code}: {last}")
    error.exit_code = code if code in (1, 2) else 1
    return error


def run_script(main: Callable[[], int | None]) -> NoReturn:
    """Run a script's main() and exit with its code; bad input (a TfmError: a missing model, dataset
    or config) ends it with one line on stderr and the error's exit code (1 runtime, 2 usage)."""
    from transformer_cli.errors import TfmError

    try:
        code = main()
    except TfmError as e:
        print(f"{Path(sys.argv[0]).stem}: error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    sys.exit(code or 0)


def last_json_line(text: str) -> dict:
    for line in reversed(text.strip().splitlines()):
        if line.strip().startswith("{"):
            return json.loads(line)
    raise ValueError(f"no JSON line in child output:\n{text[-2000:]}")


# --------------------------------------------------------------------------- output


def fmt(value, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def print_table(rows: list[dict], columns: list[tuple[str, str]], digits: dict[str, int] | None = None) -> None:
    """rows of dicts; columns = [(key, header)]; numbers right-aligned, text left-aligned."""
    digits = digits or {}
    cells = [[fmt(r.get(k), digits.get(k, 1)) for k, _ in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]
    numeric = [all(isinstance(r.get(k), (int, float)) or r.get(k) is None for r in rows) for k, _ in columns]

    def line(values):
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)).rstrip()

    print(line([h for _, h in columns]))
    print(line(["-" * w for w in widths]))
    for c in cells:
        print(line(c))


def check(what: str, value: float, target: float, unit: str = "", higher_is_better: bool = True) -> dict:
    """Print one target line, e.g. `target  (a)/(b) synthetic: 1.67x (target >= 5x): NOT MET`."""
    ok = value >= target if higher_is_better else value <= target
    sign = ">=" if higher_is_better else "<="
    print(f"target  {what}: {value:.3g}{unit} (target {sign} {target:g}{unit}): {'met' if ok else 'NOT MET'}")
    return {"what": what, "value": value, "target": target, "met": ok}


def write_json(path: str | Path | None, obj: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(obj, indent=2, default=str) + "\n")
        print(f"\nwrote {path}")
