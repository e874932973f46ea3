"""`dctl tui`: the terminal dashboard. Talks to the control plane through `client` only (REST,
never the database) and is the only package built on textual; `tests/test_layering.py` holds it
to `client` and `protocol`."""
