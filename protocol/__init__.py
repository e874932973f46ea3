"""Contracts every part may import: wire messages, schemas, hashing, source URIs, engine config.

pydantic (with pydantic-settings), PyYAML and the standard library only; of the project, only the
shared runtime (`runtime/`: an engine config's validators check its TLS files).
"""
