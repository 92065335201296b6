"""The training optimizer: AdamW, fused where torch has the kernel, with optional lazy updates of
embedding tables; and gradient clipping that understands them.

Under `model.lazy_embeddings`, an `nn.Embedding(sparse=True)` gets a sparse gradient: only the rows
its batch looked up. `LazyAdamW` then updates just those rows, as TensorFlow's LazyAdam and torch's
SparseAdam do, instead of reading and writing every row of every table at every step. That is
faster, but it changes what the model learns (a row that a step does not use gets neither its
momentum nor weight decay), so it is off by default.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from transformer_cli.config import TrainConfig


class LazyAdamW(torch.optim.AdamW):
    """AdamW, except that a parameter with a sparse gradient is updated in its gradient's rows only.

    Those rows get AdamW's full update (moments, bias correction by the global step, decoupled
    weight decay); every other row, and its moments, stays as it is. Dense gradients get AdamW's
    own update, fused or foreach. The state has AdamW's layout, so checkpoints load either way.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        # A fused AdamW would take GradScaler's inf check into its kernel and skip only the dense
        # update; without this flag the scaler skips the whole step() instead.
        self._step_supports_amp_scaling = False

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sparse = [(group, p, p.grad) for group in self.param_groups for p in group["params"]
                  if p.grad is not None and p.grad.is_sparse]
        for _, p, _ in sparse:  # AdamW refuses sparse gradients and skips parameters without one
            p.grad = None
        try:
            super().step()
        finally:
            for _, p, grad in sparse:
                p.grad = grad
        for group, p, grad in sparse:
            self._lazy_update(group, p, grad.coalesce())
        return loss

    def _lazy_update(self, group: dict, p: torch.Tensor, grad: torch.Tensor) -> None:
        if group["amsgrad"] or group["maximize"]:
            raise ValueError("LazyAdamW's sparse update supports neither amsgrad nor maximize")
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


def make_optimizer(model: torch.nn.Module, tc: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """The training optimizer over the model's parameter groups: torch's AdamW, or LazyAdamW under
    `model.lazy_embeddings`. On CPU and CUDA it uses torch's fused AdamW kernel, one pass over each
    tensor instead of foreach's several."""
    fused = device.type in ("cpu", "cuda")
    cls = LazyAdamW if model.cfg.lazy_embeddings else torch.optim.AdamW
    return cls(model.param_groups(tc.weight_decay, tc.layer_lr_decay), lr=tc.lr, betas=(tc.beta1, tc.beta2),
               fused=fused, foreach=None if fused else True)
