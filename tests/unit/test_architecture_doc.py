"""docs/architecture.md and the README's layout section describe the packages that exist: every
package and module they name is there, and every package of hybridserve is named."""

from __future__ import annotations

import re
from pathlib import Path

import hybridserve

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(hybridserve.__file__).parent
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
README = (ROOT / "README.md").read_text()


def packages() -> set[str]:
    """Every package under hybridserve/, and its top-level modules, as `name/` or `name.py`."""
    found = {f"{p.parent.relative_to(PACKAGE).as_posix()}/" for p in PACKAGE.rglob("__init__.py")}
    found.discard("./")
    return found | {p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}


def package_map() -> str:
    section = ARCHITECTURE.split("## 1. Packages", 1)[1]
    return re.search(r"```\n(.*?)```", section, flags=re.DOTALL).group(1)  # type: ignore[union-attr]


def test_the_package_map_names_every_package_and_only_real_ones() -> None:
    entries = set(re.findall(r"^  ([a-z_]+(?:/|\.py))", package_map(), flags=re.MULTILINE))
    top = {p for p in packages() if p.count("/") <= 1}
    assert entries == top, (sorted(entries - top), sorted(top - entries))


def test_every_file_the_architecture_doc_names_exists() -> None:
    named = set(re.findall(r"`?([a-z_]+(?:/[a-z_]+)*/[a-z_]+\.py)`?", ARCHITECTURE))
    named |= set(re.findall(r"\b([a-z_]+/[a-z_]+\.py)\b", package_map()))
    missing = [n for n in named if not any(PACKAGE.glob(f"**/{n}"))]
    assert not missing, missing
    for module in re.findall(r"^\s+(?:[a-z_]+/\s+)?.*?\b([a-z_]+\.py)\b", package_map(), re.M):
        assert any(PACKAGE.rglob(module)), module


def test_the_builders_the_architecture_doc_lists_are_the_callers_of_build_engine() -> None:
    callers = set(re.findall(r"^\| `([a-z_.]+)` \|", ARCHITECTURE, flags=re.MULTILINE))
    users = set()
    for path in PACKAGE.rglob("*.py"):
        text = path.read_text()
        if "build_engine(" in text and path.name != "assembly.py":
            module = path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", ".")
            for name in re.findall(r"^def ([a-z_]+)\(", text, flags=re.MULTILINE):
                body = text.split(f"def {name}(", 1)[1].split("\ndef ", 1)[0]
                if "build_engine(" in body:
                    users.add(f"{module}.{name}")
    assert callers == users


def test_the_readme_layout_names_every_package() -> None:
    layout = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`hybridserve/([a-z_]+(?:\.py)?)`", layout))
    top = {p.rstrip("/") for p in packages() if p.count("/") <= 1}
    assert named == top, (sorted(named - top), sorted(top - named))


# A read of a clock: time.monotonic() and its kin, or datetime's "now" (parsing a timestamp is not).
CLOCK_READ = re.compile(
    r"\btime\.(?:monotonic|time|perf_counter|process_time|thread_time|clock_gettime)(?:_ns)?\("
    r"|\bfrom time import\b|\b(?:datetime|date)\.(?:now|utcnow|today)\("
)


def test_the_packages_the_doc_says_never_read_a_clock_read_none() -> None:
    """The packages docs/architecture.md lists as never reading a clock have no clock read, and
    the server, which it says reads the wall clock, does."""
    text = " ".join(ARCHITECTURE.split())
    listed = re.search(r"((?:`[a-z_]+`,? )+and `[a-z_]+`) never read a clock", text)
    assert listed is not None, "architecture.md no longer says which packages never read a clock"
    names = re.findall(r"`([a-z_]+)`", listed.group(1))
    assert {"scheduler", "kvcache", "engine", "sim"} <= set(names)
    for name in names:
        sources = [PACKAGE / f"{name}.py"] if (PACKAGE / f"{name}.py").is_file() else []
        sources += sorted((PACKAGE / name).rglob("*.py")) if (PACKAGE / name).is_dir() else []
        assert sources, name
        reads = [
            p.relative_to(PACKAGE).as_posix() for p in sources if CLOCK_READ.search(p.read_text())
        ]
        assert not reads, (name, reads)
    assert "The server does read the wall clock" in text
    assert CLOCK_READ.search((PACKAGE / "server" / "async_engine.py").read_text())
