"""What is asked of the running instance: ready in time, serving through the gateway, its key
checked and never on a command line, its figures at the control plane."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .report import Report, StepFailed, wait_for
from .stack import DEPLOYMENT, HOST, BenchStack

if TYPE_CHECKING:
    from protocol.rest import InstanceOut

MAX_TOKENS = 16
PROMPT = [{"role": "user", "content": "Say something about rivers."}]


def wait_until_ready(stack: BenchStack, timeout_s: float, report: Report) -> InstanceOut:
    """The deployment's instance once ready, its messages printed as they change."""
    from client.http import ClientError

    started, seen = time.monotonic(), [("", "")]

    def ready() -> InstanceOut | None:
        try:
            instances = stack.api.get_deployment(DEPLOYMENT).instances
        except ClientError:
            return None
        if not instances:
            return None
        inst = instances[0]
        if (inst.observed_state, inst.message) != seen[-1]:
            seen.append((inst.observed_state, inst.message))
            print(
                f"  {time.monotonic() - started:6.1f} s  instance {inst.id} "
                f"{inst.observed_state}: {inst.message}",
                flush=True,
            )
        if inst.observed_state in ("failed", "crash_loop", "backoff") or inst.last_exit:
            # An engine that exited once will not pass here: say so now, not after retries.
            detail = f"{inst.observed_state}: {inst.message}"
            if inst.last_exit and inst.last_exit.reason not in detail:
                detail += f" ({inst.last_exit.reason})"
            raise StepFailed("instance ready", detail)
        return inst if inst.observed_state == "ready" else None

    print(f"waiting up to {timeout_s:.0f} s for the instance to be ready", flush=True)
    inst = stack.until("the instance to be ready", ready, timeout_s)
    messages = "; ".join(m for _, m in seen if m)
    report.add("PASS", "instance ready", f"{time.monotonic() - started:.1f} s ({messages[:300]})")
    return inst


def check_gateway(stack: BenchStack, report: Report) -> int:
    """A chat completion and a streamed one through the gateway with the openai client; returns
    the completion tokens they made."""
    import httpx
    import openai

    probe = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    auth = {"Authorization": f"Bearer {stack.client_token}"}

    def routed() -> bool:  # the gateway learns a new route within seconds
        try:
            url = f"{stack.gateway_url}/chat/completions"
            return httpx.post(url, json=probe, headers=auth, timeout=60).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("the gateway to route to the instance", routed, 120)
    except TimeoutError as exc:
        report.add("FAIL", "chat via gateway", str(exc))
        return 0
    client = openai.OpenAI(
        base_url=stack.gateway_url, api_key=stack.client_token, max_retries=0, timeout=120
    )
    return 1 + _chat(client, report) + _stream(client, report)  # 1: the probe's


def _chat(client: Any, report: Report) -> int:
    sent = time.monotonic()
    try:
        chat = client.chat.completions.create(
            model=DEPLOYMENT, messages=PROMPT, max_tokens=MAX_TOKENS
        )
    except Exception as exc:  # openai.OpenAIError and the transport's
        report.add("FAIL", "chat via gateway", f"{type(exc).__name__}: {exc}"[:300])
        return 0
    seconds = time.monotonic() - sent
    made = chat.usage.completion_tokens if chat.usage else 0
    choice = chat.choices[0]
    report.expect(
        made >= 1 and choice.finish_reason in ("stop", "length"),
        "chat via gateway",
        f"{seconds:.3f} s, {made} tokens, {choice.finish_reason}: {choice.message.content!r}"[:200],
    )
    return int(made)


def _stream(client: Any, report: Report) -> int:
    sent, first, text, made, finish = time.monotonic(), 0.0, [], 0, None
    try:
        chunks = client.chat.completions.create(
            model=DEPLOYMENT, messages=PROMPT, max_tokens=MAX_TOKENS, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                first = first or time.monotonic() - sent
                text.append(chunk.choices[0].delta.content)
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            made = chunk.usage.completion_tokens if chunk.usage else made
    except Exception as exc:  # openai.OpenAIError and the transport's
        report.add("FAIL", "stream via gateway", f"{type(exc).__name__}: {exc}"[:300])
        return 0
    seconds = time.monotonic() - sent
    report.expect(
        made >= 1 and finish in ("stop", "length"),
        "stream via gateway",
        f"TTFT {first:.3f} s, {seconds:.3f} s, {made} tokens, {finish}: {''.join(text)!r}"[:200],
    )
    return int(made)


def instance_key(stack: BenchStack, inst: InstanceOut, config: dict[str, Any]) -> str | None:
    """The instance's API key, read back from the 0600 file the agent wrote (as it does)."""
    from agent.backends.launch import saved_api_key
    from protocol.engine_kinds import ServerEngine

    engine: Any = ServerEngine(kind="vllm")
    if config["engine"]["kind"] == "command":
        from protocol.engine_kinds import CommandEngine

        engine = CommandEngine(**config["engine"])
    return saved_api_key(engine, stack.run_dir / f"instance-{inst.id}.yaml")


def check_instance_key(
    stack: BenchStack, inst: InstanceOut, key: str | None, fake: bool, report: Report
) -> None:
    """Straight at the instance: 401 without its key, 200 with it."""
    import httpx

    who = "the agent's key proxy (the mock checks no key)" if fake else "vLLM's own check"
    if not key:
        report.add("FAIL", "instance key", "no API key in the instance's 0600 config")
        return
    url = f"http://127.0.0.1:{inst.port}/v1/chat/completions"
    body = {"model": DEPLOYMENT, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    try:
        without = httpx.post(url, json=body, timeout=60).status_code
        with_key = httpx.post(
            url, json=body, timeout=60, headers={"Authorization": f"Bearer {key}"}
        ).status_code
    except httpx.HTTPError as exc:
        report.add("FAIL", "instance key", f"{url}: {exc}")
        return
    report.expect(
        without == 401 and with_key == 200,
        "instance key",
        f"without it {without}, with it {with_key}: {who}",
    )


def process_tree(pid: int) -> list[int]:
    """PID and every live process below it (vLLM's engine core is a child of its API server)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit():  # stat: "pid (name) state ppid ..."; a name may hold ")"
                ppid = (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                parents[int(entry.name)] = int(ppid)
        except (OSError, IndexError):
            continue
    tree, todo = [], [pid]
    while todo:
        tree.append(now := todo.pop())
        todo += [child for child, parent in parents.items() if parent == now]
    return tree


def check_no_key_in_proc(stack: BenchStack, key: str | None, fake: bool, report: Report) -> None:
    """The key is on no command line and in no environment of the engine's processes."""
    shown = json.loads(stack.dctl("deploy", "show", DEPLOYMENT, "--json"))
    pid = shown["instances"][0]["pid"]
    if not pid or not key:
        report.add("FAIL", "key not in /proc", f"pid {pid} from dctl deploy show, key {bool(key)}")
        return
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    leaks = []
    tree = process_tree(pid)
    for proc in tree:
        for part in ("cmdline", "environ"):
            try:
                if key.encode() in Path(f"/proc/{proc}/{part}").read_bytes():
                    leaks.append(f"{proc}/{part}")
            except OSError:
                continue  # exited meanwhile
    # The config's settings on argv (the key only in the --config file).
    wanted = ["agent.backends.fronted"] if fake else [
        "vllm.entrypoints.cli.main", "--tensor-parallel-size 1", "--max-model-len 512",
        "--gpu-memory-utilization 0.3", "--enforce-eager"]  # fmt: skip
    line = " ".join(a.decode(errors="replace") for a in argv)
    shape = all(f" {w} " in f" {line} " for w in wanted)
    report.expect(
        not leaks and shape,
        "key not in /proc",
        f"{len(tree)} processes, leaks: {leaks or 'none'}; engine argv: {line}"[:500],
    )


def check_metrics(stack: BenchStack, inst: InstanceOut, tokens: int, report: Report) -> None:
    """The control plane holds the instance's dllm_* samples (renamed from vllm:* by the agent):
    the running requests, and generated tokens adding up to at least what the requests made."""
    from client.calls import host_samples
    from client.http import ClientError

    running, generated = "dllm_requests_running", "dllm_generated_tokens_total"
    found: dict[str, list[float]] = {}

    def complete() -> bool:
        try:
            series = stack.api.send(host_samples(HOST, minutes=30))
        except ClientError:
            return False
        found.clear()
        found.update({s.name: [v for _, v in s.points] for s in series
                      if s.instance_id == inst.id and s.name.startswith("dllm_")})  # fmt: skip
        # Samples land when their 10 s bucket closes: wait for the one with the last request.
        return running in found and sum(found.get(generated, [])) >= tokens

    with contextlib.suppress(TimeoutError):  # then the verdict below says what is missing
        wait_for("the instance's samples", complete, 60, every_s=2)
    made = sum(found.get(generated, []))
    report.expect(
        running in found and made >= tokens,
        "dllm_* samples",
        f"{len(found)} series, {running} in: {running in found}, {generated} {made:.0f} "
        f"(requests made >= {tokens}); series: {', '.join(sorted(found))}"[:400],
    )
