"""Issue 27's shape, held by parsing the tree: `Rollout` rows are written in one module (the
rollout store), and the rollout states and phases are spelled once (`protocol.rollout_states`);
everything else imports them."""

from __future__ import annotations

import ast
from pathlib import Path

from protocol.rollout_states import RolloutPhase, RolloutState

ROOT = Path(__file__).resolve().parent.parent
STORE = "controlplane/rollouts/store.py"
VOCABULARY = "protocol/rollout_states.py"
# Columns only a `Rollout` row has (`state`, `message`... are also other rows' and objects').
ROLLOUT_COLUMNS = {
    "step_index", "canary_weight", "canary_instances", "paused_left_s", "step_started_at",
    "ticked_at",
}  # fmt: skip
# The values no other vocabulary of the project uses (`paused`, `failed`, `waiting`... are).
SPELLINGS = {
    RolloutState.PROGRESSING, RolloutState.PROMOTED, RolloutState.ROLLED_BACK,
    RolloutPhase.ANALYSING, RolloutPhase.PROMOTING, RolloutPhase.RESTARTING,
}  # fmt: skip


def modules(*folders: str) -> list[tuple[str, ast.AST]]:
    return [
        (path.relative_to(ROOT).as_posix(), ast.parse(path.read_text(), filename=str(path)))
        for folder in folders
        for path in sorted((ROOT / folder).rglob("*.py"))
    ]


def test_rollout_rows_are_written_by_the_store_alone() -> None:
    writes = []
    for relpath, tree in modules("controlplane", "cli", "tui", "bench", "doctor"):
        if relpath == STORE:
            continue
        for node in ast.walk(tree):
            targets: list[ast.expr] = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            writes += [
                f"{relpath}:{t.lineno} {ast.unparse(t)}"
                for t in targets
                if isinstance(t, ast.Attribute) and t.attr in ROLLOUT_COLUMNS
            ]
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Rollout":
                writes.append(f"{relpath}:{node.lineno} Rollout(...)")
    assert writes == [], f"write rollout rows through {STORE}"


def test_rollout_states_and_phases_are_spelled_once() -> None:
    spelled = [
        f"{relpath}:{node.lineno} {node.value!r}"
        for relpath, tree in modules(
            "protocol", "controlplane", "cli", "tui", "bench", "doctor", "client", "tests"
        )
        if relpath != VOCABULARY
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in SPELLINGS
    ]
    assert spelled == [], f"import the enums of {VOCABULARY}"
