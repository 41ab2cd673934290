"""The processes a run lives in, and the services every layer above uses.

* ``launch`` / ``worker``: start ``--nproc`` local workers or read torchrun's environment,
  the rendezvous store, failure attribution;
* ``warm``: the server that has imported torch and the package once and forks the workers;
* ``procs``: a launcher's worker processes, seen through /proc (for tools that signal a rank);
* ``devices``: one rule from rank to GPU, process-group devices;
* ``watchdog``: the flight recorder of collectives and the hang watchdog;
* ``stops``: exit codes and why a run stopped (NaN, preemption, hang);
* ``host_sync``: the named points where a step reads a device value on the host;
* ``timing``: host and CUDA-event clocks;
* ``startup``: the start-up's clock (the launch to the first step, by phase) and each
  process's peak memory;
* ``activation_meter``: the saved-tensor hooks that count (and, on a GPU, offload) the
  bytes autograd keeps for backward, per layer and stage;
* ``cuda_rules``: CUDA's rules and kernel shapes checked on fake CUDA tensors;
* ``op_count``: the operators a step runs, counted (its kernel launches on a GPU).

Nothing here knows a model, a parallel layer or the training loop: it imports only
``config`` and itself.
"""
