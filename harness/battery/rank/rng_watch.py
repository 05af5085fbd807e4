"""Who moved a global random generator: while a recipe's ``setup()`` or ``backward_window`` runs, the global seeding and
state-setting entry points (``random.seed``, ``numpy.random.seed``, ``torch.manual_seed``, ``torch.set_rng_state``,
``torch.cuda.manual_seed_all``, ...) are wrapped, and each call that changes a generator's state is recorded with the
frames between it and the harness. A generator that moved is then explained (:class:`GeneratorMove`): by the last such
call (``transformers.trainer_utils.set_seed``, called from ``Trainer.__init__``, called from the recipe's line), or,
with none, as drawn from, inside the model's forward or outside it (a forward pre/post hook compares torch's states).

The wrappers replace module attributes, which is how library seeding functions reach them (transformers' ``set_seed``
calls ``random.seed``, ``np.random.seed``, ``torch.manual_seed`` through their modules); a name bound at import
(``from torch import manual_seed``) escapes them, and a torch seed changed so is still told apart from a draw by
``torch.initial_seed()``. Nothing here runs on the path of a call that does not seed: the cost is one attribute swap
per entry point per window, and two ``torch.get_rng_state()`` per forward of the model.
"""

from __future__ import annotations

import functools
import linecache
import os
import random
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType, ModuleType, TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn

TORCH = ("torch CPU", "torch CUDA")
ENTRY_POINTS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("random", "seed", "random.seed", ("python random",)),
    ("random", "setstate", "random.setstate", ("python random",)),
    ("numpy.random", "seed", "numpy.random.seed", ("numpy",)),
    ("numpy.random", "set_state", "numpy.random.set_state", ("numpy",)),
    ("torch", "manual_seed", "torch.manual_seed", TORCH),
    ("torch.random", "manual_seed", "torch.manual_seed", TORCH),
    ("torch", "seed", "torch.seed", TORCH),
    ("torch.random", "seed", "torch.seed", TORCH),
    ("torch", "set_rng_state", "torch.set_rng_state", ("torch CPU",)),
    ("torch.random", "set_rng_state", "torch.set_rng_state", ("torch CPU",)),
    *((m, f, f"torch.cuda.{f}", ("torch CUDA",)) for m in ("torch.cuda", "torch.cuda.random")
      for f in ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all")),
)
"""``(module, attribute, name shown, generators it sets)``: the global entry points wrapped while a recipe runs."""


def states(names: tuple[str, ...] | None = None) -> dict[str, object]:
    """The global generators' states (CUDA's only where initialized), all or the ``names`` given."""
    out: dict[str, object] = {}
    want = names or ("python random", "numpy", *TORCH)
    if "python random" in want:
        out["python random"] = random.getstate()
    if "numpy" in want:
        out["numpy"] = np.random.get_state()
    if "torch CPU" in want:
        out["torch CPU"] = torch.get_rng_state()
    if "torch CUDA" in want and torch.cuda.is_available() and torch.cuda.is_initialized():
        out["torch CUDA"] = torch.cuda.get_rng_state_all()
    return out


def same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))  # type: ignore[arg-type]
    return a == b


def _torch_states() -> tuple[torch.Tensor, ...]:
    """torch's CPU generator state, and the current CUDA device's where CUDA is initialized (its seed and offset: no
    device synchronization): what a forward pre/post hook compares, a few microseconds."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.get_rng_state(), torch.cuda.get_rng_state()
    return (torch.get_rng_state(),)


@dataclass(frozen=True)
class Frame:
    """One frame between a seeding call and the harness: the function's dotted name, its file (relative to the
    ``sys.path`` entry it was imported from), line and source text."""

    name: str
    file: str
    line: int
    text: str
    qual: str = ""
    """The function's name without its module: ``Trainer.__init__``."""

    @classmethod
    def of(cls, frame: FrameType) -> Frame:
        code = frame.f_code
        module = str(frame.f_globals.get("__name__", ""))
        qual = getattr(code, "co_qualname", code.co_name)
        return cls(f"{module}.{qual}" if module else qual, _short(code.co_filename), frame.f_lineno,
                   linecache.getline(code.co_filename, frame.f_lineno).strip(), qual)


def _short(path: str) -> str:
    roots = sorted((os.path.abspath(p) for p in sys.path if p), key=len, reverse=True)
    full = os.path.abspath(path)
    root = next((r for r in roots if full.startswith(r + os.sep)), None)
    return os.path.relpath(full, root) if root else os.path.basename(full)


@dataclass(frozen=True, eq=False)
class _Call:
    entry: str
    generators: tuple[str, ...]
    frames: tuple[Frame, ...]
    after: dict[str, object]


@dataclass(frozen=True)
class GeneratorMove:
    """Why some global generators moved: ``kind`` is ``"seeded"`` (a watched call set them: ``chain`` is the calling
    function, then its callers down to the recipe's frame, last), ``"drawn"`` (no call set them; ``where`` says
    where the draw was seen, if it was), or ``"unwatched"`` (torch's seed changed through a call not watched)."""

    generators: tuple[str, ...]
    kind: str
    entries: tuple[str, ...] = ()
    chain: tuple[Frame, ...] = ()
    where: str = ""
    drawn_after: bool = False

    @property
    def sentence(self) -> str:
        """Why they moved, without naming them: "set by `random.seed`/`torch.manual_seed`, called by ..."."""
        if self.kind == "unwatched":
            return ("seeded (torch.initial_seed() changed) through a call the harness does not watch: a seeding "
                    "function bound at import (`from torch import manual_seed`) or a generator's own method "
                    "(torch.default_generator.manual_seed)")
        if self.kind == "drawn":
            return f"drawn from (no seeding call was made){self.where}"
        return f"set by {'/'.join(f'`{e}`' for e in self.entries)}, {describe(self.chain)}" + (
            "; and drawn from after it" if self.drawn_after else "")

    @property
    def constructor(self) -> Frame | None:
        """The first ``__init__`` between the seeding call and the recipe (``Trainer.__init__``), else None."""
        return next((f for f in self.chain[:-1] if f.name.endswith(".__init__")), None)


def describe(chain: tuple[Frame, ...]) -> str:
    """``called by `pkg.set_seed` (pkg/x.py:12), called from `Trainer.__init__` (...), called from your recipe at
    my_recipe.py:30 in backward_window: `trainer = Trainer(...)```: the last frame is the recipe's."""
    *inner, mine = chain
    if len(inner) > 5:
        inner = [*inner[:3], Frame(f"... {len(inner) - 4} more frames ...", "", 0, ""), inner[-1]]
    parts = [f"called by `{inner[0].name}` ({inner[0].file}:{inner[0].line})"] if inner else []
    parts += [f"called from `{f.qual}` ({f.file}:{f.line})" if f.line else f.name for f in inner[1:]]
    parts.append(f"called from your recipe at {mine.file}:{mine.line} in {mine.qual}: "
                 f"`{mine.text}`")
    return ", ".join(parts)


class GeneratorWatch:
    """Watches the global generators around one call of the recipe: ``with watch: recipe.backward_window(...)``;
    then :attr:`moved` names the generators that moved and :attr:`moves` explains them. ``model`` (optional) gets a
    forward pre/post hook that tells a draw inside its forward from one outside it."""

    def __init__(self, model: nn.Module | None = None) -> None:
        self._local = threading.local()
        self._active = False
        self.moved: tuple[str, ...] = ()
        self.moves: tuple[GeneratorMove, ...] = ()
        self._calls: list[_Call] = []
        self._forward_draw: str | None = None
        self._forwards = 0
        self._before_forward: tuple[torch.Tensor, ...] | None = None
        if model is not None:
            model.register_forward_pre_hook(self._pre)
            model.register_forward_hook(self._post)

    def _pre(self, module: nn.Module, args: object) -> None:
        if self._active and self._forward_draw is None:
            self._before_forward = _torch_states()

    def _post(self, module: nn.Module, args: object, out: object) -> None:
        if self._active and self._before_forward is not None:
            self._forwards += 1
            if self._forward_draw is None and not same(self._before_forward, _torch_states()):
                mine = self._chain(sys._getframe(1))[-1:]
                self._forward_draw = f", inside the model's forward, {describe(mine)}" if mine else \
                    ", inside the model's forward"
            self._before_forward = None

    def __enter__(self) -> GeneratorWatch:
        self._stop = sys._getframe(1)  # the harness's frame that runs the recipe: a chain ends below it
        self._calls, self._forward_draw, self._forwards = [], None, 0
        self._before, self._seed = states(), torch.initial_seed()
        self._saved: list[tuple[ModuleType, str, Any]] = []
        wrapped: dict[int, Callable[..., Any]] = {}
        for module_name, attr, entry, gens in ENTRY_POINTS:
            module = sys.modules.get(module_name)
            original = getattr(module, attr, None)
            if module is None or original is None:
                continue
            if id(original) not in wrapped:
                wrapped[id(original)] = self._wrap(original, entry, gens)
            self._saved.append((module, attr, original))
            setattr(module, attr, wrapped[id(original)])
        self._active = True
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self._active = False
        for module, attr, original in reversed(self._saved):
            setattr(module, attr, original)
        after = states()
        self.moved = tuple(n for n in after if n not in self._before or not same(self._before[n], after[n]))
        self.moves = self._explain(after) if self.moved else ()

    def _wrap(self, original: Callable[..., Any], entry: str, gens: tuple[str, ...]) -> Callable[..., Any]:
        local = self._local

        @functools.wraps(original)
        def watched(*args: Any, **kwargs: Any) -> Any:
            if getattr(local, "depth", 0):  # torch.manual_seed's own call of torch.cuda.manual_seed_all
                return original(*args, **kwargs)
            local.depth = 1
            try:
                before = states(gens)
                result = original(*args, **kwargs)
                after = states(gens)
                if any(not same(before.get(g), after.get(g)) for g in after):  # a restore of the same state is no move
                    self._calls.append(_Call(entry, gens, self._chain(sys._getframe(1)), after))
                return result
            finally:
                local.depth = 0

        return watched

    def _chain(self, frame: FrameType | None) -> tuple[Frame, ...]:
        """The frames from ``frame`` out to the recipe's (the one the harness called), innermost first, ending at the
        innermost frame in the recipe's own file."""
        frames: list[FrameType] = []
        while frame is not None and frame is not self._stop and len(frames) < 64:
            frames.append(frame)
            frame = frame.f_back
        if not frames:
            return ()
        home = frames[-1].f_code.co_filename
        end = next(i for i, f in enumerate(frames) if f.f_code.co_filename == home)
        return tuple(Frame.of(f) for f in frames[:end + 1])

    def _explain(self, after: dict[str, object]) -> tuple[GeneratorMove, ...]:
        found: dict[tuple[object, ...], list[str]] = {}
        calls: dict[tuple[object, ...], list[_Call]] = {}
        for g in self.moved:
            last = next((c for c in reversed(self._calls) if g in c.after), None)
            if last is None or same(last.after[g], self._before.get(g)):
                kind = "unwatched" if g == "torch CPU" and torch.initial_seed() != self._seed else "drawn"
                key: tuple[object, ...] = (kind,)
            else:
                key = ("seeded", last.frames[1:], last.frames[0].name if last.frames else "",
                       not same(last.after[g], after[g]))
                calls.setdefault(key, [])
                if not any(c is last for c in calls[key]):
                    calls[key].append(last)
            found.setdefault(key, []).append(g)
        moves = []
        for key, gens in found.items():
            if key[0] != "seeded":
                where = ""
                if key[0] == "drawn" and any(g in TORCH for g in gens):
                    where = self._forward_draw or (", outside the model's forward (in the recipe's own code: a "
                                                   "torch.rand/randn/randint/randperm/normal/bernoulli/multinomial or "
                                                   "a dropout without generator=)" if self._forwards else "")
                moves.append(GeneratorMove(tuple(gens), str(key[0]), where=where))
                continue
            cs = sorted(calls[key], key=self._calls.index)
            moves.append(GeneratorMove(tuple(gens), "seeded", tuple(dict.fromkeys(c.entry for c in cs)),
                                       cs[0].frames, drawn_after=bool(key[3])))
        return tuple(moves)


def moved_detail(generators: tuple[str, ...], moves: tuple[GeneratorMove, ...], phase: str = "window") -> str:
    """The hygiene verdict's words for ``generators`` moved, and why (``moves``), in the recipe's ``setup()`` or in a
    window."""
    where = "the recipe's setup()" if phase == "setup" else "the recipe"
    said = f"{where} moved the global random generator(s) {', '.join(generators)}"
    if not moves:
        return f"{said}: use a generator of its own"
    if len(moves) == 1:
        return f"{said}: {moves[0].sentence}"
    return f"{said}: " + "; ".join(f"{', '.join(m.generators)} {m.sentence}" for m in moves)


def hygiene_fix(moves: tuple[GeneratorMove, ...], in_setup: bool = False) -> str:
    """What to change in the recipe so that it leaves the global generators alone, for the ``moves`` found."""
    fixes = []
    keep = ("inside a block that puts the global generators back: save random.getstate(), numpy.random.get_state() "
            "and torch.get_rng_state() before it and restore them after "
            "(`with harness.recipes.generators_kept(): ...` does)")
    for move in moves:
        if move.kind == "seeded" and move.constructor is not None:
            ctor = move.constructor.qual.rsplit(".", 1)[0]
            where = ("keep building it once in setup(), " if in_setup else
                     "build it once, in setup(self, model) (called once per run before the first window, with the "
                     "wrapped model backward_window receives), ")
            fixes.append(f"{ctor}(...) seeds the global generators in its constructor ({move.chain[0].name}): "
                         f"{where}{keep}")
        elif move.kind in ("seeded", "unwatched"):
            fixes.append("seed once, in the script that builds the model, not in the recipe; or call it " + keep)
        else:
            fixes.append("draw from a generator of its own: torch.Generator().manual_seed(s) passed as generator= "
                         "(torch.randperm(n, generator=g)), random.Random(s), numpy.random.default_rng(s)")
    return "; ".join(dict.fromkeys(fixes))


__all__ = ["ENTRY_POINTS", "Frame", "GeneratorMove", "GeneratorWatch", "describe", "hygiene_fix", "moved_detail",
           "same", "states"]
