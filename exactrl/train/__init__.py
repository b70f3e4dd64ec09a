"""Training: the run config, set-up from it, the optimisation step, the synchronous and asynchronous
loops, checkpoints, the run directory, metrics logging, reports and the warm start.
"""
