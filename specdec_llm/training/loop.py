"""The one training loop both draft kinds run (``distill.train``, ``eagle.train_eagle``).

A :class:`TrainLoop` owns a run's position (step, tokens seen, history) and its checkpoint
directory: ``state.json`` (step, tokens seen, history, the config), the draft's own tensors
(``draft.safetensors``), AdamW's moments (``optim.safetensors``) and, for a draft whose head
covers a vocabulary subset, its token ids (``subset.safetensors``). Checkpoints hold no
pickle. A kind gives the loop one callable per batch (its loss, the tokens it saw, its
metrics), one that turns the last 50 batches' metrics into a history entry, and one that
writes a checkpoint (``TrainLoop.save`` and the kind's own export); the loop does the rest:
the learning-rate schedule, the optimizer step, the deadline, when to record and checkpoint.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..pairs import VOCAB_SUBSET

STATE = "state.json"
WINDOW = 50  # batches whose metrics a history entry averages


def cosine_lr(step: int, lr: float, warmup: int, steps: int) -> float:
    """Linear warmup, then cosine decay to a tenth of ``lr`` at ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def save_adam(opt: torch.optim.Optimizer, params: list, path: Path) -> None:
    """AdamW's moments of ``params`` as safetensors (checkpoints hold no pickle)."""
    state = {}
    for i, p in enumerate(params):
        if p in opt.state:
            state[f"{i}.exp_avg"] = opt.state[p]["exp_avg"].cpu()
            state[f"{i}.exp_avg_sq"] = opt.state[p]["exp_avg_sq"].cpu()
    save_file(state, str(path))


def load_adam(opt: torch.optim.Optimizer, params: list, path: Path, step: int) -> None:
    """Restore ``save_adam``'s moments into ``opt`` (on each parameter's device) at ``step``."""
    state = load_file(str(path))
    for i, p in enumerate(params):
        if f"{i}.exp_avg" in state:
            opt.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": state[f"{i}.exp_avg"].to(p.device),
                "exp_avg_sq": state[f"{i}.exp_avg_sq"].to(p.device),
            }


def subset_rows(subset: torch.Tensor | None, vocab: int, device=None) -> torch.Tensor | None:
    """Token id -> row of a subset head (-1 outside the subset); None for a full head."""
    if subset is None:
        return None
    pos = torch.full((vocab,), -1, dtype=torch.long, device=device)
    pos[subset.to(pos.device)] = torch.arange(len(subset), device=device)
    return pos


@dataclass
class Schedule:
    """How long a run trains and how often it records and checkpoints."""

    steps: int
    lr: float
    warmup: int
    checkpoint_every: int
    history_every: int = 10


# one batch: (loss to minimise, tokens the batch held, the metrics its history entry averages)
LossStep = Callable[[], tuple[torch.Tensor, int, object]]


@dataclass
class TrainLoop:
    """A run's position and checkpoint directory ``ckpt``; with ``resume`` and a checkpoint
    there, ``state`` is its ``state.json`` (None: a fresh run) and ``restore`` continues it."""

    ckpt: Path
    resume: bool = False
    step: int = 0
    tokens_seen: int = 0
    history: list[dict] = field(default_factory=list)
    state: dict | None = None
    seconds: float = 0.0  # spent in ``run`` (the steps it took)
    start: int = 0  # the step ``run`` started from

    def __post_init__(self) -> None:
        path = self.ckpt / STATE
        self.state = json.loads(path.read_text()) if self.resume and path.exists() else None

    def saved_subset(self) -> torch.Tensor | None:
        """The vocabulary subset of the checkpoint resumed, if its draft has one."""
        path = self.ckpt / "subset.safetensors"
        if self.state is None or not path.exists():
            return None
        return load_file(str(path))[VOCAB_SUBSET].long()

    def restore(self, draft: torch.nn.Module, opt: torch.optim.Optimizer, params: list, device=None) -> None:
        """Load the checkpoint's own tensors into ``draft``, its moments into ``opt`` and its
        position into the loop (nothing on a fresh run)."""
        if self.state is None:
            return
        draft.load_state_dict(
            load_file(str(self.ckpt / "draft.safetensors"), device=str(device or "cpu")), strict=False
        )
        load_adam(opt, params, self.ckpt / "optim.safetensors", self.state["step"])
        self.step = self.state["step"]
        self.history = self.state.get("history", [])
        self.tokens_seen = self.state.get("tokens_seen", 0)

    def wants_heldout(self) -> bool:
        """Whether the last history entry still lacks a held-out agreement (a checkpoint adds it)."""
        return bool(self.history) and "heldout_agreement" not in self.history[-1]

    def heldout_curve(self) -> list[dict]:
        return [
            {k: h[k] for k in ("step", "tokens_seen", "heldout_agreement")}
            for h in self.history
            if "heldout_agreement" in h
        ]

    def save(self, tensors: dict, opt: torch.optim.Optimizer, params: list, subset, config: dict) -> None:
        """The checkpoint: the draft's own ``tensors``, the moments, the subset, the state."""
        self.ckpt.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(self.ckpt / "draft.safetensors"))
        save_adam(opt, params, self.ckpt / "optim.safetensors")
        if subset is not None:
            save_file({VOCAB_SUBSET: subset.to(torch.int32).cpu()}, str(self.ckpt / "subset.safetensors"))
        tmp = self.ckpt / (STATE + ".tmp")
        state = {"step": self.step, "tokens_seen": self.tokens_seen, "history": self.history, "config": config}
        tmp.write_text(json.dumps(state))
        tmp.replace(self.ckpt / STATE)

    def run(
        self,
        loss_step: LossStep,
        opt: torch.optim.Optimizer,
        params: list,
        schedule: Schedule,
        record: Callable[[list], dict],
        checkpoint: Callable[[], None],
        deadline: float | None = None,
        close_history: bool = False,
    ) -> None:
        """Train until ``schedule.steps`` or ``deadline`` (time.time()), then checkpoint.

        Every ``history_every`` steps (and at the last) a history entry: step, tokens seen and
        ``record(metrics of the last 50 batches)``; every ``checkpoint_every`` steps, and at
        the end, ``checkpoint()``. ``close_history``: an end between entries adds one (step
        and tokens only) for the last checkpoint's held-out agreement."""
        t0, self.start = time.time(), self.step
        window: list = []
        while self.step < schedule.steps:
            if deadline and time.time() > deadline:
                break
            for g in opt.param_groups:
                g["lr"] = cosine_lr(self.step, schedule.lr, schedule.warmup, schedule.steps)
            loss, tokens, metrics = loss_step()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            self.step += 1
            self.tokens_seen += tokens
            window = (window + [metrics])[-WINDOW:]
            if self.step % schedule.history_every == 0 or self.step == schedule.steps:
                self.history.append({"step": self.step, "tokens_seen": self.tokens_seen, **record(window)})
            if self.step % schedule.checkpoint_every == 0:
                checkpoint()
        if close_history and (not self.history or self.history[-1]["step"] != self.step):
            self.history.append({"step": self.step, "tokens_seen": self.tokens_seen})
        checkpoint()
        self.seconds = time.time() - t0
