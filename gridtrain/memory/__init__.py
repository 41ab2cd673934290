"""Memory: the memory model, what a rank of a layout holds, in closed form.

* ``model``: per rank: parameters, the gradient buffer, the optimizer's state and the
  activation peak along the schedule, and the partition of the blocks into a stage's
  model chunks (which the model provider builds from, so the model counted is the one
  built);
* ``activations``: per layer: the bytes a transformer block saves for backward
  (Korthikanti et al., adapted; docs/memory.md).

It describes ``parallel`` and ``models`` (partition, schedules, recomputation policy,
block sizes), so it imports them; training (the run report), the dry run and the
planner read it. The measurement it is checked against, the saved-activation meter, is
``runtime.activation_meter``, below the layers it measures.
"""
