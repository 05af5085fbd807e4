#!/usr/bin/env bash
# Every GPU check in one call, for a lent GPU machine (one device-time budget, one try):
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # OUT_DIR defaults to ./gpu-check-out
#
# 1. the machine: GPU name, driver, Python, torch, CUDA, cuDNN, NCCL, which test plugins are present;
# 2. the GPU lanes: pytest -m "gpu or gpu2" tests/gpu -v -rA --durations=0 (gpu2 skips with its reason on one GPU);
# 3. a probe that prints measured numbers: CUDA float32 reference vs CPU float64, and two ranks sharing the GPU over
#    gloo (parity max error and worst ratio for the correct recipe and for the mean-of-means control), with wall times;
# 4. portability: the unit tier on this machine's own Python and torch.
#
# Writes OUT_DIR/gpu-check.log (everything printed), gpu-battery.json (battery verdicts), gpu-junit.xml,
# unit-junit.xml and gpu-probe.json. Installs nothing: a missing PyYAML or numpy is taken from a wheel carried in
# .whl/ (unzipped into a temporary folder on PYTHONPATH), or reported. Every step runs under timeout(1): about
# 5 minutes if every step hit its limit; expected 1 to 2 minutes on one H200 with 16 cores.
set -uo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-./gpu-check-out}"
mkdir -p "$out" && out="$(cd "$out" && pwd)"
log="$out/gpu-check.log"
: >"$log"

# Limits in seconds (each step is killed with its whole process group past its limit, ranks and torchrun included).
LANES_LIMIT=140
PROBE_LIMIT=60
UNIT_LIMIT=40
SMALL_LIMIT=20

export PYTHONUNBUFFERED=1
PY="${PYTHON:-$(command -v python3 || command -v python)}"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cd "$root"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"

status=0

section() { printf '\n==== %s ====\n' "$*"; }

# step NAME LIMIT CMD...: run under timeout, record rc and wall time. pytest's 5 ("no tests collected") is a failure.
step() {
  local name="$1" limit="$2"; shift 2
  local t0=$SECONDS rc
  timeout -k 10 "$limit" "$@"
  rc=$?
  local took=$((SECONDS - t0))
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "!! $name: killed at its ${limit}s limit"
  fi
  printf '%-24s rc=%-3s %4ss\n' "$name" "$rc" "$took" >>"$work/summary"
  [ "$rc" -eq 0 ] || status=1
  return 0
}

main() {
  section "gpu_check.sh $(date -u +%Y-%m-%dT%H:%M:%SZ) in $root"
  echo "output: $out"
  echo "python: $PY"
  if command -v nvidia-smi >/dev/null 2>&1; then
    timeout "$SMALL_LIMIT" nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  else
    echo "nvidia-smi: not found"
  fi

  section "dependencies (nothing is installed; a missing module comes from a wheel in .whl/, or is reported)"
  local missing=0 mod pattern whl
  for mod in yaml numpy; do
    if "$PY" -c "import $mod" >/dev/null 2>&1; then
      echo "$mod: $("$PY" -c "import $mod; print($mod.__version__, $mod.__file__)")"
      continue
    fi
    pattern="$([ "$mod" = yaml ] && echo '[Pp][Yy][Yy][Aa][Mm][Ll]-*.whl' || echo 'numpy-*.whl')"
    whl="$(find "$root/.whl" -maxdepth 1 -name "$pattern" 2>/dev/null | sort | tail -n 1)"
    if [ -n "$whl" ]; then
      mkdir -p "$work/deps"
      "$PY" -m zipfile -e "$whl" "$work/deps"
      export PYTHONPATH="$work/deps:$PYTHONPATH"
      echo "$mod: not installed here; using $(basename "$whl") unzipped into $work/deps"
    fi
    if ! "$PY" -c "import $mod" >/dev/null 2>&1; then
      echo "!! $mod: MISSING and no usable wheel in .whl/: the harness imports it (PyYAML: harness.data.config; numpy:"
      echo "!!   tests/conftest.py and harness.training.trainer), so every test would fail to import. Carry a cp312 wheel"
      echo "!!   in .whl/ (pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl PyYAML numpy)."
      missing=1
    fi
  done
  local pytest_extra=()
  if "$PY" -c "import pytest_timeout" >/dev/null 2>&1; then
    echo "pytest-timeout: present (pytest.ini's timeout = 300 is the per-test backstop)"
  else
    # pytest.ini sets `timeout = 300` and addopts has --strict-config: without pytest-timeout that key is unknown,
    # which pytest 8 turns into an error. A stub plugin registers the key; timeout(1) around each step bounds the run.
    printf '%s\n' '"""Registers the ini key `timeout` where pytest-timeout is absent (written by gpu_check.sh)."""' \
      'def pytest_addoption(parser):' \
      '    parser.addini("timeout", "unused: pytest-timeout is not installed; gpu_check.sh bounds each run")' \
      >"$work/gpu_check_ini_stub.py"
    export PYTHONPATH="$work:$PYTHONPATH"
    pytest_extra+=(-p gpu_check_ini_stub)
    echo "pytest-timeout: absent; the ini key 'timeout' is registered by a stub so --strict-config does not fail"
  fi
  local xdist=()
  if "$PY" -c "import xdist" >/dev/null 2>&1; then xdist=(-n 4); fi

  section "versions"
  step versions "$SMALL_LIMIT" "$PY" - <<'PY'
import platform
import sys

import torch
import torch.distributed as dist

print("python", sys.version.split()[0], platform.machine())
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version())
print("cuda available", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"  cuda:{i} {p.name}, {p.total_memory / 2**30:.0f} GiB, capability {p.major}.{p.minor}")
nccl = None
if dist.is_nccl_available():
    v = torch.cuda.nccl.version()
    nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
print("gloo", dist.is_gloo_available(), "| nccl", dist.is_nccl_available(), "| nccl version", nccl)
print("float32 matmul precision", torch.get_float32_matmul_precision())
for name in ("pytest", "xdist", "pytest_timeout", "hypothesis", "numpy", "yaml"):
    try:
        mod = __import__(name)
        print(f"{name} {getattr(mod, '__version__', '?')}")
    except ImportError:
        print(f"{name} MISSING")
PY
  if [ "$missing" -ne 0 ]; then
    echo "!! stopping: a module every test imports is missing (see above)"
    echo "dependencies             MISSING (see above)" >>"$work/summary"
    status=1
    return
  fi

  section "GPU lanes: pytest -m 'gpu or gpu2' tests/gpu"
  step "pytest gpu lanes" "$LANES_LIMIT" "$PY" -m pytest ${pytest_extra[@]+"${pytest_extra[@]}"} \
    -m "gpu or gpu2" tests/gpu -v -rA --durations=0 --battery-report="$out/gpu-battery.json" --junitxml="$out/gpu-junit.xml"

  section "probe: measured errors and wall times"
  # A file, not stdin: the launcher's ranks re-import the main module by its path.
  cat >"$work/gpu_probe.py" <<'PY'
"""Measured numbers for docs/gpu.md: CUDA fp32 reference vs CPU fp64, and two ranks sharing one GPU over gloo."""

from __future__ import annotations

import json
import os
import time


def main() -> None:
    import torch

    from harness.battery import scenarios
    from harness.battery.judge import checks
    from harness.battery.launch import runner
    from harness.core.compare import FLOAT32_TOLERANCE, compare
    from harness.model import build_model
    from harness.core.reference import reference_gradient
    from harness.testing.skips import two_gpus_missing

    report: dict[str, object] = {"gpu2_lane": two_gpus_missing() or "can run here"}
    print("gpu2 lane:", report["gpu2_lane"])
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return
    report["device"] = torch.cuda.get_device_name(0)
    report["torch"] = torch.__version__
    report["cuda"] = torch.version.cuda

    atol, rtol = FLOAT32_TOLERANCE
    refs = []
    for scenario in ("uneven", "varying"):
        for k, window in enumerate(scenarios.build(scenario, 2)):
            t0 = time.perf_counter()
            model = build_model(scenarios.BATTERY_CONFIG).to(torch.float32).to("cuda")
            got = reference_gradient(model, window)
            torch.cuda.synchronize()
            took = time.perf_counter() - t0
            want = reference_gradient(build_model(scenarios.BATTERY_CONFIG).to(torch.float64), window)
            c = compare(got.gradient, want.gradient, atol=atol, rtol=rtol)
            row = {"scenario": scenario, "window": k, "max_abs_error": c.max_abs_error, "worst_ratio": c.worst_ratio,
                   "loss_error": abs(got.loss - want.loss), "passed": c.passed, "cuda_seconds": round(took, 3)}
            refs.append(row)
            print(f"reference cuda fp32 vs cpu fp64, {scenario} window {k}: max abs error {c.max_abs_error:.3e}, "
                  f"worst ratio {c.worst_ratio:.3g}, loss error {row['loss_error']:.3e}, {took:.3f} s")
    report["reference"] = refs

    runs = []
    for device in ("cuda", "cpu"):
        for recipe in ("global_token_mean", "mean_of_local_means"):
            windows = scenarios.build("uneven", 2)
            t0 = time.perf_counter()
            run = runner.run_windows(f"harness.recipes:{recipe}", windows, "fp32", scenario="uneven", device=device,
                                     backend="gloo", deadline=45)
            took = time.perf_counter() - t0
            v = checks.parity(run)
            row = {"device": device, "recipe": recipe, "passed": v.passed, "max_error": v.max_error,
                   "worst_ratio": v.worst_ratio, "wall_seconds": round(took, 2)}
            runs.append(row)
            err = "n/a" if v.max_error is None else f"{v.max_error:.3e}"
            ratio = "n/a" if v.worst_ratio is None else f"{v.worst_ratio:.3g}"
            print(f"2 ranks on {device} over gloo, {recipe}: parity {'passed' if v.passed else 'FAILED'}, "
                  f"max error {err}, worst ratio {ratio}, launch + run {took:.2f} s")
            if v.max_error is None:
                print("   ", v.message)
    report["two_ranks_gloo"] = runs
    path = os.path.join(os.environ["GPU_CHECK_OUT"], "gpu-probe.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    print("wrote", path)
    wrong = [r for r in runs if r["passed"] != (r["recipe"] == "global_token_mean")]
    if not all(r["passed"] for r in refs) or wrong:
        raise SystemExit("probe: a measured number is outside what the tests require (see above)")


if __name__ == "__main__":
    main()
PY
  GPU_CHECK_OUT="$out" step probe "$PROBE_LIMIT" "$PY" "$work/gpu_probe.py"

  section "portability: the unit tier on this machine's Python and torch"
  step "pytest tests/unit" "$UNIT_LIMIT" "$PY" -m pytest ${pytest_extra[@]+"${pytest_extra[@]}"} tests/unit -q ${xdist[@]+"${xdist[@]}"} \
    --junitxml="$out/unit-junit.xml"
}

finish() {
  section "summary: $((SECONDS - t_start)) s in all"
  cat "$work/summary" 2>/dev/null
  if [ "$status" -eq 0 ]; then echo "RESULT: every step passed"; else echo "RESULT: FAILED (see the steps above)"; fi
  echo "files: $(cd "$out" && ls | tr '\n' ' ')"
  return "$status"
}

t_start=$SECONDS
# One pipeline, so that everything printed (including each step's own output) lands in the log as well.
{ main; finish; } 2>&1 | tee -a "$log"
exit "${PIPESTATUS[0]}"
