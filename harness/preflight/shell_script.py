"""Read a bash script's commands the way bash would run them, without running anything.

Upstream parity needs each `vllm serve` and proxy command line of vLLM's own
`run_epd_correctness_test.sh` with its variables expanded: multi-line single-quoted JSON with a
double-quoted variable spliced in, `${name:-default}` defaults, `local` variables of the function
that launches it, `env NAME=VALUE` and `NAME=VALUE` prefixes. This reader covers the forms such
scripts use, and says so when it meets one it cannot expand: a command substitution, an array,
arithmetic yield `UNKNOWN`, which a caller refuses to compare rather than guess.

Semantics kept from bash: quoting (single, double, backslash, line continuation), parameter
expansion with `:-`, `-`, `:=`, `,,`, `^^` and `#`, field splitting of unquoted expansions,
assignment words, function definitions and calls (`$1`... set, `local` scoped to the call),
exports (`export`, `declare -x`, `X=1 stage`) in the environment of every command they reach,
redirections dropped. Deliberately not evaluated: conditions and loops. Both branches of an
`if` run in order, so a caller pins the variables a condition would decide (`pinned`: values
the script never overwrites, as if given in its environment).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

UNKNOWN = "\x00?"  # what an expansion this reader cannot perform turns into
KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}"}
SKIPPED = {"for", "case", "esac", "function", "select"}
DECLARATIONS = {"local", "declare", "export", "readonly", "typeset"}
# Local in a function (declare and typeset unless -g); export and readonly set a global.
LOCAL_DECLARATIONS = {"local", "declare", "typeset"}
NAME = r"[A-Za-z_][A-Za-z0-9_]*"
ASSIGNMENT = re.compile(rf"({NAME})(\+?)=(.*)", re.S)
OPERATORS = ("&&", "||", ";;", ";", "&", "|", "(", ")")


class ScriptError(ValueError):
    """The script uses a form this reader cannot follow (its line named)."""


@dataclass(frozen=True)
class Part:
    kind: str  # "lit" or "expand"
    text: str  # literal text, or the expansion ("NAME", "{NAME:-x}", "(cmd)")
    quoted: bool  # inside double or single quotes: no field splitting


@dataclass(frozen=True)
class Word:
    parts: tuple[Part, ...]
    line: int

    @property
    def literal(self) -> str | None:
        """The word's text when it has no expansion at all (keywords, function names)."""
        if all(p.kind == "lit" for p in self.parts):
            return "".join(p.text for p in self.parts)
        return None


@dataclass(frozen=True)
class Op:
    text: str  # an operator, "\n", or a redirection (">", "2>&1", ...)
    line: int


Token = Word | Op


@dataclass(frozen=True)
class Command:
    """One simple command as bash would run it, its expansions done."""

    line: int
    stage: str  # the top-level function call it ran in ("" outside functions)
    env: dict[str, str]  # NAME=VALUE words before it, and those of a leading `env`
    argv: tuple[str, ...]


@dataclass
class _Frame:
    variables: dict[str, str]
    positional: list[str] = field(default_factory=list)
    locals: set[str] = field(default_factory=set)  # declared `local` in this call
    # Names every command's environment carries: the script's exports (one set for the whole
    # script, as bash's export is global) and a call's assignment prefix (`X=1 stage`).
    exported: set[str] = field(default_factory=set)


# --- lexing ------------------------------------------------------------------------------------


def tokenize(text: str) -> list[Token]:
    tokens: list[Token] = []
    i, line, n = 0, 1, len(text)
    parts: list[Part] = []
    literal: list[str] = []
    word_line = 1

    def end_word() -> None:
        _flush(literal, parts, quoted=False)
        if parts:
            tokens.append(Word(tuple(parts), word_line))
            parts.clear()

    while i < n:
        c = text[i]
        if not parts and not literal:
            word_line = line
        if c == "\\" and i + 1 < n and text[i + 1] == "\n":
            i, line = i + 2, line + 1
            continue
        if c in " \t":
            end_word()
            i += 1
            continue
        if c == "\n":
            end_word()
            tokens.append(Op("\n", line))
            i, line = i + 1, line + 1
            continue
        if c == "#" and not parts and not literal:
            while i < n and text[i] != "\n":
                i += 1
            continue
        if c in "<>":
            prefix = ""
            if literal and not parts and "".join(literal).isdigit():
                prefix = "".join(literal)
                literal.clear()
            end_word()
            match = re.match(r"(>>|>&|<<|<|>)(&?[0-9-]+)?", text[i:])
            assert match is not None
            tokens.append(Op(prefix + match.group(0), line))
            i += len(match.group(0))
            continue
        operator = next((op for op in OPERATORS if text.startswith(op, i)), None)
        if operator is not None:
            if operator == "&" and text.startswith("&>", i):
                end_word()
                tokens.append(Op("&>", line))
                i += 2
                continue
            end_word()
            tokens.append(Op(operator, line))
            i += len(operator)
            continue
        if c == "'":
            end = text.find("'", i + 1)
            if end < 0:
                raise ScriptError(f"line {line}: unterminated single quote")
            _flush(literal, parts, quoted=False)
            parts.append(Part("lit", text[i + 1 : end], True))
            line += text.count("\n", i, end)
            i = end + 1
            continue
        if c == '"':
            _flush(literal, parts, quoted=False)
            i, line = _double_quoted(text, i + 1, line, parts)
            continue
        if c == "\\" and i + 1 < n:
            literal.append(text[i + 1])
            i += 2
            continue
        if c in "$`":
            i, line = _expansion(text, i, line, literal, parts, quoted=False)
            continue
        literal.append(c)
        i += 1
    end_word()
    return tokens


def _double_quoted(text: str, i: int, line: int, parts: list[Part]) -> tuple[int, int]:
    literal: list[str] = []
    start_line = line
    while i < len(text):
        c = text[i]
        if c == '"':
            _flush(literal, parts, quoted=True)
            if not parts or parts[-1].quoted is False:
                parts.append(Part("lit", "", True))  # "" is a word of its own
            return i + 1, line
        if c == "\\" and i + 1 < len(text) and text[i + 1] in '$`"\\\n':
            if text[i + 1] == "\n":
                line += 1
            else:
                literal.append(text[i + 1])
            i += 2
            continue
        if c in "$`":
            i, line = _expansion(text, i, line, literal, parts, quoted=True)
            continue
        if c == "\n":
            line += 1
        literal.append(c)
        i += 1
    raise ScriptError(f"line {start_line}: unterminated double quote")


def _flush(literal: list[str], parts: list[Part], quoted: bool) -> None:
    """End the literal text read so far as a part of its own (an expansion or a quote follows
    it, or the word ends); `literal` is left empty for what comes next."""
    if literal:
        parts.append(Part("lit", "".join(literal), quoted))
        literal.clear()


def _expansion(
    text: str, i: int, line: int, literal: list[str], parts: list[Part], quoted: bool
) -> tuple[int, int]:
    """Read the `$...` or backquoted expansion at text[i] into `parts` (a part of its own, after
    the literal text before it), alike inside double quotes and out but for `quoted`.

    A `$` that starts no expansion is literal text. Returns the index after the expansion and
    the line it ends on (a `$(...)` or backquote may span lines)."""
    if text[i] == "`":
        end = _backquote_end(text, i, line)
        expansion: str | None = "(" + text[i + 1 : end] + ")"
        after = end + 1
    else:
        expansion, after = _dollar(text, i, line)
    line += text.count("\n", i, after)
    if expansion is None:
        literal.append("$")
    else:
        _flush(literal, parts, quoted)
        parts.append(Part("expand", expansion, quoted))
    return after, line


def _backquote_end(text: str, i: int, line: int) -> int:
    """The index of the backquote that closes the one at text[i]."""
    end = text.find("`", i + 1)
    if end < 0:
        raise ScriptError(f"line {line}: unterminated backquote")
    return end


def _dollar(text: str, i: int, line: int) -> tuple[str | None, int]:
    """The expansion at text[i] == "$": ("NAME" | "{...}" | "(...)", index after it)."""
    rest = text[i + 1 :]
    if rest.startswith("{"):
        end = _matching(text, i + 1, "{", "}", line)
        return "{" + text[i + 2 : end] + "}", end + 1
    if rest.startswith("("):
        end = _matching(text, i + 1, "(", ")", line)
        return "(" + text[i + 2 : end] + ")", end + 1
    match = re.match(rf"{NAME}|[0-9@*#?$!-]", rest)
    if match is None:
        return None, i + 1
    return match.group(0), i + 1 + len(match.group(0))


def _matching(text: str, i: int, opening: str, closing: str, line: int) -> int:
    depth, quote = 0, ""
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 2
                continue
            if c == quote:
                quote = ""
        elif c in "'\"":
            quote = c
        elif c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise ScriptError(f"line {line}: unterminated ${opening}")


# --- running ---------------------------------------------------------------------------------


def read_commands(text: str, pinned: Mapping[str, str] = ()) -> list[Command]:
    """Every simple command the script would run, in order, with its expansions done."""
    pinned = dict(pinned)
    tokens = tokenize(text)
    functions: dict[str, list[Token]] = {}
    main = _take_functions(tokens, functions)
    commands: list[Command] = []
    frame = _Frame(dict(pinned))
    _run(main, frame, functions, pinned, commands, stack=())
    return commands


def _take_functions(tokens: list[Token], functions: dict[str, list[Token]]) -> list[Token]:
    """Record `name() { ... }` definitions; returns the tokens outside them."""
    rest: list[Token] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if (
            isinstance(token, Word)
            and token.literal
            and re.fullmatch(NAME, token.literal)
            and i + 2 < len(tokens)
            and isinstance(tokens[i + 1], Op)
            and tokens[i + 1].text == "("
            and isinstance(tokens[i + 2], Op)
            and tokens[i + 2].text == ")"
        ):
            j = i + 3
            while j < len(tokens) and isinstance(tokens[j], Op) and tokens[j].text == "\n":
                j += 1
            opening = tokens[j] if j < len(tokens) else None
            if not (isinstance(opening, Word) and opening.literal == "{"):
                raise ScriptError(f"line {token.line}: function {token.literal} has no {{ body")
            end = _body_end(tokens, j)
            functions[token.literal] = tokens[j + 1 : end]
            i = end + 1
            continue
        rest.append(token)
        i += 1
    return rest


def _body_end(tokens: list[Token], start: int) -> int:
    """The index of the `}` closing the `{` word at `start` (braces as command words)."""
    depth = 0
    at_command_start = True
    for k in range(start, len(tokens)):
        token = tokens[k]
        if isinstance(token, Op):
            at_command_start = token.text in ("\n", ";", "&", "&&", "||", "|", "(")
            continue
        if at_command_start and token.literal == "{":
            depth += 1
        elif at_command_start and token.literal == "}":
            depth -= 1
            if depth == 0:
                return k
        at_command_start = token.literal in KEYWORDS
    raise ScriptError(f"line {tokens[start].line}: unterminated function body")


def _split(tokens: list[Token]) -> list[tuple[list[Word], int]]:
    """Simple commands: words between operators, redirections and their targets dropped."""
    commands: list[tuple[list[Word], int]] = []
    words: list[Word] = []
    skip_next = False
    for token in tokens:
        if isinstance(token, Op):
            if token.text[:1].isdigit() or token.text[:1] in "<>" or token.text == "&>":
                skip_next = not re.search(r"&[0-9-]+$", token.text)
                continue
            if token.text in ("(", ")"):
                continue
            if words:
                commands.append((words, words[0].line))
            words = []
            continue
        if skip_next:
            skip_next = False
            continue
        words.append(token)
    if words:
        commands.append((words, words[0].line))
    return commands


def _run(
    tokens: list[Token],
    frame: _Frame,
    functions: dict[str, list[Token]],
    pinned: dict[str, str],
    commands: list[Command],
    stack: tuple[str, ...],
) -> None:
    for words, line in _split(tokens):
        while words and words[0].literal in KEYWORDS:
            words = words[1:]
        if not words or words[0].literal in SKIPPED:
            continue
        head = words[0].literal
        if head in DECLARATIONS:
            texts = [_expand_one(word, frame) for word in words[1:]]
            flags = "".join(text[1:] for text in texts if text.startswith("-"))
            for text in texts:
                local = head in LOCAL_DECLARATIONS and "g" not in flags
                name = _assign(text, frame, pinned, local=local)
                if name and (head == "export" or "x" in flags):
                    frame.exported.add(name)
            continue
        prefix: dict[str, str] = {}
        while words and ASSIGNMENT.fullmatch(_raw(words[0])):
            name, append, _value = ASSIGNMENT.fullmatch(_raw(words[0])).groups()
            value = _expand_one(words[0], frame).split("=", 1)[1]
            prefix[name] = (frame.variables.get(name, "") if append else "") + value
            words = words[1:]
        if not words:
            for name, value in prefix.items():
                if name not in pinned:
                    frame.variables[name] = value
            continue
        argv = [field_ for word in words for field_ in _expand(word, frame)]
        if argv and argv[0] in functions:
            # An assignment before a call is the call's variable and environment, then undone.
            values = {**frame.variables, **{k: v for k, v in prefix.items() if k not in pinned}}
            called = _Frame(values, argv[1:], exported=frame.exported | set(prefix))
            _run(functions[argv[0]], called, functions, pinned, commands, (*stack, argv[0]))
            frame.exported |= called.exported - set(prefix) - called.locals
            for name, value in called.variables.items():  # what it set, but its locals
                if name not in called.locals and name not in prefix:
                    frame.variables[name] = value
            continue
        env = {
            name: frame.variables[name]
            for name in sorted(frame.exported)
            if name in frame.variables
        }
        env.update(prefix)
        if argv and argv[0] == "env":
            argv = argv[1:]
            while argv and ASSIGNMENT.fullmatch(argv[0]):
                name, _append, value = ASSIGNMENT.fullmatch(argv[0]).groups()
                env[name] = value
                argv = argv[1:]
        commands.append(Command(line, stack[0] if stack else "", env, tuple(argv)))


def _raw(word: Word) -> str:
    """The word's first literal text, enough to see an assignment (`NAME=` is literal)."""
    first = word.parts[0] if word.parts else None
    return first.text if first is not None and first.kind == "lit" and not first.quoted else ""


def _assign(text: str, frame: _Frame, pinned: dict[str, str], local: bool) -> str | None:
    """One word of a declaration (`local X=1`, `export X`); returns the name it declares."""
    if text.startswith("-"):
        return None  # declare -a and the like
    match = ASSIGNMENT.fullmatch(text)
    name = match.group(1) if match else text
    if local:
        frame.locals.add(name)
    if match and name not in pinned:
        frame.variables[name] = match.group(3)
    return name


def _expand_one(word: Word, frame: _Frame) -> str:
    """A word as one string (assignments: no field splitting)."""
    return "".join(_expand_part(part, frame) for part in word.parts)


def _expand(word: Word, frame: _Frame) -> list[str]:
    """A word as argv fields: the results of unquoted expansions split on whitespace."""
    fields: list[str] = []
    current: str | None = None  # None: no field begun
    for part in word.parts:
        value = _expand_part(part, frame)
        if part.kind == "lit" or part.quoted:
            current = (current or "") + value
            continue
        for k, piece in enumerate(re.split(r"\s+", value)):
            if k and current is not None:
                fields.append(current)
                current = None
            if piece:
                current = (current or "") + piece
    if current is not None:
        fields.append(current)
    return fields


def _expand_part(part: Part, frame: _Frame) -> str:
    if part.kind == "lit":
        return part.text
    text = part.text
    if text.startswith("("):
        return UNKNOWN  # command substitution or arithmetic
    if not text.startswith("{"):
        return _parameter(text, frame)
    inner = text[1:-1]
    if inner.startswith("#"):
        value = frame.variables.get(inner[1:])
        return str(len(value)) if value is not None and re.fullmatch(NAME, inner[1:]) else UNKNOWN
    match = re.fullmatch(rf"({NAME}|[0-9]+)(:-|-|:=|,,|\^\^)?(.*)", inner, re.S)
    if match is None or (match.group(2) is None and match.group(3)):
        return UNKNOWN  # arrays, substrings, patterns
    name, operator, rest = match.groups()
    value = _parameter(name, frame) if name in frame.variables or name.isdigit() else None
    if operator in (":-", ":="):
        if not value:
            value = _expand_one(Word(tokenize_default(rest), 0), frame)
            if operator == ":=":
                frame.variables[name] = value
        return value
    if operator == "-":
        return value if value is not None else _expand_one(Word(tokenize_default(rest), 0), frame)
    if operator == ",,":
        return (value or "").lower()
    if operator == "^^":
        return (value or "").upper()
    return value or ""


def tokenize_default(text: str) -> tuple[Part, ...]:
    """The word in `${name:-word}`, lexed as the inside of double quotes."""
    parts: list[Part] = []
    _double_quoted(text + '"', 0, 0, parts)
    return tuple(parts)


def _parameter(name: str, frame: _Frame) -> str:
    if name.isdigit():
        index = int(name)
        return frame.positional[index - 1] if 0 < index <= len(frame.positional) else ""
    if name in "@*#?$!-":
        return UNKNOWN
    return frame.variables.get(name, "")
