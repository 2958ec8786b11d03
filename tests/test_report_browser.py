"""The HTML report rendered by a real headless Chromium: what a person opening it would see."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from PIL import Image, ImageStat

from harness.judge.compare import Verdict
from harness.judge.guards import GuardResult
from harness.outcomes.chat import ChatResult
from harness.outcomes.outcome import Outcome
from harness.report.bundle import write_bundle, write_run_info
from harness.report.text import CaseRecord
from harness.spec.prompts import SKELETON_PROMPTS
from harness.spec.settings import RunSettings, ServedVllm
from harness.spec.topology import TOPOLOGIES, ServingConfig
from harness.testing.builders import chat
from harness.testing.judging import judged

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
# Where a machine already has a Chromium-based browser under another name: GitHub's Ubuntu
# runners carry Google Chrome and have no Debian `chromium` (and the job is not root for apt).
INSTALLED_BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
APT_TIMEOUT_S = 1200.0
BROWSER_TIMEOUT_S = 120.0
DIVERGENCE = 9


def ensure_chromium() -> Path:
    """Debian's Chromium, or a Chromium-based browser already on PATH; otherwise Debian's,
    installed with apt-get the first time a test needs it.

    It fails rather than skips when Chromium cannot be had: a skipped browser check reads as
    green in CI, and a report nobody rendered is a report nobody checked.
    """
    if CHROMIUM.exists():
        return CHROMIUM
    for name in INSTALLED_BROWSERS:
        found = shutil.which(name)
        if found:
            return Path(found)
    apt = shutil.which("apt-get")
    if apt is None:
        pytest.fail(
            f"no Chromium ({', '.join(INSTALLED_BROWSERS)}) on PATH and apt-get is not "
            "available to install it"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    started = time.monotonic()
    for argv in ([apt, "update"], [apt, "install", "-y", "chromium"]):
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, env=env, timeout=APT_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"`{' '.join(argv)}` took over {APT_TIMEOUT_S:.0f}s; install chromium")
        if proc.returncode != 0:
            pytest.fail(
                f"cannot install Chromium: `{' '.join(argv)}` exited {proc.returncode} "
                f"(root needed; or run `apt-get install -y chromium` yourself):\n"
                f"{proc.stderr[-2000:]}"
            )
    if not CHROMIUM.exists():
        pytest.fail(f"apt-get installed chromium but {CHROMIUM} does not exist")
    print(f"installed Chromium in {time.monotonic() - started:.0f}s")
    return CHROMIUM


def mismatch_run() -> tuple[list[CaseRecord], dict[str, dict[str, Any]]]:
    """A passing text case and an image case whose candidate departs at position 9."""
    ids = [(37 * i) % 800 for i in range(48)]
    departed = ids[:DIVERGENCE] + [31, 402, 77] + ids[DIVERGENCE + 3 :]

    def answer(token_ids: list[int], text: str) -> ChatResult:
        def ranked(_position: int, t: int) -> list[tuple[int, float]]:
            return [(t, -1.25), (t + 1, -1.5), (t + 2, -2.75)]

        return chat(token_ids, prompt_ids=range(120), text=text, top=ranked)

    reference = {
        "text": Outcome("text", answer(ids, "A house, a tree and a car.")),
        "image": Outcome("image", answer(ids, "The sky is blue over the house.")),
    }
    candidate = {
        "text": Outcome("text", answer(ids, "A house, a tree and a car.")),
        "image": Outcome("image", answer(departed, "The sky is <b>not</b> blue.")),
    }
    records = [
        judged(
            "1E+1P+1D",
            "baseline",
            reference[p],
            candidate[p],
            [GuardResult("encoder_output", True, "1 media item(s) encoded once")],
        )
        for p in ("text", "image")
    ]
    responses = {
        "baseline": {p: o.to_json() for p, o in reference.items()},
        "1E+1P+1D": {p: o.to_json() for p, o in candidate.items()},
    }
    return records, responses


def chromium(browser: Path, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run with nothing that reaches the network or a GPU."""
    argv = [
        str(browser),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        *args,
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=BROWSER_TIMEOUT_S)
    assert proc.returncode == 0, f"chromium exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc


def test_report_renders_in_headless_chromium(tmp_path: Path):
    browser = ensure_chromium()
    run_dir = tmp_path / "run"
    records, responses = mismatch_run()
    assert [r.verdict for r in records] == [Verdict.MATCH, Verdict.MISMATCH]
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    serving = ServingConfig(model=str(model))
    topologies = (TOPOLOGIES["baseline"], TOPOLOGIES["1E+1P+1D"])
    settings = RunSettings(
        serving, run_dir, vllm=ServedVllm("/venv/bin/vllm", "0.32.0+cpu", "2.13.0")
    )
    run_info = write_run_info(settings, topologies, SKELETON_PROMPTS)
    write_bundle(run_dir, records, responses, run_info)
    url = (run_dir / "report.html").as_uri()

    dom = chromium(browser, tmp_path / "profile-dom", "--dump-dom", url).stdout
    assert '<table class="verdicts">' in dom
    divergence = records[1].divergence
    assert divergence is not None
    for anchor, token in (("ref", divergence["reference_token"]), ("can", 31)):
        assert re.search(
            rf'<span class="t diverge" id="case-1-{anchor}-div"[^>]*>{token}</span>', dom
        ), f"no highlighted divergence {anchor}={token} in the rendered DOM"

    screenshot = run_dir / "report.png"
    chromium(
        browser,
        tmp_path / "profile-shot",
        f"--screenshot={screenshot}",
        "--window-size=1280,2000",
        url,
    )
    assert screenshot.is_file() and screenshot.stat().st_size > 20_000
    with Image.open(screenshot) as image:
        assert image.size == (1280, 2000)
        gray = image.convert("L")
        assert ImageStat.Stat(gray).stddev[0] > 20, "the screenshot is (nearly) blank"
        # The divergence highlight's red, as rendered, not as written in the CSS.
        colors = dict((rgb, n) for n, rgb in image.convert("RGB").getcolors(1 << 24))
        red = colors.get((207, 34, 46), 0)
        assert red > 200, "no divergence/MISMATCH red on the screenshot"
