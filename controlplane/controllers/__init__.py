"""Controllers: objects with `tick(now)` that move the store toward what it should be, and the one
loop (`loop.ControllerLoop`) that runs them on the replica holding the controllers' database
lease (`lease.DatabaseLease`). Host health (`host_health`) is one; the rollout controller
(`controlplane.rollouts.controller`) is another.
"""
