"""What a checkpoint holds, as tensors only (nothing pickled): model and optimizer through DCP's state-dict API
("app": sharded as DTensors, so a load reshards; the optimizer's settings packed as float64 tensors), the step
and the LR scheduler's numbers ("trainer"), a user's extra numbers ("extra"), and a float16 run's loss scaler
("scaler": any Stateful whose state is tensors, components/scaler.py); and the model's shape beside it
(`model.json`, for `trainyard checkpoint export`)."""
from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.checkpoint.stateful import Stateful

from trainyard.engine.components.checkpoint.locations import filesystem

# Optimizer state keyed by parameter name, param-group settings included ("param_groups.<name>.lr"):
# with pipeline parallelism every rank holds different parameters, and a nested "param_groups" list
# would be one key that DCP saves once, from one rank, for all of them.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class ModelOptimState(Stateful):
    """Model and optimizer through DCP's state-dict API (FSDP2-aware, reshards on load). `only`: the model entries
    saved or loaded (the trainable parameters of a fine-tuning run; None: all); the others are left as they are."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, only: set[str] | None = None,
                 optim_saved: bool | None = None) -> None:
        # optim_saved: on a load, whether the step holds optimizer state (None on a save)
        self.model, self.optimizer, self.only, self.optim_saved = model, optimizer, only, optim_saved

    def _model(self, model_sd: dict[str, Any]) -> dict[str, Any]:
        return model_sd if self.only is None else {k: v for k, v in model_sd.items() if k in self.only}

    def _with_optim(self) -> bool:
        """Whether the optimizer's state is saved, or loaded. An optimizer that holds parameters but has not stepped
        has none, and none is saved: DCP's get_state_dict would make some with a step at learning rate 0 when no
        gradient is set (Adam's step count then one ahead of a run that did not save: other weights from then on),
        and save none when one is (a step that then failed to load). A load of such a step leaves the optimizer
        without state, as it was."""
        opt = self.optimizer
        if opt is None:
            return False
        if self.optim_saved is not None:
            return self.optim_saved
        return bool(opt.state) or not any(g["params"] for g in opt.param_groups)

    def state_dict(self) -> dict[str, Any]:
        if not self._with_optim():  # weights only: the model's entries alone are saved or requested
            return {"model": self._model(get_model_state_dict(self.model, options=_OPTIONS))}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        # what a load that follows (DCP asks for the state it loads into first) takes the settings' types from:
        # the live state, unchanged in between; a second get_state_dict cost a tenth of a 120 MB load
        self._template = optim_sd
        return {"model": self._model(model_sd), "optim": to_tensors(optim_sd)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        options = _OPTIONS if self.only is None else _PARTIAL
        if not self._with_optim():
            set_model_state_dict(self.model, state_dict["model"], options=options)
            if self.optimizer is not None:  # saved before its first step: it had no state
                self.optimizer.state.clear()
            return
        template = self.__dict__.pop("_template", None)
        if template is None:
            _, template = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=from_tensors(state_dict["optim"], template), options=options)


_PARTIAL = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)


def trainable_names(model: nn.Module) -> set[str]:
    """The state-dict names of the parameters that train (requires_grad)."""
    return {name for name, p in model.named_parameters() if p.requires_grad}


def saved_model_names(metadata) -> set[str]:
    """The model entries a step's DCP metadata holds."""
    head = "app.model."
    return {k[len(head):] for k in metadata.state_dict_metadata if k.startswith(head)}


_GROUP_PREFIX = "param_groups."


def to_tensors(flat: dict[str, Any]) -> dict[str, Any]:
    """A flat optimizer state dict as tensors only. The settings DCP repeats for every parameter
    (`param_groups.<name>.lr`, `.betas`, ...) are packed into one float64 vector per parameter, in the
    sorted order of their names (float64 holds the float32/float64 settings, integers and booleans
    exactly); None settings are left out. Other values are already tensors."""
    out: dict[str, Any] = {}
    packs: dict[str, list[tuple[str, Any]]] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            out[key] = value
        elif key.startswith(_GROUP_PREFIX):
            name, setting = key.rsplit(".", 1)
            if value is not None:
                packs.setdefault(name, []).append((setting, value))
        else:
            raise TypeError(f"checkpoint state {key!r} is a {type(value).__name__}; only tensors are saved")
    for name, settings in packs.items():
        numbers: list[float] = []
        for setting, value in sorted(settings):
            items = value if isinstance(value, (tuple, list)) else (value,)
            if not all(isinstance(v, (bool, int, float)) for v in items):
                raise TypeError(f"optimizer setting {name}.{setting} = {value!r} is not numeric")
            numbers.extend(float(v) for v in items)
        out[name] = torch.tensor(numbers, dtype=torch.float64)
    return out


def from_tensors(loaded: dict[str, Any], template: dict[str, Any]) -> dict[str, Any]:
    """Undo `to_tensors`, giving each setting the Python type it has in `template` (the live state)."""
    out = {k: loaded.get(k, v) for k, v in template.items() if not k.startswith(_GROUP_PREFIX)}
    groups: dict[str, list[tuple[str, Any]]] = {}
    for key, value in template.items():
        if key.startswith(_GROUP_PREFIX):
            name, setting = key.rsplit(".", 1)
            groups.setdefault(name, []).append((setting, value))
    for name, settings in groups.items():
        values = iter(loaded[name].tolist()) if name in loaded else None
        for setting, value in sorted(settings, key=lambda kv: kv[0]):
            key = f"{name}.{setting}"
            if value is None or values is None:
                out[key] = value
            elif isinstance(value, (tuple, list)):
                out[key] = type(value)(type(t)(next(values)) for t in value)
            else:
                out[key] = type(value)(next(values))
    return out


class TrainerState(Stateful):
    """The step number and the LR scheduler's numeric state, stored as tensors.

    Scheduler entries that are numbers or lists of numbers become float64 tensors (exact for the
    integers and float32/float64 values involved); others (e.g. LambdaLR's lr_lambdas) are not saved.
    """

    def __init__(self, scheduler: torch.optim.lr_scheduler.LRScheduler | None, step: int = 0) -> None:
        self.scheduler, self.step = scheduler, step

    def _numeric_items(self) -> dict[str, Any]:
        out = {}
        if self.scheduler is None:
            return out
        for key, value in self.scheduler.state_dict().items():
            if isinstance(value, (bool, int, float)) or (
                isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value)
            ):
                out[key] = value
        return out

    def state_dict(self) -> dict[str, Any]:
        sched = {k: torch.tensor(v, dtype=torch.float64) for k, v in self._numeric_items().items()}
        return {"step": torch.tensor(self.step, dtype=torch.int64), "scheduler": sched}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        if self.scheduler is None:
            return
        current = self.scheduler.state_dict()
        for key, tensor in state_dict["scheduler"].items():
            template = current[key]
            if isinstance(template, list):
                current[key] = [type(t)(v) for t, v in zip(template, tensor.tolist())]
            else:
                current[key] = type(template)(tensor.item())
        self.scheduler.load_state_dict(current)


class ExtraState(Stateful):
    """A user's extra values (numbers or tensors) under their keys; a load fills the given dict in place,
    each value back in the type it has there."""

    def __init__(self, values: dict[str, Any]) -> None:
        for key, value in values.items():
            if not isinstance(value, (torch.Tensor, bool, int, float)):
                raise TypeError(f"extra[{key!r}] is a {type(value).__name__}; checkpoints hold numbers and tensors")
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        # copies: an asynchronous save copies the state after `save` returned, while the loop may change the values
        return {k: v.detach().clone() if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float64)
                for k, v in self.values.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for key, loaded in state_dict.items():
            template = self.values[key]
            self.values[key] = loaded if isinstance(template, torch.Tensor) else type(template)(loaded.item())


def state_of(model, optimizer, scheduler, step: int, extra: dict | None,
             scaler: Stateful | None = None, only: set[str] | None = None,
             optim_saved: bool | None = None) -> dict[str, Stateful]:
    state: dict[str, Stateful] = {"app": ModelOptimState(model, optimizer, only, optim_saved),
                                  "trainer": TrainerState(scheduler, step)}
    if extra:
        state["extra"] = ExtraState(extra)
    if scaler is not None:
        state["scaler"] = scaler
    return state


SCALER_KEY = "scaler"


def holds(metadata, key: str) -> bool:
    """Whether a step's DCP metadata holds entries under the top-level `key` (DCP flattens to `key.name`)."""
    return any(k == key or k.startswith(f"{key}.") for k in metadata.state_dict_metadata)


def write_model_config(target: str, model: nn.Module) -> None:
    """`<step>/model.json`: the model's shape, for `trainyard checkpoint export` (rank 0: before a blocking save,
    so that its committed step has it; after an asynchronous one's commit, in the background)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict") or (dist.is_initialized() and dist.get_rank() != 0):
        return
    fs, path = filesystem(target)
    fs.makedirs(path, exist_ok=True)  # local paths; a no-op on object stores
    fs.pipe_file(f"{path}/model.json", json.dumps(config.to_dict(), indent=1).encode())
