"""The launch: a battery run's ranks started with a deadline, after the parent's preparation.

A run goes through these stages, each in its own module (``docs/layout.md`` draws them):

1. the plan (:mod:`harness.battery.plan.cases`): the cases, from the options (:mod:`harness.battery.plan.options`);
2. preparation (:mod:`harness.battery.prepare.steps`): the model's facts, the reference chain, the bf16 noise;
3. the rank program (:mod:`harness.battery.rank.rank_program`): what every rank runs;
4. the launch (this module): :func:`run` (cached per :class:`~harness.battery.plan.options.RunSpec`),
   :func:`run_windows` (explicit windows) and :func:`launch_run`, each giving a
:class:`~harness.battery.launch.run.Run`; 5. judging: the checks (:mod:`harness.battery.judge.checks`, listed in
:mod:`harness.battery.judge.registry`), each giving a
   :class:`~harness.battery.judge.verdict.Verdict`, a failed launch read as one
(:mod:`harness.battery.judge.failed_runs`); 6. diagnosis (:mod:`harness.battery.diagnose.of_run`); 7. the report
(:mod:`harness.battery.report.table`,
   :mod:`harness.battery.report.junit`).

``model`` (``"pkg.mod:factory"``) checks the recipe on a user's model instead of the built-in one, and
``batch_format="hf"`` hands the recipe each microbatch as the dict a Hugging Face loop sees; both travel to the ranks
as one :class:`~harness.battery.spec.ModelSpec`, and the reference is computed with the same model and convention
(``batch_format="packed"``: padding-free rows, judged against the same sequences unpacked, the hf way).
"""

from __future__ import annotations

from harness.battery import mesh_scenarios, scenarios
from harness.battery.launch import printed
from harness.battery.launch.run import Run
from harness.battery.plan.options import RunSpec
from harness.battery.prepare.steps import prepare
from harness.battery.rank.rank_program import rank_body
from harness.battery.spec import model_modules
from harness.distributed.launcher import LaunchError, launch
from harness.recipes import recipe_module

LOCKSTEP_GRACE = 2.0
"""Seconds a rank may lag behind a peer that finished (or refused) the same window before the run is stopped as a
desync: every window ends in a collective (DDP's synchronization, or the count), so ranks finish it together unless
one of them left a collective unmatched."""

_CACHE: dict[RunSpec, Run] = {}


def run(recipe: str | RunSpec, scenario: str | None = None, world_size: int | None = None, precision: str = "fp32",
        probe: bool = False, **options: object) -> Run:
    """Launch a run on its named scenario, cached per :class:`~harness.battery.plan.options.RunSpec` for the session:
    ``run(spec)``, or ``run(recipe, scenario, world_size, precision, **options)`` with the spec's other fields as
    keywords (``model``, ``batch_format``, ``strategy``, ``find_unused``, ``deadline``, ...). ``probe``: the model's
    probe runs first, in the same preparation (:func:`~harness.battery.prepare.steps.prepare`)."""
    if isinstance(recipe, RunSpec):
        spec = recipe
    else:
        if scenario is None or world_size is None:
            msg = "run(recipe, scenario, world_size, ...) needs the scenario and the world size (or pass a RunSpec)"
            raise TypeError(msg)
        spec = RunSpec(recipe, scenario, world_size, precision, **options)  # type: ignore[arg-type]
    if spec not in _CACHE:
        windows = mesh_scenarios.build(spec.scenario, spec.mesh, spec.chunking)
        _CACHE[spec] = launch_run(spec, windows, share_chain=True, probe=probe)
    return _CACHE[spec]


def run_windows(recipe: str, windows: scenarios.Windows, precision: str = "fp32", *, scenario: str = "custom",
                env: dict[str, str] | None = None, **options: object) -> Run:
    """Launch ``recipe`` on explicit ``windows[k][rank][microbatch]`` (world size = ranks per window); not cached.
    ``options`` are :class:`~harness.battery.plan.options.RunSpec`'s other fields (``model``, ``batch_format``,
    ``init_seed``, ``reduction``, ``strategy``, ``find_unused``, ``deadline``, ``device``, ``backend``)."""
    if not windows or len({len(w) for w in windows}) != 1:
        msg = "windows must be a non-empty list of windows with the same number of ranks each"
        raise ValueError(msg)
    spec = RunSpec(recipe, scenario, len(windows[0]), precision, **options)  # type: ignore[arg-type]
    return launch_run(spec, windows, env=env)


def launch_run(spec: RunSpec, windows: scenarios.Windows, env: dict[str, str] | None = None, *,
               share_chain: bool = False, probe: bool = False) -> Run:
    """Launch ``spec`` on ``windows`` through the in-process launcher: :func:`prepare`, then the ranks (not cached).

    ``reduction="sum"`` makes the harness's comm hook sum gradients instead of averaging them (DDP's default);
    ``init_seed`` draws other initial weights (the same on every rank and in the reference). ``model``
    (``"pkg.mod:factory"``) builds the user's model on every rank and for the reference, from the same seed;
    ``batch_format="hf"`` gives the recipe the dicts of :func:`harness.core.formats.to_hf`, ``"packed"`` those of
    :func:`harness.core.formats.to_packed` (the reference: the same sequences unpacked). ``find_unused``: see
    :data:`FIND_UNUSED`; ``strategy``: the data-parallel strategy the ranks wrap the model with
    (:mod:`harness.distributed.strategies`). A user's model that cannot run one of the microbatches gives a run with
    ``model_error`` set and no launch.
    """
    ready = prepare(spec, windows, share_chain=share_chain, probe=probe)
    if ready.chain.model_error is not None:
        return ready.run(None, model_error=ready.chain.model_error)
    # The forkserver imports the rank program, the recipe's module and the model's once, rather than every rank of
    # every launch as it unpickles its function.
    preload = tuple(m for m in (rank_body.__module__, recipe_module(spec.recipe), *model_modules(spec.model)) if m)
    # FSDP2 and DTensor's parallel styles: a second or more of imports each rank would pay itself, in every launch
    # (a DDP run asks for neither, and its server never imports them).
    if spec.strategy == "fsdp2":
        preload += ("torch.distributed.fsdp",)
    if spec.mesh.size("tp") > 1:
        preload += ("torch.distributed.tensor.parallel",)
    quiet = printed.collecting()  # the ranks' prints: once per distinct line at the battery's end (printed.py)
    try:
        records = launch(rank_body, spec.mesh.world_size, spec, ready.windows, ready.digest, ready.wrap,
                         ready.chain.max_norm, None if ready.start is None else ready.start.numpy(),
                         deadline=spec.deadline, backend=spec.backend, device=spec.device, env=env, preload=preload,
                         lockstep_grace=LOCKSTEP_GRACE, nodes=spec.nodes, relay_output=not quiet)
    except LaunchError as exc:
        printed.record(exc.output)
        return ready.failed(exc)
    printed.record(records.output)
    return ready.run(records)

