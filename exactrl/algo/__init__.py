"""Pure RL math, tensors in and tensors out: advantages, policy losses, off-policy corrections, KL
estimators, loss aggregation, mismatch diagnostics and the types they share (docs/design.md §8).

Nothing here knows about models, engines or files; every function is checked against a hand-computed
reference in tests/unit.
"""
