"""README.md and docs/*.md: every example runs as printed, every quoted output is what the command prints,
and every link lands.

The pages are README.md and every docs/*.md except docs/serving-several-models.md, whose blocks
tests/test_recipe_several_models.py runs in order (its links are checked here too). A fenced block's
language says what happens to it:

* ``python``: runs on its own in a fresh interpreter (a reader copies one block, so each block must
  stand alone, with no shared prelude), in an empty folder, with ``$KVPOOL_POOL`` naming a pool
  private to the test so an example never touches the host's real ``default`` pool; it must exit 0.
* ``console``: a shell transcript. Each ``$ `` line is a kvpool command (pipes allowed), run in bash
  against :func:`scene`; the lines after it, up to the next ``$ ``, are what it must print (stdout and
  stderr), compared after :func:`normalise` (process ids, and the runs of spaces and rules whose width
  follows them). Every command must exit 0.
* ``bash``: every line is a kvpool command, run in bash (``-e -o pipefail``) against :func:`scene`;
  it must exit 0.
* ``text``, ``yaml``: output or configuration quoted for the reader; not run. A block with no
  language is refused: say which it is.

A block that cannot run here carries an HTML comment on the line before it:

* ``<!-- doc-test: needs gpu -->``, ``<!-- doc-test: needs vllm -->``: skipped unless this machine
  has it (a python block marked ``needs vllm`` runs in the vLLM venv, ``$KVPOOL_VLLM_PYTHON``);
* ``<!-- doc-test: skip (WHY) -->``: never run here, and reported as a skip with WHY: what runs it
  instead, or why nothing can. A file it names (under ``tests/``, ``scripts/`` or ``.ci/``) must
  exist.

Blocks are parametrized by ``page:line`` (the line of the block's first line of code).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvpool import Pool, cuda_unavailable_reason

ROOT = Path(__file__).resolve().parent.parent
RECIPE = ROOT / "docs" / "serving-several-models.md"  # its blocks are tests/test_recipe_several_models.py's
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p != RECIPE)]
LINKED = [*PAGES, RECIPE]
RUN = ("python", "console", "bash")
QUOTED = ("text", "yaml")
FENCE = re.compile(r"^```(?P<lang>\S*)\s*$")
MARKER = re.compile(r"^<!-- doc-test: (?P<what>.*?) -->$")
SKIP = re.compile(r"skip \((?P<why>.+)\)")
BIN = Path(sys.executable).parent  # the venv's bin: its `kvpool` comes first on PATH


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based, the block's first line of code
    lang: str
    marker: str | None
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def parse(page: Path) -> tuple[list[Block], list[str]]:
    """A page's fenced blocks, and what is wrong with its fences and markers (if anything)."""
    lines = page.read_text().splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            if MARKER.match(lines[i]) and not (i + 1 < len(lines) and FENCE.match(lines[i + 1])):
                problems.append(f"{page.name}:{i + 1}: a doc-test marker must be the line just before a fence")
            i += 1
            continue
        start = i + 1
        end = next((j for j in range(start, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            problems.append(f"{page.name}:{i + 1}: fence never closed")
            break
        marker = MARKER.match(lines[i - 1]) if i > 0 else None
        blocks.append(Block(page, start + 1, m.group("lang"), marker.group("what") if marker else None,
                            "\n".join(lines[start:end]) + "\n"))
        i = end + 1
    for b in blocks:
        if b.lang not in RUN + QUOTED:
            problems.append(f"{b.where}: ```{b.lang} is not a language this test knows ({', '.join(RUN + QUOTED)})")
        if b.marker is not None and b.lang in QUOTED:
            problems.append(f"{b.where}: a ```{b.lang} block is never run; its doc-test marker says nothing")
        if b.marker is not None and b.marker not in ("needs gpu", "needs vllm") and not SKIP.fullmatch(b.marker):
            problems.append(f"{b.where}: unknown doc-test marker {b.marker!r}")
        if b.marker in ("needs gpu", "needs vllm") and b.lang != "python":
            problems.append(f"{b.where}: `{b.marker}` is for python blocks; a {b.lang} block runs kvpool commands"
                            " or is marked skip (WHY)")
    return blocks, problems


def all_blocks(lang: str) -> list[Block]:
    return [b for page in PAGES for b in parse(page)[0] if b.lang == lang]


def ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def test_every_block_is_one_this_test_knows() -> None:
    problems = [p for page in PAGES for p in parse(page)[1]]
    assert not problems, "\n".join(problems)


def test_the_pages_have_examples_of_every_kind() -> None:
    # A parser that matched nothing would pass every test below.
    assert {p.name for p in PAGES} >= {"README.md", "user-guide.md", "vllm.md", "sglang.md", "operators.md",
                                       "numbers.md", "ARCHITECTURE.md"}
    assert len(all_blocks("python")) >= 6
    assert len(all_blocks("console")) >= 4
    assert len(all_blocks("bash")) >= 3


def skip_if_marked(b: Block) -> None:
    """Skip a block its marker keeps from running here, after checking what the marker claims."""
    if b.marker is None:
        return
    if b.marker == "needs gpu":
        reason = cuda_unavailable_reason() if os.environ.get("KVPOOL_REAL_CUDA") == "1" else "needs a GPU"
        if reason:
            pytest.skip(f"{b.where}: {reason}")
        return
    if b.marker == "needs vllm":
        if not os.environ.get("KVPOOL_VLLM_PYTHON"):
            pytest.skip(f"{b.where}: needs the vLLM venv ($KVPOOL_VLLM_PYTHON)")
        return
    m = SKIP.fullmatch(b.marker)
    assert m, b.marker
    for path in re.findall(r"(?:\.ci|scripts|tests)/[\w./-]*\w", m.group("why")):
        assert (ROOT / path).exists(), f"{b.where}: the skip reason names {path}, which is not in the repository"
    pytest.skip(f"{b.where}: {m.group('why')}")


# -- python -----------------------------------------------------------------------------------------


@pytest.mark.timeout(200)
@pytest.mark.parametrize("b", all_blocks("python"), ids=ids(all_blocks("python")))
def test_python_example_runs(b: Block, pool_name: str, tmp_path: Path) -> None:
    skip_if_marked(b)
    python = os.environ["KVPOOL_VLLM_PYTHON"] if b.marker == "needs vllm" else sys.executable
    r = subprocess.run([python, "-c", b.code], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                       env={**os.environ, "KVPOOL_POOL": pool_name})
    assert r.returncode == 0, f"{b.where} failed:\n{r.stderr}"


# -- console and bash: kvpool commands against a scene ----------------------------------------------

# One tenant: a process that joins POOL as NAME with one KV space, commits MIB MiB and holds it until
# its stdin closes (as a server holds its cache). A page commits 4 MiB (2 regions x 2 MiB), so MIB
# must be a multiple of 4. No reserve thread: committed is exactly what the blocks need.
TENANT = """
import sys
from kvpool import Geometry, KVSpace, Pool
g = Geometry(1, 2, 64 << 10, 4096, page_bytes=2 << 20)
pool, name, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
with KVSpace(g, pool=Pool(pool, create=False), name=name, reserve_thread=False, reserve=(0, 0)) as s:
    held = s.alloc(mib * 2**20 // (2 * g.block_bytes))
    print(s.stats().committed_bytes, flush=True)
    sys.stdin.read()
    s.free(held)
"""


@dataclass
class Scene:
    """What the operator pages' transcripts were taken on, under private names."""

    names: dict[str, str]  # the pages' pool name -> this run's
    cwd: Path  # not the checkout, whose kvpool/ folder has no compiled _native
    pids: list[int] = field(default_factory=list)
    tenants: list[subprocess.Popen[str]] = field(default_factory=list)

    def join(self, pool: str, name: str, mib: int) -> subprocess.Popen[str]:
        p = subprocess.Popen([sys.executable, "-c", TENANT, self.names[pool], name, str(mib)], text=True,
                             cwd=self.cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.tenants.append(p)
        self.pids.append(p.pid)
        assert p.stdout is not None
        assert p.stdout.readline().strip() == str(mib << 20), f"tenant {name} did not commit {mib} MiB"
        return p

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVPOOL_")}
        # 120 columns: `kvpool top` shows every column (on a narrower terminal it leaves some out, with a note).
        return {**env, "KVPOOL_POOL": self.names["demo-pool"], "COLUMNS": "120",
                "PATH": f"{BIN}{os.pathsep}{env['PATH']}"}

    def private(self, text: str) -> str:
        for page_name, run_name in self.names.items():
            text = re.sub(rf"(?<![\w.-]){re.escape(page_name)}(?![\w.-])", run_name, text)
        return text

    def public(self, text: str) -> str:
        for page_name, run_name in self.names.items():
            text = text.replace(run_name, page_name)
        for pid in self.pids:
            text = re.sub(rf"(?<![\w.]){pid}(?![\w.])", "<pid>", text)
        return text


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[Scene]:
    """Pool ``demo-pool`` of 1.0 GiB with two live tenants, ``chat`` holding 192 MiB and ``code`` 64 MiB,
    and pool ``old-run`` of 1.0 GiB whose only tenant, ``batch``, was killed (SIGKILL) holding 8 MiB.
    ``$KVPOOL_POOL`` names demo-pool. The pools have private names, which the commands and their output
    are translated to and from."""
    run = f"docs-{uuid.uuid4().hex[:8]}"  # one prefix: the private names sort as the pages' names do
    s = Scene({name: f"{run}-{name}" for name in ("demo-pool", "old-run")}, tmp_path)
    try:
        for pool in s.names:
            Pool(s.names[pool], capacity=1 << 30)
        batch = s.join("old-run", "batch", 8)
        batch.kill()
        batch.wait()
        s.join("demo-pool", "chat", 192)
        s.join("demo-pool", "code", 64)
        yield s
    finally:
        for p in s.tenants:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.close()  # a tenant frees, closes its space and exits when its stdin closes
            p.wait(timeout=30)
            p.stdout.close()
        for name in s.names.values():
            Pool.remove(name)


def normalise(text: str, *, shown: bool) -> list[str]:
    """Lines with what differs run to run made equal: runs of spaces and of rule characters, whose
    width follows the widths of pids and names, are one. Process ids read ``<pid>``: in what a
    command printed, :meth:`Scene.public` put it in place of the scene's; in what a page ``shown``,
    any number of 4 or more digits standing alone is taken for one."""
    if shown:
        text = re.sub(r"(?<![\w.<])\d{4,}(?![\w.])", "<pid>", text)
    lines = [re.sub(r"─+", "─", re.sub(r" +", " ", ln.strip())) for ln in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def transcript(b: Block) -> list[tuple[str, str]]:
    """A console block as (command, what it prints) pairs."""
    pairs: list[tuple[str, str]] = []
    for ln in b.code.splitlines():
        if ln.startswith("$ "):
            pairs.append((ln[2:], ""))
        else:
            assert pairs, f"{b.where}: a transcript starts with a `$ ` line"
            pairs[-1] = (pairs[-1][0], pairs[-1][1] + ln + "\n")
    return pairs


def is_kvpool_command(line: str) -> bool:
    return line.startswith("kvpool ") or line == "kvpool"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("b", all_blocks("console"), ids=ids(all_blocks("console")))
def test_console_transcript_prints_what_it_shows(b: Block, scene: Scene, tmp_path: Path) -> None:
    skip_if_marked(b)
    for command, shown in transcript(b):
        assert is_kvpool_command(command), f"{b.where}: `{command}` is not a kvpool command: mark the block"
        r = subprocess.run(["bash", "-o", "pipefail", "-c", scene.private(command)], cwd=tmp_path,
                           env=scene.env(), capture_output=True, text=True, timeout=60)
        printed = scene.public(r.stdout + r.stderr)
        assert r.returncode == 0, f"{b.where}: `{command}` exited {r.returncode}:\n{printed}"
        assert normalise(printed, shown=False) == normalise(shown, shown=True), \
            f"{b.where}: `{command}` printed\n{printed}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("b", all_blocks("bash"), ids=ids(all_blocks("bash")))
def test_bash_block_runs(b: Block, scene: Scene, tmp_path: Path) -> None:
    skip_if_marked(b)
    commands = [ln.strip() for ln in b.code.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    odd = [c for c in commands if not is_kvpool_command(c)]
    assert not odd, f"{b.where}: not kvpool commands, so not run here: {odd}; mark the block skip (WHY)"
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", scene.private(b.code)], cwd=tmp_path,
                       env=scene.env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, f"{b.where} exited {r.returncode}:\n{scene.public(r.stdout + r.stderr)}"


def test_every_kvpool_command_on_the_pages_parses() -> None:
    # Skipped blocks included: a marker keeps a command from running here, not from being wrong.
    import shlex

    from kvpool.cli import _parser

    lines = [command for b in all_blocks("console") for command, _ in transcript(b)]
    lines += [ln.strip() for b in all_blocks("bash") for ln in b.code.splitlines()]
    lines = [ln for ln in lines if is_kvpool_command(ln)]
    assert len(lines) >= 8
    for line in lines:
        argv = shlex.split(line, comments=True)
        argv = argv[1:argv.index("|")] if "|" in argv else argv[1:]
        args, rest = _parser().parse_known_args(argv)  # argparse exits (SystemExit) on a bad one
        assert rest == [], line


# -- links ------------------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    in_fence = False
    for ln in page.read_text().splitlines():
        if ln.startswith("```"):
            in_fence = not in_fence
        m = None if in_fence else re.match(r"#{1,6} (.*)", ln)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links() -> list[tuple[str, Path, str]]:
    """(page:line, page, target) for every relative link of every page, code blocks left out."""
    out = []
    for page in LINKED:
        in_fence = False
        for n, ln in enumerate(page.read_text().splitlines(), 1):
            if ln.startswith("```"):
                in_fence = not in_fence
            if in_fence:
                continue
            for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"`[^`]*`", "", ln)):
                if not re.match(r"[a-z]+:", target):
                    out.append((f"{page.relative_to(ROOT)}:{n}", page, target))
    return out


def test_the_pages_link_each_other() -> None:
    assert len(links()) >= 20
    readme = {t for where, _, t in links() if where.startswith("README.md:")}
    for page in PAGES[1:] + [RECIPE]:
        assert f"docs/{page.name}" in readme, f"the README does not link docs/{page.name}"


@pytest.mark.parametrize(("where", "page", "target"), links(), ids=[f"{w} {t}" for w, _, t in links()])
def test_link_lands(where: str, page: Path, target: str) -> None:
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    assert dest.is_relative_to(ROOT), f"{where}: {target} points outside the repository"
    assert dest.exists(), f"{where}: {target}: no such file"
    if anchor:
        assert dest.suffix == ".md", f"{where}: {target}: an anchor into a file that is not markdown"
        assert anchor in anchors(dest), f"{where}: {target}: no heading of {dest.name} has that anchor"


def test_the_operators_page_lists_every_metric_the_exporter_serves(scene: Scene) -> None:
    env, pool = scene.env(), scene.names["demo-pool"]
    # A limit, so that the series a tenant without one has no sample of is served too.
    subprocess.run(["kvpool", "limit", pool, "chat", "256MiB"], cwd=scene.cwd, env=env, check=True,
                   capture_output=True)
    out = subprocess.run(["kvpool", "metrics", pool], cwd=scene.cwd, env=env, check=True, capture_output=True,
                         text=True).stdout
    served = set(re.findall(r"^(kvpool_\w+)\{", out, re.M))
    page = (ROOT / "docs" / "operators.md").read_text()
    table = page[page.index("| metric (gauges; `_total`: counters) |"):]
    table = table[:table.index("\n\n")]
    listed = set(re.findall(r"`(kvpool_\w+)`", table))
    assert listed == served, f"listed, not served: {listed - served}; served, not listed: {served - listed}"
