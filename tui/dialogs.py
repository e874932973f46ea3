"""The actions' dialogs: confirm (y / n / esc), the canary form, the rollback list, and the error
an API answer becomes. Thin: the rules they show live in `tui.actions` (text and validation),
each dialog only lays them out and dismisses with the user's answer."""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.suggester import SuggestFromList
from textual.widgets import Input, Label, OptionList, Static

from protocol.rollouts import RolloutCreate
from tui.actions.canary import CanaryFields, FieldError, completions, read_canary
from tui.actions.rules import RollbackChoice

BOX_CSS = """
{name} {{ align: center middle; }}
{name} > Vertical {{
    width: 76; max-width: 100%; height: auto; max-height: 100%;
    border: thick $accent; background: $surface; padding: 0 1;
}}
{name} .title {{ text-style: bold; margin-bottom: 1; }}
{name} .keys {{ color: $text-muted; margin-top: 1; }}
"""


def _css(name: str, extra: str = "") -> str:
    return BOX_CSS.format(name=name) + extra


class ConfirmDialog(ModalScreen[bool]):
    """A yes / no question: `y` answers True, `n` or `esc` False."""

    DEFAULT_CSS = _css("ConfirmDialog")
    BINDINGS: ClassVar[list[Any]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n", "answer(False)", "No"),
        Binding("escape", "answer(False)", "Cancel"),
    ]

    def __init__(self, title: str, question: str) -> None:
        super().__init__()
        self.title_text = title
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.title_text, classes="title", markup=False)
            yield Static(self.question, id="question", markup=False)
            yield Static("y confirm    n / esc cancel", classes="keys", markup=False)

    def action_answer(self, yes: bool) -> None:
        """Dismiss with the answer."""
        self.dismiss(yes)


class ErrorDialog(ModalScreen[None]):
    """The API's refusal (or the network's), as it said it; `esc` or `enter` closes it."""

    DEFAULT_CSS = _css("ErrorDialog", "ErrorDialog > Vertical { border: thick $error; }")
    BINDINGS: ClassVar[list[Any]] = [
        Binding("escape", "close", "Close"),
        Binding("enter", "close", "Close"),
    ]

    def __init__(self, title: str, message: str) -> None:
        super().__init__()
        self.title_text = title
        self.message = message

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(self.title_text, classes="title", markup=False)
            yield Static(self.message, id="message", markup=False)
            yield Static("esc / enter close", classes="keys", markup=False)

    def action_close(self) -> None:
        """Close the dialog."""
        self.dismiss(None)


# Form field (as `FieldError` names it) -> the input's id.
_INPUTS = {"version": "version", "canary %": "canary", "steps": "steps", "interval": "interval"}


class CanaryForm(ModalScreen[RolloutCreate | None]):
    """The canary rollout form; `enter` in any field submits, wrong fields are listed by name
    (nothing is sent), `esc` cancels."""

    DEFAULT_CSS = _css(
        "CanaryForm", "CanaryForm Input { margin-bottom: 0; } CanaryForm #errors { color: $error; }"
    )
    BINDINGS: ClassVar[list[Any]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, deployment: str, versions: tuple[str, ...]) -> None:
        super().__init__()
        self.deployment = deployment
        self.versions = versions

    def compose(self) -> ComposeResult:
        defaults = CanaryFields()
        suggest = SuggestFromList(completions(self.versions), case_sensitive=False)
        with Vertical():
            yield Static(f"Canary rollout of {self.deployment}", classes="title", markup=False)
            yield Label("version")
            yield Input(id="version", placeholder="v2 or demo:v2", suggester=suggest)
            yield Label("canary %")
            yield Input(defaults.canary, id="canary")
            yield Label("steps (rising percents, the last 100)")
            yield Input(defaults.steps, id="steps")
            yield Label("interval (each step held and analysed)")
            yield Input(defaults.interval, id="interval")
            yield Static("", id="errors", markup=False)
            yield Static("enter submit    tab next    → complete    esc cancel", classes="keys")

    def fields(self) -> CanaryFields:
        """What the inputs hold now."""
        value = {key: self.query_one(f"#{key}", Input).value for key in set(_INPUTS.values())}
        return CanaryFields(**value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        """`enter` in any field: submit the whole form."""
        event.stop()
        self.submit()

    def submit(self) -> None:
        """Dismiss with the request, or list what is wrong and focus the first wrong field."""
        result = read_canary(self.fields())
        if isinstance(result, RolloutCreate):
            self.dismiss(result)
            return
        self.show_errors(result)

    def show_errors(self, errors: list[FieldError]) -> None:
        """List ERRORS under the fields."""
        self.query_one("#errors", Static).update("\n".join(str(e) for e in errors))
        self.query_one(f"#{_INPUTS.get(errors[0].field, 'version')}", Input).focus()

    def action_cancel(self) -> None:
        """Close without a request."""
        self.dismiss(None)


class RollbackPicker(ModalScreen[RollbackChoice | None]):
    """The versions to roll back to, the default first and highlighted; `enter` picks."""

    DEFAULT_CSS = _css("RollbackPicker", "RollbackPicker OptionList { height: auto; }")
    BINDINGS: ClassVar[list[Any]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, deployment: str, choices: list[RollbackChoice]) -> None:
        super().__init__()
        self.deployment = deployment
        self.choices = choices

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(f"Roll {self.deployment} back to", classes="title", markup=False)
            yield OptionList(*(choice.label for choice in self.choices), markup=False)
            yield Static("↑↓ choose    enter pick    esc cancel", classes="keys")

    def on_mount(self) -> None:
        options = self.query_one(OptionList)
        options.highlighted = 0
        options.focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        """The picked version."""
        event.stop()
        self.dismiss(self.choices[event.option_index])

    def action_cancel(self) -> None:
        """Close without a choice."""
        self.dismiss(None)
