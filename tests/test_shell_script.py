"""The reader of bash scripts that upstream parity uses (harness/preflight/shell_script.py): each
command as bash would run it, expansions done, nothing executed. The scripts here are written
for these tests."""

from __future__ import annotations

import json
import textwrap

import pytest

from harness.preflight.shell_script import UNKNOWN, ScriptError, read_commands

pytestmark = pytest.mark.unit


def commands(script: str, **pinned: str) -> list[tuple[str, dict[str, str], tuple[str, ...]]]:
    return [(c.stage, c.env, c.argv) for c in read_commands(textwrap.dedent(script), pinned)]


def test_defaults_quotes_and_line_continuations_expand_like_bash() -> None:
    script = """
        PORT="${PORT:-8000}"
        NAME=${NAME:-a b}
        EMPTY=""
        serve --port "$PORT" \\
            --name "$NAME" --split $NAME "$EMPTY" \\
            --literal '$PORT' --escaped \\$PORT x"$PORT"y  # a comment
    """
    ((_stage, env, argv),) = commands(script)
    assert env == {}
    assert argv == (
        "serve",
        "--port",
        "8000",
        "--name",
        "a b",
        "--split",
        "a",
        "b",
        "",
        "--literal",
        "$PORT",
        "--escaped",
        "$PORT",
        "x8000y",
    )


def test_pinned_variables_win_over_the_scripts_own_assignments() -> None:
    script = """
        MODE="${MODE:-cpu}"
        if [[ "${MODE,,}" == "xpu" ]]; then
            DEVICE_ENV="ZE_AFFINITY_MASK"
        else
            DEVICE_ENV="CUDA_VISIBLE_DEVICES"
        fi
        env "$DEVICE_ENV=0" run "$MODE"
    """
    assert commands(script)[-1][1:] == ({"CUDA_VISIBLE_DEVICES": "0"}, ("run", "cpu"))
    pinned = commands(script, MODE="XPU", DEVICE_ENV="ZE_AFFINITY_MASK")
    assert pinned[-1][1:] == ({"ZE_AFFINITY_MASK": "0"}, ("run", "XPU"))


def test_multi_line_single_quoted_json_with_a_spliced_variable_is_one_word() -> None:
    script = """
        STORE=/tmp/store
        serve --config '{
            "path": "'"$STORE"'",
            "role": "producer"
        }' > "$LOG"/x.log 2>&1 &
    """
    ((_stage, _env, argv),) = commands(script)
    assert argv[0:2] == ("serve", "--config")
    assert json.loads(argv[2]) == {"path": "/tmp/store", "role": "producer"}
    assert len(argv) == 3, "redirections are not arguments"


def test_functions_run_where_they_are_called_with_their_locals_and_arguments() -> None:
    script = """
        PORT=1
        start() {
            local PORT=$2
            local -a PIDS=()
            GLOBAL=set
            VAR=inner serve "$1" --port "$PORT"
            PIDS+=($!)
        }
        helper() { echo "$1"; }
        start first 10
        start second 20
        serve after --port "$PORT" --global "$GLOBAL"
    """
    serves = [c for c in commands(script) if c[2][:1] == ("serve",)]
    assert serves == [
        ("start", {"VAR": "inner"}, ("serve", "first", "--port", "10")),
        ("start", {"VAR": "inner"}, ("serve", "second", "--port", "20")),
        ("", {}, ("serve", "after", "--port", "1", "--global", "set")),
    ]


def test_env_prefixes_and_assignment_prefixes_are_the_commands_environment() -> None:
    script = """
        GPU=2
        env "CUDA_VISIBLE_DEVICES=$GPU" \\
        SIDE_PORT=5559 \\
        serve model
        A=1 B="x y" serve other
    """
    assert commands(script) == [
        ("", {"CUDA_VISIBLE_DEVICES": "2", "SIDE_PORT": "5559"}, ("serve", "model")),
        ("", {"A": "1", "B": "x y"}, ("serve", "other")),
    ]


def test_exported_variables_are_every_later_commands_environment() -> None:
    """What a script exports reaches every command it runs after, as bash passes it: at the
    top, inside a function (export is global there; local -x is not), and an assignment
    before a function call for the commands of that call."""
    script = """
        export UCX_TLS=all
        setup() {
            export VLLM_X=1
            declare -gx VLLM_Y=2
            local -x GONE=3
            serve inside
        }
        start() {
            serve "$SHARE"
        }
        setup
        before serve
        SHARE=0.5 start
        serve after "$SHARE"
    """
    exported = {"UCX_TLS": "all", "VLLM_X": "1", "VLLM_Y": "2"}
    assert commands(script) == [
        ("setup", {**exported, "GONE": "3"}, ("serve", "inside")),
        ("", exported, ("before", "serve")),
        ("start", {**exported, "SHARE": "0.5"}, ("serve", "0.5")),
        ("", exported, ("serve", "after", "")),
    ]


def test_what_cannot_be_expanded_is_marked_never_guessed() -> None:
    script = """
        ROOT="$(cd "$(dirname "$0")" && pwd)"
        serve "$ROOT/x" "${ARRAY[@]}" $((1 + 2)) "${ROOT:-fallback}"
    """
    ((_stage, _env, argv),) = commands(script)
    assert argv == ("serve", f"{UNKNOWN}/x", UNKNOWN, UNKNOWN, UNKNOWN)
    pinned = commands(script, ROOT="/src")
    assert pinned[0][2] == ("serve", "/src/x", UNKNOWN, UNKNOWN, "/src")


@pytest.mark.parametrize(
    ("script", "message"),
    [
        ("serve 'open", "line 1: unterminated single quote"),
        ('serve "open', "line 1: unterminated double quote"),
        ("serve `open", "line 1: unterminated backquote"),
        # Inside double quotes too, named where it opens (it once rewound to the script's
        # start and failed, or not, by what lay before it).
        ('serve \\\n  "a\n`open" x', "line 3: unterminated backquote"),
        ('x "`a\nb`"\nserve "open', "line 3: unterminated double quote"),  # lines counted
        ('X=$(a\nb)\nserve "open', "line 3: unterminated double quote"),
        ('X="${A:-a\nb}"\nserve "open', "line 3: unterminated double quote"),
        ("f() echo", "line 1: function f has no { body"),
    ],
)
def test_a_script_it_cannot_follow_is_one_error_naming_the_line(script: str, message: str) -> None:
    with pytest.raises(ScriptError, match=message):
        read_commands(script)


def test_commands_of_a_nested_call_belong_to_the_top_level_stage() -> None:
    """Parity groups launches by stage: a helper a stage calls to start each server must not
    make every server a stage of its own."""
    script = """
        launch() { serve "$1"; }
        run_stage() { launch a; launch b; }
        run_stage
    """
    assert [(stage, argv) for stage, _env, argv in commands(script)] == [
        ("run_stage", ("serve", "a")),
        ("run_stage", ("serve", "b")),
    ]


def test_an_empty_default_and_an_assigning_default_expand_like_bash() -> None:
    script = """
        EMPTY=""
        serve "${EMPTY:-fallback}" "${EMPTY-kept}" "${UNSET:=given}" "$UNSET"
    """
    ((_stage, _env, argv),) = commands(script)
    assert argv == ("serve", "fallback", "", "given", "given")


def test_an_empty_quoted_argument_is_an_argument_and_a_hash_inside_a_word_is_text() -> None:
    script = """
        serve --empty "" --url http://host/#anchor a#b  # a comment
    """
    ((_stage, _env, argv),) = commands(script)
    assert argv == ("serve", "--empty", "", "--url", "http://host/#anchor", "a#b")


def test_pinned_variables_win_over_declarations_and_call_prefixes() -> None:
    script = """
        export MODE=cpu
        start() { serve "$MODE"; }
        MODE=rocm start
        serve "$MODE"
    """
    assert [argv for _stage, _env, argv in commands(script, MODE="cuda")] == [
        ("serve", "cuda"),
        ("serve", "cuda"),
    ]


def test_special_parameters_are_unknown_and_an_append_prefix_appends() -> None:
    script = """
        OPTS=a
        OPTS+=b serve "$#" "$@"
    """
    ((_stage, env, argv),) = commands(script)
    assert env == {"OPTS": "ab"}
    assert argv == ("serve", UNKNOWN, UNKNOWN)
