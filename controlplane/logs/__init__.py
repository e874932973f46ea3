"""Logs through the control plane: the lines agents ship, the gateways' request summaries and
per-token use, kept bounded, and the queries `dctl logs`, `dctl requests` and `dctl audit` ask."""
