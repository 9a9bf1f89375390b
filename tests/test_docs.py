"""Every command in README.md and docs/*.md is one a user can type: each `scripts/...` and `make`
command of a fenced block names a script (or target) that exists, whose own argument parser takes
every flag given (the parser the script uses, imported from the package and built here in-process:
nothing runs), with every --config file there; and every relative link resolves. A flag renamed or
a guide moved fails here, not in a newcomer's shell."""

import importlib.util
import re
import shlex
from collections.abc import Callable
from pathlib import Path

import pytest

from jaxtrain.config import load_config
from jaxtrain.health import cli as health_cli
from jaxtrain.health import gpu_check
from jaxtrain.hf import cli as hf_cli
from jaxtrain.launch import cli as launch_cli
from jaxtrain.plan import cli as plan_cli
from jaxtrain.prepare import cli as prepare_cli

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"^(?:\./)?(scripts/[\w/]+\.(?:py|sh))$")
SHELL_OPS = {"|", "||", "&&", ";", ">", ">>", "2>", "&"}


def _commands(page: Path) -> list[list[str]]:
    """The words of each command line in the page's fenced blocks (continuations joined, comments
    and the brackets of optional arguments dropped)."""
    out = []
    for block in re.findall(r"(?ms)^```[\w-]*\n(.*?)^```", page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            words = [w.strip("[]") for w in shlex.split(line, comments=True)]
            for i, w in enumerate(words):
                if w in SHELL_OPS:
                    words = words[:i]
                    break
            if words:
                out.append([w for w in words if w])
    return out


def _chat_example(args: list[str]) -> None:
    # The one script whose logic (and parser) lives in the script: the worked example of
    # docs/documents_and_chat.md, which drives the other scripts as a user does.
    spec = importlib.util.spec_from_file_location("chat_example", ROOT / "scripts" / "chat_example.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.parse_args(args)


def _train(args: list[str]) -> None:
    load_config(args)


def _plan(args: list[str]) -> None:
    _, rest = plan_cli._parser().parse_known_args(args)
    load_config(rest)


def _run_distributed(args: list[str]) -> None:
    ns, rest = launch_cli.parse_args(args)
    _check(ns.script, rest)


def _multi_node(args: list[str]) -> None:
    cut = args.index("--") if "--" in args else len(args)
    assert cut == 3, f"launch_multi_node.sh takes <coordinator> <num_nodes> <gpus_per_node>, got {args[:cut]}"
    _train(args[cut + 1 :])


CHECKS: dict[str, Callable[[list[str]], None]] = {
    "scripts/train.py": _train,
    "scripts/plan.py": _plan,
    "scripts/run_distributed.py": _run_distributed,
    "scripts/launch_multi_node.sh": _multi_node,
    "scripts/test_distributed.py": health_cli.parse_args,
    "scripts/prepare_data.py": prepare_cli.parse_args,
    "scripts/export_hf.py": hf_cli.parse_args,
    "scripts/gpu_check.py": gpu_check.parse_args,
    "scripts/chat_example.py": _chat_example,
}


def _check(script: str, args: list[str]) -> None:
    """`script args` as its own parser reads them; raises on a flag it does not take."""
    assert (ROOT / script).is_file(), f"{script} does not exist"
    for i, word in enumerate(args[:-1]):
        if word == "--config":
            assert (ROOT / args[i + 1]).is_file(), f"--config {args[i + 1]} does not exist"
    assert script in CHECKS, f"{script}: no parser known; put its parser in the package and add it to CHECKS"
    CHECKS[script](args)


def _found() -> list[tuple[str, list[str]]]:
    """(where, words) of every scripts/ and make command in the pages."""
    found = []
    for page in PAGES:
        for words in _commands(page):
            at = next((i for i, w in enumerate(words) if SCRIPT.match(w) or w == "make"), None)
            if at is not None:
                found.append((f"{page.relative_to(ROOT)}: {shlex.join(words)}", words[at:]))
    return found


COMMANDS = _found()


def test_the_pages_hold_the_commands_a_newcomer_runs_first() -> None:
    readme = [words for where, words in COMMANDS if where.startswith("README.md")]
    assert ["make", "train"] in readme and ["make", "test"] in readme
    assert {w[0] for w in readme} >= {
        "make",
        "scripts/train.py",
        "scripts/prepare_data.py",
        "scripts/plan.py",
    }
    assert len(COMMANDS) > 40, len(COMMANDS)  # the guides' commands were found, not skipped


@pytest.mark.parametrize("where,words", COMMANDS, ids=[w for w, _ in COMMANDS])
def test_every_command_is_taken_by_its_own_parser(where: str, words: list[str]) -> None:
    if words[0] == "make":
        targets = set(re.findall(r"(?m)^([\w.-]+):", (ROOT / "Makefile").read_text()))
        assert words[1] in targets, f"{where}: no make target {words[1]}"
        return
    try:
        _check(SCRIPT.match(words[0])[1], words[1:])  # type: ignore[index]
    except (Exception, SystemExit) as e:
        pytest.fail(f"{where}\n  {type(e).__name__}: {e}")


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:|#", target):
                continue
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
