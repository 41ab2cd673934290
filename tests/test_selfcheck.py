"""The GPU self-check's own logic, on the CPU (gridtrain/selfcheck/): the one-line refusal
without a GPU, the time boxes, the report written step by step, the throughput and MFU
arithmetic, and one rehearsal of the real steps with ``--device cpu`` on tiny models."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gridtrain.selfcheck.baseline import median_after, throughput_row
from gridtrain.selfcheck.report import Report, StepResult
from gridtrain.selfcheck.runner import (CPU_BOX_SCALE, DEFAULT_BUDGET_S, EXIT_REFUSED, REPO, RESERVE_S, SIDE_BY_SIDE,
                                        Step, build_parser, plan_seconds, plan_steps, run_side_by_side, run_step,
                                        stages)

PY = sys.executable
no_gpu = pytest.mark.skipif(torch.cuda.is_available(),
                            reason="checks the refusal where no GPU is visible; with one, the check runs instead")


@no_gpu
@pytest.mark.spawn
def test_gpu_check_without_a_gpu_refuses_in_one_line_with_exit_2(tmp_path):
    done = subprocess.run([PY, "-m", "gridtrain.selfcheck", "--gpu", "--out", str(tmp_path / "r")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == EXIT_REFUSED
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-check: no CUDA device is visible"), done.stderr
    assert not (tmp_path / "r").exists()  # refused before anything was written


@no_gpu
@pytest.mark.spawn
def test_make_gpu_check_refuses_too():
    done = subprocess.run(["make", "-s", "gpu-check", f"PYTHON={PY}", "GPU_CHECK_OUT=/nonexistent/x"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines()[0].startswith("gpu-check: no CUDA device is visible"), done.stderr


def _python(code: str) -> list[str]:
    return [PY, "-c", code]


@pytest.mark.spawn
def test_a_step_is_time_boxed_with_its_whole_process_group(tmp_path):
    marker = tmp_path / "grandchild.pid"
    # the step's process starts a grandchild that would outlive it, then hangs
    hang = _python(f"import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
                   f"'import time; time.sleep(600)']); open({str(marker)!r}, 'w').write(str(p.pid)); "
                   f"print('hanging', flush=True); time.sleep(600)")
    began = time.monotonic()
    result = run_step(Step("hangs", "a step that hangs", 3.0, [hang]), tmp_path, budget_left_s=100)
    assert time.monotonic() - began < 20
    assert result.status == "timeout" and "killed after its time box of 3 s" in result.detail
    assert "hanging" in result.tail
    pid = int(marker.read_text())
    time.sleep(0.5)
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(")")[1][:3]


@pytest.mark.spawn
def test_steps_run_in_order_stop_at_the_first_failure_and_keep_its_last_lines(tmp_path):
    ran = tmp_path / "ran"
    step = Step("two", "fails at the second command", 60,
                [_python("print('first')"), _python("import sys; print('the reason'); sys.exit(3)"),
                 _python(f"open({str(ran)!r}, 'w')")])
    result = run_step(step, tmp_path, budget_left_s=60)
    assert result.status == "fail" and result.detail.startswith("exit code 3")
    assert result.tail.splitlines()[-1] == "the reason"
    assert not ran.exists()
    # the budget left caps the step's own time box
    capped = run_step(Step("capped", "", 600, [_python("import time; time.sleep(30)")]), tmp_path, budget_left_s=2.0)
    assert capped.status == "timeout" and "time box of 2 s" in capped.detail and capped.seconds < 10


def test_throughput_and_mfu_arithmetic():
    row = throughput_row("gpt2", False, "plain PyTorch", step_s=0.05, tokens_per_step=16384,
                         flops_per_token=854e6, peak_tflops=989.0)
    assert row["tokens_per_s"] == pytest.approx(327680)
    assert row["tflops"] == pytest.approx(327680 * 854e6 / 1e12)
    assert row["mfu"] == pytest.approx(row["tflops"] / 989.0)
    assert row["step_ms"] == pytest.approx(50.0)
    assert throughput_row("x", False, "y", 1.0, 1, 1.0, None)["mfu"] is None  # no known peak
    assert median_after([9.0, 1.0, 2.0, 3.0], warmup=1) == 2.0
    assert median_after([5.0], warmup=3) == 5.0  # too few steps: all of them


def test_the_report_is_complete_after_every_step_and_lists_what_did_not_run(tmp_path):
    report = Report(tmp_path, "python3 -m gridtrain.selfcheck --gpu", "cuda",
                    planned=[("environment", "versions"), ("throughput-gpt2", "speed"), ("watchdog", "hangs")])
    report.write()
    first = json.loads((tmp_path / "report.json").read_text())
    assert [s["status"] for s in first["steps"]] == ["not run"] * 3
    assert "still running or killed" in (tmp_path / "report.md").read_text()
    report.add(StepResult("environment", "versions", "pass", 1.0, data={"environment": {"gpu": "NVIDIA H100"}}))
    rows = [throughput_row("gpt2", False, "plain PyTorch", 0.05, 16384, 854e6, 989.0),
            throughput_row("gpt2", False, "gridtrain train", 0.04, 16384, 854e6, 989.0)]
    rows[1].update(vs_plain=0.05 / 0.04, baseline="plain PyTorch", vs=0.05 / 0.04)
    report.add(StepResult("throughput-gpt2", "speed", "fail", 30.0, "exit code 1", "the last line",
                          data={"throughput": rows,
                                "memory": [{"run": "gpt2", "measured_gib": 18.0, "predicted_gib": 17.0,
                                            "ratio": 18 / 17, "plain_gib": 20.0}],
                                "planner": [{"run": "gpt2", "hardware": "h100-sxm", "predicted_ms": 45.0,
                                             "measured_ms": 40.0, "ratio": 40 / 45}]}))
    report.write()
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["environment"] == {"gpu": "NVIDIA H100"}
    assert [s["status"] for s in data["steps"]] == ["pass", "fail", "not run"]
    assert data["throughput"] == rows and data["memory"][0]["ratio"] == pytest.approx(18 / 17)
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# gridtrain self-check: NVIDIA H100")
    assert "| gpt2 | False | gridtrain train | 16,384 | 40.0 | 409,600 | 349.8 | 35.4% | plain PyTorch | 1.250x |" in md
    assert "| gpt2 | 18.00 | 17.00 | 1.059 | 20.00 |" in md
    assert "| gpt2 | h100-sxm | 45.0 | 40.0 | 0.889 |" in md
    assert "### throughput-gpt2 (fail)" in md and "the last line" in md
    report.finish()
    report.write()
    assert "still running" not in (tmp_path / "report.md").read_text()


SEMANTICS = ["float8-gemms", "grouped-gemm", "efficient-attention-bwd", "head-loss", "offload", "fp8-zero",
             "compile-fp8"]
MEASURING = ["fp8", "cp-attention", "document-mask", "moe", "throughput-gpt2", "throughput-gpt2-compile",
             "throughput-llama", "throughput-llama-compile", "head-loss"]


def test_the_gpu_plan_covers_what_the_check_promises(tmp_path):
    steps = {s.name: s for s in plan_steps("cuda", tmp_path, tiny=False, peak_tflops=None)}
    order = list(steps)
    assert order[:5] == ["environment", "float8-gemms", "grouped-gemm", "efficient-attention-bwd", "head-loss"]
    assert set(SEMANTICS) <= set(steps)  # what only a GPU shows (issue 54)
    # cheap first, the measurements last, the largest of them at the end
    assert order.index("compile-fp8") < order.index("fp8") < order.index("cp-attention")
    assert order[-4:] == ["throughput-gpt2", "throughput-gpt2-compile", "throughput-llama", "throughput-llama-compile"]
    assert "--model moe" in " ".join(steps["moe"].commands[0])
    commands = {name: " ".join(" ".join(c) for c in s.commands) for name, s in steps.items()}
    assert "tests/test_gpu.py" in commands["gpu-tests"]
    assert "--optimizer muon" in commands["optimizers"] and "--optimizer-offload" in commands["optimizers"]
    assert "--nproc 1 --device cuda --dtype bf16" in commands["optimizers"]  # NCCL, the state on the host
    assert "--nproc 1 --device cuda" in commands["one-rank"] and "--backend" not in commands["one-rank"]  # NCCL
    for name in ("tp-sp-pp", "dp-zero1-dcp", "zb-h1"):
        assert "--device cuda --backend gloo" in commands[name]  # ranks sharing the one GPU
    assert "--save-async" in commands["dp-zero1-dcp"] and "--offload-activations" in commands["dp-zero1-dcp"]
    assert {f"throughput-{m}{c}" for m in ("gpt2", "llama") for c in ("", "-compile")} <= set(steps)
    assert "--profile" in commands["throughput-gpt2"] and "--profile" not in commands["throughput-llama"]
    for name in ("throughput-gpt2-compile", "throughput-llama-compile", "document-mask", "moe"):
        assert "--rounds 1" in commands[name]  # one run of each loop: a compile each, or a large model


def test_every_step_of_the_gpu_plan_fits_the_default_budget(tmp_path):
    """The budget arithmetic of runner.py's docstring, as data: every stage's longest box
    summed, plus the reserve, within the default --budget-s, so that one call runs every
    step with its whole box. Only steps that measure no speed run side by side."""
    steps = plan_steps("cuda", tmp_path, tiny=False, peak_tflops=None)
    assert build_parser().parse_args([]).budget_s == DEFAULT_BUDGET_S == 570
    assert all(0 < s.timeout_s <= 120 for s in steps)
    assert plan_seconds(steps) + RESERVE_S <= DEFAULT_BUDGET_S, [(s.name, s.timeout_s) for s in steps]
    assert plan_seconds(steps) == sum(max(s.timeout_s for s in stage) for stage in stages(steps))
    from gridtrain.selfcheck import runner  # its docstring states the arithmetic: it must be this plan's

    assert f"= {plan_seconds(steps):.0f} s of stages + RESERVE_S {RESERVE_S:.0f} = " \
           f"{plan_seconds(steps) + RESERVE_S:.0f} s <= {DEFAULT_BUDGET_S:.0f} s" in runner.__doc__
    for step in steps:
        assert f"{step.name} {step.timeout_s:.0f}" in " ".join(runner.__doc__.split()), step.name
    together = [s.name for s in steps if s.batch is not None]
    assert {s.batch for s in steps} == {None, SIDE_BY_SIDE} and not set(together) & set(MEASURING)
    assert len(stages(steps)) == len(steps) - len(together) + 1  # the batch is one stage, in one piece
    assert set(SEMANTICS) - {"offload", "fp8-zero"} <= {s.name for s in steps if s.batch is None}


@pytest.mark.spawn
def test_steps_side_by_side_run_together_each_in_its_own_box(tmp_path):
    sleeper = _python("import time; time.sleep(2); print('slept')")
    batch = [Step("a", "sleeps", 30, [sleeper], batch="b"), Step("b", "sleeps", 30, [sleeper], batch="b"),
             Step("c", "overruns", 1, [_python("import time; time.sleep(30)")], batch="b")]
    assert len(stages([Step("x", "", 5, [sleeper]), *batch])) == 2
    report = Report(tmp_path, "x", "cpu", planned=[(s.name, s.what) for s in batch])
    began = time.monotonic()
    run_side_by_side(batch, tmp_path, 60, report)
    assert time.monotonic() - began < 15  # together, not one after another (2 + 2 + the kill)
    assert [(s.name, s.status) for s in report.steps] == [("a", "pass"), ("b", "pass"), ("c", "timeout")]


@pytest.mark.spawn
def test_a_cpu_rehearsal_of_the_measuring_steps(tmp_path):
    out = tmp_path / "report"
    done = subprocess.run([PY, "-m", "gridtrain.selfcheck", "--device", "cpu", "--out", str(out), "--peak-tflops",
                           "1", "--only", "environment,throughput-gpt2"], cwd=REPO, capture_output=True, text=True,
                          timeout=600)
    data = json.loads((out / "report.json").read_text())
    assert done.returncode == 0, (done.stdout, [s.get("tail") for s in data["steps"]])
    assert data["environment"]["torch"] == torch.__version__
    plain, ours = data["throughput"]
    assert (plain["loop"], ours["loop"]) == ("plain PyTorch", "gridtrain train")
    for row in (plain, ours):
        assert row["tokens_per_step"] == 4 * 64 and row["tokens_per_s"] > 0 and 0 < row["mfu"] < 1
    assert ours["vs_plain"] == pytest.approx(plain["step_ms"] / ours["step_ms"])
    (planner,) = data["planner"]
    assert planner["hardware"] == "cpu" and planner["predicted_ms"] > 0
    assert "## Throughput" in (out / "report.md").read_text()


# ---- the fp8 step -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,tiny", [("cuda", False), ("cpu", True)])
def test_the_fp8_step_is_planned_with_a_well_formed_command(tmp_path, device, tiny):
    from gridtrain.selfcheck import fp8

    steps = plan_steps(device, tmp_path, tiny=tiny, peak_tflops=989.0)
    first = next(s for s in steps if s.name == "fp8")
    assert len(first.commands) == 1 and first.result_file and first.batch is None
    command = first.commands[0]
    assert command[:3] == [PY, "-m", "gridtrain.selfcheck.fp8"]
    args = fp8.build_parser().parse_args(command[3:])
    assert (args.device, args.tiny, args.peak_tflops, args.result) == (device, tiny, 989.0, first.result_file)
    assert 0 < first.timeout_s <= 120 * (1 if device == "cuda" else CPU_BOX_SCALE)  # a share of the lease
    assert "torchao" in first.what and "1.25x" in first.what


def test_the_fp8_runs_are_bf16_and_float8_compiled_first_and_valid(tmp_path):
    """On a GPU compiled bf16 and tensorwise, then eager bf16, tensorwise and rowwise, back
    to back; on a CPU eager only. Every run is one ``gridtrain train`` configuration that
    validation accepts: TinyLlama's layer shape (the preset, 8 of its layers), bf16, one
    micro-batch a step."""
    from gridtrain.selfcheck import fp8
    from gridtrain.training.validate import validate

    args = fp8.build_parser().parse_args(["--device", "cpu", "--result", str(tmp_path / "r.json")])
    assert [(c, r) for c, r, _ in fp8.run_configs(args, torch.device("cuda"))] == \
        [(True, "none"), (True, "tensorwise"), (False, "none"), (False, "tensorwise"), (False, "rowwise")]
    runs = fp8.run_configs(args, torch.device("cpu"))
    assert [(c, r) for c, r, _ in runs] == [(False, "none"), (False, "tensorwise"), (False, "rowwise")]
    for _, recipe, cfg in runs:
        m, t = cfg.model, cfg.training
        assert (m.arch, m.n_layer, m.d_model, m.n_head, m.n_kv_head, m.ffn_hidden, m.seq_len, m.vocab_size) == \
            ("llama", 8, 2048, 32, 4, 5632, 2048, 32000)
        assert (t.fp8, t.dtype, t.micro_batch_size, t.global_batch_size) == (recipe, "bf16", 4, 4)
        assert 10 <= t.steps <= 50
        validate(cfg, 1)
    tiny = fp8.build_parser().parse_args(["--device", "cpu", "--result", "x", "--tiny"])
    assert {cfg.model.d_model for _, _, cfg in fp8.run_configs(tiny, torch.device("cpu"))} == {64}


def test_the_fp8_summary_against_bf16_and_its_target():
    from gridtrain.selfcheck.fp8 import summary_row

    base = {"tokens_per_s": 1000.0, "step_ms": 10.0, "mfu": 0.4, "losses": [5.0, 4.0], "peak_gib": 10.0}
    fast = {**base, "tokens_per_s": 1300.0, "losses": [5.0, 4.02], "peak_gib": 9.0}
    row = summary_row("tensorwise", True, fast, base, 1.4)
    assert row["vs_bf16"] == pytest.approx(1.3) and row["final_loss_rel_diff"] == pytest.approx(0.005)
    assert row["memory_vs_bf16"] == pytest.approx(0.9) and row["target"] == "pass"
    assert summary_row("rowwise", True, {**fast, "tokens_per_s": 1200.0}, base, None)["target"] == "fail"  # slow
    assert summary_row("rowwise", True, {**fast, "losses": [5.0, 4.1]}, base, None)["target"] == "fail"  # loss
    assert summary_row("tensorwise", False, fast, base, None)["target"] == "n/a"  # eager: not the target's
    assert summary_row("none", True, base, base, 1.0)["target"] == "n/a"


@pytest.mark.spawn
def test_a_result_that_says_skipped_marks_its_step_skipped_in_one_line(tmp_path):
    result = tmp_path / "fp8.json"
    line = "fp8: skipped: torchao's float8 does not import here (ImportError: no torchao); pip install torchao"
    write = _python(f"import json; print({line!r}); json.dump({{'skipped': {line!r}}}, open({str(result)!r}, 'w'))")
    got = run_step(Step("fp8", "float8", 30, [write], str(result)), tmp_path, budget_left_s=60)
    assert (got.status, got.detail, got.tail) == ("skipped", line, "")
    report = Report(tmp_path, "x", "cuda", planned=[("fp8", "float8")])
    report.add(got)
    assert f"| fp8 | float8 | skipped: {line} |" in "\n".join(report.markdown())


def test_the_fp8_check_skips_without_torchao(tmp_path, monkeypatch, capsys):
    from gridtrain.selfcheck import fp8

    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # import torchao.float8 raises ImportError
    assert fp8.torchao_missing().startswith("fp8: skipped: torchao's float8 does not import here")
    assert fp8.main(["--device", "cpu", "--tiny", "--result", str(tmp_path / "r.json")]) == 0
    assert capsys.readouterr().out.count("\n") == 1
    assert json.loads((tmp_path / "r.json").read_text())["skipped"].startswith("fp8: skipped")


def test_the_report_has_a_float8_table(tmp_path):
    report = Report(tmp_path, "x", "cuda", planned=[("fp8", "float8")])
    row = {"run": "fp8 tensorwise compile", "tokens_per_s": 12000.0, "vs_bf16": 1.31, "predicted_vs_bf16": 1.28,
           "final_loss": 4.0, "final_loss_rel_diff": 0.004, "max_loss_rel_diff": 0.008, "steps": 40,
           "peak_gib": 30.0, "memory_vs_bf16": 0.95, "target": "pass"}
    report.add(StepResult("fp8", "float8", "pass", 200.0, data={"fp8": [row]}))
    md = "\n".join(report.markdown())
    assert "## Float8 against bf16 (one device)" in md
    assert "| fp8 tensorwise compile | 12,000 | 1.310x | 1.280x | 4.0000 | 0.40% | 0.80% | 40 | 30.00 | 0.950x | pass |" \
        in md
    assert report.as_json()["fp8"] == [row]


@pytest.mark.spawn
def test_a_cpu_rehearsal_of_the_fp8_step(tmp_path):
    """The tiny variant end to end on the CPU (float8 emulated): three eager runs, their
    summary against bf16 and the planner's predicted ratio."""
    pytest.importorskip("torchao.float8")
    result = tmp_path / "fp8.json"
    done = subprocess.run([PY, "-m", "gridtrain.selfcheck.fp8", "--device", "cpu", "--tiny", "--result", str(result)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(result.read_text())
    assert [r["loop"] for r in data["fp8_runs"]] == ["bf16", "fp8 tensorwise", "fp8 rowwise"]
    rows = {r["fp8"]: r for r in data["fp8"]}
    assert set(rows) == {"none", "tensorwise", "rowwise"} and rows["none"]["vs_bf16"] == 1.0
    for recipe in ("tensorwise", "rowwise"):
        assert rows[recipe]["final_loss_rel_diff"] < 0.05 and rows[recipe]["predicted_vs_bf16"] > 0
        assert rows[recipe]["target"] == "n/a" and rows[recipe]["steps"] == 6


# ---- what only a GPU shows (gridtrain/selfcheck/cuda_semantics.py) ------------------------------------

@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_semantics_steps_have_well_formed_commands(tmp_path, device):
    from gridtrain.selfcheck import cuda_semantics

    steps = {s.name: s for s in plan_steps(device, tmp_path, tiny=device == "cpu", peak_tflops=None)}
    for name in SEMANTICS:
        (command,) = steps[name].commands
        assert command[:4] == [PY, "-m", "gridtrain.selfcheck.cuda_semantics", name]
        args = cuda_semantics.build_parser().parse_args(command[3:])
        assert (args.name, args.device, args.result, args.tiny) == (name, device, steps[name].result_file,
                                                                   device == "cpu")
        assert 0 < steps[name].timeout_s <= 60 * (1 if device == "cuda" else CPU_BOX_SCALE)


@pytest.mark.spawn
def test_a_cpu_rehearsal_of_the_offload_check(tmp_path):
    """The offload check end to end on the CPU (tiny: 4 steps): both CLI runs, the loss
    curves in the result, and the comparison row (on a CPU the state is on the host
    either way, so the curves are equal)."""
    result = tmp_path / "offload.json"
    done = subprocess.run([PY, "-m", "gridtrain.selfcheck.cuda_semantics", "offload", "--device", "cpu", "--tiny",
                           "--result", str(result)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(result.read_text())
    assert data["offload"]["steps"] == 4 and len(data["offload"]["losses_offloaded"]) == 4
    (row, _) = data["semantics"]
    assert row["check"] == "offload" and row["value"] == 0.0 and row["limit"] == 1e-6 and row["ok"]
    assert "--optimizer-offload" in done.stdout and "--zero 1" in done.stdout


def test_a_cpu_rehearsal_of_the_head_loss_check(tmp_path):
    """The chunked head loss against the unfused one at tiny sizes: the same loss, both
    timed, the ratios reported (no peak memory off CUDA)."""
    from types import SimpleNamespace

    from gridtrain.selfcheck import cuda_semantics
    from gridtrain.selfcheck.checks import Result

    args = SimpleNamespace(device="cpu", tiny=True)
    assert cuda_semantics.head_loss(args, Result(str(tmp_path / "h.json"))) == 0
    data = json.loads((tmp_path / "h.json").read_text())
    rows = {r["quantity"]: r for r in data["semantics"]}
    assert rows["summed loss, fused vs unfused, relative"]["value"] <= 1e-2
    assert rows["fused: ms (forward + backward)"]["value"] > 0 and rows["speed, fused / unfused"]["value"] > 0
    assert data["head_loss"]["fused_peak_gib"] is None and data["head_loss"]["vocab"] == 1024


def test_the_grouped_gemm_check_on_the_cpu_at_tiny_sizes(tmp_path):
    """The grouped GEMMs against the loop in bf16 on the CPU (where torch._grouped_mm
    takes bf16 too): within tolerance, no gradient for the experts without tokens, and
    the path gridtrain picks reported."""
    from types import SimpleNamespace

    from gridtrain.selfcheck import cuda_semantics
    from gridtrain.selfcheck.checks import Result

    assert cuda_semantics.grouped_gemm(SimpleNamespace(device="cpu", tiny=True), Result(str(tmp_path / "g.json"))) == 0
    rows = json.loads((tmp_path / "g.json").read_text())["semantics"]
    assert rows[0]["quantity"] == "gridtrain picks" and rows[0]["value"] == "grouped GEMM"
    assert all(r["ok"] for r in rows)
    assert next(r for r in rows if r["quantity"].startswith("experts without tokens"))["value"] == 0


def test_the_cuda_kernel_checks_say_why_they_are_skipped_off_cuda(tmp_path):
    """float8-gemms needs CUDA's float8 kernels: skipped in one line on a CPU;
    efficient-attention-bwd rehearses its comparison with the CPU's flash kernel and
    reports the step skipped."""
    from types import SimpleNamespace

    from gridtrain.selfcheck import cuda_semantics
    from gridtrain.selfcheck.checks import Result

    args = SimpleNamespace(device="cpu", tiny=True)
    assert cuda_semantics.float8_gemms(args, Result(str(tmp_path / "f.json"))) == 0
    assert json.loads((tmp_path / "f.json").read_text())["skipped"].startswith("float8-gemms: skipped")
    assert cuda_semantics.efficient_attention_bwd(args, Result(str(tmp_path / "e.json"))) == 0
    data = json.loads((tmp_path / "e.json").read_text())
    assert data["skipped"].startswith("efficient-attention-bwd: skipped: the memory-efficient attention kernel needs")
    assert {r["quantity"] for r in data["semantics"]} >= {"dq vs fp64, relative", "dk vs fp64, relative"}
    assert all(r["ok"] for r in data["semantics"])


def test_graph_breaks_and_recompiles_are_counted_by_record():
    """TORCH_LOGS prefixes every line of a record with its artifact; a record counts once."""
    from gridtrain.selfcheck.cuda_semantics import count_compile_events

    head = "V1204 20:46:01.000000 123 torch/_dynamo/guards.py:5389] [0/1]"
    text = "\n".join([
        f"{head} [__recompiles] Recompiling function layer in gridtrain/models/decoder.py:132",
        f"{head} [__recompiles]     triggered by the following guard failure(s):",
        f"{head} [__recompiles]     - 0/0: ___check_obj_id(self._modules['mlp'], 1)",
        f"{head} [__graph_breaks] Graph break in user code at gridtrain/x.py:3",
        f"{head} [__graph_breaks] Graph Break Reason: a reason",
        "an ordinary line: Graph break in user code (not a log record)"])
    counts = count_compile_events(text)
    assert (counts["recompiles"], counts["graph_breaks"]) == (1, 1)
    assert (counts["recompile_lines"], counts["graph_break_lines"]) == (3, 2)
    assert counts["graph_break_reasons"] == ["a reason"]
    assert counts["recompile_guards"] == ["- 0/0: ___check_obj_id(self._modules['mlp'], 1)"]


def test_the_report_has_a_table_of_what_only_a_gpu_shows_in_the_planned_order(tmp_path):
    report = Report(tmp_path, "x", "cuda", planned=[("float8-gemms", "f8"), ("offload", "o"), ("fp8-zero", "z")])
    row = {"check": "offload", "case": "AdamW", "quantity": "max relative loss difference", "value": 2.5e-8,
           "limit": 1e-6, "ok": True}
    report.add(StepResult("fp8-zero", "z", "skipped", 1.0, "no torchao"))
    report.add(StepResult("offload", "o", "pass", 20.0, data={"semantics": [row]}))  # finished in another order
    md = "\n".join(report.markdown())
    assert [s["name"] for s in report.as_json()["steps"]] == ["offload", "fp8-zero", "float8-gemms"]
    assert "## What only a GPU shows" in md
    assert "| offload | AdamW | max relative loss difference | 2.5e-08 | 1e-06 | True |" in md
