"""The battery's options, decided once: :class:`BatteryOptions` from the command line (``python -m harness battery``) or
from pytest's options (the plugin), and :class:`RunSpec`, one run of one recipe on one case.

A ``RunSpec`` is what keys the runner's cache and what travels to the ranks: the recipe reference, the model and its
batch format, the strategy, precision, world size and scenario, and how the run is launched. Both surfaces validate
through :meth:`BatteryOptions.parse`, so a bad value gets the same message, naming the option both surfaces share.

Pure Python: the pytest plugin validates options here at start-up without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

# --objective: what the recipe's gradient must be the gradient of (the names, pure Python; the formulas are in
# harness.core.objectives).
from harness.battery.plan.mesh_options import (
    CHUNKING_HELP,
    DDP_OVER_TP,
    MESH_HELP,
    PP_MAX_MICROBATCHES,
    PP_MICROBATCHES_HELP,
    PP_SCHEDULE_HELP,
    PP_STEPS_HELP,
    check_format_over,
    check_layout,
    check_pp_count,
    check_pp_schedule,
    check_strategy_over,
)
from harness.battery.plan.selection import QUICK_HELP, SKIP_HELP, parse_skips, quick_choices
from harness.core.mesh import CHUNKINGS, Mesh
from harness.core.objective_names import OBJECTIVES, check_objective

DEADLINE = 30.0
"""Seconds one battery run (one launch) may take (``--battery-deadline``)."""

MAX_WORLD_SIZE = 8
"""The largest world size ``--battery-world-sizes`` accepts: the in-process launcher's ranks share this machine's
cores (a larger job runs under torchrun, :mod:`harness.battery.dist`)."""

MAX_SCENARIO_WORLD_SIZE = 32
"""The largest world size the battery's scenarios are built for (``harness.battery.scenarios``: rank r reads the
r-th of W length bands of the corpus, and past 32 the narrowest band holds no sequence)."""

WORLD_SIZES = (1, 2, 3, 4)
"""World sizes every recipe runs at: 1 is the sanity lane, 2-4 the data-parallel ones."""

PRECISIONS = ("fp32", "fp64", "bf16")
"""The battery's lanes: float32 (tolerances atol 1e-6, rtol 1e-4), the strict float64 lane, and bf16 (autocast under
DDP, ``MixedPrecisionPolicy`` under FSDP2; judged against float64 with a bound derived from the measured noise,
:mod:`harness.battery.prepare.bf16`)."""

PRECISION_CHOICES = {"fp32": ("fp32",), "fp64": ("fp64",), "bf16": ("bf16",), "both": ("fp32", "fp64")}
"""``--precision``: one lane, ``both`` (float32 and float64), or a comma-separated list of lanes
(``fp32,bf16``)."""

STRATEGY_CHOICES = {"ddp": ("ddp",), "fsdp2": ("fsdp2",), "both": ("ddp", "fsdp2")}
"""``--strategy``: the ranks wrap the model in DDP (the default), shard it with FSDP2 (``fully_shard``), or both."""

BATCH_FORMATS = ("harness", "hf", "packed")
"""``--batch-format``: the harness's Microbatch with aligned labels, the dict a Hugging Face loop sees, or its
padding-free packed rows (``harness.core.formats``, whose ``BATCH_FORMATS`` this mirrors without importing torch)."""

BATCH_FORMAT_HELP = ("what a recipe receives per microbatch: the harness's Microbatch (aligned labels, default); hf, "
                     "the dict a Hugging Face loop sees (input_ids, attention_mask, unshifted labels; shift in the "
                     "loss); or packed, padding-free rows as transformers' DataCollatorWithFlattening builds them "
                     "(several sequences per row: input_ids, labels with -100 at each sequence's start, position_ids "
                     "restarting at 0, seq_idx, cu_seq_lens_q/k, max_length_q/k, no attention_mask), judged against "
                     "the same sequences unpacked (docs/your-model.md)")

KEEP_GOING_HELP = ("run every case even when the recipe raises in the pre-flight (by default the recipe first runs "
                   "once on the smallest case, and a recipe that raises there stops the battery with one message: "
                   "the exception, the rank and the line of the recipe's code; exit status 1)")
"""``--batch-format``'s help, the same on every surface."""

FIND_UNUSED = ("auto", "on", "off")
"""``--find-unused-parameters``: ``auto`` (the default) wraps the ranks' DDP with ``find_unused_parameters=True`` when
the reference finds a parameter without a gradient in some microbatch, and says so; ``on`` always; ``off`` never (a
model that needs it then fails with DDP's own error and the parameters named)."""

DEFAULT_EXAMPLES = 12
"""Drawn layouts the property lane checks (``--battery-examples``)."""

REDUCTIONS = ("mean", "sum")
"""How the harness's comm hook combines the ranks' gradients: DDP's average, or a sum."""


LANE_OPTIONS: dict[str, dict[str, Any]] = {
    "--strategy": {"default": "ddp", "choices": tuple(STRATEGY_CHOICES),
                   "help": "the data-parallel strategy the ranks run under: ddp (DistributedDataParallel, default), "
                   "fsdp2 (the harness shards the model with fully_shard per block and the root), or both"},
    "--precision": {"default": "both", "metavar": "LANES",
                    "help": "fp32, fp64, bf16 (a bound derived from the measured noise), both (fp32,fp64: the "
                    "default) or lanes separated by commas (fp32,bf16)"},
    "--objective": {"default": "token_mean", "metavar": "NAME",
                    "help": "what the gradient must be the gradient of: token_mean (default), sequence_mean, "
                    "weighted_token_mean or fixed_normalizer (docs/objectives.md)"},
}
"""The options that say which lanes a recipe is judged in, as the command line declares them for ``battery`` and
``explain`` alike (one name, one set of values, one validation: :meth:`BatteryOptions.parse`)."""


def add_lane_options(parser: Any, **defaults: str) -> None:
    """Declare :data:`LANE_OPTIONS` on an ``argparse`` parser; ``defaults`` overrides a default by its ``dest``
    (``precision="fp32"``), and the help then names the new default."""
    for flag, spec in LANE_OPTIONS.items():
        spec = dict(spec)
        dest = flag[2:]
        if dest in defaults:
            spec["help"] += f" (here the default is {defaults[dest]})"
            spec["default"] = defaults[dest]
        parser.add_argument(flag, **spec)


def parse_world_sizes(text: str | Sequence[int], option: str = "--battery-world-sizes") -> tuple[int, ...]:
    """``"1,2,4"`` -> ``(1, 2, 4)``, validated; ValueError naming the option and the fix otherwise."""
    if not isinstance(text, str):
        return check_world_sizes(list(text), option)
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        msg = f"{option}={text!r} must be comma-separated world sizes from 1 to {MAX_WORLD_SIZE}, e.g. 1,2"
        raise ValueError(msg) from None
    return check_world_sizes(worlds, option)


def check_world_sizes(world_sizes: Sequence[int], option: str = "--battery-world-sizes",
                      limit: int = MAX_WORLD_SIZE) -> tuple[int, ...]:
    """Validate world sizes: from 1 to ``limit`` (the in-process launcher's :data:`MAX_WORLD_SIZE` by default; the
    scenarios' :data:`MAX_SCENARIO_WORLD_SIZE` under torchrun)."""
    bad = [w for w in world_sizes if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= limit]
    if bad or not world_sizes:
        msg = (f"{option}={','.join(map(str, world_sizes))!r} must be world sizes between 1 and {limit}, "
               "e.g. 1,2,3,4")
        raise ValueError(msg)
    return tuple(dict.fromkeys(world_sizes))


def parse_meshes(value: str | Sequence[str] | None, option: str = "--mesh",
                 max_world_size: int | None = MAX_WORLD_SIZE) -> tuple[Mesh, ...]:
    """``--mesh`` as meshes: None or nothing -> none (``dp=W``); each shape ``"dp=2,cp=2"`` (the option repeated, or
    shapes separated by spaces or ``;``), validated as the battery runs it; ValueError naming the option otherwise.
    ``max_world_size``: the most ranks one process launches (None: no limit, torchrun starts the ranks)."""
    if value is None:
        return ()
    texts = [value] if isinstance(value, str) else list(value)
    shapes = [s for t in texts for s in str(t).replace(";", " ").split()]
    out = []
    for shape in shapes:
        mesh = Mesh.parse(shape, option)
        check_layout(mesh, mesh.world_size, option)
        if max_world_size is not None and mesh.world_size > max_world_size:
            msg = (f"{option}={shape!r} has {mesh.world_size} ranks: at most {max_world_size} run in one process "
                   f"(and {MAX_SCENARIO_WORLD_SIZE} data-parallel ranks); more run under torchrun")
            raise ValueError(msg)
        if mesh.data_ranks > MAX_SCENARIO_WORLD_SIZE:
            msg = (f"{option}={shape!r} has {mesh.data_ranks} data-parallel ranks: the scenarios are built for at "
                   f"most {MAX_SCENARIO_WORLD_SIZE}")
            raise ValueError(msg)
        out.append(mesh)
    return tuple(dict.fromkeys(out))


def precisions(choice: str, option: str = "--precision") -> tuple[str, ...]:
    """The lanes of ``--precision``: a name of :data:`PRECISION_CHOICES`, or lanes separated by commas."""
    if isinstance(choice, str) and choice in PRECISION_CHOICES:
        return PRECISION_CHOICES[choice]
    lanes = choice.split(",") if isinstance(choice, str) else []
    if not lanes or any(lane not in PRECISIONS for lane in lanes):
        msg = (f"{option}={choice!r} must be one of {', '.join(PRECISION_CHOICES)} or lanes separated by commas "
               f"(from {', '.join(PRECISIONS)}, e.g. fp32,bf16)")
        raise ValueError(msg)
    return tuple(dict.fromkeys(lanes))


def strategies(choice: str, option: str = "--strategy") -> tuple[str, ...]:
    if choice not in STRATEGY_CHOICES:
        msg = f"{option}={choice!r} must be one of {', '.join(STRATEGY_CHOICES)}"
        raise ValueError(msg)
    return STRATEGY_CHOICES[choice]


def check_find_unused(value: str, option: str = "--find-unused-parameters") -> str:
    if value not in FIND_UNUSED:
        msg = f"{option}={value!r} must be one of {', '.join(FIND_UNUSED)} (auto: on when a parameter gets no gradient)"
        raise ValueError(msg)
    return value


def _choice(value: object, choices: Sequence[str], option: str) -> str:
    if value not in choices:
        msg = f"{option}={value!r} must be one of {', '.join(choices)}"
        raise ValueError(msg)
    return str(value)


def _deadline(value: object, option: str = "--battery-deadline") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        msg = f"{option}={value!r} must be a positive number of seconds, e.g. 120"
        raise ValueError(msg)
    return float(value)


@dataclass(frozen=True)
class RunSpec:
    """One battery run: ``recipe`` (``"pkg.mod:attr"``) on ``scenario`` at ``world_size`` in ``precision``, on
    ``model`` (``"pkg.mod:factory"``; None: the built-in model) with ``batch_format``, the initial weights of
    ``init_seed`` (None: the battery config's), wrapped by ``strategy``, judged under ``objective``; ``reduction``,
    ``find_unused``, ``device``, ``backend``, ``deadline`` and ``nodes`` (how many nodes the ranks' environment says
    they are spread over: :func:`harness.distributed.launcher.launch`) say how it is launched. Hashable: the runner
    caches one run per spec, and it is what the ranks receive."""

    recipe: str
    scenario: str = "custom"
    world_size: int = 2
    precision: str = "fp32"
    model: str | None = None
    batch_format: str = "harness"
    init_seed: int | None = None
    strategy: str = "ddp"
    reduction: str | None = None
    """How the ranks' gradients are combined: ``"mean"``, ``"sum"``, or None (the default): what the recipe declares
    (its ``reduction`` attribute), else the mean."""
    find_unused: str = "auto"
    device: str = "cpu"
    backend: str = "gloo"
    deadline: float = DEADLINE
    nodes: int = 1
    objective: str = "token_mean"
    layout: Mesh | None = None
    """The ranks' mesh (:class:`harness.core.mesh.Mesh`, e.g. ``Mesh.parse("dp=2,cp=2")``); None: ``dp=W``. Read it as
    :attr:`mesh`."""
    chunking: str = "contiguous"
    """How the cp ranks split a sequence's positions (:mod:`harness.data.context_parallel`)."""
    pp_schedule: str = "gpipe"
    """The schedule a recipe's ``pipeline.schedule()`` builds on a mesh with pp (:data:`PP_SCHEDULES`)."""
    pp_steps: int = 1
    """A: the schedule steps a pipelined recipe accumulates each window over (``pipeline.accumulation_steps``)."""
    pp_microbatches: int = 2
    """M: the microbatches of each schedule step (``pipeline.n_microbatches``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.recipe, str) or ":" not in self.recipe:
            msg = f"recipe={self.recipe!r} must be a 'package.module:attr' string"
            raise ValueError(msg)
        if isinstance(self.world_size, bool) or not isinstance(self.world_size, int) or self.world_size < 1:
            msg = f"world_size={self.world_size!r} must be a positive number of ranks"
            raise ValueError(msg)
        _choice(self.precision, PRECISIONS, "precision")
        _choice(self.strategy, STRATEGY_CHOICES["both"], "strategy")
        _choice(self.batch_format, BATCH_FORMATS, "batch_format")
        if self.reduction is not None:
            _choice(self.reduction, REDUCTIONS, "reduction")
        check_objective(self.objective, "objective")
        check_find_unused(self.find_unused, "find_unused")
        _deadline(self.deadline, "deadline")
        if self.layout is not None:
            check_layout(self.layout, self.world_size)
            check_strategy_over(self.layout, (self.strategy,))
            check_format_over(self.layout, self.batch_format)
        if self.chunking not in CHUNKINGS:
            msg = f"chunking={self.chunking!r} must be one of {', '.join(CHUNKINGS)}"
            raise ValueError(msg)
        check_pp_schedule(self.pp_schedule, "pp_schedule")
        for field, default in (("pp_steps", 1), ("pp_microbatches", 2)):
            value = getattr(self, field)
            if isinstance(value, str) or check_pp_count(value, field, default) != value:
                msg = f"{field}={value!r} must be an int from 1 to {PP_MAX_MICROBATCHES}, e.g. {field}={default}"
                raise ValueError(msg)
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1 \
                or self.world_size % self.nodes:
            msg = (f"nodes={self.nodes!r} must be a positive number of nodes that divides world_size={self.world_size} "
                   "(each node holds world_size // nodes consecutive ranks)")
            raise ValueError(msg)

    @property
    def mesh(self) -> Mesh:
        """The layout of the run's ranks (:mod:`harness.core.mesh`): which of them share a window, which group a count
        is reduced over. Every stage reads it here; without a ``layout``, one-dimensional data parallelism over the
        world size."""
        return self.layout if self.layout is not None else Mesh.data_parallel(self.world_size)

    def at(self, scenario: str, world_size: int, precision: str) -> RunSpec:
        """The same run on another case."""
        return replace(self, scenario=scenario, world_size=world_size, precision=precision)


@dataclass(frozen=True)
class BatteryOptions:
    """What a battery session runs with, parsed once (:meth:`parse`) from either surface: the model and batch format,
    the strategy, the precision lanes, the world sizes, the drawn-layout budget, each run's deadline, DDP's
    ``find_unused_parameters`` policy and the report's path."""

    model: str | None = None
    batch_format: str = "harness"
    strategy: str = "ddp"
    precision: str = "both"
    world_sizes: tuple[int, ...] = WORLD_SIZES
    examples: int = DEFAULT_EXAMPLES
    deadline: float = DEADLINE
    find_unused: str = "auto"
    report: str | None = None
    objective: str = "token_mean"
    meshes: tuple[Mesh, ...] = ()
    """``--mesh``: the shapes the plan's cases run over instead of ``dp=W`` at each world size (the world sizes still
    choose the drawn layouts' and the controls'); empty: ``dp=W``."""
    chunking: str = "contiguous"
    """``--cp-chunking``: how the cp ranks of a mesh split the positions (:data:`harness.core.mesh.CHUNKINGS`)."""
    pp_schedule: str = "gpipe"
    """``--pp-schedule``: the schedule of a mesh with pp (:data:`harness.core.mesh.PP_SCHEDULES`)."""
    pp_steps: int = 1
    """``--pp-steps``: the schedule steps of each pipelined window (A)."""
    pp_microbatches: int = 2
    """``--pp-microbatches``: the microbatches of each schedule step (M)."""
    skip: tuple[tuple[str, str], ...] = ()
    """``--battery-skip``: (check, reason) pairs whose verdicts are recorded as skipped (:mod:`.selection`)."""
    quick: bool = False
    """``--quick``: only the scenarios that tell the known mistakes apart (:data:`.selection.QUICK_SCENARIOS`)."""

    @classmethod
    def parse(cls, *, model: str | None = None, batch_format: str = "harness", strategy: str = "ddp",
              precision: str = "both", world_sizes: str | Sequence[int] = WORLD_SIZES,
              examples: int | None = DEFAULT_EXAMPLES, deadline: float | None = None, find_unused: str = "auto",
              report: str | None = None, objective: str = "token_mean",
              mesh: str | Sequence[str] | None = None, chunking: str | None = "contiguous",
              pp_schedule: str | None = "gpipe", pp_steps: int | str | None = 1,
              pp_microbatches: int | str | None = 2, skip: str | Sequence[str] | None = None,
              quick: bool = False) -> BatteryOptions:
        """Validated options; ValueError naming the option (the name both surfaces share), the value and the fix.
        ``quick``: :func:`.selection.quick_choices` picks the world sizes, precision and examples left at default."""
        if quick:
            world_sizes, precision, examples = quick_choices(world_sizes, precision, examples)  # type: ignore[assignment]
        precisions(precision)
        strategies(strategy)
        if isinstance(examples, bool) or not isinstance(examples, int) or examples < 0:
            msg = f"--battery-examples={examples} must be 0 (no drawn layouts) or a positive number"
            raise ValueError(msg)
        if model is not None and (not isinstance(model, str) or ":" not in model):
            msg = f"--model={model!r} must be 'package.module:factory'"
            raise ValueError(msg)
        meshes = parse_meshes(mesh)
        for shape in meshes:
            check_strategy_over(shape, strategies(strategy), "--strategy")
            check_format_over(shape, batch_format, "--batch-format")
        return cls(model=model, batch_format=_choice(batch_format, BATCH_FORMATS, "--batch-format"),
                   strategy=strategy, precision=precision,
                   world_sizes=parse_world_sizes(world_sizes), examples=examples,
                   deadline=DEADLINE if deadline is None else _deadline(deadline),
                   find_unused=check_find_unused(find_unused), report=report, objective=check_objective(objective),
                   meshes=meshes, chunking=_choice(chunking or "contiguous", CHUNKINGS, "--cp-chunking"),
                   pp_schedule=check_pp_schedule(pp_schedule or "gpipe"),
                   pp_steps=check_pp_count(pp_steps, "--pp-steps", 1),
                   pp_microbatches=check_pp_count(pp_microbatches, "--pp-microbatches", 2),
                   skip=parse_skips(skip), quick=bool(quick))

    @property
    def lanes(self) -> tuple[str, ...]:
        return precisions(self.precision)

    @property
    def strategy_lanes(self) -> tuple[str, ...]:
        return STRATEGY_CHOICES[self.strategy]

    def spec(self, recipe: str, scenario: str, world_size: int, precision: str, *,
             batch_format: str | None = None, strategy: str | None = None,
             objective: str | None = None, mesh: Mesh | None = None, model: str | None = None) -> RunSpec:
        """The run of ``recipe`` on one case under these options (``batch_format``, ``objective``: a control written
        for another format or objective than the session's; ``strategy``: one of the session's strategy lanes, the
        first by default; ``model``: a control written for another model than the session's)."""
        return RunSpec(recipe, scenario, world_size, precision, model=model or self.model,
                       batch_format=batch_format or self.batch_format, strategy=strategy or self.strategy_lanes[0],
                       find_unused=self.find_unused, deadline=self.deadline, objective=objective or self.objective,
                       layout=mesh, chunking=self.chunking, pp_schedule=self.pp_schedule, pp_steps=self.pp_steps,
                       pp_microbatches=self.pp_microbatches)


PYTEST_OPTIONS = {"model": "model", "batch_format": "batch_format", "strategy": "strategy", "precision": "precision",
                  "world_sizes": "battery_world_sizes", "examples": "battery_examples",
                  "deadline": "battery_deadline", "find_unused": "find_unused_parameters", "report": "battery_report",
                  "objective": "objective", "mesh": "mesh", "chunking": "cp_chunking",
                  "pp_schedule": "pp_schedule", "pp_steps": "pp_steps", "pp_microbatches": "pp_microbatches",
                  "skip": "battery_skip", "quick": "battery_quick"}
"""Each :meth:`BatteryOptions.parse` argument's pytest option (its ``dest``; the flags are the command line's)."""

_CACHED = "_harness_battery_options"


def from_pytest(config: Any) -> BatteryOptions:
    """The session's options from a ``pytest.Config``, parsed on first use and kept on the config (the plugin at
    start-up, the battery's collection hooks after it); ValueError as :meth:`BatteryOptions.parse`."""
    cached = getattr(config, _CACHED, None)
    if isinstance(cached, BatteryOptions):
        return cached
    options = BatteryOptions.parse(**{arg: config.getoption(dest) for arg, dest in PYTEST_OPTIONS.items()})
    setattr(config, _CACHED, options)
    return options


__all__ = [
    "BATCH_FORMATS",
    "BATCH_FORMAT_HELP",
    "CHUNKING_HELP",
    "DDP_OVER_TP",
    "DEADLINE",
    "DEFAULT_EXAMPLES",
    "FIND_UNUSED",
    "KEEP_GOING_HELP",
    "LANE_OPTIONS",
    "MAX_SCENARIO_WORLD_SIZE",
    "MAX_WORLD_SIZE",
    "MESH_HELP",
    "OBJECTIVES",
    "PP_MAX_MICROBATCHES",
    "PP_MICROBATCHES_HELP",
    "PP_SCHEDULE_HELP",
    "PP_STEPS_HELP",
    "PRECISIONS",
    "PRECISION_CHOICES",
    "PYTEST_OPTIONS",
    "QUICK_HELP",
    "SKIP_HELP",
    "STRATEGY_CHOICES",
    "WORLD_SIZES",
    "BatteryOptions",
    "RunSpec",
    "add_lane_options",
    "check_find_unused",
    "check_format_over",
    "check_objective",
    "check_pp_count",
    "check_pp_schedule",
    "check_strategy_over",
    "check_world_sizes",
    "from_pytest",
    "parse_world_sizes",
    "precisions",
    "strategies",
]
