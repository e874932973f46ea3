"""The desired-state planner: deployment + active rollout + hosts + instances -> changes.

Pure, like `engine/decoding.py`: plain data in, a decision out; no session, clock or randomness.
The services (`controlplane/services/placement.py`) load the views from the store, call
`plan_deployment` or `plan_fleet`, and turn the changes into rows.

The rules, per deployment:
- Target hosts: those named in the placement plus every host carrying all its labels.
- Each target host runs `instances_per_host` instances with ordinals 0..n-1; scaling down drops
  the highest ordinals first; a host that is no longer a target loses its instances.
- Draining hosts keep their instances, desired "stopped"; so do the instances a rolling restart
  holds stopped (`DeploymentView.held_stopped`, until their agent reports them stopped); every
  other instance runs. This planner is the only writer of an instance's desired state.
- Versions: without a rollout every instance runs the stable version. With one, exactly
  `canary_instances` instances run the canary; instances already on it stay on it (new instances
  take the canary first, as they cost no restart), every other instance runs stable.
- Ports: the lowest free port of the host's range; every deployment's instances count.
- GPUs, `gpus_per_instance` k: each instance gets k indices of its host, disjoint from every
  other instance's there; an assignment that is still valid is kept, so re-planning moves
  nothing. k None: the instance gets `()`, all GPUs of the host; such instances may share a host
  with each other (as before GPUs were assigned) but never with instances holding indices.
- Parallel: an instance runs one rank per GPU it gets (engine config `parallel.size`, default
  its GPU count). With k None and `parallel.size` set (`DeploymentView.parallel_size`), a host
  whose GPU count differs does not fit; with k set the API already refused a size other than k.
- Memory: with the version's memory plan, a rank's share must fit in each of the instance's GPUs
  (all of the host's for `()`: instances sharing a host are each checked against the whole
  host, so set k to have memory checked per instance): weights / ranks, the whole activation
  headroom, and its K/V heads' part of the KV reserve (`MemoryPlan.rank_bytes`). The KV reserve
  is max_seq_len × max_concurrent_requests tokens of the engine config (`kv_reserve_tokens`):
  enough for every request slot holding a full-length sequence.
- Hosts that report no GPUs yet (no heartbeat since registration) are placed without GPU indices
  (`()` = all GPUs) and without the memory check: refusing them would make every deployment
  created right after `dctl host provision` fail; the next planning after the host reports its
  GPUs gives exclusive instances their indices.

Autoscaled deployments (`DeploymentView.total` set) ask for a count for the whole deployment
instead: `spread` keeps instances where they are and puts new ones on the host with the fewest
that has room (free GPUs and ports), draining hosts left out; what fits nowhere is a "capacity"
problem. `standby` of them are kept out of the gateway's pools (new instances first, so a
scale-up promotes a loaded standby), always on the stable version. Instances being retired
(scaled down) keep their ports and GPUs but no longer count; once drained they are deleted.

A host where the deployment does not fit (ports, GPUs or memory) gets no new instances and no GPU
or version changes; the plan carries a `Problem` for it instead. Deletions and desired-state
changes always go through, so draining and scaling down work even on a full host.
"""

from controlplane.planner.changes import (
    Change,
    Create,
    Delete,
    Plan,
    Problem,
    UpdateDesiredState,
    UpdateGpus,
    UpdateStandby,
    UpdateVersion,
    apply_changes,
)
from controlplane.planner.fit import gib, gpu_ranks, kv_reserve_tokens
from controlplane.planner.plan import plan_deployment, plan_fleet
from controlplane.planner.views import (
    RUNNING,
    STOPPED,
    DeploymentView,
    GpuView,
    HostView,
    InstanceView,
    RolloutView,
    VersionView,
)

__all__ = [
    "RUNNING",
    "STOPPED",
    "Change",
    "Create",
    "Delete",
    "DeploymentView",
    "GpuView",
    "HostView",
    "InstanceView",
    "Plan",
    "Problem",
    "RolloutView",
    "UpdateDesiredState",
    "UpdateGpus",
    "UpdateStandby",
    "UpdateVersion",
    "VersionView",
    "apply_changes",
    "gib",
    "gpu_ranks",
    "kv_reserve_tokens",
    "plan_deployment",
    "plan_fleet",
]
