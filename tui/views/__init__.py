"""The views: one screen per module. `VIEWS` names the top-level ones `:` and ctrl+p switch to."""
