"""The docs stay honest: every hook documented and tested, every link resolving, every headline figure sourced."""

import inspect
import re
from pathlib import Path

from aitrainsai import hookspecs

ROOT = Path(__file__).resolve().parents[2]


def hooks():
    return {name: fn for name, fn in vars(hookspecs).items() if name.startswith("register_") and callable(fn)}


def _parameters(fn) -> str:
    """The hook's parameters as the reference names them, ``(register)``: the types are in its signature."""
    parameters = inspect.signature(fn).parameters.values()
    return str(inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in parameters]))


def test_every_hook_is_documented_with_its_signature():
    contributing = (ROOT / "CONTRIBUTING.md").read_text()
    for name, fn in hooks().items():
        assert f"`{name}{_parameters(fn)}`" in contributing, f"{name} missing from CONTRIBUTING.md"
        assert len(inspect.getdoc(fn) or "") > 60, f"{name} needs a docstring that serves as reference"


def test_every_hook_has_a_test():
    sources = "\n".join(p.read_text() for p in ROOT.glob("core/tests/*.py"))
    for name in hooks():
        assert f"def {name}(" in sources, f"no test plugin implements {name}"


# The README is a front page; docs/ and each distribution's README hold the rest. What follows keeps them linked.

DOCS = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    *sorted(ROOT.glob("docs/*.md")),
    *sorted(ROOT.glob("core/README.md")),
    *sorted(ROOT.glob("plugins/*/README.md")),
    *sorted(ROOT.glob("task_families/*/README.md")),
]
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside code fences and inline code."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        if match := re.match(r"#{1,6} (.+)", line):
            slug = _slug(match.group(1))
            anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
            seen[slug] = seen.get(slug, 0) + 1
    return anchors


def test_every_link_in_the_docs_resolves():
    broken = []
    for doc in DOCS:
        for target in LINK.findall(_prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_every_headline_figure_is_on_the_page_it_links():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Headline figures", 1)[1].split("\n## ", 1)[0]
    bullets = re.split(r"\n- ", section)[1:]
    assert len(bullets) >= 5
    for bullet in bullets:
        page = re.search(r"\]\((docs/[^)#]+)", bullet)
        assert page, f"a headline figure without its docs page: {bullet[:60]}"
        text = (ROOT / page.group(1)).read_text()
        prose = re.sub(r"\[[^\]]*\]\([^)]*\)", "", bullet)
        for number in re.findall(r"\d+(?:\.\d+)?", prose):
            assert number in text, f"{number} is not in {page.group(1)} ({bullet[:60]})"


def test_every_make_target_the_docs_name_exists():
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    for doc in DOCS:
        code = "\n".join(FENCE.findall(doc.read_text()) + re.findall(r"`[^`\n]*`", doc.read_text()))
        for name in re.findall(r"(?<![\w./-])make ([a-z][\w-]*)", code):
            assert name in targets, f"{doc.relative_to(ROOT)} names `make {name}`, which the Makefile lacks"
