"""`dctl up --demo`: control plane, agent, engines and gateway on this machine, wired together.

`run` is the entry module (settings in, exit code out; signals and a terminal that goes away);
`stack` starts the parts in order and stops them in reverse; `children` owns their processes;
`ports` keeps their ports across runs; `summary` is what the demo prints once it is up;
`traffic` sends the demo's requests through the gateway.
"""
