"""Where rollouts come from: the `RolloutBackend` protocol every engine implements, sampling and
scoring groups of samples, agent episodes against the server, and the external-engine backend.
"""
