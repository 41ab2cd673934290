"""Memory: the memory model, what a rank of a layout holds, in closed form.

* ``model``: per rank: parameters, the gradient buffer, the optimizer's state and the
  activation peak along the schedule, and the partition of the blocks into a stage's
  model chunks (which the model provider builds from, so the model counted is the one
  built);
* ``activations``: per layer: the bytes a transformer block saves for backward
  (Korthikanti et al., adapted; docs/memory.md);
* ``zero``: ZeRO's closed forms: the parameter, gradient and optimizer bytes of a rank
  for stages 0-3 and a shard group (hybrid sharding), ZeRO-3's gathered working set,
  and the collectives of a step;
* ``cp``: context parallelism's: the bytes a cp rank's attention sends;
* ``moe``: mixtures of experts': total and active parameters, model FLOPs over the
  active ones, a rank's experts, the all-to-all bytes, what a MoE layer keeps for
  backward.

It describes ``parallel`` and ``models`` (partition, schedules, recomputation policy,
block sizes), so it imports them; training (the run report), the dry run and the
planner read it. The measurement it is checked against, the saved-activation meter, is
``runtime.activation_meter``, below the layers it measures.
"""
