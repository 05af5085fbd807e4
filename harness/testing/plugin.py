"""The harness's pytest plugin: markers, options and fixtures shared by the repository's tests and the shipped battery.

Loaded by the repository's ``conftest.py`` from a checkout, or by the ``pytest11`` entry point once installed, so
another project can run ``pytest --pyargs harness.battery --recipe=theirpkg.module:attr``.

It is loaded in every pytest run of an environment that has the package, so it costs a run that runs no battery test
nothing: torch, the battery and the recipes are imported only when a battery test runs, or when ``--recipe`` or
``--battery-report`` is given (``tests/unit/test_plugin_cost.py``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from harness.battery.judge.verdict import Verdict
    from harness.battery.plan.options import BatteryOptions
    from harness.resume.options import ResumeOptions

MARKERS = {
    "recipe": "the recipe battery: gradient-semantics checks of a recipe (--recipe=pkg.module:attr picks it)",
    "resume": "the resume battery: kill-and-resume equality of a training loop (--trainer=pkg.module:factory picks it)",
    "audit": "the audit of a training script, unchanged (pytest --pyargs harness.audit --audit-command=...)",
    "gpu": "needs one CUDA device",
    "gpu2": "needs two CUDA devices and NCCL (one rank per device)",
    "slow": "over ~10 s; scripts/test.sh leaves it out, `scripts/test.sh -m slow` runs it (CI runs both)",
    "required_gpus_missing": "set by harness.testing.skips when HARNESS_REQUIRE_GPUS requires a GPU lane this machine "
    "cannot run: the test fails with the marker's message instead of skipping",
}

_PROPERTY = "battery_verdict"


def pytest_addoption(parser: pytest.Parser) -> None:
    # pure Python, like every option's parsing
    from harness.battery.plan.options import (
        BATCH_FORMAT_HELP,
        BATCH_FORMATS,
        CHUNKING_HELP,
        KEEP_GOING_HELP,
        MESH_HELP,
        PP_MICROBATCHES_HELP,
        PP_SCHEDULE_HELP,
        PP_STEPS_HELP,
        QUICK_HELP,
        SKIP_HELP,
    )

    group = parser.getgroup("ddp-harness", "distributed gradient semantics")
    group.addoption(
        "--recipe", default=None, metavar="PKG.MODULE:ATTR",
        help="the recipe the battery checks: an instance or a zero-argument factory (default: the harness's correct "
        "recipe, harness.recipes.CORRECT_RECIPE)",
    )
    group.addoption(
        "--model", default=None, metavar="PKG.MODULE:FACTORY",
        help="the model the battery checks the recipe on: a zero-argument callable returning a torch.nn.Module (or an "
        "nn.Module class), built on every rank and for the reference after torch.manual_seed(init seed), dropout "
        "disabled; its output may be logits, a tuple starting with them, or an object with .logits (default: the "
        "harness's TinyCausalLM)",
    )
    group.addoption(
        "--batch-format", default="harness", choices=BATCH_FORMATS, help=BATCH_FORMAT_HELP,
    )
    group.addoption("--mesh", action="append", default=None, metavar="DIM=N,...", help=MESH_HELP)
    group.addoption("--cp-chunking", default="contiguous", metavar="contiguous|load_balanced", help=CHUNKING_HELP)
    group.addoption("--pp-schedule", default="gpipe", metavar="gpipe|1f1b|...", help=PP_SCHEDULE_HELP)
    group.addoption("--pp-steps", default="1", metavar="A", help=PP_STEPS_HELP)
    group.addoption("--pp-microbatches", default="2", metavar="M", help=PP_MICROBATCHES_HELP)
    group.addoption(
        "--strategy", default="ddp", choices=("ddp", "fsdp2", "both"),
        help="the data-parallel strategy the battery's ranks run under: ddp (DistributedDataParallel, default), fsdp2 "
        "(the harness shards the model with fully_shard per block and the root, and counts its reduce-scatters), or "
        "both",
    )
    group.addoption(
        "--objective", default="token_mean", metavar="NAME",
        help="what the recipe's gradient must be the gradient of: token_mean (default: the mean over every supervised "
        "token of the global window), sequence_mean, weighted_token_mean (per-token weights the harness draws) or "
        "fixed_normalizer (a loss sum over the constant the recipe declares as `normalizer`); docs/objectives.md",
    )
    group.addoption(
        "--find-unused-parameters", default="auto", choices=("auto", "on", "off"),
        help="DDP's find_unused_parameters for the battery's ranks: auto (default) turns it on, with a note, when the "
        "single-device reference finds a parameter without a gradient in some microbatch; on; off",
    )
    group.addoption(
        "--battery-report", default=None, metavar="PATH",
        help="write the battery report as JSON to PATH: every verdict (world size, precision, pass/fail/n/a, max "
        "error, tolerance ratio), the expected and run counts, errors outside a verdict, and pytest's exit status",
    )
    group.addoption(
        "--precision", default="both", metavar="LANES",
        help="the battery's lanes: fp32 (atol 1e-6, rtol 1e-4), fp64 (the strict lane), bf16 (autocast under DDP, "
        "MixedPrecisionPolicy under FSDP2, judged by a bound derived from the measured noise), both (fp32,fp64: the "
        "default), or lanes separated by commas (fp32,bf16)",
    )
    group.addoption(
        "--battery-world-sizes", default="1,2,3,4", metavar="W,...",
        help="world sizes the battery runs at (default: 1,2,3,4)",
    )
    group.addoption(
        "--battery-examples", default=12, type=int, metavar="N",
        help="drawn layouts the battery's property lane checks (default: 12; each is one multi-rank launch; 0: none)",
    )
    group.addoption("--battery-skip", dest="battery_skip", action="append", default=None, metavar="CHECK[=REASON]",
                    help=SKIP_HELP)
    group.addoption("--quick", dest="battery_quick", action="store_true", default=False, help=QUICK_HELP)
    group.addoption("--battery-keep-going", dest="battery_keep_going", action="store_true", default=False,
                    help=KEEP_GOING_HELP)
    group.addoption(
        "--trainer", default=None, metavar="PKG.MODULE:FACTORY",
        help="the training loop the resume battery checks (pytest --pyargs harness.resume): a zero-argument factory "
        "called on every rank whose result has step(), save(folder), load(folder) and state() (default: the "
        "harness's trainer, harness.training.trainer:trainer_factory)",
    )
    group.addoption(
        "--audit-command", default=None, metavar="COMMAND",
        help="the training script the audit lane judges (pytest --pyargs harness.audit), as you run it: "
        '"torchrun --nproc-per-node 2 train.py --its-args" (docs/audit.md)',
    )
    group.addoption("--audit-options", default=None, metavar="OPTIONS",
                    help='options of python -m harness audit for the audit lane, e.g. "--windows 2 --unbalance"')
    group.addoption("--resume-steps", default=20, type=int, metavar="S",
                    help="the resume battery's continuous run length in optimizer steps (default: 20)")
    group.addoption("--resume-every", default=5, type=int, metavar="K",
                    help="the resume battery checkpoints every K steps and at each stop (default: 5)")
    group.addoption("--resume-world-size", default=2, type=int, metavar="W",
                    help="ranks of every run of the resume battery (default: 2)")
    group.addoption("--resume-seed", default=0, type=int, metavar="N",
                    help="seeds the global generators and the draw of the resume battery's stop and kill steps")
    group.addoption(
        "--battery-deadline", default=None, type=float, metavar="SECONDS",
        help="seconds one battery run (one launch) may take before it is called hung (default: "
        "harness.battery.plan.options.DEADLINE, 30); raise it for a slow model, e.g. one under torch.compile",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")
    from harness.testing import preflight_plugin  # the pre-flight and the ranks' prints said once

    config.pluginmanager.register(preflight_plugin, "harness-preflight")
    # A bad --recipe is a usage error now, in the parent, not a traceback from deep inside a rank later. The default
    # recipe needs no check (the harness's tests cover it), and so a run without --recipe does not import torch here.
    if config.getoption("recipe") is not None:
        from harness.recipes import RecipeError, load_recipe

        try:
            load_recipe(config.getoption("recipe"))
        except RecipeError as exc:
            raise pytest.UsageError(f"--recipe: {exc}") from None
        objective = config.getoption("objective")
        if objective == "fixed_normalizer":  # the constant is the recipe's to declare: say so before any run
            from harness.battery.prepare.objective import resolve

            try:
                resolve(objective, config.getoption("recipe"))
            except ValueError as exc:
                raise pytest.UsageError(f"--objective: {exc}") from None
    if config.getoption("trainer") is not None:
        from harness.resume.contract import TrainerError, resolve_factory

        try:
            resolve_factory(config.getoption("trainer"))
        except TrainerError as exc:
            raise pytest.UsageError(str(exc)) from None
    resume_options_from(config)  # bad --resume-* values are a usage error now (pure Python: no torch imported)
    _MODEL_NOTES.clear()
    # The model probe (its backward checked by finite differences included) runs before a battery of a user's recipe
    # or model; a session of the harness's own tests does not import torch here.
    if config.getoption("model") is not None or config.getoption("recipe") is not None:
        from harness.battery.prepare.probe.facts import probe
        from harness.model import ModelError

        model = config.getoption("model")
        try:
            found = probe(model, config.getoption("batch_format"))
            _MODEL_NOTES[:] = found.notes() if model is not None else ()
        except ModelError as exc:
            raise pytest.UsageError(f"--model: {exc}" if model is not None else str(exc)) from None
    options = options_from(config)  # bad options are a usage error now, before collection (parsed once: kept)
    if any(m.size("tp") > 1 or m.size("pp") > 1 for m in options.meshes):
        from harness.battery.prepare.probe.facts import probe_meshes
        from harness.model import ModelError

        try:  # a model without a tp plan or a pp split it can run is refused once, before any verdict
            probe_meshes(options.model, options.meshes, options.batch_format, options.pp_schedule)
        except ModelError as exc:
            raise pytest.UsageError(f"--model: {exc}" if options.model is not None else str(exc)) from None
    _check_required_gpus()
    _CONTROLLER_VERDICTS.clear()
    _ERRORS.clear()
    _SESSION.clear()


# HARNESS_REQUIRE_GPUS: harness.testing.skips decides at collection which GPU lanes must fail instead of skipping and
# marks their tests; this part refuses a bad value at start-up and fails the marked tests before any skip is evaluated.


def _check_required_gpus() -> None:
    from harness.testing.skips import REQUIRE_GPUS_ENV, required_gpus

    try:
        required_gpus(os.environ.get(REQUIRE_GPUS_ENV))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    from harness.testing.skips import REQUIRED_MARK

    for mark in item.iter_markers(name=REQUIRED_MARK):
        pytest.fail(str(mark.args[0]), pytrace=False)


def pytest_collection_finish(session: pytest.Session) -> None:
    # How many battery checks this session should report (after -k/-m selection): the report sets it beside the
    # verdicts that arrived.
    config = session.config
    expected = sum(1 for item in session.items if item.get_closest_marker("recipe") is not None)
    _SESSION["expected"] = expected
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: every worker collects the same items; the controller reads one
        workeroutput["battery_expected"] = expected


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    out = getattr(node, "workeroutput", None) or {}
    if "battery_expected" in out:
        _SESSION["expected"] = int(out["battery_expected"])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # Verdicts travel as the test report's user properties, which pytest-xdist sends from its workers to the
    # controller: so the controller alone sees every verdict, with or without -n.
    verdicts = [value for name, value in report.user_properties if name == _PROPERTY]
    if report.when == "call":
        _CONTROLLER_VERDICTS.extend(verdicts)  # type: ignore[arg-type]
    if report.failed and not verdicts and "recipe" in report.keywords:
        # A battery test that failed outside a verdict (a fixture, a crash in the harness): the report says so.
        text = str(report.longrepr).strip().splitlines()
        _ERRORS.append(f"{report.nodeid} ({report.when}): {text[-1] if text else 'failed'}")


_CONTROLLER_VERDICTS: list[dict[str, object]] = []
_ERRORS: list[str] = []
_SESSION: dict[str, int] = {}
_MODEL_NOTES: list[str] = []
"""What the probe of ``--model`` found (:class:`harness.battery.prepare.probe.facts.ModelFacts`), for the report."""


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = session.config.getoption("battery_report")
    if not path or hasattr(session.config, "workerinput"):  # an xdist worker: the controller writes the report
        return
    from harness.battery.report.summary import verdict_from_dict, write_full_report
    from harness.battery.report.table import report_payload

    options = options_from(session.config)
    write_full_report(path, report_payload(
        recipes=[chosen_recipe(session.config)], checks=_CONTROLLER_VERDICTS, expected=_SESSION.get("expected", 0),
        exit_status=int(exitstatus), errors=_ERRORS, model=options.model, batch_format=options.batch_format,
        model_notes=_MODEL_NOTES, world_sizes=options.world_sizes, precision=options.precision,
    ), [verdict_from_dict(c) for c in _CONTROLLER_VERDICTS], _ERRORS)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    # The battery's grouped summary, once, after pytest's own failures: each cause with its cases, reading and fix,
    # and what --battery-skip recorded (the controller's verdicts: with or without xdist).
    if hasattr(config, "workerinput") or not _CONTROLLER_VERDICTS:
        return
    if not any(c.get("status") in ("fail", "skipped") for c in _CONTROLLER_VERDICTS):
        return
    from harness.battery.report.summary import format_summary, text_path, verdict_from_dict

    path = config.getoption("battery_report")
    said = format_summary([verdict_from_dict(c) for c in _CONTROLLER_VERDICTS], path,
                          text_path(path) if path else None)
    terminalreporter.write_sep("=", "battery summary")
    for line in said.splitlines():
        terminalreporter.write_line(line)


def chosen_recipe(config: pytest.Config) -> str:
    """``--recipe``, or the harness's correct recipe when it was not given."""
    chosen = config.getoption("recipe")
    if chosen is None:
        from harness.recipes import CORRECT_RECIPE

        return CORRECT_RECIPE
    return str(chosen)


@pytest.fixture(scope="session")
def recipe_path(pytestconfig: pytest.Config) -> str:
    """The ``package.module:attr`` of the recipe under test."""
    return chosen_recipe(pytestconfig)


def options_from(config: pytest.Config) -> BatteryOptions:
    """The battery's options from pytest's (:func:`harness.battery.plan.options.from_pytest`: the command line's
    :meth:`~harness.battery.plan.options.BatteryOptions.parse`, pure Python); bad input is a usage error."""
    from harness.battery.plan.options import from_pytest

    try:
        options = from_pytest(config)
        if options.skip:  # the registry's names (importing it imports torch: only when --battery-skip is given)
            from harness.battery.plan.skips import check_skips

            check_skips(options.skip)
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    return options


def resume_options_from(config: pytest.Config) -> ResumeOptions:
    """The resume battery's options from ``--resume-steps``, ``--resume-every``, ``--resume-world-size`` and
    ``--resume-seed``; bad input is a usage error naming the option."""
    from harness.resume.options import ResumeOptions

    try:
        return ResumeOptions(steps=config.getoption("resume_steps"), every=config.getoption("resume_every"),
                             world_size=config.getoption("resume_world_size"), seed=config.getoption("resume_seed"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None


@pytest.fixture(scope="session")
def trainer_path(pytestconfig: pytest.Config) -> str:
    """``--trainer``: the ``package.module:factory`` of the training loop under test (default: the harness's)."""
    from harness.resume.contract import HARNESS_TRAINER

    return str(pytestconfig.getoption("trainer") or HARNESS_TRAINER)


@pytest.fixture(scope="session")
def resume_options(pytestconfig: pytest.Config) -> ResumeOptions:
    """The session's :class:`~harness.resume.options.ResumeOptions`."""
    return resume_options_from(pytestconfig)


@pytest.fixture(scope="session")
def battery_options(pytestconfig: pytest.Config) -> BatteryOptions:
    """The session's :class:`~harness.battery.plan.options.BatteryOptions`, parsed once from ``--model``,
    ``--batch-format``, ``--strategy``, ``--objective``, ``--precision``, ``--battery-world-sizes``,
    ``--battery-examples``, ``--battery-deadline``, ``--find-unused-parameters`` and ``--battery-report``."""
    return options_from(pytestconfig)


@pytest.fixture(scope="session")
def model_path(battery_options: BatteryOptions) -> str | None:
    """``--model``: the ``package.module:factory`` of the user's model, or None for the built-in one."""
    return battery_options.model


@pytest.fixture(scope="session")
def battery_deadline(battery_options: BatteryOptions) -> float:
    """``--battery-deadline``: seconds one battery run may take (default
    :data:`harness.battery.plan.options.DEADLINE`)."""
    return battery_options.deadline


@pytest.fixture(scope="session")
def batch_format(battery_options: BatteryOptions) -> str:
    """``--batch-format``: ``"harness"``, ``"hf"`` or ``"packed"``."""
    return battery_options.batch_format


@pytest.fixture
def battery_check(request: pytest.FixtureRequest) -> Callable[[Verdict], None]:
    """Record a verdict for ``--battery-report``; fail the test with its message when it failed (with every rank's
    whole report under ``-v``), skip it when the check does not apply or ``--battery-skip`` names it (the reason
    and what it would have said in the skip's message)."""
    from harness.battery.judge.verdict import NOT_APPLICABLE, SKIPPED
    from harness.battery.plan.skips import skip, skip_message

    skips = options_from(request.config).skip

    def check(verdict: Verdict) -> None:
        verdict = skip(verdict, skips)  # --battery-skip: recorded as skipped, with what it would have said
        request.node.user_properties.append((_PROPERTY, verdict.to_dict()))
        if verdict.status == SKIPPED:
            pytest.skip(skip_message(verdict))
        if verdict.status == NOT_APPLICABLE:
            pytest.skip(verdict.message)
        if not verdict.passed:
            message = verdict.message
            if verdict.details and request.config.get_verbosity() > 0:
                message += "\n\nevery rank's report:\n" + verdict.details
            pytest.fail(message, pytrace=False)

    return check
