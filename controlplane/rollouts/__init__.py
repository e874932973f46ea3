"""Rollouts, rollbacks and restarts: the plan's arithmetic, the canary analysis, the controller
that drives them step by step, and the notifications it sends."""
