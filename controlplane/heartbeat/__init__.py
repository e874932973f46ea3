"""The heartbeat path: an agent's heartbeat checked, rate limited, written as observed state and
sampled, and answered with the host's desired state.

`service.HeartbeatService` is the one entry (the heartbeat route and its fast lane call it);
`rate_limit` guards it (and registration) per host, `observed_state` writes what the agent
reports, `samples` downsamples its metrics, `desired_state` builds the reply.
"""
