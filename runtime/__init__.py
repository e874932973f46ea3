"""Shared runtime pieces every part may import: logging, TLS, settings loading, paths, durations.

Not contracts (those are `protocol/`): how a dctl process runs, written once. pydantic (with
pydantic-settings), PyYAML and the standard library only; nothing of the project.
"""
