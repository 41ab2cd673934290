"""``gridtrain plan``: choose a data x pipeline x tensor layout for a GPT model on a cluster.

This package holds the planner's reference data: ``published`` (the configurations and
throughputs Narayanan et al. 2021 report for Megatron-LM, the yardstick the planner is
checked against) and ``hardware`` (vendor figures for the GPUs it plans for). Where every
number comes from is listed in docs/planner-sources.md.
"""
