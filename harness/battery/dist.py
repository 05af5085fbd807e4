"""The battery inside torchrun: every worker of the job is one rank of every battery run, on the process group
torchrun set up, on one machine or many.

    torchrun --nnodes=1 --nproc-per-node=2 -m harness.battery.dist --recipe mypkg.step:recipe \\
        [--model pkg.mod:factory] [--batch-format harness|hf] [--strategy ddp|fsdp2|both] \\
        [--precision fp32|fp64|both] \\
        [--scenarios uneven,long,...] [--battery-report out.json] [--battery-junit out.xml] \\
        [--backend gloo|nccl] [--battery-deadline 30] [--find-unused-parameters auto|on|off] \\
        [--mesh dp=2,cp=2] [--battery-skip CHECK[=reason]] [--quick] [-v]

Each worker joins the group (NCCL when every local rank has a GPU of its own, gloo otherwise; ``--backend``
overrides), builds each scenario's windows for the job's world size (the same windows the in-process launcher
builds), and runs the recipe through the same rank program (:func:`harness.battery.rank.rank_program.rank_body`). The
runs are dealt round-robin over the ranks (:func:`owner`): before the first starts, each rank computes the
single-device references of its share (:func:`harness.battery.prepare.steps.prepare`); after each, its owner collects
every rank's records and says whether the battery goes on; at the end each rank judges its share with the battery's
checks, so no rank carries the whole reference and judging cost while the others wait. Rank 0 gathers the verdicts,
writes the report (``--battery-report``: the schema of the command line's; ``--battery-junit``: JUnit XML, one test
case per verdict; the full report always, in a temporary folder without ``--battery-report``) and prints the table's
failing rows and the grouped summary (:mod:`harness.battery.report.summary`). Every worker exits with the same status:
0 every check holds (or only ``--battery-skip``'s checks failed), 1 a check failed, 2 bad input.

Over a device mesh (``--mesh dp=2,cp=2``, repeatable; the sizes' product must be the job's world size) every run
is over that mesh instead of ``dp=W``, as ``--mesh`` does on the other surfaces. The mesh numbers the job's ranks
row-major, the last dimension fastest, and torchrun gives a node consecutive ranks, so the last dimension lies within
a node: ``--nnodes=2 --nproc-per-node=2 ... --mesh dp=2,cp=2`` puts dp across the nodes and cp within each.

Results travel through torchrun's store (``MASTER_ADDR:MASTER_PORT``), not through collectives: a rank whose recipe
raises, or whose collective timed out at ``--battery-deadline``, still reports, and the battery stops there (a process
group after a failed collective is not trusted again) with the failing rank named in the report and on every
worker's last line. A worker that dies is torchrun's to stop the others; the rest give up within the deadline.
Workers leave through :func:`harness.distributed.worker.exit_worker` with the process group destroyed.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from harness.battery import mesh_scenarios, scenarios
from harness.battery.dist_store import STORE_SLACK, connect, get, histories, put, reporting, working
from harness.battery.judge import registry
from harness.battery.judge.crash_report import every_rank_raised, grouped
from harness.battery.judge.verdict import FAIL, Verdict
from harness.battery.launch.printed import Printed, captured
from harness.battery.launch.run import Run, WindowRecord
from harness.battery.plan import cases as plan
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
    BatteryOptions,
    RunSpec,
    parse_meshes,
)
from harness.battery.plan.skips import check_skips, skip_all
from harness.battery.prepare.objective import windows_for
from harness.battery.prepare.steps import Prepared, prepare
from harness.battery.rank.rank_program import rank_body
from harness.distributed.divergence import COLLECTIVE_FAILURES, first_divergence
from harness.distributed.errors import LaunchError
from harness.distributed.worker import default_backend, exit_worker

USAGE = ("torchrun --nnodes=1 --nproc-per-node=2 -m harness.battery.dist --recipe pkg.module:attr "
         "[--battery-report out.json] [--battery-junit out.xml]")

def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m harness.battery.dist", description=__doc__.split("\n\n")[0],
                                usage=USAGE)
    p.add_argument("--recipe", required=True, metavar="PKG.MODULE:ATTR", help="the recipe under test")
    p.add_argument("--model", default=None, metavar="PKG.MODULE:FACTORY", help="the model (default: the built-in)")
    p.add_argument("--batch-format", default="harness", choices=BATCH_FORMATS, help=BATCH_FORMAT_HELP)
    p.add_argument("--strategy", default="ddp", choices=("ddp", "fsdp2", "both"))
    p.add_argument("--objective", default="token_mean", metavar="NAME", help="the declared objective (token_mean)")
    p.add_argument("--precision", default="both", metavar="LANES", help="fp32, fp64, bf16, both, or fp32,bf16 ...")
    p.add_argument("--scenarios", default=",".join(ALL_SCENARIOS), metavar="NAME,...",
                   help=f"scenarios to run (default: all of {', '.join(ALL_SCENARIOS)}; the mesh scenarios on the "
                        "meshes they are written for)")
    p.add_argument("--battery-report", dest="report", default=None, metavar="PATH", help="the JSON report (rank 0)")
    p.add_argument("--battery-junit", dest="junit", default=None, metavar="PATH", help="JUnit XML (rank 0)")
    p.add_argument("--backend", default=None, choices=("gloo", "nccl"),
                   help="default: nccl when every local rank has its own GPU, else gloo")
    p.add_argument("--battery-deadline", dest="deadline", type=float, default=None, metavar="SECONDS",
                   help="seconds one run (and each collective in it) may take (default 30)")
    p.add_argument("--find-unused-parameters", dest="find_unused", default="auto", choices=("auto", "on", "off"))
    p.add_argument("--mesh", action="append", metavar="DIM=N,...", help=MESH_HELP)
    p.add_argument("--cp-chunking", default="contiguous", metavar="contiguous|load_balanced", help=CHUNKING_HELP)
    p.add_argument("--pp-schedule", default="gpipe", metavar="gpipe|1f1b|...", help=PP_SCHEDULE_HELP)
    p.add_argument("--pp-steps", default="1", metavar="A", help=PP_STEPS_HELP)
    p.add_argument("--pp-microbatches", default="2", metavar="M", help=PP_MICROBATCHES_HELP)
    p.add_argument("--battery-skip", dest="skip", action="append", metavar="CHECK[=REASON]", help=SKIP_HELP)
    p.add_argument("--quick", action="store_true", help=QUICK_HELP + " (here: fp32 and the quick scenarios at the "
                   "job's world size)")
    p.add_argument("--battery-keep-going", dest="keep_going", action="store_true", help=KEEP_GOING_HELP)
    p.add_argument("-v", "--verbose", action="store_true", help="every row of the table and every failure's message")
    return p.parse_args(argv)


ALL_SCENARIOS = (*scenarios.BATTERY_SCENARIOS, *mesh_scenarios.MESH_SCENARIOS)
"""The scenarios ``--scenarios`` may name: the battery's and the mesh scenarios."""


def _say(rank: int, text: str, *, everyone: bool = False) -> None:
    if everyone or rank == 0:
        prefix = "" if rank == 0 else f"[rank {rank}] "
        print(prefix + text, flush=True)


def _meshes(options: BatteryOptions, world: int) -> None:
    """ValueError naming ``--mesh`` when a shape's ranks are not the job's."""
    for mesh in options.meshes:
        if mesh.world_size != world:
            msg = (f"--mesh={mesh.label} has {mesh.world_size} ranks but torchrun started {world}: the sizes' product "
                   f"is the world size; start {mesh.world_size} workers (--nnodes x --nproc-per-node) or give a mesh "
                   f"of {world}")
            raise ValueError(msg)


def _scenarios(text: str, world_size: int) -> list[str]:
    names = [s for s in text.split(",") if s]
    unknown = [s for s in names if s not in ALL_SCENARIOS]
    if unknown or not names:
        msg = f"--scenarios={text!r}: {', '.join(unknown) or 'none given'}; choose from {ALL_SCENARIOS}"
        raise ValueError(msg)
    return [s for s in names if not (world_size == 1 and s in scenarios.MULTI_RANK_ONLY)]


def main(argv: Sequence[str] | None = None) -> int:
    """One worker's battery; returns the job's exit status (the same on every worker)."""
    args = parse_args(argv)
    if "RANK" not in os.environ or "MASTER_ADDR" not in os.environ:
        print(f"harness.battery.dist runs one process per rank: start it with {USAGE}", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    try:
        options = replace(BatteryOptions.parse(model=args.model, batch_format=args.batch_format, strategy=args.strategy,
                                               precision=args.precision, world_sizes=[1], examples=0,
                                               deadline=args.deadline, find_unused=args.find_unused,
                                               report=args.report, objective=args.objective,
                                               chunking=args.cp_chunking, pp_schedule=args.pp_schedule,
                                               pp_steps=args.pp_steps, pp_microbatches=args.pp_microbatches,
                                               skip=args.skip, quick=args.quick),
                          world_sizes=(world,), meshes=parse_meshes(args.mesh, max_world_size=None))
        _meshes(options, world)
        check_skips(options.skip)
        data_ranks = options.meshes[0].data_ranks if options.meshes else world
        if not 1 <= data_ranks <= scenarios.MAX_SCENARIO_WORLD_SIZE:
            msg = (f"torchrun started {world} ranks; the battery's scenarios are built for 1 to "
                   f"{scenarios.MAX_SCENARIO_WORLD_SIZE} data-parallel ranks")
            raise ValueError(msg)
        names = _scenarios(args.scenarios, data_ranks)
        from harness.recipes import load_recipe

        load_recipe(args.recipe)
        from harness.battery.prepare.probe.facts import probe

        probe(args.model, args.batch_format)  # the built-in model too: its backward is checked before every battery
    except Exception as exc:  # bad input: every worker finds it, the same, before any joins the group
        # Every worker says it: torchrun stops the others as soon as one exits, so rank 0 may never get to print.
        print(("" if rank == 0 else f"[rank {rank}] ") + f"bad input: {exc}", file=sys.stderr, flush=True)
        return 2
    backend = args.backend or default_backend(local_world)
    if backend == "nccl":
        if torch.cuda.device_count() < local_world:
            print(f"--backend nccl needs one CUDA device per local rank ({local_world}), found "
                  f"{torch.cuda.device_count()}; use --backend gloo", file=sys.stderr)
            return 2
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=options.deadline))
    try:
        return _battery(args.recipe, options, names, backend, args.junit, args.verbose, args.keep_going)
    finally:
        gc.collect()  # a DDP module held by a reference cycle must not outlive the process group
        dist.destroy_process_group()


def _on_cpu(records: list[WindowRecord]) -> list[WindowRecord]:
    return [replace(r, grad=None if r.grad is None else r.grad.cpu(), params_before=r.params_before.cpu(),
                    params_after=r.params_after.cpu()) for r in records]


def _let_down(text: str) -> bool:
    first = text.strip().splitlines()[0].lower() if text.strip() else ""
    return any(k in first for k in COLLECTIVE_FAILURES)


def _failure(results: dict[int, tuple[str, str, float]], world: int) -> LaunchError:
    """The ranks that raised: first the one whose own code raised earliest, then those whose collectives failed
    because of it (a timeout, a closed connection)."""
    raised = sorted(results, key=lambda r: (_let_down(results[r][1]), results[r][2], r))
    details = {r: results[r][1] for r in raised}
    first = raised[0]
    head = details[first].strip().splitlines()[0] if details[first].strip() else "raised"
    summary = (f"rank {first} of {world} raised {head}; every worker stopped"
               + (f"; also reported: rank(s) {raised[1:]}" if len(raised) > 1 else ""))
    return LaunchError("raised", raised, details, summary)


def _desync(ahead: dict[int, str | None], errors: dict[int, tuple[str, str, float]], world: int) -> LaunchError:
    """Ranks that ended the run (their recipe refused a window, or returned) while their peers went on into a
    collective they never entered and waited in it until the deadline: the in-process launcher's ``desync``."""
    leader = min(ahead)
    left = sorted(errors)
    did = f"refused a window alone ({ahead[leader]})" if ahead[leader] else "ended the run"
    details = {r: errors[r][1] for r in left}
    details[leader] = did
    summary = (f"rank {leader} of {world} {did} while rank(s) {left} waited in a collective it never entered, "
               "until the deadline; every worker stopped")
    return LaunchError("desync", left, details, summary, leader)


def owner(i: int, world: int) -> int:
    """The rank that prepares run ``i`` (its single-device reference), decides whether the battery goes on after it,
    and judges it: runs are dealt round-robin, so at W ranks each computes about 1/W of the references and checks
    instead of rank 0 computing them all while the others wait."""
    return i % world


def _prepare_share(store: dist.Store, rank: int, world: int,
                   specs: list[tuple[RunSpec, scenarios.Windows]]) -> dict[int, Prepared]:
    """This rank's share of the preparations, published to the store before any run starts (every rank prepares at
    once); a preparation that raises is published as such and stops every worker."""
    mine: dict[int, Prepared] = {}
    for i, (spec, windows) in enumerate(specs):
        if owner(i, world) != rank:
            continue
        try:
            ready = prepare(spec, windows, share_chain=True)
        except Exception as exc:
            put(store, f"{i}/plan", ("raise", f"rank {rank} preparing run {spec.scenario}/{spec.precision}: "
                                               f"{type(exc).__name__}: {exc}"))
            raise
        mine[i] = ready
        # The starting weights travel whole (harness.battery.prepare.start): a worker that recomputed them could sum
        # otherwise.
        put(store, f"{i}/plan", ("ok", ready.chain.model_error, ready.digest, ready.wrap, ready.chain.max_norm,
                                  ready.start))
    return mine


def _battery(recipe: str, options: BatteryOptions, names: list[str], backend: str, junit: str | None,
             verbose: bool = False, keep_going: bool = False) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    store = connect(options.deadline)
    device = "cuda" if backend == "nccl" else "cpu"
    cases = [c for c in plan.session_cases(options) if c.scenario in names]
    runs = list(dict.fromkeys((c.scenario, c.precision, c.strategy, c.mesh) for c in cases))
    over = "".join(f", mesh {m.label}" for m in options.meshes)
    _say(rank, f"battery: {recipe} at W={world}{over} ({backend}), {len(cases)} checks over {len(runs)} runs")
    start = time.monotonic()
    specs = []
    for scenario, precision, strategy, mesh in runs:
        spec = replace(options.spec(recipe, scenario, world, precision, strategy=strategy, mesh=mesh), device=device,
                       backend=backend)
        # The objective's drawn factors (weights, advantages): the same draw on every worker, as in prepare().
        specs.append((spec, windows_for(spec, mesh_scenarios.build(scenario, spec.mesh, spec.chunking))))
    mine = _prepare_share(store, rank, world, specs)
    judged: dict[int, Run] = {}
    stopped: str | None = None
    done = 0
    for i, (spec, windows) in enumerate(specs):
        published = get(store, f"{i}/plan", options.deadline)
        if published[0] == "raise":
            raise RuntimeError(published[1])
        _, model_error, digest, wrap, max_norm, weights = published
        said: list[str] = []
        if model_error is None:
            with captured(not verbose) as said:  # the recipe's prints: once per distinct line, by rank 0 at the end
                try:
                    with reporting(store, i, rank):
                        records = rank_body(spec, windows, digest, wrap, max_norm, weights)
                    out: tuple[Any, ...] = ("ok", _on_cpu(records))
                except Exception as exc:
                    out = ("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}", time.time())
            put(store, f"{i}/rank{rank}", out)  # a peer left in a collective fails at the deadline, and reports
        put(store, f"{i}/printed{rank}", "".join(said))
        if i in mine:
            judged[i], stopped = _collect(store, i, mine[i], world, options.deadline, model_error)
            if keep_going and every_rank_raised(judged[i].failure, world):
                stopped = None  # --battery-keep-going: no rank is left in a collective, so the next run can start
            put(store, f"{i}/go", stopped)
        stopped = get(store, f"{i}/go", options.deadline)
        done = i + 1
        if stopped is not None:
            break
    # Each rank judges the runs it owns, all at once, then rank 0 gathers the verdicts in the battery's order.
    for i, run in judged.items():
        mine_cases = [c for c in cases if (c.scenario, c.precision, c.strategy, c.mesh) == runs[i]]
        put(store, f"{i}/verdicts", [registry.CHECKS[c.check](run) for c in mine_cases])
    status = 0
    if rank == 0:
        verdicts: list[Verdict] = [v for i in range(done) for v in get(store, f"{i}/verdicts", options.deadline)]
        printed = Printed()
        for i in range(done):
            printed.add({r: get(store, f"{i}/printed{r}", options.deadline) for r in range(world)})
        status = _report(recipe, options, cases, verdicts, stopped, junit, time.monotonic() - start, world, verbose,
                         printed.block())
        put(store, "status", status)
    status = int(get(store, "status", options.deadline))
    _say(rank, f"prepared and judged {len(judged)} of {done} run(s)", everyone=True)
    if stopped is not None:
        _say(rank, f"FAILED: {stopped}", everyone=True)
    elif rank != 0:
        _say(rank, "every check holds" if status == 0 else f"FAILED: exit status {status} (rank 0 has the table)",
             everyone=True)
    return status


def _collect(store: dist.Store, i: int, ready: Prepared, world: int, deadline: float,
             model_error: str | None) -> tuple[Run, str | None]:
    """The owner of run ``i``: every rank's result of it as a :class:`~harness.battery.Run`, and why the
    battery stops here (None: it goes on)."""
    if model_error is not None:
        return ready.run(None, model_error=model_error), None
    results: dict[int, tuple[Any, ...]] = {}
    for r in range(world):
        try:
            results[r] = get(store, f"{i}/rank{r}", deadline)
        except Exception as exc:  # the store wait timed out: the rank died or hangs
            results[r] = ("error", f"no result from rank {r} within {deadline + STORE_SLACK:g} s ({exc})",
                          time.time())
    errors = {r: (v[0], v[1], v[2]) for r, v in results.items() if v[0] == "error"}
    if not errors:
        return ready.run([results[r][1] for r in range(world)]), None
    ahead = {r: next((rec.error for rec in v[1] if rec.error), None) for r, v in results.items() if v[0] == "ok"}
    if ahead and all(_let_down(text) for _, text, _ in errors.values()):
        failure = _desync(ahead, errors, world)
    else:
        failure = _failure(errors, world)
    # The ranks' records first, whatever ended the run: finished windows, then what each rank did inside its last.
    # A worker that gave no result by the deadline may only be slow: then only steps some rank finished are read.
    settled = not any(text.startswith("no result from rank") for _, text, _ in errors.values())
    found = first_divergence(histories(store, i, world), world, working(store, i, world), settled)
    if found is not None:
        failure.name_cause(*found)
    s = ready.spec
    said = failure.summary if failure.cause is None else f"{failure.cause} (then: {failure.summary})"
    return ready.failed(failure), f"{said} (run {s.scenario}, W={world}, {s.precision})"


def _report(recipe: str, options: BatteryOptions, cases: list[plan.Case], verdicts: list[Verdict],
            stopped: str | None, junit: str | None, seconds: float, world: int, verbose: bool = False,
            said_by_ranks: str = "") -> int:
    from harness.battery.report.junit import write_junit
    from harness.battery.report.summary import compact_table, format_summary, write_full_report
    from harness.battery.report.table import format_table, report_json

    judged = {(v.check, v.scenario, v.precision, v.strategy, v.mesh) for v in verdicts}
    for c in cases:
        label = None if c.mesh is None else c.mesh.label
        if (c.check, c.scenario, c.precision, c.strategy, label) not in judged:
            verdicts.append(Verdict(c.check, recipe, c.scenario, c.world_size, c.precision, FAIL,
                                    f"check {c.check} not run: the battery stopped: {stopped}", cause="stopped",
                                    strategy=c.strategy, mesh=label))
    verdicts[:] = skip_all(verdicts, options.skip)
    failed = [v for v in verdicts if not v.passed]
    usage = [v for v in failed if v.cause == "usage"]
    status = 2 if usage else 1 if failed else 0
    print(format_table(verdicts) if verbose else compact_table(verdicts), flush=True)
    notes = list(dict.fromkeys(n for v in verdicts for n in v.notes))
    if notes:
        print(f"\nabout the model {options.model or '(built-in)'}:\n" + "\n".join(f"  {n}" for n in notes), flush=True)
    quick = " (--quick)" if options.quick else ""
    print(f"\n{len(verdicts)} checks at W={world}{quick} under torchrun in {seconds:.1f} s", flush=True)
    payload = report_json([recipe], verdicts, len(cases), status, world_sizes=options.world_sizes,
                          precision=options.precision, model=options.model, batch_format=options.batch_format)
    report, text = write_full_report(options.report, payload, verdicts)
    if junit:
        write_junit(junit, verdicts, duration_s=seconds)
        print(f"junit written to {junit}", flush=True)
    if verbose:
        for v in failed:
            if v.cause != "stopped":
                print(v.message, file=sys.stderr, flush=True)
    for said in (said_by_ranks, "\n".join(grouped(verdicts))):
        if said:
            print("\n" + said, flush=True)
    print("\n" + format_summary(verdicts, report, text), flush=True)
    not_run = sum(v.cause == "stopped" for v in failed)
    if not_run:
        print(f"{not_run} check(s) not run: the battery stopped after the run that failed", file=sys.stderr,
              flush=True)
    if not failed:
        print("every check holds", flush=True)
    elif stopped is None:
        first = failed[0]
        print(f"FAILED: {len(failed)} check(s) failed; first: {first.check} ({first.scenario}, W={first.world_size}, "
              f"{first.precision})", file=sys.stderr, flush=True)
    return status


def entry(argv: Sequence[str] | None = None) -> NoReturn:
    """The torchrun worker: :func:`main`, then ``os._exit`` with its status. Never call this in-process."""
    exit_worker(main, argv)


if __name__ == "__main__":
    entry()
