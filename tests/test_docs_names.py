"""The README and docs/architecture.md name only modules and commands that exist.

Parses every ``captioner/...py`` path, every module path of the architecture page's flows
(``training/loop.py``), the README's Development tree, and every ``captioner <command>`` in code
(inline or fenced), and checks them against the package and the CLI's command registry.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("config", "data", "models", "decoding", "checkpoint", "features", "training", "evaluation", "viz",
            "share", "demo", "commands")
MODULE_PATH = re.compile(r"(?<![\w/.])(?:captioner/)?((?:%s)/\w+\.py|\w+\.py)" % "|".join(PACKAGES))
FULL_PATH = re.compile(r"(?<![\w/.])captioner/([\w/]+\.py)")
COMMAND = re.compile(r"(?:^|[\s;|(])captioner ([a-z][a-z-]*)")


def registered_commands() -> set[str]:
    cli = importlib.import_module("captioner.cli")
    return {importlib.import_module(f"captioner.commands.{name}").NAME for name in cli.COMMAND_MODULES}


def code_spans(text: str) -> list[str]:
    """The text of fenced code blocks (line by line) and of inline code spans."""
    fenced = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    rest = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return [line for block in fenced for line in block.splitlines()] + re.findall(r"`([^`\n]+)`", rest)


def development_tree(text: str) -> tuple[list[str], list[str]]:
    """Files and folders a Development tree (the architecture page's "The folders") names under ``captioner/`` and ``scripts/``."""
    block = re.search(r"^## (?:Development|The folders)\n.*?^```\n(.*?)^```", text, flags=re.S | re.M)
    package, scripts, current = [], [], None
    for line in (block.group(1).splitlines() if block else []):
        head = line.split()[0] if line.strip() else ""
        if not line.startswith(" "):
            current = head if head in ("captioner/", "scripts/") else None
            if current == "scripts/":
                scripts += re.findall(r"[\w.]+(?:\.py|\.sh|/)", line[len(head):])
            continue
        if current == "captioner/":
            names = line.strip().split("   ")[0]
            package += [n.rstrip(",") for n in names.split() if n.endswith((".py", ".py,", "/", "/,"))]
        elif current == "scripts/":
            scripts += re.findall(r"[\w.]+(?:\.py|\.sh|/)", line)
    return package, scripts


def missing_names(text: str, commands: set[str], root: Path = ROOT, architecture: bool = False) -> list[str]:
    """What ``text`` names that does not exist: ``path`` or ``captioner <command>``."""
    package = root / "captioner"
    missing = [f"captioner/{p}" for p in FULL_PATH.findall(text) if not (package / p).is_file()]
    if architecture:
        for span in code_spans(text):
            for p in MODULE_PATH.findall(span):
                if "/" in p and not (package / p).is_file():
                    missing.append(p)
    for span in code_spans(text):
        missing += [f"captioner {c}" for c in COMMAND.findall(span) if c not in commands]
    files, scripts = development_tree(text)
    missing += [f"captioner/{n}" for n in files if not (package / n).exists()]
    missing += [f"scripts/{n}" for n in scripts if not (root / "scripts" / n).exists()]
    return sorted(set(missing))


def test_readme_names_only_what_exists():
    assert missing_names((ROOT / "README.md").read_text(encoding="utf-8"), registered_commands()) == []


def test_architecture_names_only_what_exists():
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    assert missing_names(text, registered_commands(), architecture=True) == []


def test_the_architecture_page_has_a_development_tree():
    files, scripts = development_tree((ROOT / "docs" / "architecture.md").read_text(encoding="utf-8"))
    assert "training/" in files and "inference.py" in files and "benchmark.py" in scripts


def test_the_name_check_sees_a_missing_module_command_and_tree_entry(tmp_path: Path):
    (tmp_path / "captioner" / "training").mkdir(parents=True)
    (tmp_path / "captioner" / "training" / "loop.py").write_text("")
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "test.sh").write_text("")
    text = ("See `captioner/training/loop.py` and `captioner/training/epoch.py`; run `captioner train`\n"
            "or `captioner fly`.\n\n```bash\ncaptioner demo --out x\n```\n\n"
            "## Development\n\n```\ncaptioner/    the package\n  training/  gone/   two folders\n"
            "scripts/      test.sh, old.py\n```\n")
    assert missing_names(text, {"train", "demo"}, root=tmp_path) == [
        "captioner fly", "captioner/gone/", "captioner/training/epoch.py", "scripts/old.py"]
    arch = "```\n  per epoch        training/epoch.py  train_one_epoch\n```\n"
    assert missing_names(arch, {"train"}, root=tmp_path, architecture=True) == ["training/epoch.py"]
