"""What happens to gradients after backward, and the step that consumes them.

* ``optimizer``: AdamW parameter groups, the learning rate of a step, norms and clipping;
* ``schedules``: the learning-rate schedules (cosine, linear, wsd, constant) as pure functions
  of the step, and what a checkpoint records of them;
* ``distributed_optimizer``: ZeRO-1 (master weights and Adam state sharded over data
  parallel, flat fp32 masters for 16-bit parameters) and the fp16 loss scaler;
* ``grads``: the gradient path in the order it must happen (data-parallel reduction,
  sequence-parallel and tied-embedding sums, the step's scalars, the global norm, clipping).

May import ``parallel``, ``runtime``, ``config``.
"""
