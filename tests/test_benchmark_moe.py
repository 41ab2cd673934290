"""benchmarks/moe.py parses, validates and runs end to end at its smallest size: gridtrain's
MoE layer against the plain loop over experts and a dense model on one process, and dp 2
x ep 2 against dp 2 x ep 1 on two gloo processes. The timings are not checked, only the
run's own checks: every MoE side's losses agree with the one-process gridtrain side's and
the ep side's all-to-all bytes equal the closed form."""

import re
import subprocess
import sys

import pytest
import torch

from tests.test_benchmarks import BENCHMARKS, ROOT, TINY, _load

SMALLEST = [*TINY, "--n-experts", "4", "--moe-ffn-hidden", "32", "--microbatches", "1", "--micro-batch-size", "2"]


def test_flags_parse_and_the_configurations_validate():
    from gridtrain.training.validate import validate

    module = _load("moe")
    opts = module.parse_args([])
    assert (opts["d_model"], opts["n_layer"], opts["n_experts"], opts["moe_top_k"], opts["moe_ffn_hidden"]) == \
        (256, 4, 8, 2, 512)
    two = list(module._configs(opts))  # validates the one-process configurations on the way
    for cfg in two:
        validate(cfg, world_size=module.DP)
    assert [c.parallel.ep for c in two] == [1, module.EP]
    one = module._config(opts, one=True)
    dense = module._config(opts, one=True, dense=True)
    assert one.model.arch == "llama" and one.model.moe_layers == [0, 1, 2, 3]
    assert one.training.micro_batch_size == module.DP * opts["micro_batch_size"]
    assert one.training.global_batch_size == two[0].training.global_batch_size
    assert dense.model.n_experts == 0 and dense.model.ffn_size == 2 * 512


@pytest.mark.parametrize("bad", [["--moe-top-k", "0"], ["--aux-loss-coeff", "-1"], ["--microbatches", "0"]])
def test_a_bad_flag_is_refused(bad, capsys):
    module = _load("moe")
    with pytest.raises(SystemExit) as exc:
        module.parse_args(bad)
    assert exc.value.code == 2 and bad[0] in capsys.readouterr().err


def test_a_bad_shape_is_one_line_and_status_2_before_any_process(capsys, no_process_may_start):
    module = _load("moe")
    assert module.main(["--n-experts", "3", "--moe-top-k", "2"]) == 2
    err = capsys.readouterr().err
    assert err == "moe: error: --ep 2 does not divide --n-experts 3; choose an ep that divides the expert count\n"


def test_the_loop_computes_what_gridtrain_s_layer_computes():
    """The loop side's forward against gridtrain's dispatch on one layer: the same output
    and the same gradients (the load-balancing loss's included), to fp32 rounding."""
    from gridtrain.models.decoder import Decoder, init_parameters

    module = _load("moe")
    cfg = module._config(module.parse_args(SMALLEST), one=True).model
    grads = []
    for loop in (False, True):
        model = Decoder(cfg)
        init_parameters(model, 0)
        if loop:
            assert module.use_loop(model) == len(cfg.moe_layers)
        layer = model.blocks["0"].mlp
        x = torch.randn(2, 16, cfg.d_model, generator=torch.Generator().manual_seed(0), requires_grad=True)
        out = layer(x)
        out.square().sum().backward()
        grads.append([out.detach(), x.grad, *(p.grad for p in layer.parameters())])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.spawn
def test_moe_runs_and_every_moe_side_agrees():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "moe.py"), *SMALLEST, "--ref-threads", "1"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    assert re.search(r"^wall time \d+ s$", out, re.M), out
    rows = [line.split(" | ")[0][2:] for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["side", "gridtrain MoE", "loop MoE", "dense", "side", "gridtrain MoE dp 2 x ep 1",
                    "gridtrain MoE dp 2 x ep 2"], out
    assert re.search(r"^loss check over 2 steps \(1 warm-up \+ 1 timed\), every MoE side against gridtrain MoE .*: "
                     r"AGREE ", out, re.M), out
    assert "  loop MoE: steps 1-2 routed alike" in out, out
    assert re.search(r"all-to-all bytes per step .* sum ([\d,]+) B \(closed form \1 B: match\)", out), out


def test_the_loss_check_compares_the_steps_routed_alike():
    """Losses are checked while a side routes like the reference; from the step where
    its routing first differs they are printed, not checked; a difference before is a
    DISAGREE."""
    module = _load("moe")
    opts = {"warmup": 1, "repeats": 1, "steps": 2}
    ref = {"name": module.ONE, "losses": [5.0, 4.0, 3.0], "norms": [1.0, 1.0, 1.0], "routing": [[[3, 1]]] * 3}
    parted = {"name": module.EP2, "losses": [5.0, 4.0, 3.1], "norms": [1.0, 1.0, 1.2],
              "routing": [[[3, 1]], [[3, 1]], [[2, 2]]]}
    lines = module.loss_check([ref, parted], opts)
    assert ": AGREE (bound 1e-05 relative)" in lines[0]
    assert lines[1].startswith(f"  {module.EP2}: steps 1-2 routed alike, largest loss difference 0.0e+00 (bit for bit)")
    assert "routing first differs at step 3, the losses then by 3.3e-02" in lines[1]
    early = dict(parted, losses=[5.0, 4.001, 3.1])
    assert ": DISAGREE " in module.loss_check([ref, early], opts)[0]
