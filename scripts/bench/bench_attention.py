"""Attention kernels on this CPU, against the matmul peak: how much faster attention could get.

What it measures
    For each shape (--shapes B,H,T,Dh;...) and precision (fp32, and bf16 on a CPU with native bf16,
    or with --bf16), one process times, on the same inputs, with a (B, 1, 1, T) padding mask as the
    model passes it (the last --pad-fraction of the keys of every other row are padding):
      fused     F.scaled_dot_product_attention: torch's CPU flash kernel
      explicit  transformer_cli.model.explicit_attention: softmax(q k^T / sqrt(Dh)) v, written out
      kernel    transformer_cli.kernels.attention_bf16, what `tfm evaluate` and `tfm predict` run
                under bf16 (bf16 only, forward only, where it is available; it reads q, k and v from
                one (B, T, 3 H Dh) tensor, as the model's fused projection gives them, built before
                timing, and writes (B, T, H Dh))
    each forward alone (under torch.inference_mode) and forward + backward, interleaved over
    --repeats rounds after an untimed one, median. A torch.mm peak in each precision is timed
    between the rounds.

How to read the table
    ms          median wall time of one call over the whole (B, H, T, Dh) batch
    GFLOP/s     the attention's matmul FLOPs / time: forward 4 B H T^2 Dh (q k^T and p v), forward +
                backward 12 B H T^2 Dh (also dP, dV, dQ, dK). Softmax and the flash kernel's
                recomputation of q k^T in its backward are not counted: this is useful work
    % peak      GFLOP/s over the torch.mm peak in the row's precision
    vs fp32     the row's time over the same kernel and pass in fp32 (bf16 rows; for `kernel`, over
                fused in fp32, what the model runs without it)
    A kernel that did only these matmuls at the peak would be (100 / % peak) times faster than the
    row: the most any kernel of that precision could gain. The softmax around the matmuls (exp on
    T^2 scores per head) is not free either, so the real room is smaller.
    The fused and explicit outputs of each shape and precision are compared (max |difference|),
    a check that both compute the same attention; `kernel`'s output against fp32 fused's, over the
    rows up to each sequence's last real token (the kernel leaves the rows after it zero).

Examples
    python scripts/bench/bench_attention.py                                    # the default shapes
    python scripts/bench/bench_attention.py --shapes 32,2,512,32 --repeats 3 --json attn.json
"""

from __future__ import annotations

import argparse
import statistics

import _bench_common as bc
import torch
import torch.nn.functional as F

# The sizes (8 heads of 16, T=256) and the default model's heads (2 of 32) at two lengths.
DEFAULT_SHAPES = "32,8,256,16;32,2,256,32;32,2,1024,32"
PASSES = {"forward": 4, "forward+backward": 12}  # matmul FLOPs per B H T^2 Dh


def parse_args(argv=None) -> argparse.Namespace:
    from transformer_cli.runtime import cpu_has_fast_bf16

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=DEFAULT_SHAPES, metavar="B,H,T,Dh;...")
    p.add_argument("--pad-fraction", type=float, default=0.0, help="share of keys that are padding in every other row")
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds (median)")
    p.add_argument("--bf16", action="store_true", help="also bf16 on a CPU without native bf16 (emulated, slow)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write all results as JSON")
    args = p.parse_args(argv)
    try:
        args.shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes.split(";") if s.strip()]
    except ValueError:
        p.error(f"--shapes {args.shapes!r}: give B,H,T,Dh groups of integers separated by ';'")
    if not args.shapes or any(len(s) != 4 or min(s) < 1 for s in args.shapes):
        p.error(f"--shapes {args.shapes}: each shape is four positive integers B,H,T,Dh")
    if not 0 <= args.pad_fraction < 1 or args.repeats < 1:
        p.error("--pad-fraction must be in [0, 1) and --repeats at least 1")
    args.dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 or cpu_has_fast_bf16() else [])
    return args


def key_mask(B: int, T: int, pad_fraction: float) -> torch.Tensor:
    mask = torch.ones(B, 1, 1, T, dtype=torch.bool)  # (B, 1, 1, T), True at real keys
    mask[1::2, ..., T - int(pad_fraction * T) :] = False  # every other row padded at its end; [CLS] stays
    mask[:, ..., 0] = True
    return mask


def kernels():
    from transformer_cli.model import explicit_attention

    return {"fused": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            "explicit": explicit_attention}


def cpu_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor):
    """transformer_cli.kernels.attention_bf16 on these (B, H, T, Dh) inputs, as a call with no
    arguments (they are packed into the model's (B, T, 3C) layout here, untimed), or None where it
    does not run."""
    from transformer_cli import kernels as cpu_kernels

    if not cpu_kernels.available() or q.size(-1) not in cpu_kernels.HEAD_SIZES:
        return None
    B, H, T, Dh = q.shape
    qkv = torch.cat([x.transpose(1, 2).reshape(B, T, H * Dh) for x in (q, k, v)], dim=2).bfloat16()  # (B, T, 3C)
    keys = mask.reshape(B, T)  # (B, T)

    def call() -> torch.Tensor:
        with torch.inference_mode():
            return cpu_kernels.attention_bf16(qkv, keys, H)

    return call


def timed_call(fn, q, k, v, mask, grad, backward: bool) -> float:
    if backward:
        q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
        t0 = bc.now()
        fn(q, k, v, mask).backward(grad)
        return bc.now() - t0
    with torch.inference_mode():
        t0 = bc.now()
        fn(q, k, v, mask)
        return bc.now() - t0


def run_shape(shape: tuple[int, int, int, int], args) -> tuple[dict, dict]:
    """(this shape's results, its matmul peaks)."""
    B, H, T, Dh = shape
    peaks = {bc.dtype_name(dt): bc.MatmulPeak(dtype=dt) for dt in args.dtypes}  # timed between this shape's rounds
    g = torch.Generator().manual_seed(args.seed)
    q32, k32, v32, grad32 = (torch.randn(B, H, T, Dh, generator=g) for _ in range(4))
    mask = key_mask(B, T, args.pad_fraction)
    fns = kernels()
    cases = [(dt, name, p) for dt in args.dtypes for name in fns for p in PASSES]
    inputs = {dt: tuple(x.to(dt) for x in (q32, k32, v32, grad32)) for dt in args.dtypes}
    diffs = {}
    for dt in args.dtypes:  # both kernels compute the same attention; also the warm-up
        q, k, v, _ = inputs[dt]
        with torch.inference_mode():
            diffs[dt] = (fns["fused"](q, k, v, mask).float() - fns["explicit"](q, k, v, mask).float()).abs().max().item()
    packed = cpu_kernel(q32, k32, v32, mask) if torch.bfloat16 in args.dtypes else None
    if packed is not None:
        cases.append((torch.bfloat16, "kernel", "forward"))
        fns["kernel"] = lambda q, k, v, m: packed()  # its own packed inputs
        with torch.inference_mode():
            fused = fns["fused"](q32, k32, v32, mask).transpose(1, 2).reshape(B, T, H * Dh)  # (B, T, C)
        rows_run = torch.arange(T)[None, :] <= mask.reshape(B, T).cumsum(1).argmax(1)[:, None]  # to the last real key
        diffs["kernel"] = (packed().float() - fused)[rows_run].abs().max().item()
    times: dict[tuple, list[float]] = {c: [] for c in cases}
    for r in range(1 + args.repeats):  # round 0 untimed: first calls (oneDNN primitives, buffers)
        for dt, name, p in cases:
            q, k, v, grad = inputs[dt]
            sec = timed_call(fns[name], q, k, v, mask, grad, p != "forward")
            if r:
                times[(dt, name, p)].append(sec)
        if r:
            for peak in peaks.values():
                peak.sample()
    rows = []
    for dt, name, p in cases:
        sec = statistics.median(times[(dt, name, p)])
        gflops = PASSES[p] * B * H * T * T * Dh / sec / 1e9
        prec = bc.dtype_name(dt)
        rows.append({"shape": f"{B}x{H}x{T}x{Dh}", "precision": prec, "kernel": name, "pass": p, "ms": 1e3 * sec,
                     "gflops": gflops, "pct_peak": 100 * gflops / peaks[prec].gflops})
    fp32 = {(r["kernel"], r["pass"]): r["ms"] for r in rows if r["precision"] == "fp32"}
    for r in rows:
        r["vs_fp32"] = r["ms"] / fp32[("fused" if r["kernel"] == "kernel" else r["kernel"], r["pass"])]
    diffs = {k if isinstance(k, str) else bc.dtype_name(k): d for k, d in diffs.items()}
    return {"shape": list(shape), "max_abs_diff": diffs, "rows": rows,
            "matmul_peaks": {name: p.as_dict() for name, p in peaks.items()}}, peaks


def main(argv=None) -> None:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    info = bc.hardware_info()
    bc.print_header("bench_attention: attention kernels against the matmul peak", info)
    results = {"hardware": info, "args": {**vars(args), "dtypes": [bc.dtype_name(d) for d in args.dtypes]}, "shapes": []}
    for shape in args.shapes:
        res, peaks = run_shape(shape, args)
        rows, diffs = res["rows"], res["max_abs_diff"]
        B, H, T, Dh = shape
        print(f"-- B={B}, {H} heads of {Dh}, T={T}, padding mask ({args.pad_fraction:.0%} of the keys of every "
              f"other row padded); {args.repeats} rounds; max |fused - explicit|: "
              + ", ".join(f"{p} {d:.2g}" for p, d in diffs.items() if p != "kernel")
              + (f"; max |kernel - fp32 fused|: {diffs['kernel']:.2g}" if "kernel" in diffs else ""))
        bc.print_table(rows, [("precision", "precision"), ("kernel", "kernel"), ("pass", "pass"), ("ms", "ms"),
                              ("gflops", "GFLOP/s"), ("pct_peak", "% peak"), ("vs_fp32", "vs fp32")],
                       digits={"ms": 2, "vs_fp32": 2})
        best = {}
        for r in rows:
            key = (r["precision"], r["pass"])
            if key not in best or r["ms"] < best[key]["ms"]:
                best[key] = r
        for (prec, p), r in best.items():
            print(f"   {prec} {p}: the faster kernel ({r['kernel']}) is at {r['pct_peak']:.0f}% of the {prec} peak; "
                  f"one doing only its matmuls at the peak would be {100 / r['pct_peak']:.1f}x faster")
        for peak in peaks.values():
            print(f"   peak: {peak.describe()}, between this shape's rounds")
        print()
        results["shapes"].append(res)
    bc.write_json(args.json, results)


if __name__ == "__main__":
    bc.run_script(main)
