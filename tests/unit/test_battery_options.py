"""The battery's options are decided once: both surfaces parse through one function into one value, and one
``RunSpec`` per run keys the cache and travels to the ranks."""

from __future__ import annotations

import pickle

import pytest

from harness.battery.plan import cases as plan
from harness.battery.plan.options import DEADLINE, BatteryOptions, RunSpec
from harness.core.mesh import Mesh
from harness.testing.plugin import options_from
from harness.workflow.checks import battery_options
from harness.workflow.cli import build_parser
from harness.workflow.outputs import BadInput

FLAGS = {"--battery-world-sizes": "2,3", "--precision": "fp32", "--battery-examples": "4",
         "--battery-deadline": "45", "--batch-format": "hf", "--find-unused-parameters": "off",
         "--battery-report": "out.json", "--strategy": "both", "--objective": "sequence_mean", "--mesh": "dp=2,cp=2",
         "--cp-chunking": "load_balanced", "--pp-schedule": "1f1b",
         "--pp-steps": "3", "--pp-microbatches": "4", "--battery-skip": "hygiene=we seed ourselves"}


class _Config:
    """The part of pytest.Config the plugin reads: its options by dest, after pytest's own defaults."""

    def __init__(self, pytester_args: dict[str, str]) -> None:
        self.values: dict[str, object] = {
            "model": None, "batch_format": "harness", "strategy": "ddp", "precision": "both",
            "battery_world_sizes": "1,2,3,4", "battery_examples": 12, "battery_deadline": None,
            "find_unused_parameters": "auto", "battery_report": None, "objective": "token_mean", "mesh": None,
            "cp_chunking": "contiguous", "pp_schedule": "gpipe", "pp_steps": "1", "pp_microbatches": "2",
            "battery_skip": None, "battery_quick": False}
        for flag, value in pytester_args.items():
            dest = flag.lstrip("-").replace("-", "_")
            self.values[dest] = int(value) if dest == "battery_examples" else (
                float(value) if dest == "battery_deadline" else value)

    def getoption(self, name: str) -> object:
        return self.values[name]


def _cli(flags: dict[str, str]) -> BatteryOptions:
    argv = ["battery", *(x for kv in flags.items() for x in kv)]
    return battery_options(build_parser().parse_args(argv))


def test_both_surfaces_parse_the_same_flags_into_the_same_options() -> None:
    cli, pytest_side = _cli(FLAGS), options_from(_Config(FLAGS))  # type: ignore[arg-type]
    assert cli == pytest_side
    assert cli == BatteryOptions(batch_format="hf", precision="fp32", world_sizes=(2, 3), examples=4, deadline=45.0,
                                 find_unused="off", report="out.json", strategy="both", objective="sequence_mean",
                                 meshes=(Mesh.parse("dp=2,cp=2"),), chunking="load_balanced",
                                 pp_schedule="1f1b", pp_steps=3, pp_microbatches=4,
                                 skip=(("hygiene", "we seed ourselves"),))
    assert _cli({}) == options_from(_Config({})) == BatteryOptions()  # type: ignore[arg-type]
    # Its negative control: one flag apart is another value.
    assert _cli({"--precision": "fp64"}) != options_from(_Config({}))  # type: ignore[arg-type]


@pytest.mark.parametrize("schedule", ["interleaved1f1b", "loopedbfs"])
def test_the_interleaved_schedules_are_accepted_on_both_surfaces(schedule: str) -> None:
    """The schedules of two stages per rank parse to the same options on the command line and in pytest, and a
    ``RunSpec`` takes them."""
    flags = {"--pp-schedule": schedule, "--mesh": "pp=2"}
    assert schedule == _cli(flags).pp_schedule == options_from(_Config(flags)).pp_schedule  # type: ignore[arg-type]
    spec = RunSpec("harness.recipes:pipeline_token_mean", "uneven", 2, "fp32", layout=Mesh.parse("pp=2"),
                   pp_schedule=schedule)
    assert schedule == spec.pp_schedule


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--battery-world-sizes", "9", "--battery-world-sizes='9' must be world sizes between 1 and 8"),
    ("--battery-world-sizes", "two", "--battery-world-sizes='two' must be comma-separated world sizes"),
    ("--battery-examples", "-1", "--battery-examples=-1 must be 0 (no drawn layouts) or a positive number"),
    ("--battery-deadline", "0", "--battery-deadline=0.0 must be a positive number of seconds"),
    ("--objective", "mean", "--objective='mean' must be one of token_mean, sequence_mean, weighted_token_mean, "
                            "fixed_normalizer"),
    ("--mesh", "pp=2,cp=2", "--mesh=pp=2,cp=2: a pipeline (pp > 1) runs beside dp only for now; cp with pp"),
    ("--pp-schedule", "zigzag", "--pp-schedule='zigzag' must be one of gpipe, 1f1b, interleaved1f1b, loopedbfs"),
    ("--pp-schedule", "interleavedzb", "--pp-schedule='interleavedzb' is not run by the harness: its weight "
                                       "backward (torch.autograd.grad"),
    ("--mesh", "dp=2,tp=2", "--strategy='ddp' over the mesh dp=2,tp=2: DDP cannot wrap a tensor-parallel"),
    ("--cp-chunking", "zigzag", "--cp-chunking='zigzag' must be one of"),
    ("--pp-steps", "0", "--pp-steps='0' must be a whole number from 1 to 64 (default 1), e.g. --pp-steps 2"),
    ("--pp-microbatches", "two", "--pp-microbatches='two' must be a whole number from 1 to 64 (default 2)"),
])
def test_a_bad_value_gets_one_message_on_both_surfaces(flag: str, value: str, says: str) -> None:
    """The command line's bad input (exit 2) and pytest's usage error carry the same words, naming the shared
    option."""
    with pytest.raises(BadInput) as cli:
        _cli({flag: value})
    with pytest.raises(pytest.UsageError) as pyt:
        options_from(_Config({flag: value}))  # type: ignore[arg-type]
    assert says in str(cli.value)
    assert str(cli.value) == str(pyt.value)


def test_a_run_spec_is_a_value_that_keys_the_cache_and_pickles() -> None:
    """The session's spec for a case equals the one a test builds by hand, so the two share one launch; it survives
    the trip to the ranks."""
    options = BatteryOptions()
    (case, *_) = plan.session_cases(options, checks=("parity",))
    spec = options.spec("harness.recipes:global_token_mean", case.scenario, case.world_size, case.precision)
    assert spec == RunSpec("harness.recipes:global_token_mean", case.scenario, case.world_size, case.precision)
    assert hash(spec) == hash(pickle.loads(pickle.dumps(spec)))
    assert spec.deadline == DEADLINE
    assert spec.at("long", 3, "fp64") == RunSpec("harness.recipes:global_token_mean", "long", 3, "fp64")
    # Its negative control: any field that changes what runs gives another key.
    assert spec != options.spec("harness.recipes:global_token_mean", case.scenario, case.world_size, "fp64")
    assert spec != BatteryOptions(objective="sequence_mean").spec("harness.recipes:global_token_mean", case.scenario,
                                                                  case.world_size, case.precision)
    assert spec != BatteryOptions(find_unused="on").spec("harness.recipes:global_token_mean", case.scenario,
                                                         case.world_size, case.precision)
    assert spec != BatteryOptions(chunking="load_balanced").spec("harness.recipes:global_token_mean", case.scenario,
                                                                 case.world_size, case.precision)
    assert spec != BatteryOptions(pp_steps=2).spec("harness.recipes:global_token_mean", case.scenario,
                                                   case.world_size, case.precision)


@pytest.mark.parametrize(("fields", "says"), [
    ({"recipe": "no_colon"}, "recipe='no_colon' must be a 'package.module:attr' string"),
    ({"world_size": 0}, "world_size=0 must be a positive number of ranks"),
    ({"precision": "fp16"}, "precision='fp16' must be one of fp32, fp64, bf16"),
    ({"batch_format": "json"}, "batch_format='json' must be one of harness, hf, packed"),
    ({"find_unused": "maybe"}, "find_unused='maybe' must be one of auto, on, off"),
    ({"deadline": -1}, "deadline=-1 must be a positive number of seconds"),
    ({"nodes": 3}, "nodes=3 must be a positive number of nodes that divides world_size=2"),
    ({"nodes": 0}, "nodes=0 must be a positive number of nodes"),
    ({"objective": "tokens"}, "objective='tokens' must be one of token_mean, sequence_mean"),
    ({"pp_steps": 0}, "pp_steps=0 must be a whole number from 1 to 64 (default 1), e.g. pp_steps=2"),
    ({"pp_microbatches": "4"}, "pp_microbatches='4' must be an int from 1 to 64, e.g. pp_microbatches=2"),
])
def test_a_bad_run_spec_is_refused_naming_the_field(fields: dict[str, object], says: str) -> None:
    base: dict[str, object] = {"recipe": "harness.recipes:global_token_mean"}
    with pytest.raises(ValueError, match=says.replace("(", r"\(").replace(")", r"\)")):
        RunSpec(**{**base, **fields})  # type: ignore[arg-type]


def test_precision_takes_lanes_separated_by_commas() -> None:
    """``--precision fp32,bf16`` is two lanes, in that order; a lane that does not exist is refused naming them."""
    from harness.battery.plan.options import precisions

    assert ("fp32", "bf16") == precisions("fp32,bf16")
    assert ("fp32", "fp64") == precisions("both")
    assert ("fp32", "bf16") == BatteryOptions.parse(precision="fp32,bf16").lanes
    with pytest.raises(ValueError, match=r"--precision='fp32,fp16' must be one of .* \(from fp32, fp64, bf16"):
        precisions("fp32,fp16")


@pytest.mark.parametrize("shape", ["dp=2,cp=2", "dp=2,tp=2", "pp=2", "dp=2"])
def test_packed_rows_run_over_data_parallel_meshes_only(shape: str) -> None:
    """Packed rows are built for data-parallel ranks: over cp, tp or pp the option is refused on the command line and
    by RunSpec, naming the mesh and the fix; over dp alone (the control) both accept it."""
    mesh = Mesh.parse(shape)
    strategy = "fsdp2" if mesh.size("tp") > 1 else "ddp"
    if shape == "dp=2":
        BatteryOptions.parse(batch_format="packed", mesh=[shape])
        RunSpec("r:r", "uneven", mesh.world_size, "fp32", batch_format="packed", layout=mesh)
        return
    with pytest.raises(ValueError, match=r"--batch-format='packed' over the mesh .*: packed rows are built for "
                                         r"data-parallel ranks only"):
        BatteryOptions.parse(batch_format="packed", mesh=[shape], strategy=strategy)
    with pytest.raises(ValueError, match=r"batch_format='packed' over the mesh"):
        RunSpec("r:r", "uneven", mesh.world_size, "fp32", batch_format="packed", layout=mesh, strategy=strategy)


@pytest.mark.parametrize(("batch_format", "shape"), [("hf", "pp=2"), ("hf", "dp=2,pp=2"), ("harness", "pp=2"),
                                                     ("hf", "dp=2,cp=2")])
def test_hf_dicts_do_not_run_through_a_pipeline(batch_format: str, shape: str) -> None:
    """A pipeline's stages take the harness's microbatches: hf over pp is refused naming the fix (it would raise
    deep in every rank); the harness format over pp and hf over cp (the controls) are accepted."""
    mesh = Mesh.parse(shape)
    if batch_format == "harness" or mesh.size("pp") == 1:
        BatteryOptions.parse(batch_format=batch_format, mesh=[shape])
        return
    with pytest.raises(ValueError, match=r"--batch-format='hf' over the mesh .*: a pipeline's stages take the "
                                         r"harness's microbatches"):
        BatteryOptions.parse(batch_format=batch_format, mesh=[shape])
    with pytest.raises(ValueError, match=r"batch_format='hf' over the mesh"):
        RunSpec("r:r", "uneven", mesh.world_size, "fp32", batch_format=batch_format, layout=mesh)
