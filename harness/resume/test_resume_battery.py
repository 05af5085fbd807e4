"""The resume battery: does ``--trainer``, stopped, resumed, resumed again and killed anywhere, land on the bits of a
run that never stopped?

``pytest --pyargs harness.resume --trainer=pkg.module:factory`` (default: the harness's own trainer). The battery
runs once per session (every case shares the continuous run it is compared with); each test is one case's verdict,
failing with the rank and the state that differs. ``--resume-steps``, ``--resume-every``, ``--resume-world-size``
and ``--resume-seed`` shape it; ``harness.resume.battery`` says what each case does.
"""

from __future__ import annotations

import pytest

from harness.resume.battery import NOT_BITWISE, Report, run_battery
from harness.resume.options import CASES, ResumeOptions

# One worker runs the whole battery: under -n the cases stay together (--dist loadgroup) instead of re-running it.
pytestmark = [pytest.mark.resume, pytest.mark.xdist_group("resume-battery")]


@pytest.fixture(scope="session")
def resume_report(trainer_path: str, resume_options: ResumeOptions) -> Report:
    """Every case of the battery for the session's trainer, run once."""
    return run_battery(trainer_path, resume_options)


def test_the_trainer_runs_under_the_batterys_options(resume_report: Report) -> None:
    """The trainer's first run does not refuse (a world size it does not support, a state() outside the contract):
    a refusal is this one failure, and every case below is skipped."""
    if resume_report.usage_error is not None:
        pytest.fail(f"usage error: {resume_report.usage_error}", pytrace=False)


@pytest.mark.parametrize("case", CASES)
def test_the_trainer_resumes_onto_the_continuous_runs_bits(case: str, resume_report: Report) -> None:
    """The case's runs end with every state, generator, loss and checkpoint label of the continuous run."""
    if resume_report.usage_error is not None:
        pytest.skip("not run: the trainer refused to run (test_the_trainer_runs_under_the_batterys_options)")
    (result,) = [r for r in resume_report.results if r.case == case]
    if result.status == NOT_BITWISE:
        pytest.fail(f"{case}: cannot be judged bitwise, so not passed: {result.message}", pytrace=False)
    assert result.passed, f"{case}: {result.message}\n\n{resume_report.table()}"
