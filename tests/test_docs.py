"""Every repository path the docs cite exists: file paths and `python -m` module paths in backticks,
fenced code blocks and markdown links of README.md, BENCHMARKS.md and docs/*.md."""
import itertools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("actors", "april_ray", "driver", "jobs", "sim", "tests")
TOP = (*PACKAGES, "cluster", "configs", "docs")

FENCE = re.compile(r"```([^\n]*)\n(.*?)```", re.S)
SHELL = ("bash", "sh", "shell", "console")  # other fences hold trees and code, not commands
CODE = re.compile(r"`([^`]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
LINE_NUMBERS = re.compile(r":\d+(-\d+)?$")
FILES = (".py", ".yaml", ".yml", ".json", ".md", ".png", ".txt", ".toml")
MODULE = re.compile(rf"^(?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+$")


def expand(token: str) -> list[str]:
    """`configs/qwen3_4b_{dapo,grpo}.yaml` -> both names (shell brace expansion, one level)."""
    parts = re.split(r"\{([^{}]*,[^{}]*)\}", token)
    choices = [p.split(",") if i % 2 else [p] for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def citations(text: str) -> set[str]:
    """The repository paths and dotted module paths cited in markdown `text`."""
    commands = [body for info, body in FENCE.findall(text) if info.strip() in SHELL]
    spans = commands + CODE.findall(FENCE.sub("", text)) + LINK.findall(text)
    found = set()
    for token in (t for span in spans for t in re.split(r"[\s=]+", span)):
        token = LINE_NUMBERS.sub("", token.strip(".,;:()'\""))
        parts = token.split("/") if "/" in token else token.split(".")
        if re.search(r"[<>*$]", token) or any(re.fullmatch(r"[A-Z_]+", s) for s in parts):
            continue  # a placeholder: cluster/<name>.yaml, jobs.X, docs/PATH
        if token.split("/")[0] in TOP and "/" in token or MODULE.match(token):
            found.update(expand(token))
    return found


def missing(citation: str) -> bool:
    """Whether `citation` names nothing: a path, or a module path with an optional member
    (`april_ray.types.Sample`; also written `driver/engines.check_resources`)."""
    if "/" in citation:
        if (ROOT / citation).exists():
            return False
        if citation.endswith("/") or Path(citation).suffix in FILES:
            return True
        citation = citation.replace("/", ".")
    names = citation.split(".")
    for i in range(len(names), 0, -1):  # the longest prefix that is a module; the rest names a member
        base = ROOT.joinpath(*names[:i])
        source = next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)
        if source:
            rest = names[i:]
            return bool(rest) and not re.search(rf"\b{rest[0]}\b", source.read_text())
    return True


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_a_doc_cites_exists(doc):
    cited = citations(doc.read_text())
    assert cited, f"{doc.name} cites no repository path: the pattern no longer matches"
    assert not sorted(c for c in cited if missing(c))


def test_the_check_catches_dangling_paths():
    text = """Run `python -m jobs.bench.schedule --config configs/tiny_cpu.yaml` (see [the map](docs/architecture.md),
`april_ray/rollout/monitor.py:86`, `april_ray.types.Sample`, `configs/qwen3_4b_{dapo,gspo}.yaml`).
Gone: `jobs/bench_schedule.py`, `april_ray/nothing/`, `python -m jobs.bench_schedule`, [old](docs/benchmarks/engine_pair.py),
`april_ray.types.NoSuchMessage`, `configs/qwen3_4b_{dapo,nope}.yaml`.
```bash
python -m jobs.nothing --config configs/none.yaml
```"""
    cited = citations(text)
    assert sorted(c for c in cited if missing(c)) == [
        "april_ray.types.NoSuchMessage", "april_ray/nothing/", "configs/none.yaml", "configs/qwen3_4b_nope.yaml",
        "docs/benchmarks/engine_pair.py", "jobs.bench_schedule", "jobs.nothing", "jobs/bench_schedule.py"]
    assert {"jobs.bench.schedule", "configs/tiny_cpu.yaml", "docs/architecture.md", "april_ray/rollout/monitor.py",
            "april_ray.types.Sample", "configs/qwen3_4b_gspo.yaml"} <= cited - {c for c in cited if missing(c)}
