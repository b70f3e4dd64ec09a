"""RL math and the training loop: rollout types, advantages, losses, off-policy
corrections, KL, metrics (DESIGN.md §2, §5)."""
