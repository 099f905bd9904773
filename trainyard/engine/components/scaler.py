"""Dynamic loss scaling for float16 training whose gradients are sharded (MiCS/FSDP2, TP, PP DTensors).

    scaler = GradScaler(model.parameters)       # te.scaler(model) returns the transformed model's own
    scaler.scale(loss).backward()               # the loss times the scale: small fp16 gradients do not underflow
    scaler.unscale_()                           # gradients / scale; inf/nan looked for on every shard of every rank
    clip(...)                                   # on the unscaled gradients
    stepped = scaler.step(optimizer)            # optimizer.step(), or skipped (False) when any rank found inf/nan
    scaler.update()                             # backoff after a skipped step, growth after growth_interval clean ones

The rules are torch.amp.GradScaler's (same defaults: scale 2^16, x2 after 2,000 clean steps, x0.5 on overflow,
`torch._amp_foreach_non_finite_check_and_unscale_` on each device's gradients). Why not torch's own
(`ShardedGradScaler`): it unscales per optimizer (the engine's `clip_grad_norm_` knows the model, not the
optimizer), it runs the check on DTensors, whose handler reduces a flag over each gradient's own mesh (one
collective per device and dtype, and the ranks of other pipeline stages are on other meshes), and its state is
Python numbers (checkpoints hold tensors only). This one reads each gradient's local shard (`to_local()`: the
same storage, so unscaling it unscales the DTensor), and agrees on one flag with ONE all-reduce (MAX) over the
whole job (the default process group): a shard that overflows on one rank skips the step on every rank.

Disabled (`enabled=False`: any precision but float16), it is a pass-through: `scale(loss)` is `loss`, `step`
always steps, so one loop serves every precision.
"""
from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

INIT_SCALE = 2.0 ** 16  # torch.amp.GradScaler's: large enough that fp16 gradients rarely underflow at the start
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000  # clean steps before the scale grows again (torch's default)


class GradScaler:
    """Loss scaling over the gradients of `parameters` (a callable returning them: FSDP2 swaps a model's parameter
    objects between sharded and unsharded, so they are read when needed). `group`: the processes that agree on
    a skip (None: the whole job, the default process group). `device`: where the flag is all-reduced (NCCL needs
    a GPU tensor even when gradients live in host memory under CPU offload)."""

    def __init__(self, parameters: Callable[[], Iterable[torch.Tensor]], *, enabled: bool = True,
                 init_scale: float = INIT_SCALE, growth_factor: float = GROWTH_FACTOR,
                 backoff_factor: float = BACKOFF_FACTOR, growth_interval: int = GROWTH_INTERVAL,
                 device: torch.device | str = "cpu", group: dist.ProcessGroup | None = None) -> None:
        if not init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {init_scale!r}")
        if not growth_factor > 1:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        self.parameters, self.enabled = parameters, enabled
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.device, self.group = torch.device(device), group
        self._scale = float(init_scale)
        self.growth_tracker = 0
        """Clean steps since the scale last changed."""
        self.skipped_steps = 0
        """Steps skipped for inf/nan gradients over the whole run (saved in checkpoints)."""
        self.found_inf: bool | None = None
        """This step's verdict once `unscale_` ran (None before): whether any rank found inf/nan."""

    def get_scale(self) -> float:
        """The loss scale of the current step (1.0 when disabled)."""
        return self._scale if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss` times the scale (`loss` itself when disabled)."""
        if not self.enabled:
            return loss
        if self.found_inf is not None:
            raise RuntimeError("loss scaling: a new step's loss was scaled before the last step was ended (its gradients "
                               "were unscaled but update() never ran): end each step with te.optimizer_step(model, "
                               "opt), or scaler.step(opt) and scaler.update()")
        return loss * self._scale

    def unscale_(self) -> bool:
        """Divide every gradient by the scale and decide, over all ranks, whether any is inf or nan (a collective
        when distributed; every rank calls it). Once per step: a second call returns the verdict. Returns True
        when the step must be skipped."""
        if not self.enabled:
            return False
        if self.found_inf is not None:
            return self.found_inf
        inv_scale = torch.tensor(1.0 / self._scale, dtype=torch.float32)  # a power of two: exact
        by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
        for p in self.parameters():
            g = p.grad
            if g is None:
                continue
            local = g.to_local() if isinstance(g, DTensor) else g
            if local.numel():
                by_device.setdefault(local.device, {}).setdefault(local.dtype, []).append(local)
        flag = torch.zeros(1, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for device, per_dtype in by_device.items():
                found = torch.zeros(1, dtype=torch.float32, device=device)
                inv = inv_scale.to(device)
                for grads in per_dtype.values():
                    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
                flag += found.to(self.device)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        self.found_inf = bool(flag.item() > 0)
        return self.found_inf

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """`optimizer.step()` unless a gradient of any rank is inf/nan (unscaling first if `unscale_` was not
        called this step). Returns whether the optimizer stepped."""
        if not self.enabled:
            optimizer.step()
            return True
        if self.unscale_():
            self.skipped_steps += 1
            return False
        optimizer.step()
        return True

    def update(self) -> None:
        """End the step: after inf/nan, scale x backoff_factor; after growth_interval clean steps in a row, scale
        x growth_factor."""
        if not self.enabled:
            return
        if self.found_inf is None:
            raise RuntimeError("update() before unscale_() or step(): no inf/nan check was made this step")
        if self.found_inf:
            self._scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self._scale *= self.growth_factor
                self.growth_tracker = 0
        self.found_inf = None

    # checkpoints hold tensors only (components/checkpoint): the scale in float64 (exact for powers of two)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"scale": torch.tensor(self._scale, dtype=torch.float64),
                "growth_tracker": torch.tensor(self.growth_tracker, dtype=torch.int64),
                "skipped_steps": torch.tensor(self.skipped_steps, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self._scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        self.skipped_steps = int(state["skipped_steps"])
        self.found_inf = None

    def __repr__(self) -> str:
        if not self.enabled:
            return "GradScaler(disabled)"
        return (f"GradScaler(scale={self._scale:g}, growth_tracker={self.growth_tracker}/{self.growth_interval}, "
                f"skipped_steps={self.skipped_steps})")
