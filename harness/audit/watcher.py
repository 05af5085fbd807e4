"""Watching a training loop the harness did not write: the in-code form of the audit.

    with harness.audit.watch(windows=1) as audit:
        train()                      # the script's own loop, unchanged
    print(audit.verdict())          # parity against the single-device reference, the reading and its fix

While the block runs, global hooks of torch watch every model and optimizer in the process
(``register_module_forward_hook(..., with_kwargs=True)`` with its pre-hook, and
``register_optimizer_step_pre_hook``), and four functions of torch are wrapped (:data:`PATCHED`):

- the outermost module call (through DDP: its ``module``) is the model. After ``skip`` optimizer steps, each of the
  next ``windows`` windows records the model's weights when its first call starts (an FSDP2 model's gathered whole),
  the random generators' states then, every call's arguments and keyword arguments (:func:`harness.audit.record.plain`),
  how many of the calls synchronize their backward (DDP's ``require_backward_grad_sync``, which ``no_sync()`` clears;
  FSDP2's ``set_requires_gradient_sync``), and, when ``optimizer.step()`` begins, the gradient each parameter holds
  (gathered whole under FSDP2);
- ``torch.nn.utils.clip_grad_norm_``: the ``max_norm`` and the norm it returned in a window, so that the reference is
  clipped the same way and the norm judged;
- ``torch.distributed.fsdp.fully_shard``: at its first call, a copy of the whole model before any part is sharded
  (the reference's model);
- with ``unbalance``, ``DataLoader`` iteration: each batch the script's loaders yield until the last window ends has
  a drawn suffix of each row's supervised ``labels`` set to -100 (:func:`mask_suffixes`), so that counts differ
  across ranks and microbatches and a mean of means shows. The masking starts with the first batch because loops
  count a window's tokens, and loaders fetch, before the window's first forward.

Dropout is off in the audited windows: each dropout probability of the model (the battery's rule,
:func:`harness.model.disable_dropout`) is 0 from the first window's first call and restored after the last; the
reference runs without it too. Nothing is recorded after the last window, and everything is undone when the block
ends.

A model that is not given its labels, a loop that never steps an optimizer, and a capture over ``max_capture_mb`` are
named by :meth:`Audit.verdict`, never judged.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from harness.audit.models import (
    autocast_dtype,
    dropout_off,
    flat_grads,
    flat_weights,
    mask_suffixes,
    mesh_refusal,
    on_meta,
    root_of,
    synchronizes,
    unwrap,
    whole,
)
from harness.audit.record import Call, Clip, Record, Window, plain

PATCHED = (("torch.nn.utils", "", "clip_grad_norm_"), ("torch.nn.utils.clip_grad", "", "clip_grad_norm_"),
           ("torch.distributed.fsdp", "", "fully_shard"),
           ("torch.utils.data.dataloader", "_BaseDataLoaderIter", "__next__"))
"""The functions the watch wraps while it is active: (module, class in it or "", attribute)."""


class Audit(Record):
    """What :func:`watch` records (a :class:`~harness.audit.record.Record`); :meth:`verdict` judges it.

    ``unbalance``: the seed of the label masking (None: off); ``max_capture_mb``: the capture's bound (None: none);
    ``rank``: this process's rank, which the masking's generator is seeded with besides the seed."""

    def __init__(self, windows: int, skip: int, unbalance: int | None = None, max_capture_mb: float | None = None,
                 rank: int = 0) -> None:
        super().__init__(windows, skip)
        self.unbalance, self.max_capture_mb = unbalance, max_capture_mb
        self.template: nn.Module | None = None
        """The whole model before ``fully_shard`` (None: the script did not shard it)."""
        self._depth = 0
        self._open: Window | None = None
        self._restore: Callable[[], None] | None = None
        self._bytes = 0
        self._masked = 0
        self._masking = None if unbalance is None else torch.Generator().manual_seed(unbalance * 1009 + rank)
        self._judges = rank == 0  # only the judging rank keeps a copy of the model before fully_shard
        self._mesh_refused = False

    @property
    def recording(self) -> bool:
        """Inside the audited windows. A capture over its bound still walks them (the gathers of a sharded model are
        collectives every rank must enter), storing nothing; a refused mesh opens no window at all."""
        return not self._mesh_refused and self.skip <= self.steps < self.skip + self.wanted

    @property
    def done(self) -> bool:
        return self.steps >= self.skip + self.wanted

    def _count(self, nbytes: int) -> None:
        self._bytes += nbytes
        if self.refusal is None and self.max_capture_mb is not None and self._bytes > self.max_capture_mb * 2**20:
            self.refusal = (f"the capture reached {self._bytes / 2**20:.1f} MB, over --max-capture-mb="
                            f"{self.max_capture_mb:g}: audit fewer windows (--windows), smaller batches, or raise the "
                            "bound")
            self.windows.clear()
            if self._open is not None:
                self._open.calls.clear()

    def _pre(self, module: nn.Module, args: Any) -> None:
        if self._depth == 0 and self.recording and torch.is_grad_enabled():
            model = unwrap(module)
            if self.model is None:
                self.model = model
            if model is self.model and self._open is None and (mesh := mesh_refusal(model)):
                self.refusal, self._mesh_refused = mesh, True  # the same mesh on every rank: none gathers
            elif model is self.model:
                if self._open is None:
                    if self._restore is None:
                        self._restore = dropout_off(model)
                        changed = self._restore.changed  # type: ignore[attr-defined]
                        if changed:
                            self.notes.append(f"dropout was off in the audited windows ({changed} probabilities of "
                                              "the model set to 0, restored after), and off in the reference")
                    rng = {"cpu": torch.get_rng_state()}
                    if torch.cuda.is_available() and torch.cuda.is_initialized():
                        rng["cuda"] = torch.cuda.get_rng_state()
                    self._open = Window(flat_weights(model), rng=rng,
                                        buffers=[whole(b).cpu().clone() for b in model.buffers()])
                    self._count(self._open.start.numel() * self._open.start.element_size() * 2)
                synced = synchronizes(module, model)
                if self.strategy is None and synced is not None:
                    self.strategy = "ddp" if module is not model else "fsdp2"
                if synced is not None:
                    self._open.syncs = (self._open.syncs or 0) + int(synced)
        self._depth += 1

    def _post(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
        self._depth -= 1
        if self._depth != 0 or self._open is None or unwrap(module) is not self.model or not torch.is_grad_enabled():
            return  # a call with gradients off (an evaluation) trains nothing: it is not the window's
        if self._open.autocast is None:
            self._open.autocast = autocast_dtype()
        if self.refusal is None:
            call = Call(plain(tuple(args)), plain(dict(kwargs)))
            self._count(call.nbytes)
            if self.refusal is None:
                self._open.calls.append(call)

    def _step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if self.recording and self._open is not None and (dtype := autocast_dtype()) is not None:
            self.problems.append(f"optimizer.step() ran inside a {dtype} autocast region: autocast caches its casts "
                                 "of the weights until the region exits, so the next forward in it reads the weights "
                                 "from before this step; wrap only the forward and the loss in torch.autocast")
        if self.recording and self._open is not None and self.model is not None:
            self._open.grad = flat_grads(self.model)  # gathered on every rank, stored only within the bound
            if self.refusal is None:
                self.windows.append(self._open)
        self._open = None
        self.steps += 1
        if self.done:
            self.undo_dropout()

    def undo_dropout(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = lambda: None

    def _clip(self, original: Callable[..., Any], parameters: Any, max_norm: float, norm_type: float = 2.0,
              *args: Any, **kwargs: Any) -> Any:
        total = original(parameters, max_norm, norm_type, *args, **kwargs)
        if self._open is not None:
            self._open.clips.append(Clip(float(max_norm), float(norm_type), float(whole(total))))
        return total

    def _shard(self, original: Callable[..., Any], module: Any, *args: Any, **kwargs: Any) -> Any:
        first = module[0] if isinstance(module, (list, tuple)) and module else module
        if self._judges and self.template is None and isinstance(first, nn.Module):
            root = root_of(first)
            self.template = copy.deepcopy(root).to("cpu") if not on_meta(root) else copy.deepcopy(root)
        return original(module, *args, **kwargs)

    def _next(self, original: Callable[..., Any], iterator: Any) -> Any:
        batch = original(iterator)
        if self._masking is None or self.done:
            return batch
        labels = batch.get("labels") if hasattr(batch, "get") else None
        if isinstance(labels, torch.Tensor) and labels.dim() == 2 and not labels.is_floating_point():
            batch["labels"] = mask_suffixes(labels, self._masking)
            self._masked += 1
        return batch

    def report_unbalance(self) -> None:
        """The note (or problem) ``unbalance`` leaves in the record at the end."""
        if self.unbalance is None:
            return
        if self._masked:
            self.notes.append(f"--unbalance: each row of the {self._masked} batches this rank's DataLoader yielded "
                              "until the audited windows ended kept a drawn number of its supervised labels, the rest "
                              f"set to -100 (seed {self.unbalance}); the reference reads the same masked labels")
        else:  # not the script's fault: its windows are judged with their own counts, and the note says so
            self.notes.append("--unbalance found no batch to mask (it masks the labels of the dict batches a torch "
                              "DataLoader yields, a 'labels' tensor [B, T]): the windows hold the script's own counts")

    def verdict(self, objective: str = "token_mean", labels: str = "auto", model: str | None = None) -> Any:
        """The audit's verdict (:class:`harness.audit.evidence.AuditVerdict`): ``objective`` and ``labels`` as the
        command's options; ``model``, ``PKG.MODULE:FACTORY``, builds the reference's model.

        In a process group of more than one rank every rank must call it: the ranks' records meet on rank 0
        (:func:`harness.audit.exchange.exchange`), rank 0 judges them together, and every rank gets the same verdict
        (its diagnosis object on rank 0 only)."""
        from harness.audit.evidence import AuditVerdict, judge, objective_of
        from harness.audit.exchange import exchange, group
        from harness.audit.options import check_labels
        from harness.audit.record import Record

        objective_of(objective)  # bad arguments raise on every rank, before any rank waits on another
        check_labels(labels)
        ranks = group()
        if ranks is None or ranks[1] == 1:
            return judge(self, objective=objective, labels=labels, model=model)
        found = None

        def judged(plains: list[Any]) -> dict[str, Any]:
            nonlocal found
            try:  # rank 0 answers the others whatever happens here: none is left waiting in the broadcast
                found = judge(self, [Record.from_plain(p) for p in plains[1:]], objective=objective, labels=labels,
                              model=model)
            except Exception as exc:
                said = f"audit: not judged: judging the record failed: {type(exc).__name__}: {exc}"
                return {"passed": False, "lines": [said], "problems": [said]}
            return {"passed": found.passed, "lines": list(found.lines), "problems": list(found.problems)}

        said = exchange(self, judged)
        return AuditVerdict(said["passed"], tuple(said["lines"]), None if found is None else found.diagnosis,
                            tuple(said["problems"]))


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then(module)`` right after module ``name`` is first imported (so that a module the script may never use,
    ``torch.distributed.fsdp``, costs nothing to watch when it does not)."""

    def __init__(self, name: str, then: Callable[[Any], None]) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        self.remove()
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader, then = spec.loader, self.then
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            then(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _wrap_in(wrap: Callable[[Any, str], None], inside: str, name: str, module: Any) -> None:
    wrap(getattr(module, inside) if inside else module, name)


@contextlib.contextmanager
def patched(audit: Audit) -> Iterator[None]:
    """:data:`PATCHED`'s functions wrapped by ``audit`` while the block runs (a module not yet imported, when it
    is), restored after."""
    saved: list[tuple[Any, str, Any]] = []
    waiting: list[_AfterImport] = []
    wrappers: dict[str, Callable[..., Any]] = {"clip_grad_norm_": audit._clip, "fully_shard": audit._shard}

    def wrap(owner: Any, name: str) -> None:
        original = getattr(owner, name)
        if name == "__next__":  # a method: a function, so that it binds to the iterator

            def method(iterator: Any) -> Any:
                return audit._next(original, iterator)

            wrapper: Any = functools.wraps(original)(method)
        else:
            wrapper = functools.wraps(original)(functools.partial(wrappers[name], original))
        saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    for where, inside, name in PATCHED:
        if where in sys.modules:
            module = sys.modules[where]
            wrap(getattr(module, inside) if inside else module, name)
        else:
            hook = _AfterImport(where, functools.partial(_wrap_in, wrap, inside, name))
            sys.meta_path.insert(0, hook)
            waiting.append(hook)
    try:
        yield
    finally:
        for hook in waiting:
            hook.remove()
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)


def install(audit: Audit, on_step: Callable[[], None] | None = None) -> list[Any]:
    """``audit``'s hooks and wrappers, installed for the whole process; ``on_step`` runs after each optimizer step's
    record. Returns what :func:`uninstall` takes."""
    def step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        audit._step(optimizer, args, kwargs)
        if on_step is not None:
            on_step()

    stack = contextlib.ExitStack()
    stack.enter_context(patched(audit))
    return [register_module_forward_pre_hook(audit._pre), register_module_forward_hook(audit._post, with_kwargs=True),
            register_optimizer_step_pre_hook(step), stack]


def uninstall(handles: list[Any]) -> None:
    for h in handles:
        if isinstance(h, contextlib.ExitStack):
            h.close()
        else:
            h.remove()


@contextlib.contextmanager
def watch(windows: int = 1, skip: int = 0, unbalance: int | None = None,
          max_capture_mb: float | None = None) -> Iterator[Audit]:
    """Record ``windows`` optimizer steps of whatever loop runs inside the block, after ``skip`` steps."""
    audit = Audit(windows, skip, unbalance, max_capture_mb)
    handles = install(audit)
    try:
        yield audit
    finally:
        uninstall(handles)
        audit.undo_dropout()
        audit.report_unbalance()


__all__ = ["PATCHED", "Audit", "install", "patched", "uninstall", "watch"]
