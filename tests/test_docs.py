"""docs/architecture.md's module map names every package and module of the project, and nothing else.

The map is the section under "## Module map" (up to the next "## " heading): one bullet per package
directory, "- `pkg/` ...: `module.py` what it does; ...", continuation lines indented. A package
directory is any directory with a .py file under the project's top-level packages; its modules are
its .py files but __init__.py and the generated *_pb2*.py. File names in a bullet are resolved in
that bullet's directory; paths with a slash from the repository root. Plain text only: nothing here
imports the project.
"""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
PACKAGES = ("server", "pools", "attention_nodes", "expert_nodes", "m2n_comm", "telemetry", "models", "kernels",
            "planner", "training", "clients", "bench")
SKIP_DIRS = {"__pycache__"}
BULLET = re.compile(r"^- `([\w/]+/)`")
CODE = re.compile(r"`([^`\s]+)`")
FILE_NAME = re.compile(r"^[\w.-]+\.(py|c|h|proto)$")


def _section(text: str, heading: str) -> str:
    """The lines under `heading` up to the next heading of the same level."""
    level = heading.split(" ")[0]
    lines = text.splitlines()
    start = lines.index(heading) + 1
    end = next((i for i in range(start, len(lines)) if re.match(rf"^{level} ", lines[i])), len(lines))
    return "\n".join(lines[start:end])


def _bullets(section: str) -> dict[str, str]:
    """Package directory ("server/", "clients/proto/") -> the text of its bullet."""
    out: dict[str, str] = {}
    current = None
    for line in section.splitlines():
        m = BULLET.match(line)
        if m:
            current = m.group(1)
            assert current not in out, f"the module map lists {current} twice"
            out[current] = line[m.end():]
        elif current is not None and line.startswith("  "):
            out[current] += " " + line.strip()
        else:
            current = None
    return out


def _is_module(path: Path) -> bool:
    return path.suffix == ".py" and path.name != "__init__.py" and "_pb2" not in path.name


def _package_dirs() -> dict[str, list[str]]:
    """Every directory with a .py file under the top-level packages -> its modules' names."""
    found: dict[str, list[str]] = {}
    for top in PACKAGES:
        base = ROOT / top
        assert base.is_dir(), f"{top}/ is not a directory"
        for d in [base, *sorted(p for p in base.rglob("*") if p.is_dir())]:
            parts = d.relative_to(ROOT).parts
            if SKIP_DIRS & set(parts) or any(part.startswith(".") for part in parts):
                continue
            py = sorted(p for p in d.iterdir() if p.is_file() and p.suffix == ".py")
            if py:
                found[d.relative_to(ROOT).as_posix() + "/"] = [p.name for p in py if _is_module(p)]
    return found


def _module_map() -> dict[str, str]:
    return _bullets(_section(DOC.read_text(), "## Module map"))


def test_every_package_and_module_is_in_the_module_map():
    bullets = _module_map()
    missing = []
    for pkg, modules in _package_dirs().items():
        if pkg not in bullets:
            missing.append(pkg)
            continue
        named = set(CODE.findall(bullets[pkg]))
        missing += [pkg + m for m in modules if m not in named]
    assert not missing, f"docs/architecture.md's module map does not name: {', '.join(missing)}"


def test_the_module_map_names_nothing_that_does_not_exist():
    wrong = []
    for pkg, text in _module_map().items():
        if not (ROOT / pkg).is_dir():
            wrong.append(pkg)
            continue
        for name in CODE.findall(text):
            if FILE_NAME.match(name):
                if not (ROOT / pkg / name).is_file():
                    wrong.append(pkg + name)
            elif "/" in name and not name.startswith("/") and (name.endswith(".py") or name.endswith("/")):
                if not (ROOT / name).exists():
                    wrong.append(name)
    assert not wrong, f"docs/architecture.md's module map names what does not exist: {', '.join(wrong)}"


def test_the_map_names_every_c_source_of_the_native_library():
    text = _module_map().get("kernels/csrc/", "")
    named = set(CODE.findall(text))
    sources = sorted(p.name for p in (ROOT / "kernels" / "csrc").iterdir() if p.suffix in (".c", ".h"))
    assert not [s for s in sources if s not in named], f"kernels/csrc/ files missing from the module map: {sources}"


def test_the_parser_reads_a_section_and_its_bullets():
    text = "# T\n## Module map\nintro\n- `a/` (x): `m.py` one;\n  `n.py` two\n- `a/b/`: `c.py`\n## Next\n- `z/`: `q.py`\n"
    bullets = _bullets(_section(text, "## Module map"))
    assert set(bullets) == {"a/", "a/b/"}
    assert CODE.findall(bullets["a/"]) == ["m.py", "n.py"]


def test_architecture_describes_the_present_not_a_run_history():
    text = DOC.read_text()
    assert len(text.splitlines()) <= 1000, "docs/architecture.md grew past 1,000 lines: move history out of it"
    narration = re.findall(r"\b\w+(?:st|nd|rd|th) round\b", text, flags=re.IGNORECASE)
    assert not narration, f"docs/architecture.md narrates rounds ({narration[:3]}): describe the code as it is"
