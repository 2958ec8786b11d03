"""Secrets never reach an artifact: credentials in environments and argv lists are masked.

A leaf module, because the launcher writes each instance's command file and the bundle
rewrites them, and neither should import the other for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

SECRET_NAME_PARTS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
# vLLM flags whose value is a credential. Flags are not matched by name: many merely mention
# tokens (--max-num-batched-tokens).
SECRET_FLAGS = ("--api-key", "--hf-token")
REDACTED = "[redacted]"
# Shorter values are not scrubbed from free text: replacing every "1" would destroy the
# artifacts, and a credential that short protects nothing anyway.
MIN_SCRUBBED_LEN = 6


def is_secret_name(name: str) -> bool:
    upper = name.upper()
    return any(part in upper for part in SECRET_NAME_PARTS)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    return {name: REDACTED if is_secret_name(name) else value for name, value in env.items()}


def _secret_assignment(arg: str) -> str | None:
    """The value of a `NAME=VALUE` argument whose NAME is a secret's (`--ray-instance-env
    HF_TOKEN=...`), else None."""
    name, eq, value = arg.partition("=")
    is_name = name.replace("_", "a").isalnum() and not name[:1].isdigit()
    return value if eq and is_name and is_secret_name(name) else None


def redact_argv(argv: Sequence[str]) -> list[str]:
    """`--api-key X` and `--api-key=X` keep the flag and lose the value; so does a `NAME=VALUE`
    argument whose NAME is a secret's (found in review: `--ray-instance-env HF_TOKEN=...`
    reached run.json)."""
    redacted: list[str] = []
    hide_next = False
    for arg in argv:
        flag, eq, _ = arg.partition("=")
        if hide_next:
            redacted.append(REDACTED)
        elif eq and (flag in SECRET_FLAGS or _secret_assignment(arg) is not None):
            redacted.append(f"{flag}={REDACTED}")
        else:
            redacted.append(arg)
        hide_next = not hide_next and arg in SECRET_FLAGS
    return redacted


def secret_values(env: Mapping[str, str], argv: Sequence[str]) -> set[str]:
    """Every credential value in an environment and an argv list (to scrub from free text)."""
    values = {value for name, value in env.items() if is_secret_name(name)}
    values |= {new for old, new in zip(argv, argv[1:]) if old in SECRET_FLAGS}
    values |= {arg.partition("=")[2] for arg in argv if arg.partition("=")[0] in SECRET_FLAGS}
    values |= {value for arg in argv if (value := _secret_assignment(arg))}
    return values


# Every credential value of a command this process launched: its `.cmd.json` is written
# redacted (`harness.serve.entry.command_json`), so the bundle cannot learn them from it, and a
# secret only an instance had (the vLLM proxy's fresh ADMIN_API_KEY) must still be scrubbed
# from the free text of every artifact (an error's log tail, a response).
_LAUNCHED_SECRETS: set[str] = set()


def remember_secrets(env: Mapping[str, str], argv: Sequence[str]) -> None:
    """Note the credential values of a command about to be launched, for `launched_secrets`."""
    _LAUNCHED_SECRETS.update(secret_values(env, argv))


def launched_secrets() -> frozenset[str]:
    """The credential values of every command this process launched (`remember_secrets`)."""
    return frozenset(_LAUNCHED_SECRETS)
