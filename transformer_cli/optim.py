"""The training optimizer: AdamW, fused where torch has the kernel, fed sparse gradients by the
embedding tables; and gradient clipping that understands them.

A batch uses a few rows of the token embeddings and of the 4.2M-row n-gram table. As sparse
gradients, those rows cost little to compute and to clip, where a dense gradient must be
allocated and zeroed in full at every step. `SparseGradAdamW` then updates the tables either as
AdamW does, every row at every step (the default), or lazily, only the rows a step used
(`model.lazy_embeddings`; faster, but it changes what the model learns: README, Configuration
reference).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from transformer_cli.config import TrainConfig


class SparseGradAdamW(torch.optim.AdamW):
    """AdamW that also takes sparse gradients.

    `lazy=False`: a sparse gradient is scattered into a zeroed dense buffer kept between steps, and
    AdamW updates every row, exactly as with a dense gradient. `lazy=True`: only the gradient's rows
    get AdamW's update (moments, bias correction by the global step, decoupled weight decay);
    every other row, and its moments, stays as it is (LazyAdam). Dense gradients get AdamW's own
    update, fused or foreach. The state has AdamW's layout, so checkpoints load either way.
    """

    def __init__(self, params, lazy: bool = False, **kwargs):
        super().__init__(params, **kwargs)
        self.lazy = lazy
        self._buffers: dict[torch.Tensor, torch.Tensor] = {}  # parameter -> zeroed dense gradient
        # A fused AdamW would take GradScaler's inf check into its kernel and skip only the dense
        # update; without this flag the scaler skips the whole step() instead.
        self._step_supports_amp_scaling = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sparse = [(group, p, p.grad.coalesce()) for group in self.param_groups for p in group["params"]
                  if p.grad is not None and p.grad.is_sparse]
        for _, p, grad in sparse:  # AdamW refuses sparse gradients and skips parameters without one
            if self.lazy:
                p.grad = None
            else:
                buf = self._buffers.get(p)
                if buf is None:
                    buf = self._buffers[p] = torch.zeros_like(p)
                p.grad = buf.index_copy_(0, grad.indices()[0], grad.values())
        try:
            super().step()
        finally:
            for _, p, grad in sparse:
                if not self.lazy:
                    self._buffers[p].index_fill_(0, grad.indices()[0], 0.0)
                p.grad = grad
        if self.lazy:
            for group, p, grad in sparse:
                self._lazy_update(group, p, grad)
        return loss

    def _lazy_update(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        if group["amsgrad"] or group["maximize"]:
            raise ValueError("SparseGradAdamW's lazy update supports neither amsgrad nor maximize")
        state = self.state[p]
        if not state:
            on_device = group["fused"] or group["capturable"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        t = state["step"].item()
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        rows, g = grad.indices()[0], grad.values()  # (N,), (N, D): each row once
        m = state["exp_avg"].index_select(0, rows).lerp_(g, 1 - beta1)  # (N, D)
        v = state["exp_avg_sq"].index_select(0, rows).mul_(beta2).addcmul_(g, g, value=1 - beta2)  # (N, D)
        state["exp_avg"].index_copy_(0, rows, m)
        state["exp_avg_sq"].index_copy_(0, rows, v)
        w = p.index_select(0, rows).mul_(1 - lr * wd)  # (N, D)
        denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
        w.addcdiv_(m, denom, value=-lr / (1 - beta1**t))
        p.index_copy_(0, rows, w)


def clip_grad_norm_(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ that also takes sparse gradients (it coalesces them in place).

    Returns the total norm before clipping; `max_norm = inf` only measures it.
    """
    grads = []
    for p in params:
        if p.grad is None:
            continue
        if p.grad.is_sparse:  # repeated rows must be summed before their norm is taken
            p.grad = p.grad.coalesce()
            grads.append(p.grad._values())
        else:
            grads.append(p.grad)
    total = torch.nn.utils.get_total_norm(grads)
    if math.isfinite(max_norm):
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coef)
    return total


def make_optimizer(
    model: torch.nn.Module, tc: TrainConfig, device: torch.device, lazy: bool = False, fused: bool | None = None
) -> SparseGradAdamW:
    """The training optimizer over the model's parameter groups; it also sets how the model's
    embedding tables return gradients.

    Sparse gradients on the CPU, or with `lazy`; dense ones on GPUs otherwise (NCCL's all-reduce of
    sparse tensors is not tested here). `fused` (default: on CPU and CUDA) uses torch's fused
    AdamW kernel, one pass over each tensor instead of foreach's several.
    """
    for table in model.embedding_tables():
        table.sparse = lazy or device.type == "cpu"
    if fused is None:
        fused = device.type in ("cpu", "cuda")
    return SparseGradAdamW(model.param_groups(tc.weight_decay), lazy=lazy, lr=tc.lr, betas=(tc.beta1, tc.beta2),
                           fused=fused, foreach=None if fused else True)
