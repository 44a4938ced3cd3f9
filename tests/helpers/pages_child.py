"""A stand-in for the parsing child of services/retrieval/core/sandbox.py that reads pages slowly:
it reads the request from stdin, then ``pages`` times says on ``progress_fd`` that OCR of a page
begins and takes ``page_s`` seconds over it, and exits.

    python -m tests.helpers.pages_child   (reads {"progress_fd", "pages", "page_s"} on stdin)
"""

from __future__ import annotations

import json
import os
import sys
import time

if __name__ == "__main__":
    request = json.loads(sys.stdin.read())
    for _ in range(int(request["pages"])):
        os.write(int(request["progress_fd"]), b".")
        time.sleep(float(request["page_s"]))
