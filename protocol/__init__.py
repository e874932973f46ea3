"""Contracts every part may import: wire messages, schemas, hashing, source URIs, settings.

pydantic (with pydantic-settings), PyYAML and the standard library only; nothing of the project.
"""
