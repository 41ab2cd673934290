"""How the work is split over ranks: the parallelism itself.

* ``grid``: pure rank arithmetic (which rank holds which tp/dp/pp coordinate, every
  group of every kind) and the one function that creates the process groups;
* ``distributed``: this rank's :class:`DistributedContext` (groups, device, dtypes, RNG
  streams, TP and recomputation settings), built once per run;
* ``comm``: collectives and the paired autograd mappings (identity forward / all-reduce
  backward and the reverse) that every split layer is made of;
* ``tensor_parallel``, ``split_backward``, ``rng``: Megatron-style column/row/vocab
  parallel layers, the weight-gradient deferral that ZB-H1 uses, the RNG tracker;
* ``data_parallel``: the DDP-style gradient reducer (flat buffer, buckets, hooks);
* ``recompute``: activation recomputation (full and selective) with replayed RNG;
* ``pipeline/``: schedules as action lists, their validation, simulation, pictures,
  partitioning, and the runtime that executes them.

A new parallel axis starts here: its coordinate in ``grid``, its kind of group in
``grid._group_kinds`` (made by ``create_process_groups``), its handle on :class:`distributed.DistributedContext`, and the
layer that splits the work. This package knows no model, no optimizer and no training
loop; it may import ``runtime`` (clocks, the watchdog's flight recorder), ``memory``,
``data`` (the batch type) and ``config``.
"""
