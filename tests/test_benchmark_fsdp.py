"""benchmarks/fsdp_vs_torch.py parses, validates and runs end to end at its smallest size:
gridtrain's ZeRO stages named by ``STAGES`` against PyTorch FSDP2 on two gloo processes.
The timings are not checked, only the run's own checks: every side's losses agree with
FSDP2's, the memory ledger is consistent and matches torch's FSDPMemTracker on the FSDP2
side, and FSDP2 holds exactly its sharded parameters, gradients and Adam moments."""

import re
import subprocess
import sys

import pytest

from tests.test_benchmarks import BENCHMARKS, ROOT, TINY, _load

STAGES = "3,2"  # gridtrain ZeRO stages the smoke test runs (comma-separated, as --zero takes them)


def _stages() -> list[int]:
    return [int(s) for s in STAGES.split(",")]


def test_flags_parse_and_the_configurations_validate():
    from gridtrain.training.validate import validate

    module = _load("fsdp_vs_torch")
    assert module.parse_args([])["zero"] == [3, 2]  # the default sides
    opts = module.parse_args(["--zero", STAGES])
    assert opts["zero"] == _stages() and opts["dtype"] == "fp32" and opts["reference"] is False
    for cfg in module._configs(opts):
        validate(cfg, world_size=module.DP)
    assert [c.parallel.zero for c in module._configs(opts)][:len(_stages())] == _stages()


@pytest.mark.parametrize("bad", ["4", "1,1", "x"])
def test_a_bad_stage_list_is_refused(bad, capsys):
    module = _load("fsdp_vs_torch")
    with pytest.raises(SystemExit) as exc:
        module.parse_args(["--zero", bad])
    assert exc.value.code == 2 and "--zero" in capsys.readouterr().err


@pytest.mark.spawn
def test_fsdp_vs_torch_runs_and_every_side_agrees_with_fsdp2():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "fsdp_vs_torch.py"), *TINY, "--zero", STAGES,
                           "--microbatches", "2", "--micro-batch-size", "2"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"^wall time \d+ s$", out, re.M), out
    names = [f"gridtrain --zero {z}" for z in _stages()]
    if 3 in _stages():
        names.append("gridtrain --zero 3 --zero3-keep-gathered")
    names += ["FSDP2", "FSDP2 reshard_after_forward=False"]
    rows = [line.split(" | ")[0][2:] for line in out.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert rows == names, out
    # every side, every step (1 warm-up + 1 timed), within the fp32 parity bound of FSDP2's losses
    assert re.search(r"^loss check over all 2 steps \(1 warm-up \+ 1 timed\), every side against FSDP2: AGREE ",
                     out, re.M), out
    assert "ledger consistency after the warm-up (running count vs storages' sizes summed afresh): " \
           "equal for every owner on both ranks" in out
    # the ledger and torch's own tracker see the same peak on the FSDP2 side
    cross = re.search(r"FSDP2 peak in the same step by torch's FSDPMemTracker: ([\d.]+) MiB \(ledger ([\d.]+) MiB\)",
                      out)
    assert cross and abs(float(cross.group(1)) - float(cross.group(2))) <= 0.02 * float(cross.group(2)), out
    # FSDP2 holds its parameters, gradients and both Adam moments, each sharded over the 2 ranks
    sharded = re.search(r"([\d.]+) MiB fully sharded over 2", out).group(1)
    fsdp = next(line for line in out.splitlines() if line.startswith("| FSDP2 |"))
    assert fsdp.rstrip(" |").endswith(f"| {sharded} / {sharded}"), (fsdp, sharded)
