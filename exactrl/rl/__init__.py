"""RL math and the training loop: rollout types, advantages, losses, off-policy
corrections, KL, metrics (docs/design.md §2, §8)."""
