"""``gridtrain plan``: choose the layout for N GPUs, predict its step time and memory.

hardware.py (published figures, with sources), published.py (the runs of Narayanan et
al. 2021 the planner is validated against), machine.py (the hardware as the cost model
sees it), cost.py (one layout's step and memory), search.py (every layout that divides
and fits, ranked), command.py (the CLI).
"""
