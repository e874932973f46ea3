"""The control plane's business rules: plain functions taking a session and a clock.

Routes (controlplane/api/) parse, authorize, call one of these and shape the answer; background
controllers call the same functions. Services raise `controlplane.services.errors` domain errors
(never HTTPException) and record every Event they cause.
"""
