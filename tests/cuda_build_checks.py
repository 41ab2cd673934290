"""The CUDA-semantics checks that need a CUDA build of torch (run without a GPU).

tests/test_cuda_semantics.py runs this file with the interpreter of a CUDA build
(``GRIDTRAIN_CUDA_PYTHON``, made by ``make test`` in ``.venv-cuda``): one process for all
the checks, so torch is imported once. Each check prints ``CHECK name: ok`` or
``CHECK name: FAIL <why>``; the test reads the lines.

* ``login-node``: the dry runs that a cluster's login node (a CUDA build, no GPU) must
  run, each exiting 0 with the line that says what ran on fake CUDA;
* ``offload-waits`` (--optimizer-offload reading gradients before their copies landed):
  the dry run of an offloaded AdamW step passes, and the same step with the copies read
  at once, as before the fix, is refused by the CUDA rules;
* ``fp8-zero-device`` (float8 amaxes made on the host by a rank holding no piece of a
  weight): ZeRO-3 at dp 2 with rowwise float8 weights, some smaller than a shard slice
  (ZeRO-1 with tensorwise ones is among ``login-node``'s);
* ``mtp-no-host-constant`` (a host constant copied to the device per micro-batch): the
  multi-token-prediction shift on fake CUDA under the rules, and the old constant refused.
"""

from __future__ import annotations

import contextlib
import io
import sys
import traceback

import torch

LOGIN_NODE_RUNS = [
    "--model llama-tiny --dp 2 --zero 1 --dtype bf16 --fp8 tensorwise --world-size 2",
    "--model moe-tiny --ep 2 --dp 2 --zero 3 --world-size 2",
    "--model deepseek-tiny --tp 2 --sequence-parallel --world-size 2",
    "--model llama-tiny --cp 2 --world-size 2",
    "--model llama3-8b --tp 8 --pp 2 --zero 1 --dtype bf16 --micro-batch-size 1 --global-batch-size 8 "
    "--world-size 64 --dry-run-ranks 32",  # the last stage (the first stage's path: the layouts above)
]


def dry_run(flags: str) -> tuple[int, str]:
    from gridtrain.cli.parser import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["train", *flags.split(), "--dry-run"])
    return code, out.getvalue() + err.getvalue()


def login_node() -> str | None:
    for flags in LOGIN_NODE_RUNS:
        code, text = dry_run(flags)
        if code != 0 or "no GPU here" not in text:
            return f"{flags}: exit {code}: {text.strip().splitlines()[-1] if text.strip() else ''}"
    return None


def offload_waits() -> str | None:
    from gridtrain.optim.distributed_optimizer import DistributedOptimizer

    flags = "--model llama-tiny --dp 2 --zero 1 --optimizer-offload --world-size 2"
    code, text = dry_run(flags)
    if code != 0:
        return f"the offloaded step: exit {code}: {text.strip().splitlines()[-1]}"
    fixed = DistributedOptimizer._host_grads
    DistributedOptimizer._host_grads = lambda self: [g.to(self.state_device, non_blocking=True)
                                                     for g in self._grads]
    try:
        code, text = dry_run(flags)
    finally:
        DistributedOptimizer._host_grads = fixed
    if code == 0 or "before waiting for it" not in text:
        return f"gradients read before their copies landed were not refused (exit {code})"
    return None


def fp8_zero_device() -> str | None:
    """ZeRO-3 with rowwise scales (ZeRO-1 with tensorwise ones: ``login-node``)."""
    code, text = dry_run("--model llama-tiny --dp 2 --zero 3 --dtype bf16 --fp8 rowwise --world-size 2")
    return None if code == 0 else f"exit {code}: {text.strip().splitlines()[-1]}"


def mtp_no_host_constant() -> str | None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from gridtrain.models.mtp import shifted
    from gridtrain.parallel.context_parallel import ContextParallel
    from gridtrain.runtime.cuda_rules import CudaRules

    with FakeTensorMode():
        tokens = torch.zeros(2, 16, dtype=torch.int64, device="cuda")
        with CudaRules() as rules:
            streams = shifted(tokens, tokens.clone(), 2, ContextParallel())
        with CudaRules() as old:  # the constant as it was made before
            torch.tensor([0, -100], dtype=tokens.dtype, device=tokens.device)
    if rules.breaches or streams[0][0].device.type != "cuda":
        return "; ".join(map(str, rules.breaches)) or "the shifted tokens left the device"
    if not any(b.rule == "blocking-copy" for b in old.breaches):
        return "a host constant copied to the device was not seen"
    return None


CHECKS = {"login-node": login_node, "offload-waits": offload_waits, "fp8-zero-device": fp8_zero_device,
          "mtp-no-host-constant": mtp_no_host_constant}

if __name__ == "__main__":
    assert torch.backends.cuda.is_built(), f"needs a CUDA build of torch; this is {torch.__version__}"
    for name in sys.argv[1:] or CHECKS:
        try:
            problem = CHECKS[name]()
        except Exception:  # report, and go on with the others
            problem = traceback.format_exc().strip().splitlines()[-1]
        print(f"CHECK {name}: {'ok' if problem is None else 'FAIL ' + problem}", flush=True)
