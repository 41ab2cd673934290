"""``gridtrain plan``: choose the layout for N GPUs, predict its step time and memory.

machine.py (the hardware as the cost model sees it), cost.py (one layout's step and
memory), search.py (every layout that divides and fits, ranked), command.py (the CLI).
"""
