"""The per-host agent: preflight, verified weight snapshots, engine supervision, heartbeats.

Modules: `settings` (what `dctl agent` reads: `[agent]` table, `DCTL_AGENT_*` env, flags), `gpu`
(NVML and fake backends behind one protocol), `preflight`, `snapshots` (+ `snapshot_fetcher`),
`supervisor` (+ `instance_spec`, `engine_process`), `private_files` (0600 files, 0700 dirs, no
symlinks followed), `http_bodies` (capped reads of server-chosen bodies), `engine_metrics`,
`metrics` (the agent's own /metrics), `control_plane` (`ControlPlaneLink`: the wire calls; the
identity, bound to the control plane that issued its token), `host_facts`, `reconciler` (desired
state -> engines and fetches, + `admission`: what a desired instance must pass), `main_loop`
(the main loop), `main` (the entry module: `dctl agent` calls `main.run`) and `errors` (every
exception the agent raises). It imports only the bottom layer (`protocol`, `runtime`) and runs
engines as `python -m engine.serve --config FILE` subprocesses, never importing them.
"""
