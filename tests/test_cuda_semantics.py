"""The CUDA-semantics tier: on a machine without a GPU, what only a GPU would show.

The CPU suite cannot see asynchronous copies, the device a tensor is made on, or the
shape rules of CUDA kernels. These tests hold the step to them on fake tensors
(gridtrain/runtime/cuda_rules.py): in this process on any build of torch (the rules
themselves, float8 amaxes made on the rank's device, float8 GEMM shapes under
``_scaled_mm``'s CUDA rules), and with a CUDA build of torch in a separate interpreter
(``GRIDTRAIN_CUDA_PYTHON``; ``make test`` makes one in ``.venv-cuda``) for the whole
step on fake CUDA tensors (tests/cuda_build_checks.py): the dry run of a login node, the
offloaded optimizer's copies, float8 under ZeRO and the multi-token-prediction shift.
Each defect of docs/gpus.md's list that these cover has a test that fails before its fix
(the negative controls below put the old code back).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gridtrain.runtime.cuda_rules import CudaKernelShapes, CudaRules, KernelShapeError, fake_cuda_runtime
from gridtrain.parallel import float8

ROOT = Path(__file__).resolve().parents[1]


# ---- the rules themselves, in this process --------------------------------------------------------

def test_the_rules_see_host_tensors_blocking_copies_and_unwaited_copies():
    with FakeTensorMode(), fake_cuda_runtime():
        on_device = torch.ones(8, device="cuda")
        with CudaRules() as rules:
            torch.zeros(4)  # made on the host in the step
            torch.zeros(4, device="cuda") + torch.tensor(2.0)  # a Python number: not a transfer
            torch.tensor([0, -100], device="cuda")  # a host constant copied without non_blocking
            landed = on_device.to("cpu", non_blocking=True)
            landed + 1  # read before any wait
        assert [b.rule for b in rules.breaches] == ["host-tensor", "blocking-copy", "unwaited-copy"]
        assert all("test_cuda_semantics.py" in b.site for b in rules.breaches)

        with CudaRules() as rules:
            first = on_device.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            second = on_device.to("cpu", non_blocking=True)
            event.synchronize()  # covers the first copy, not the second
            first + 1
            second + 1
            torch.cuda.synchronize()
            second + 1
            torch.empty(4, pin_memory=True)  # a staging buffer for a copy: allowed
            offloaded = on_device.to("cpu", non_blocking=True)
            # back to the device: a stream reads it, after its waits (the op itself: a CPU
            # build of torch refuses Tensor.to("cuda") before any mode sees it)
            torch.ops.aten._to_copy.default(offloaded, device=torch.device("cuda"), non_blocking=True)
        assert [b.rule for b in rules.breaches] == ["unwaited-copy"]


def test_kernel_shapes_are_checked_by_cudas_rules_on_cpu_tensors():
    with FakeTensorMode():
        a = torch.zeros(64, 100, dtype=torch.float8_e4m3fn)
        b = torch.zeros(32, 100, dtype=torch.float8_e4m3fn).t()
        one = torch.ones(())
        torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)  # the CPU kernel takes K = 100
        with CudaKernelShapes(), pytest.raises(KernelShapeError, match="divisible by 16"):
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)


# ---- defect 2: float8 amaxes on the rank's device ---------------------------------------------------

@pytest.mark.parametrize("rowwise", [False, True])
def test_float8_amaxes_of_a_weight_with_no_local_piece_are_on_the_ranks_device(rowwise):
    """A ZeRO rank whose shard holds no piece of a weight still makes that weight's amaxes
    on its device: they are joined with the others' and all-reduced there."""
    with FakeTensorMode(), CudaRules() as rules:
        shard = torch.zeros(64, device="cuda")
        amaxes = float8._local_amaxes(None, [], rowwise, (8, 16), shard.device)
    assert [a.device.type for a in amaxes] == ["cuda"] * len(amaxes)
    assert not rules.breaches


# ---- defect 4: float8 GEMM dimensions that are not multiples of 16 ---------------------------------

FP8_UNALIGNED = ["train", "--model", "llama-tiny", "--dtype", "bf16", "--fp8", "rowwise", "--seq-len", "100",
                 "--micro-batch-size", "1", "--global-batch-size", "2", "--dp", "2", "--zero", "1",
                 "--device", "cuda", "--dry-run", "--world-size", "2"]


@pytest.mark.slow
def test_float8_pads_gemm_dimensions_that_cuda_would_refuse(monkeypatch, capsys):
    """100 tokens a micro-batch: the weight gradient's GEMM contracts over them, which
    ``_scaled_mm`` on CUDA refuses unless padded to a multiple of 16; with the padding the
    step passes CUDA's shape rules, and without it (the old code) the dry run fails."""
    from gridtrain.cli.parser import main

    assert main(FP8_UNALIGNED) == 0
    monkeypatch.setattr(float8, "ALIGN", 1)
    assert main(FP8_UNALIGNED) == 1
    assert "divisible by 16" in capsys.readouterr().err


@pytest.mark.parametrize("m,k,n", [(100, 64, 48), (64, 24, 40), (16, 32, 16)])
def test_padded_float8_gemms_equal_the_unpadded_product(m, k, n):
    """Padding changes no number: the padded GEMM (run here by the CPU's ``_scaled_mm``)
    equals the plain one."""
    fp8 = float8.Float8("rowwise", emulate=False)
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(m, k, generator=g) * 4).to(torch.float8_e4m3fn)
    b = (torch.randn(n, k, generator=g) * 4).to(torch.float8_e4m3fn).t()
    sa, sb = torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
    want = (a.float() / sa) @ (b.float() / sb)
    padded = float8._padded(a, (0, (-k) % 16, 0, (-m) % 16))
    assert padded.shape == (m + (-m) % 16, k + (-k) % 16) and padded[m:].float().abs().sum() == 0
    got = fp8.mm(a, sa, b, sb, torch.float32)  # torch's CPU _scaled_mm (2.13) on the padded operands
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


# ---- the whole step on fake CUDA: a CUDA build of torch ------------------------------------------

def cuda_python() -> str | None:
    """The interpreter of a CUDA build of torch (``GRIDTRAIN_CUDA_PYTHON``), or this one
    if it is a CUDA build."""
    if torch.backends.cuda.is_built():
        return sys.executable
    return os.environ.get("GRIDTRAIN_CUDA_PYTHON") or None


def _run_with_a_cuda_build(*args: str) -> subprocess.CompletedProcess:
    python = cuda_python()
    if python is None:
        pytest.skip("no CUDA build of torch here: set GRIDTRAIN_CUDA_PYTHON (make test makes .venv-cuda)")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}  # no GPU, as on a login node
    return subprocess.run([python, *args], capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)


@pytest.mark.spawn
def test_the_kernel_layout_tests_run_on_fake_cuda_with_a_cuda_build_of_torch():
    """tests/test_attention_blocks.py's fake-CUDA cases (the kernels' output shapes, the
    efficient backward's input layout) need a CUDA build: run them with one."""
    done = _run_with_a_cuda_build("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not spawn",
                                  "tests/test_attention_blocks.py")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failed" not in done.stdout


@pytest.fixture(scope="module")
def fake_cuda_step() -> dict[str, str]:
    """tests/cuda_build_checks.py's results, run once with a CUDA build: check -> "ok" or
    the failure."""
    done = _run_with_a_cuda_build(str(ROOT / "tests" / "cuda_build_checks.py"))
    lines = [line[len("CHECK "):] for line in done.stdout.splitlines() if line.startswith("CHECK ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return dict(line.split(": ", 1) for line in lines)


@pytest.mark.spawn
def test_the_dry_run_runs_on_a_login_node(fake_cuda_step):
    """Defect 11: a CUDA build of torch without a GPU: the five layouts exit 0."""
    assert fake_cuda_step["login-node"] == "ok"


@pytest.mark.spawn
def test_offloaded_adamw_waits_for_its_gradient_copies(fake_cuda_step):
    """Defect 1: --optimizer-offload read its non_blocking gradient copies before they
    landed; the old code is refused by the rules."""
    assert fake_cuda_step["offload-waits"] == "ok"


@pytest.mark.spawn
def test_float8_under_zero_makes_nothing_on_the_host(fake_cuda_step):
    """Defect 2: --fp8 under ZeRO at dp 2, some weights smaller than a shard slice."""
    assert fake_cuda_step["fp8-zero-device"] == "ok"


@pytest.mark.spawn
def test_mtp_copies_no_host_constant_to_the_device(fake_cuda_step):
    """Defect 6: the multi-token-prediction shift made its fill on the host per micro-batch."""
    assert fake_cuda_step["mtp-no-host-constant"] == "ok"

def test_the_padded_float8_dimensions_are_said_once_at_start():
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 40), torch.nn.Linear(40, 8))
    float8.mark(model[0].weight, "column")
    float8.mark(model[1].weight, "row")  # 40 x 48: 40 is not a multiple of 16
    assert float8.padding_note(model, 4096) == (
        "--fp8: torch._scaled_mm takes dimensions that are multiples of 16; these are padded with zeros at every "
        "call (a copy of the operands): 1.weight 40x48")
    assert "1000 tokens a micro-batch, 1.weight" in float8.padding_note(model, 1000)
    float8.mark(model[1].weight, None)
    assert float8.padding_note(model, 4096) is None


def test_float8_reads_nothing_of_the_weight_for_its_scale_log_while_compiling(monkeypatch):
    """A weight's name (or id) read in the forward is a constant dynamo guards on: each
    block would compile again (past dynamo's limit of 8, silently eager). The scale log
    (tests) is skipped while compiling, before the weight is read."""
    fp8 = float8.Float8("tensorwise", log=float8.ScaleLog())
    w = torch.nn.Parameter(torch.randn(16, 16))

    def read(weight, operand):
        raise AssertionError("the weight was read for the scale log while compiling")

    monkeypatch.setattr(float8, "_note", read)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    fp8.cast(torch.randn(4, 16), None, (), float8.E4M3, (w, "input"))
    assert not fp8.log.entries
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    with pytest.raises(AssertionError, match="while compiling"):
        fp8.cast(torch.randn(4, 16), None, (), float8.E4M3, (w, "input"))
