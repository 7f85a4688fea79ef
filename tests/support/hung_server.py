"""A stdio MCP server that hangs: it starts a child, writes both pids to `$HUNG_PIDS`, then never
reads or answers anything (and ignores its stdin closing), as a wedged server does.

    python hung_server.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    Path(os.environ["HUNG_PIDS"]).write_text(f"{os.getpid()} {child.pid}")
    time.sleep(600)
