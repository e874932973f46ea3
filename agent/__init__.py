"""The per-host agent: preflight, verified weight snapshots, engine supervision, heartbeats.

Modules: `gpu` (NVML and fake backends), `preflight`, `snapshots` (+ `snapshot_fetcher`),
`supervisor` (+ `instance_spec`, `engine_process`), `engine_metrics`, `metrics` (the agent's own
/metrics), `control_plane` (the wire calls), `host_facts`, and `runtime` (the main loop).
It imports only `protocol.wire` of the control plane and never the engine.
"""
