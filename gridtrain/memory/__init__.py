"""Memory: what a rank holds, predicted and measured.

* ``activations``: the saved-tensor hooks that count (and, on a GPU, offload) the bytes
  autograd keeps for backward, per layer and stage.

Imports only ``config``: the model, the dry run, the planner and the run report read it.
"""
