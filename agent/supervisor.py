"""The supervisor: one engine subprocess per desired instance, kept alive and reported.

It is driven by `tick()` (the agent calls it every fraction of a second) and owns no thread, so
tests drive it with an injected clock, launcher and prober and never sleep. Per instance:

    starting --/health/ready--> ready --probe fails--> unhealthy --not live--> restart
        |  no ready within the start-up grace period: restart             |
        +--process exits--> backoff (1 s doubling to 5 min) --> starting   |
                              \\-- after `crash_loop_after` failures in a row: crash_loop

Stopping drains: SIGTERM to the engine, then SIGKILL to its whole process group after the grace
period; a parallel engine's ranks are in that group, and none outlives the engine's exit
(`agent.engine_process`). Every state change is reported to `on_transition`, and `observed()` is
what the heartbeat carries.

An engine is `python -m engine.serve --config instance-N.yaml`: everything it needs, its API key
included, is in that file (mode 0600, like the whole run directory), so no secret is on a
command line or in the environment. The engine gets the agent's environment minus its `DCTL_*`
variables (the bootstrap token may be one) and torch.distributed's, plus `CUDA_VISIBLE_DEVICES`
for its GPUs and, when it may run several ranks, their rendezvous (`agent.rank_group`): a free
loopback port picked at every start.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from agent.backends.launch import engine_of, plan_launch, probes, saved_api_key
from agent.backends.presence import EnginePresence
from agent.engine_process import (
    SIGKILL,
    SIGTERM,
    Launcher,
    PidRecord,
    Prober,
    rotate_log,
    truncate_if_large,
)
from agent.gpu import EngineLoad
from agent.instance_spec import (
    InstanceSpec,
    SupervisorPolicy,
    engine_config,
    threads_note,
)
from agent.private_files import private_dir, write_private
from agent.rank_group import DISTRIBUTED_ENV, free_local_port, rendezvous_env
from agent.supervised_instance import SupervisedInstance, exit_info
from protocol.engine_config import ServeConfigError
from protocol.engine_kinds import DctlEngine
from protocol.plain_text import printable
from protocol.wire import ExitInfo, InstanceState, ObservedInstance

log = logging.getLogger("dctl.agent.supervisor")
ENGINE_COMMAND = [sys.executable, "-m", "engine.serve"]
Clock = Callable[[], float]
TransitionCallback = Callable[[int, InstanceState, InstanceState, str], None]


class Supervisor:
    """Starts, probes, restarts and stops engine processes; see the module docstring."""

    def __init__(
        self,
        run_dir: Path,
        launcher: Launcher,
        prober: Prober,
        clock: Clock = time.monotonic,
        policy: SupervisorPolicy | None = None,
        engine_command: list[str] | None = None,
        on_transition: TransitionCallback | None = None,
        env: dict[str, str] | None = None,
        rendezvous_port: Callable[[], int] = free_local_port,
        presence: EnginePresence | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.launcher, self.prober, self.clock = launcher, prober, clock
        self.policy = policy or SupervisorPolicy()
        self.engine_command = engine_command or ENGINE_COMMAND
        self.on_transition = on_transition
        self.rendezvous_port = rendezvous_port
        base_env = env if env is not None else dict(os.environ)
        self.env = {
            k: v
            for k, v in base_env.items()
            if not k.startswith("DCTL_") and k not in DISTRIBUTED_ENV
        }
        self.presence = presence or EnginePresence(sys.executable, self.env.get("PATH"))
        self._instances: dict[int, SupervisedInstance] = {}
        private_dir(run_dir)

    # --- paths ---------------------------------------------------------------------------------

    def _pid_file(self, instance_id: int) -> Path:
        return self.run_dir / f"instance-{instance_id}.json"

    def config_path(self, instance_id: int) -> Path:
        """The generated engine config of an instance."""
        return self.run_dir / f"instance-{instance_id}.yaml"

    def log_path(self, instance_id: int) -> Path:
        """The engine's log file (rotated: .1, .2, ...)."""
        return self.run_dir / "logs" / f"instance-{instance_id}.log"

    # --- desired state ------------------------------------------------------------------------

    def ensure(self, spec: InstanceSpec) -> None:
        """Run SPEC. An instance already running another spec is drained and replaced."""
        current = self._instances.get(spec.instance_id)
        if current is None:
            self._instances[spec.instance_id] = SupervisedInstance(spec=spec)
            self._start(self._instances[spec.instance_id])
            return
        current.note = ""
        if current.spec.fingerprint() == spec.fingerprint():
            current.spec = spec  # the same engine; its next start takes today's default threads
            if current.state in (InstanceState.STOPPED, InstanceState.FAILED):
                current.failures = 0
                self._start(current)
            elif current.state == InstanceState.STOPPING and current.after_stop != "restart":
                current.after_stop = "restart"
            return
        log.info("instance %s: spec changed, replacing the engine", spec.instance_id)
        current.spec = spec
        current.failures = 0
        if current.process is None or current.state in (
            InstanceState.BACKOFF, InstanceState.CRASH_LOOP, InstanceState.STOPPED,
            InstanceState.PENDING, InstanceState.FAILED,
        ):  # fmt: skip
            self._start(current)
        else:
            self._begin_stop(current, then="restart", reason="replaced by a new spec")

    def stop(self, instance_id: int, remove: bool = False) -> None:
        """Drain and stop an instance; with REMOVE it is forgotten once it has exited."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return
        if inst.process is None or inst.process.poll() is not None:
            self._finish_stop(inst, remove)
            return
        self._begin_stop(inst, then="remove" if remove else "stay", reason="stop requested")

    def mark_failed(self, instance_id: int, spec: InstanceSpec, reason: str) -> None:
        """Record an instance that cannot run (e.g. its snapshot was rejected)."""
        inst = self._instances.setdefault(instance_id, SupervisedInstance(spec=spec))
        if inst.process is None or inst.process.poll() is not None:
            self._set(inst, InstanceState.FAILED, reason)
        else:
            inst.note = reason  # the engine already running keeps serving

    def instance_ids(self) -> list[int]:
        """Every instance the supervisor knows."""
        return sorted(self._instances)

    def spec_of(self, instance_id: int) -> InstanceSpec | None:
        """The spec an instance runs (None if unknown)."""
        inst = self._instances.get(instance_id)
        return inst.spec if inst else None

    def state_of(self, instance_id: int) -> InstanceState | None:
        """Current state of an instance (None if unknown)."""
        inst = self._instances.get(instance_id)
        return inst.state if inst else None

    def set_busy(self, instance_id: int, ratio: float) -> None:
        """How busy the engine is (0..1), from its metrics; the fake GPUs follow it."""
        if inst := self._instances.get(instance_id):
            inst.busy_ratio = max(0.0, min(ratio, 1.0))

    # --- lifecycle -------------------------------------------------------------------------------

    def _set(self, inst: SupervisedInstance, state: InstanceState, message: str = "") -> None:
        old = inst.state
        inst.state = state
        inst.message = message
        if old != state:
            log.info(
                "instance %s: %s -> %s %s", inst.spec.instance_id, old.value, state.value, message
            )
            if self.on_transition:
                self.on_transition(inst.spec.instance_id, old, state, message)

    def _start(self, inst: SupervisedInstance) -> None:
        spec = inst.spec
        config_path = self.config_path(spec.instance_id)
        try:
            plan = plan_launch(spec, config_path, self.engine_command, self.rendezvous_port)
        except ServeConfigError as exc:
            # Restarting cannot fix a config; only a new desired state can (`ensure`).
            inst.process = None
            self._set(inst, InstanceState.FAILED, f"engine config refused: {exc}")
            return
        presence = self.presence.check(engine_of(spec))
        if presence is not None and not presence.found:
            # Nor can it install an engine: failed (not a crash loop) until a start finds it.
            inst.process = None
            self._set(inst, InstanceState.FAILED, printable(f"engine not found: {presence.text}"))
            return
        log_path = self.log_path(spec.instance_id)
        try:
            for path, text in plan.files.items():
                write_private(path, text)
            log_path.parent.mkdir(parents=True, exist_ok=True)
            rotate_log(log_path, self.policy.log_keep)
        except OSError as exc:  # e.g. a full disk: worth retrying, like a failed launch
            inst.process = None
            self._fail(inst, ExitInfo(reason=printable(f"cannot write {config_path}: {exc}")))
            return
        env = dict(self.env)
        if spec.gpu_indices:  # none given: every GPU this host has (the agent's own view)
            env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
        env.update(plan.env)
        try:
            if plan.kind == "dctl":
                env.update(rendezvous_env(spec, spec.engine_config or {}, self.rendezvous_port))
            inst.process = self.launcher.launch(plan.argv, env, log_path)
        except OSError as exc:
            inst.process = None
            self._fail(inst, ExitInfo(reason=printable(f"cannot start {plan.argv[0]}: {exc}")))
            return
        now = self.clock()
        inst.started_at = now
        inst.next_probe_at = now
        inst.probe_failures = 0
        inst.ready_since = None
        inst.stop_deadline = None
        inst.killed = False
        inst.after_stop = "stay"
        inst.probes = probes(engine_of(spec))
        self._save_pid(inst)
        started = f"pid {inst.process.pid} on port {spec.port}"
        if "MASTER_PORT" in env:
            started += f", ranks meet on {env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        details = [started]
        if presence is not None:
            details.append(presence.text)
        if plan.note:
            details.append(plan.note)
        if plan.kind == "dctl":
            threads = threads_note(spec, engine_config(spec))
            if threads:
                details.append(threads)
        self._set(inst, InstanceState.STARTING, ", ".join(details))

    def _save_pid(self, inst: SupervisedInstance) -> None:
        instance_id = inst.spec.instance_id
        inst.pid_record(self.config_path(instance_id)).save(self._pid_file(instance_id))

    def _begin_stop(self, inst: SupervisedInstance, then: str, reason: str) -> None:
        assert inst.process is not None
        if inst.state == InstanceState.STOPPING:
            # Already draining: only what follows changes. A second SIGTERM tells an engine to
            # exit at once, cutting off the requests it is finishing (every heartbeat repeats
            # a stop; a rolling restart lost a request so), and the grace must not start over.
            inst.after_stop = then
            return
        inst.process.send(SIGTERM)
        inst.stop_deadline = self.clock() + self.policy.stop_grace_s
        inst.after_stop = then
        self._set(inst, InstanceState.STOPPING, reason)

    def _finish_stop(self, inst: SupervisedInstance, remove: bool) -> None:
        inst.process = None
        self._pid_file(inst.spec.instance_id).unlink(missing_ok=True)
        if remove:
            self._set(inst, InstanceState.STOPPED, "removed")
            del self._instances[inst.spec.instance_id]
        else:
            self._set(inst, InstanceState.STOPPED, "stopped")

    def _fail(self, inst: SupervisedInstance, exit_info: ExitInfo) -> None:
        """A crash or failed health: schedule a restart with backoff."""
        inst.last_exit = exit_info
        inst.process = None
        inst.failures += 1
        inst.restart_count += 1
        delay = self.policy.backoff_s(inst.failures)
        inst.next_start_at = self.clock() + delay
        state = (
            InstanceState.CRASH_LOOP
            if inst.failures >= self.policy.crash_loop_after
            else InstanceState.BACKOFF
        )
        self._set(inst, state, f"{exit_info.reason}; restart in {delay:.0f} s")

    def _exit_info(self, inst: SupervisedInstance, code: int | None, reason: str) -> ExitInfo:
        """How the engine ended (see `exit_info`), with the tail of its own log."""
        return exit_info(self.log_path(inst.spec.instance_id), code, reason)

    # --- the loop --------------------------------------------------------------------------------

    def tick(self) -> None:
        """Advance every instance: reap exits, probe, restart after backoff, finish drains."""
        now = self.clock()
        for inst in list(self._instances.values()):
            self._tick_one(inst, now)

    def _tick_one(self, inst: SupervisedInstance, now: float) -> None:
        state = inst.state
        if state in (InstanceState.BACKOFF, InstanceState.CRASH_LOOP):
            if now >= inst.next_start_at:
                self._start(inst)
            return
        proc = inst.process
        if proc is None:
            return
        code = proc.poll()
        if state == InstanceState.STOPPING:
            if code is not None:
                inst.last_exit = self._exit_info(inst, code, "stopped")
                if inst.after_stop == "restart":
                    self._start(inst)
                else:
                    self._finish_stop(inst, remove=inst.after_stop == "remove")
            elif inst.stop_deadline is not None and now >= inst.stop_deadline and not inst.killed:
                proc.send(SIGKILL)
                inst.killed = True
            return
        if code is not None:
            what = "exited" if code >= 0 else ("was killed" if code != -1 else "is gone")
            detail = f"code {code}" if code >= 0 else (f"signal {-code}" if code != -1 else "")
            self._fail(inst, self._exit_info(inst, code, f"engine {what} {detail}".strip()))
            return
        if truncate_if_large(
            self.log_path(inst.spec.instance_id), self.policy.log_max_bytes, self.policy.log_keep
        ):
            log.info("instance %s: log rotated", inst.spec.instance_id)
        if now < inst.next_probe_at:
            return
        inst.next_probe_at = now + self.policy.probe_interval_s
        host, port = inst.spec.probe_address, inst.spec.port
        if self.prober(host, port, inst.probes.ready):
            inst.probe_failures = 0
            if inst.state != InstanceState.READY:
                inst.ready_since = now
                self._set(inst, InstanceState.READY, f"serving on port {port}")
            elif (
                inst.ready_since is not None
                and now - inst.ready_since >= self.policy.stable_after_s
            ):
                inst.failures = 0
            return
        if state == InstanceState.STARTING:
            if now - inst.started_at > self.policy.startup_grace_s:
                reason = (
                    f"not ready within the start-up grace of {self.policy.startup_grace_s:.0f} s"
                )
                self._restart_unhealthy(inst, reason)
            return
        if self.prober(host, port, inst.probes.live):
            inst.probe_failures = 0
            self._set(inst, InstanceState.UNHEALTHY, "alive but not ready")
            return
        inst.probe_failures += 1
        if inst.probe_failures >= self.policy.liveness_failures:
            self._restart_unhealthy(inst, f"{inst.probe_failures} liveness probes failed")
        else:
            self._set(inst, InstanceState.UNHEALTHY, "liveness probe failed")

    def _restart_unhealthy(self, inst: SupervisedInstance, reason: str) -> None:
        assert inst.process is not None
        inst.process.send(SIGKILL)  # it does not answer, so draining it would only wait
        self._fail(inst, self._exit_info(inst, None, reason))

    # --- adoption and shutdown -------------------------------------------------------------------

    def adopt_existing(self) -> list[int]:
        """Take over engines a previous agent left running (pid file + live process + port)."""
        adopted = []
        for pid_file in sorted(self.run_dir.glob("instance-*.json")):
            record = PidRecord.load(pid_file)
            if record is None:
                pid_file.unlink(missing_ok=True)
                continue
            process = self.launcher.adopt(record.pid, record.config_path)
            if process is None:
                log.info("instance %s: pid %s is gone, not adopted", record.instance_id, record.pid)
                pid_file.unlink(missing_ok=True)
                continue
            bare = InstanceSpec.from_dict(record.spec)
            try:
                engine = engine_of(bare)
            except ValueError:  # a config this agent no longer takes: replaced by the desired one
                engine = DctlEngine()
            # Pid files never hold the key: without it the adopted spec would not match the
            # desired one (the engine would be replaced), and a crash restart would drop it.
            key = saved_api_key(engine, Path(record.config_path))
            spec = InstanceSpec.from_dict(record.spec, api_key=key)
            paths = probes(engine)
            if not self.prober(spec.probe_address, record.port, paths.live):
                # Alive but silent (still loading, or hung): adopting it and letting the start-up
                # grace decide is safer than starting a duplicate on the same port.
                log.info("instance %s: pid %s does not answer yet", record.instance_id, record.pid)
            now = self.clock()
            inst = SupervisedInstance(
                spec=spec,
                process=process,
                started_at=now,
                restart_count=record.restart_count,
                next_probe_at=now,
                probes=paths,
            )
            self._instances[spec.instance_id] = inst
            self._set(
                inst, InstanceState.STARTING, f"adopted pid {record.pid} on port {record.port}"
            )
            adopted.append(spec.instance_id)
        return adopted

    def stop_all(
        self, timeout_s: float | None = None, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        """Drain every engine and wait until all have exited (SIGKILL after the grace period)."""
        for instance_id in list(self._instances):
            self.stop(instance_id, remove=True)
        deadline = self.clock() + (
            timeout_s if timeout_s is not None else self.policy.stop_grace_s + 5
        )
        while self._instances and self.clock() < deadline:
            self.tick()
            sleep(0.1)

    # --- reporting -------------------------------------------------------------------------------

    def observed(self) -> list[ObservedInstance]:
        """Every instance as the heartbeat reports it."""
        return [inst.observed() for inst in self._instances.values()]

    def ready_endpoints(self) -> dict[int, tuple[str, int, str]]:
        """Instance id -> (address, port, metrics path) of every ready engine that exports
        metrics (for scraping)."""
        return {
            i: (inst.spec.probe_address, inst.spec.port, inst.probes.metrics)
            for i, inst in self._instances.items()
            if inst.state in (InstanceState.READY, InstanceState.UNHEALTHY)
            and inst.probes.metrics is not None
        }

    def loads(self, memory_bytes: Callable[[int], int] | None = None) -> list[EngineLoad]:
        """What each running engine holds, for the fake GPU backend."""
        loads = (inst.engine_load(memory_bytes) for inst in self._instances.values())
        return [load for load in loads if load is not None]
