"""The log lines an agent's heartbeat carries, written in the heartbeat's own transaction.

An agent writes only its own instances' lines: a line naming an instance that is not (and, as
far as this replica remembers, was not) on the agent's host is dropped, so one host cannot put
words in another's engines' mouths. Lines of an instance scaled away since keep the deployment
this replica saw it in. Lines the agent could not keep (its buffer's bound) become one marker
line with the count.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from datetime import datetime

from sqlalchemy import insert, select
from sqlalchemy.engine import Connection
from sqlmodel import col

from controlplane.models import Instance, LogLine
from protocol.logs import LogBatch

# Instance -> deployment remembered per host, beyond this many it starts over.
MAX_REMEMBERED = 4096


def write_batch(
    conn: Connection,
    host_id: int,
    batch: LogBatch,
    deployments: MutableMapping[int, int | None],
    now: datetime,
) -> int:
    """Insert BATCH's lines for HOST_ID; DEPLOYMENTS: this host's instance -> deployment ids as
    remembered (updated here). Returns the lines written."""
    wanted = {line.instance_id for line in batch.lines if line.instance_id is not None}
    unknown = wanted - deployments.keys()
    if unknown:
        if len(deployments) > MAX_REMEMBERED:
            deployments.clear()
        rows = conn.execute(
            select(col(Instance.id), col(Instance.deployment_id)).where(
                col(Instance.host_id) == host_id, col(Instance.id).in_(wanted)
            )
        ).all()
        deployments.update({i: dep for i, dep in rows if i is not None})
    values = []
    for line in batch.lines:
        if line.instance_id is not None and line.instance_id not in deployments:
            continue  # not an instance of this host
        values.append(
            {
                "host_id": host_id,
                "deployment_id": deployments.get(line.instance_id)
                if line.instance_id is not None
                else None,
                "instance_id": line.instance_id,
                "source": line.source,
                "time": line.time,
                "seq": line.seq,
                "line": line.line,
                "request_id": line.request_id,
                "dropped": 0,
            }
        )
    if batch.dropped:
        values.append(
            {
                "host_id": host_id,
                "deployment_id": None,
                "instance_id": None,
                "source": "agent",
                "time": now,
                "seq": 0,
                "line": f"dctl: the agent dropped {batch.dropped} log line(s) past its buffer's "
                "bound (a flood, or the control plane unreachable for long)",
                "request_id": None,
                "dropped": batch.dropped,
            }
        )
    if values:
        conn.execute(insert(LogLine), values)
    return len(values)
