"""vLLM as a dctl engine on a real GPU, end to end: install, deploy, serve, check, tear down.

On a machine with an NVIDIA GPU, from the repository root, with dctl installed in .venv with a
CUDA torch (the agent's preflight imports it), NVML and the openai client:

    python3 -m venv .venv && .venv/bin/pip install -e '.[engine,gpu]' openai   # torch: CUDA on PyPI
    .venv/bin/python bench/gpu_vllm_backend.py                  # pip install vllm, latest
    .venv/bin/python bench/gpu_vllm_backend.py --vllm-version 0.11.0 --reuse-venv
    .venv/bin/python bench/gpu_vllm_backend.py --vllm-python /opt/vllm/bin/python
    .venv/bin/python bench/gpu_vllm_backend.py --work-dir "$OUT/run"   # logs kept there
    .venv/bin/python bench/gpu_vllm_backend.py --install-only   # then --reuse-venv: two commands

Short of time, one download of torch instead of two: install vLLM first and dctl beside it,
`python3 -m venv /tmp/v && /tmp/v/bin/pip install vllm && /tmp/v/bin/pip install -e '.[gpu]'
openai`, then `/tmp/v/bin/python bench/gpu_vllm_backend.py --vllm-python /tmp/v/bin/python`.

What it does, one function per step:
1. a venv of its own (`--venv`, default /tmp/dctl-vllm-venv) with `pip install vllm`, timed;
   `--reuse-venv` skips the install when vLLM is already there, `--vllm-python` uses an
   interpreter that has it;
2. a tiny random-weight Llama checkpoint (2 layers, hidden 256, bf16, safetensors) with the demo's
   byte-level BPE tokenizer and chat template, loaded once with transformers (AutoTokenizer,
   AutoModelForCausalLM) in the vLLM interpreter before vLLM is asked to;
3. a real stack on loopback in a temporary directory: `dctl server`, `dctl agent` (NVML), `dctl
   gateway`; `dctl model register`, then `dctl deploy create --gpus-per-instance 1
   --engine-config` with `engine: {kind: vllm, python: VENV/bin/python, extra_args:
   [--enforce-eager]}`, `model: {max_seq_len: 512}`, `resources: {memory_fraction: 0.3}`;
4. waits (`--timeout-s`, 15 min) for the instance to be ready, printing the agent's instance
   message (it names the vLLM version found), then checks: a chat completion and a streamed one
   through the gateway with the openai client and a client token; straight at the instance,
   401 without its key (vLLM's own check, the key from the 0600 --config file) and 200 with it;
   the key on no command line and in no environment of the engine's processes (/proc, pid from
   `dctl deploy show`); the control plane's samples of the instance holding
   dllm_requests_running and dllm_generated_tokens_total (mapped from vllm:*);
5. prints one summary (figures: install time, time to ready, request latencies), exits 1 on
   any failure (130 on Ctrl-C, SIGTERM or SIGHUP), and stops everything on every way out; the
   temporary directory is removed after a pass and kept (with log tails printed) after a
   failure. An engine that exits, or fails, ends the wait at once.

The steps live in bench/gpu_vllm/ (`checkpoint`, `stack`, `checks`, `report`); this file is the
vLLM install and the run in order.

`--fake-vllm` (alias `--smoke`, what tests/test_bench_smoke.py runs) exercises the same stack
logic on a machine without a GPU: fake GPUs, and a `command` engine running GuideLLM's mock
server instead of vLLM (nothing installed). The mock server gets no `--processor`: GuideLLM
0.8.1 cannot load a tokenizer under transformers 5 (tests/rollout_e2e/test_command_engine_e2e.py).
It has no key check of its own (the 401 then comes from the agent's key-checking proxy) and no
/metrics, so the metrics check is skipped. Without an NVIDIA driver and without `--fake-vllm`
the script says so and exits 0 (`make bench` runs every benchmark bare).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_vllm.checkpoint import check_checkpoint, write_tiny_checkpoint
from gpu_vllm.checks import (
    check_gateway,
    check_instance_key,
    check_metrics,
    check_no_key_in_proc,
    instance_key,
    wait_until_ready,
)
from gpu_vllm.report import Report, StepFailed
from gpu_vllm.stack import GUIDELLM, BenchStack, deploy, engine_config

DEFAULT_VENV = Path("/tmp/dctl-vllm-venv")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def vllm_presence(python: str) -> tuple[bool, str]:
    """Whether PYTHON has vLLM, asked the way the agent asks before each start."""
    from agent.backends.presence import EnginePresence
    from protocol.engine_kinds import ServerEngine

    answer = EnginePresence(sys.executable).check(ServerEngine(kind="vllm", python=python))
    assert answer is not None
    return answer.found, answer.text


def prepare_vllm(args: argparse.Namespace, report: Report, work: Path) -> str:
    """The interpreter with vLLM: `--vllm-python`, or `--venv` created and `pip install vllm`."""
    if args.vllm_python:
        found, text = vllm_presence(args.vllm_python)
        if not found:
            raise StepFailed("install vLLM", text)
        report.add("SKIP", "install vLLM", f"--vllm-python: {text}")
        return str(args.vllm_python)
    python = args.venv / "bin" / "python"
    if args.reuse_venv and python.exists():
        found, text = vllm_presence(str(python))
        if found:
            report.add("SKIP", "install vLLM", f"--reuse-venv: {text}")
            return str(python)
    package = f"vllm=={args.vllm_version}" if args.vllm_version else "vllm"
    log = work / "logs" / "pip-install.log"
    print(f"installing {package} into {args.venv} (log: {log}); this takes minutes", flush=True)
    started = time.monotonic()
    steps = [] if python.exists() else [[sys.executable, "-m", "venv", str(args.venv)]]
    steps.append([str(python), "-m", "pip", "install", "--progress-bar", "off", package])
    with log.open("w") as out:
        for argv in steps:
            if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                tail = log.read_text(errors="replace").splitlines()[-5:]
                raise StepFailed("install vLLM", f"{' '.join(argv)} failed: {tail}")
    seconds = time.monotonic() - started
    found, text = vllm_presence(str(python))
    if not report.expect(found, "install vLLM", f"{seconds:.0f} s: {text}"):
        raise StepFailed("install vLLM", text)
    return str(python)


def host_prerequisites(fake: bool) -> None:
    """What the agent on this host needs before it can start vLLM; StepFailed naming the fix."""
    try:
        import openai  # noqa: F401
    except ImportError:
        raise StepFailed("prerequisites", "install the openai client: pip install openai") from None
    if fake:
        if not GUIDELLM.exists():
            raise StepFailed("prerequisites", f"no {GUIDELLM}: pip install guidellm==0.8.1")
        return
    from agent.preflight import probe_torch

    try:
        import pynvml  # noqa: F401
    except ImportError:
        raise StepFailed("prerequisites", "install NVML: pip install -e '.[gpu]'") from None
    torch = probe_torch()
    if torch.error or not torch.devices:
        # The agent's preflight checks its own torch: without CUDA it starts no engine at all.
        raise StepFailed(
            "prerequisites",
            f"dctl's torch sees no CUDA device ({torch.error or f'torch {torch.version}'}), so "
            "the agent's preflight would fail and start no engine: install a CUDA build there "
            f"({sys.executable} -m pip install --force-reinstall torch, from PyPI or "
            "--index-url https://download.pytorch.org/whl/cu128)",
        )


def run(args: argparse.Namespace) -> int:
    """Every step in order; the summary; the exit code."""
    fake = args.fake_vllm
    keep = args.keep or args.work_dir is not None
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="dctl-gpu-vllm-"))
    (work / "logs").mkdir(parents=True, exist_ok=True)
    report, stack, code = Report(), None, 0
    try:
        host_prerequisites(fake)
        if fake:
            python = None
            report.add("SKIP", "install vLLM", "--fake-vllm: GuideLLM's mock server instead")
        else:
            python = prepare_vllm(args, report, work)
        if args.install_only:
            return _finish(report, work, keep, "vLLM install (--install-only)", 0)
        checkpoint = write_tiny_checkpoint(work / "checkpoints" / "tiny-llama")
        check_checkpoint(python or sys.executable, checkpoint, report)
        stack = BenchStack(work, fake, args.timeout_s)
        stack.start()
        config = engine_config(fake, python)
        deploy(stack, checkpoint, config)
        inst = wait_until_ready(stack, args.timeout_s, report)
        tokens = check_gateway(stack, report)
        key = instance_key(stack, inst, config)
        check_instance_key(stack, inst, key, fake, report)
        check_no_key_in_proc(stack, key, fake, report)
        if fake:
            report.add("SKIP", "dllm_* samples", "the mock server has no /metrics (vLLM only)")
        else:
            check_metrics(stack, inst, tokens, report)
    except StepFailed as exc:
        report.add("FAIL", exc.step, str(exc))
    except KeyboardInterrupt:
        report.add("FAIL", "interrupted", "stopped by a signal; tearing down")
        code = 130
    finally:
        for signum in STOP_SIGNALS:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(signum, signal.SIG_IGN)
        if stack is not None:
            if report.failed:
                print(stack.log_tails(), flush=True)
            print("stopping the stack", flush=True)
            stack.stop()
    title = "dctl + GuideLLM mock (--fake-vllm)" if fake else "dctl + vLLM on a GPU"
    return _finish(report, work, keep, title, code)


def _finish(report: Report, work: Path, keep: bool, title: str, code: int) -> int:
    """Remove or keep WORK, print the summary, return the exit code."""
    if report.failed or keep:
        print(f"work dir kept: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    print(report.summary(title), flush=True)
    return code or (1 if report.failed else 0)


def main() -> int:
    """Flags in, exit code out; SIGTERM and SIGHUP stop it as Ctrl-C does."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--fake-vllm",
        "--smoke",
        action="store_true",
        help="no GPU: fake GPUs and GuideLLM's mock server instead of vLLM",
    )
    parser.add_argument(
        "--venv",
        type=Path,
        default=DEFAULT_VENV,
        help=f"the venv vLLM is installed into [{DEFAULT_VENV}]",
    )
    parser.add_argument(
        "--reuse-venv", action="store_true", help="skip the install when --venv already has vLLM"
    )
    parser.add_argument("--vllm-python", help="an interpreter that already has vLLM")
    parser.add_argument("--vllm-version", help="pip install vllm==VERSION [latest]")
    parser.add_argument(
        "--install-only",
        action="store_true",
        help="stop once vLLM is installed (then --reuse-venv)",
    )
    parser.add_argument(
        "--timeout-s", type=float, default=900.0, help="for the instance to become ready [900]"
    )
    parser.add_argument("--work-dir", type=Path, help="keep everything here [a temp dir]")
    parser.add_argument("--keep", action="store_true", help="keep the temp dir after a pass")
    args = parser.parse_args()
    # Absolute (engine.python must be, and so must the agent's data dir), not resolved: a
    # venv's python is a symlink that only works under its own name.
    args.venv = Path(os.path.abspath(args.venv))
    args.vllm_python = args.vllm_python and os.path.abspath(args.vllm_python)
    args.work_dir = args.work_dir and Path(os.path.abspath(args.work_dir))
    if args.work_dir and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty: every run starts from nothing")
    if not args.fake_vllm and shutil.which("nvidia-smi") is None:
        print(
            "no NVIDIA driver here (nvidia-smi): nothing to check; run it on a GPU machine, "
            "or with --fake-vllm to exercise the stack"
        )
        return 0

    def interrupt(_signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGHUP, interrupt)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
