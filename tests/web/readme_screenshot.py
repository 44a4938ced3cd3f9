"""Makes docs/images/chat.png: the chat page with a real answer from a fresh embedded stack.

    .venv/bin/python -m tests.web.readme_screenshot [--out docs/images/chat.png]

Starts `tandem up` in a temp TANDEM_HOME on free ports, creates the `docs` collection
from README.md and docs/*.md (services/cli/bootstrap_docs.py, as a first start does),
asks a question on the chat page in Debian's chromium, screenshots it, and stops the stack.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from services.cli.bootstrap_docs import ensure_docs_collection
from tests.helpers.servers import free_port
from tests.web.conftest import CHROMIUM, CHROMIUM_ARGS, REPO_ROOT

TANDEM = [sys.executable, "-m", "services.cli.main"]
QUESTION = "How do I start Tandem and where is the API key?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs" / "images" / "chat.png")
    parser.add_argument(
        "--question", action="append", help="ask this (repeatable: one picture each, -N before the suffix)"
    )
    args = parser.parse_args()
    os.environ.setdefault("PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD", "1")
    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryDirectory() as tmp:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TANDEM_")}
        ports = {
            f"TANDEM_{s}_PORT": str(free_port())
            for s in ("REDIS", "AGENT", "INFERENCE", "RETRIEVAL", "TRAINER")
        }
        env.update(ports, TANDEM_HOME=f"{tmp}/home", TANDEM_DEVICE="cpu")
        subprocess.run([*TANDEM, "up", "--timeout", "600"], env=env, check=True, timeout=900)
        try:
            key = Path(f"{tmp}/home/api-key").read_text().strip()
            made = ensure_docs_collection(f"http://127.0.0.1:{ports['TANDEM_RETRIEVAL_PORT']}", key)
            print(f"docs collection: {made}")
            url = f"http://127.0.0.1:{ports['TANDEM_AGENT_PORT']}"
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": 1280, "height": 760}, device_scale_factor=1)
                page.goto(f"{url}/#/signin")
                page.get_by_label("API key").fill(key)
                page.keyboard.press("Enter")
                page.wait_for_url(re.compile(r".*#/chat$"))
                questions = args.question or [QUESTION]
                for i, question in enumerate(questions, 1):
                    page.get_by_role("button", name="New conversation").click()
                    page.get_by_label("Collection", exact=True).select_option("docs")
                    page.get_by_label("Message", exact=True).fill(question)
                    page.keyboard.press("Enter")
                    page.locator(".msg.assistant[aria-busy='false']").wait_for(timeout=300_000)
                    page.locator("#chat-input").blur()
                    out = args.out if len(questions) == 1 else args.out.with_stem(f"{args.out.stem}-{i}")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(out))
                    print(f"--- {out}: {question}\n{page.locator('.msg.assistant').last.inner_text()}")
                browser.close()
        finally:
            subprocess.run([*TANDEM, "down"], env=env, timeout=180)


if __name__ == "__main__":
    main()
