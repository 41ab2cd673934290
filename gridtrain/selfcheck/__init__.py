"""The GPU self-check: one command that proves gridtrain on a machine before it is trusted.

``make gpu-check`` (``python3 -m gridtrain.selfcheck --gpu --out DIR``) runs, with the
interpreter's own torch and nothing installed, every step in one call of 9.5 minutes
(:mod:`runner` has the plan and its budget): checks of what only a GPU shows
(:mod:`cuda_semantics`: float8 GEMMs, grouped expert GEMMs, the efficient attention
kernel's backward, the chunked head loss, the offloaded optimizer, float8 under ZeRO,
compiled float8's graph breaks), the CUDA tests, a parity spot check against the CPU, one
NCCL rank, several gloo ranks sharing the one GPU (tensor, sequence and pipeline
parallelism, ZeRO-1, asynchronous checkpoints, offloaded activations, the watchdog),
float8 against bf16 (:mod:`fp8`), and the throughput of ``gridtrain train`` against a
plain PyTorch loop with its peak memory beside the dry run's prediction and its step
time beside the planner's.

Why subprocesses: each step runs in its own process group under a time box
(:mod:`runner`), so a hang or a crashed CUDA context costs that step and no more, and
the report (:mod:`report`) is rewritten after every step, so a run killed at the
machine's limit still leaves what it did. ``--device cpu`` runs the same steps on tiny
models: that is how the check's own logic is tested where there is no GPU.

Nothing else in the package imports this one.
"""
