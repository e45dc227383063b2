"""report.html in headless Chromium: the decision, the tables and every plot are there, nothing is fetched from
the network, and model text that carries <script> or Markdown/HTML injection stays inert text."""

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.cli import run
from pipeline.infra.files import read_jsonl, write_jsonl

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-quic"]
INJECTION = ("<script>document.body.setAttribute('data-pwned','1')</script><img src=x onerror=\"document.title='pwned'\">"
             " | col | [link](javascript:alert(1)) **bold** `code` </td></tr></table><h1>forged</h1>")


def _chromium(profile_dir, *args, timeout=120):
    return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile_dir}", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def small_report(tmp_path_factory, tiny_llama):
    """A small real run (original, Q8_0 GGUF, int8 KV) whose Q8_0 replies are then rewritten to carry an injection."""
    from pipeline.config.schema import PROJECT_ROOT
    from pipeline.stages.variant_setup import load_result
    from tests.conftest import compose

    root = tmp_path_factory.mktemp("html")

    def cfg(*extra):
        return compose([f"model.source={tiny_llama}", "model.name=tiny", "profile=smoke", "run.suites=[smoke]",
                        f"paths.artifacts={root / 'artifacts'}", f"paths.results={root / 'results'}",
                        f"paths.cache={PROJECT_ROOT / '.cache'}", *extra])

    variants = ["original", "gguf_q8_0", "original+kv_int8"]
    for v in variants:
        assert run(cfg(f"variant={v}")) == 0
    result = load_result(cfg("variant=gguf_q8_0"), "gguf_q8_0")
    assert result["status"] == "ok"
    samples_path = Path(result["evaluation"]["dir"]) / "samples.jsonl"       # the checks stage's rows
    rows = read_jsonl(samples_path)
    for r in rows:
        r["variant_text"] = INJECTION + r["variant_text"]
    write_jsonl(samples_path, rows)
    report_cfg = cfg("command=report", f"run.variants=[{','.join(variants)}]")
    assert run(report_cfg) == 0
    return report_cfg.results_dir


def test_report_html_is_self_contained_and_escapes_model_text(small_report):
    page = (small_report / "report.html").read_text()
    # nothing to fetch: every image is inline, no external scripts, styles or links
    assert not re.search(r"""(src|href)\s*=\s*['"]?(https?:|//)""", page)
    assert "<link" not in page and "@import" not in page and "<script" not in page
    for m in re.finditer(r"src='data:image/png;base64,([^']+)'", page):
        assert base64.b64decode(m.group(1))[:8] == b"\x89PNG\r\n\x1a\n"
    # the injection is text: escaped tags, no forged table end or heading
    assert "&lt;script&gt;" in page and "<h1>forged</h1>" not in page and "onerror=\"" not in page
    md = (small_report / "report.md").read_text()
    assert "<script>" not in md


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (make browser installs Debian's package)")
def test_report_renders_in_headless_chromium(small_report, tmp_path):
    url = (small_report / "report.html").as_uri()
    dom = _chromium(tmp_path / "p1", "--virtual-time-budget=3000", "--dump-dom", url)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html_dom = dom.stdout
    summary = json.loads((small_report / "summary.json").read_text())
    rec = summary["recommendation"]
    assert "id=\"decision\"" in html_dom and (f"Ship {rec['variant']}" in re.sub("<[^>]+>", "", html_dom)
                                            or "No recommendation" in html_dom)
    main = re.search(r"<table id=\"main\">(.*?)</table>", html_dom, re.S).group(1)
    for name in summary["variants"]:
        assert f"<td>{name}</td>" in main
    for plot in ("pareto", "kld_by_position"):
        assert f"id=\"plot-{plot}\"" in html_dom, plot
    assert "id=\"capacity\"" in html_dom and "id=\"samples\"" in html_dom
    # the injected script never ran and the injected markup never became elements
    assert "data-pwned" not in html_dom.split("<body", 1)[1].split(">", 1)[0]
    assert "<title>pwned" not in html_dom and "<h1>forged</h1>" not in html_dom
    assert "&lt;script&gt;document.body.setAttribute" in html_dom
    shot = tmp_path / "report.png"
    r = _chromium(tmp_path / "p2", "--window-size=1300,2400", f"--screenshot={shot}", url)
    assert r.returncode == 0 and shot.stat().st_size > 50_000
