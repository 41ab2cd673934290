"""The training loop and everything around it.

* ``validate``: every check of a configuration, before any process starts;
* ``trainer``: :func:`build` (groups, model, data, pipeline stage, reducer, optimizer,
  resume, in dependency order) and :class:`Trainer` (one optimizer step, validation, save);
* ``loop``: :func:`pretrain`, the loop that reads top to bottom;
* ``providers``: the built-in model, forward-step and data providers of ``gridtrain train``;
* ``report`` / ``metrics``: what a run prints and writes (JSON lines, progress bar,
  TensorBoard, summary, memory report, traces).

May import every concern below it (``parallel``, ``optim``, ``models``, ``data``,
``checkpoint``, ``memory``, ``runtime``, ``config``); nothing below imports it.
"""
