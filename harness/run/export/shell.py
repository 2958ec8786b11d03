"""The words of an export's bash scripts: literal text and shell variables (`$DECODE0_PORT`,
`$HOST`, `$WORK`), so what differs on another machine is set once at the top of serve.sh."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    """A shell variable in a rendered command line, e.g. `$DECODE0_PORT`."""

    name: str
    # The user's own comma-separated list, then a comma if it is set and non-empty, else
    # nothing (`${NO_PROXY:+${NO_PROXY},}`): what serve.sh appends its own entries to.
    list_head: bool = False
    # A value the run gave a server recorded redacted (a credential, `--api-key KEY`, or an
    # environment variable whose name the secret rule matches): serve.sh takes it from the
    # user's environment and refuses to start without it (`secret_check`).
    secret: bool = False

    def expansion(self) -> str:
        if self.list_head:
            return f"${{{self.name}:+${{{self.name}}},}}"
        return f"${{{self.name}}}"


# One argument: literal text and variables, concatenated.
Arg = tuple[str | Var, ...]


def shell_variable(name: str) -> str:
    """The stem of a server's serve.sh variables (`ref-decode0` -> REF_DECODE0: its _PORT,
    _NIXL_PORT): one rule, so an instance's and a proxy's names can never collide apart."""
    return re.sub(r"[^A-Za-z0-9]", "_", name).upper()


def shell_word(arg: Arg) -> str:
    """One argument as a shell word: `"http://${HOST}:${PORT}"` when its literal text needs
    no escaping inside double quotes, else literal pieces single-quoted and variables
    double-quoted (a JSON config: `'{"path": "'"${WORK_JSON}"'/storage/kv"}'`)."""
    if all(isinstance(piece, str) for piece in arg):
        return shlex.quote("".join(str(piece) for piece in arg))
    literal = "".join(piece for piece in arg if isinstance(piece, str))
    if not re.search(r'["$`\\!]', literal):
        inner = "".join(p.expansion() if isinstance(p, Var) else p for p in arg)
        return f'"{inner}"'
    return "".join(
        f'"{piece.expansion()}"' if isinstance(piece, Var) else shlex.quote(piece) for piece in arg
    )
